"""Secure by default: `modeld serve` on an address other than loopback needs
tokens (or an explicit --insecure, said loudly in the log), `modeld token`
makes a token the daemon's token check accepts, and the limits every front
shares (server/limits.py) refuse with the setting's name and value."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import subprocess
import sys

import grpc
import pytest

from daemon import start_daemon
from modeld.backends.errors import ResourceExhausted
from modeld.server.auth import Role, load_token_file
from modeld.server.cli import build_parser, main
from modeld.server.config import ConfigError, Settings, load_settings
from modeld.server.limits import RequestLimits, folder_bytes, is_loopback
from polling import wait_until


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "modeld.server.cli", "serve", "--grpc-port", "0", "--http-port",
                           "-1", "--metrics-port", "-1", "--model-repository", "", "--log-format", "json", *args],
                          capture_output=True, text=True, timeout=120)


def _token(role: str = "infer") -> tuple[str, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["token", "--role", role]) == 0
    token, line = out.getvalue().splitlines()
    return token, line


# -- which addresses need tokens ---------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "10.0.0.7", "example.internal", "modeld-0.modeld-nodes"])
def test_hosts_that_reach_the_network(host):
    assert not is_loopback(host)


def test_settings_refuse_an_open_host_without_tokens(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_settings({"host": "0.0.0.0", "model_repository": ""}, environ={})
    message = str(err.value)
    assert "without tokens" in message and "--insecure" in message and "auth_token_file" in message
    assert "(set by --host)" in message
    assert load_settings({"host": "0.0.0.0", "model_repository": "", "insecure": True}, environ={}).insecure
    assert load_settings({"host": "0.0.0.0", "model_repository": ""}, environ={"MODELD_INSECURE": "yes"}).insecure
    # loopback, the default, needs nothing
    assert load_settings({"model_repository": ""}, environ={}).host == "127.0.0.1"


def test_serve_on_every_interface_without_tokens_refuses():
    out = _serve("--host", "0.0.0.0")
    assert out.returncode == 2
    assert "refusing to serve on 0.0.0.0 without tokens" in out.stderr and "--insecure" in out.stderr


def test_serve_insecure_starts_and_warns_loudly(tmp_path):
    daemon = start_daemon("--host", "0.0.0.0", "--insecure", "--http-port", "-1", "--metrics-port", "-1",
                          repository=tmp_path, env={"MODELD_DRAIN_DELAY_S": "0"})
    try:
        (warning,) = wait_until(lambda: daemon.events("serving_without_tokens"), what="the warning")
        assert warning["level"] == "warning" and warning["host"] == "0.0.0.0"
        wait_until(lambda: daemon.events("serving_without_tls"), what="the TLS warning")
        with grpc.insecure_channel(daemon.address) as channel:
            grpc.channel_ready_future(channel).result(timeout=30)
    finally:
        assert daemon.stop() == 0


# -- modeld token ------------------------------------------------------------------

def test_token_lines_are_what_the_token_file_accepts(tmp_path):
    infer, infer_line = _token("infer")
    admin, admin_line = _token("admin")
    assert infer != admin and len(infer) >= 32
    assert infer_line.endswith(f"# sha256:{hashlib.sha256(infer.encode()).hexdigest()}")
    path = tmp_path / "tokens"
    path.write_text(f"{infer_line}\n{admin_line}\n")
    table = load_token_file(path)
    assert table.role_of(infer) is Role.INFER and table.role_of(admin) is Role.ADMIN
    assert table.role_of(infer + "x") is None


def test_a_token_made_by_modeld_token_opens_an_exposed_daemon(tmp_path):
    token, line = _token("admin")
    (tmp_path / "tokens").write_text(line + "\n")
    (tmp_path / "repo").mkdir()
    daemon = start_daemon("--host", "0.0.0.0", "--auth-token-file", str(tmp_path / "tokens"), "--http-port", "-1",
                          "--metrics-port", "-1", repository=tmp_path / "repo", env={"MODELD_DRAIN_DELAY_S": "0"})
    try:
        assert not daemon.events("serving_without_tokens")
        from modeld.gen import inference_pb2 as pb
        from modeld.gen import inference_pb2_grpc as pb_grpc

        with grpc.insecure_channel(daemon.address) as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            stub.RepositoryIndex(pb.RepositoryIndexRequest(), timeout=30,
                                 metadata=(("authorization", f"Bearer {token}"),))
    finally:
        assert daemon.stop() == 0


# -- the limits' own checks --------------------------------------------------------

@pytest.mark.parametrize("key, value", [("max_concurrent_rpcs", "-1"), ("http_max_concurrency", "-1"),
                                        ("max_embedding_inputs", "0"), ("stream_infer_window", "0"),
                                        ("inline_disk_quota", "-1"), ("max_streams_per_connection", "-2")])
def test_limit_settings_are_checked(key, value):
    with pytest.raises(ConfigError, match=key):
        load_settings({"model_repository": ""}, environ={f"MODELD_{key.upper()}": value})


def test_limits_reach_the_data_plane_settings():
    settings = load_settings({"model_repository": ""}, environ={
        "MODELD_MAX_EMBEDDING_INPUTS": "16", "MODELD_STREAM_INFER_WINDOW": "3", "MODELD_INLINE_DISK_QUOTA": "1MiB"})
    assert settings.request_limits() == RequestLimits(16, 3, 1024**2)
    assert Settings().request_limits() == RequestLimits()


def test_embedding_input_cap_names_the_setting():
    RequestLimits(max_embedding_inputs=4).check_embedding_inputs(4)
    with pytest.raises(ResourceExhausted, match=r"5 embedding inputs exceed the daemon's max_embedding_inputs "
                                                r"limit \(4\)"):
        RequestLimits(max_embedding_inputs=4).check_embedding_inputs(5)


def test_inline_quota_counts_other_models_folders_only(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "model.onnx").write_bytes(b"x" * 600)
    (tmp_path / "b" / "1").mkdir(parents=True)
    (tmp_path / "b" / "1" / "model.onnx").write_bytes(b"y" * 300)
    (tmp_path / "b" / "link").symlink_to(tmp_path / "a" / "model.onnx")  # not counted twice
    assert folder_bytes(tmp_path) == 900
    limits = RequestLimits(inline_disk_quota=1000)
    limits.check_inline_upload(tmp_path, "b", 400)  # b's 300 bytes are replaced by the upload
    limits.check_inline_upload(tmp_path, "c", 100)
    with pytest.raises(ResourceExhausted) as err:
        limits.check_inline_upload(tmp_path, "c", 101)
    assert "inline_disk_quota of 1000 bytes" in str(err.value) and "900 held" in str(err.value)
    assert str(tmp_path) not in str(err.value)  # no machine path in what a client reads
    RequestLimits(inline_disk_quota=0).check_inline_upload(tmp_path, "c", 10**12)  # 0: no quota


def test_a_failed_embedding_chunk_cancels_its_siblings():
    """/v1/embeddings splits a call into chunks; when one is refused (a full
    queue's 429) the others must leave their queues, not run for nobody."""
    from modeld.server.http.openai_embeddings import _all_or_none

    async def scenario():
        started, cancelled = asyncio.Event(), []

        async def waits(i):
            started.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.append(i)
                raise

        async def refused():
            await started.wait()
            raise ResourceExhausted("the queue is full")

        with pytest.raises(ResourceExhausted, match="the queue is full"):
            await _all_or_none([waits(0), refused(), waits(2)])
        assert sorted(cancelled) == [0, 2]

        async def value(i):
            await asyncio.sleep(0)
            return i

        assert await _all_or_none([value(i) for i in range(5)]) == [0, 1, 2, 3, 4]

    asyncio.run(scenario())


def test_insecure_is_a_serve_flag_never_a_default():
    assert build_parser().parse_args(["serve", "--insecure"]).insecure
    assert not build_parser().parse_args(["serve"]).insecure
    assert not Settings().insecure
