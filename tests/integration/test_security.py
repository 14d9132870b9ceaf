"""Transport security and tokens on a real daemon (issue 11): TLS with the
stock tritonclient, our Python and Node clients and the command line; mutual
TLS refusals; certificate and token reload on SIGHUP with a stream in
flight; roles over gRPC and HTTP; no token in the daemon's log.

Certificates are made here with trustme: nothing secret is checked in.
"""

from __future__ import annotations

import datetime
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from daemon import MODELS, ROOT, start_daemon
from modeld.clients import Client
from modeld.gen import generation_pb2 as g
from modeld.gen import generation_pb2_grpc as gg
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from polling import wait_until

trustme = pytest.importorskip("trustme")

INFER_TOKEN = "infer-" + secrets.token_urlsafe(24)
ADMIN_TOKEN = "admin-" + secrets.token_urlsafe(24)
WRONG_TOKEN = "wrong-" + secrets.token_urlsafe(24)
HOSTS = ("127.0.0.1", "localhost")


class Pki:
    """CAs and certificates as files in one folder."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        now = datetime.datetime.now(datetime.timezone.utc)
        self.server_ca, self.other_server_ca = trustme.CA(), trustme.CA()
        self.client_ca, self.stranger_ca = trustme.CA(), trustme.CA()
        self.write_ca("server_ca", self.server_ca)
        self.write_ca("other_server_ca", self.other_server_ca)
        self.write_ca("client_ca", self.client_ca)
        self.write_ca("stranger_ca", self.stranger_ca)
        self.write_leaf("server", self.server_ca.issue_cert(*HOSTS))
        self.write_leaf("other_server", self.other_server_ca.issue_cert(*HOSTS))
        self.write_leaf("client", self.client_ca.issue_cert("client@example.com"))
        self.write_leaf("stranger", self.stranger_ca.issue_cert("client@example.com"))
        self.write_leaf("expired", self.client_ca.issue_cert(
            "client@example.com", not_before=now - datetime.timedelta(days=2),
            not_after=now - datetime.timedelta(days=1)))

    def write_ca(self, name: str, ca) -> None:
        ca.cert_pem.write_to_path(str(self.folder / f"{name}.pem"))

    def write_leaf(self, name: str, leaf) -> None:
        with open(self.folder / f"{name}.crt", "wb") as f:
            for pem in leaf.cert_chain_pems:
                f.write(pem.bytes())
        leaf.private_key_pem.write_to_path(str(self.folder / f"{name}.key"))

    def path(self, name: str) -> str:
        return str(self.folder / name)

    def client_files(self, name: str = "client", ca: str = "server_ca") -> dict:
        return {"ca_file": self.path(f"{ca}.pem"), "cert_file": self.path(f"{name}.crt"),
                "key_file": self.path(f"{name}.key")}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def repository(tmp_path_factory):
    # three models, loaded on first use: starting is quick
    folder = tmp_path_factory.mktemp("repo")
    for name in ("minilm", "smollm2", "smollm2-draft"):  # smollm2 loads its draft model too
        (folder / name).symlink_to(MODELS / name)
    return folder


def _token_file(folder: Path, text: str) -> Path:
    path = folder / "tokens.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def secured(pki, repository):
    """TLS with client certificates, and tokens."""
    tokens = _token_file(pki.folder, f"# test tokens\n{INFER_TOKEN} infer\n\n{ADMIN_TOKEN} admin  # ops\n")
    proc = start_daemon("--no-preload", "--tls-cert", pki.path("server.crt"), "--tls-key", pki.path("server.key"),
                        "--tls-client-ca", pki.path("client_ca.pem"), "--auth-token-file", str(tokens),
                        repository=repository)
    yield proc
    proc.stop()


def _client(daemon, token=INFER_TOKEN, **files) -> Client:
    return Client(daemon.address, token=token, **(files or {}))


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value.code()


def _embed_ok(client: Client) -> None:
    assert client.embed(["a sentence"]).shape == (1, 384)


def test_tritonclient_over_mutual_tls_with_a_token(secured, pki):
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(secured.address, ssl=True, root_certificates=pki.path("server_ca.pem"),
                                      private_key=pki.path("client.key"), certificate_chain=pki.path("client.crt"))
    try:
        assert client.is_server_live() and client.is_server_ready()  # open, for probes
        text = tc.InferInput("text", [1], "BYTES")
        text.set_data_from_numpy(np.array([b"hello over tls"], dtype=object))
        headers = {"authorization": f"Bearer {INFER_TOKEN}"}
        result = client.infer("minilm", [text], headers=headers)
        assert result.as_numpy("embedding").shape == (1, 384)
        assert client.get_model_metadata("minilm", headers=headers).name == "minilm"
        from tritonclient.utils import InferenceServerException

        with pytest.raises(InferenceServerException, match="UNAUTHENTICATED"):
            client.infer("minilm", [text])
    finally:
        client.close()


def test_python_clients_infer_and_generate_with_an_infer_token(secured, pki):
    with _client(secured, **pki.client_files()) as client:
        _embed_ok(client)
        assert client.health() == "SERVING"
        assert {m.name for m in client.models()} >= {"minilm", "smollm2"}
        # the token rides on every call of the channel, generated stubs included
        stream = gg.GenerationStub(client.channel).Generate(
            g.GenerateRequest(model="smollm2", prompt="The capital of France is",
                              sampling=g.SamplingParams(max_tokens=4)), timeout=180)
        responses = list(stream)
        assert responses[-1].finish_reason == g.FINISH_REASON_LENGTH
        assert responses[-1].usage.completion_tokens == 4


async def test_async_client_with_tls_and_token(secured, pki):
    from modeld.clients import AsyncClient

    async with AsyncClient(secured.address, token=INFER_TOKEN, **pki.client_files()) as client:
        assert (await client.embed(["async over tls"])).shape == (1, 384)
        stream = gg.GenerationStub(client.channel).Generate(
            g.GenerateRequest(model="smollm2", prompt="Hello", sampling=g.SamplingParams(max_tokens=2)), timeout=180)
        assert [r async for r in stream]
    async with AsyncClient(secured.address, **pki.client_files()) as client:
        with pytest.raises(grpc.RpcError) as caught:
            await client.embed(["no token"])
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_plaintext_client_against_the_tls_port_fails_and_the_daemon_goes_on(secured, pki):
    with Client(secured.address, timeout=5, token=INFER_TOKEN) as plain:
        assert _code(lambda: plain.embed(["x"])) == grpc.StatusCode.UNAVAILABLE
    with _client(secured, **pki.client_files()) as client:
        _embed_ok(client)
    assert secured.proc.poll() is None


@pytest.mark.parametrize("case", ["no client certificate", "certificate from another CA", "expired certificate",
                                  "server from an untrusted CA"])
def test_mutual_tls_refuses_bad_client_certificates(secured, pki, case):
    files = {
        "no client certificate": {"ca_file": pki.path("server_ca.pem")},
        "certificate from another CA": pki.client_files("stranger"),
        "expired certificate": pki.client_files("expired"),
        "server from an untrusted CA": pki.client_files(ca="other_server_ca"),
    }[case]
    with Client(secured.address, timeout=5, token=INFER_TOKEN, **files) as client:
        assert _code(lambda: client.embed(["x"])) == grpc.StatusCode.UNAVAILABLE
    with _client(secured, **pki.client_files()) as client:
        _embed_ok(client)


def test_tokens_and_roles_over_grpc(secured, pki):
    files = pki.client_files()
    with _client(secured, token=None, **files) as anonymous:
        code = _code(lambda: anonymous.embed(["x"]))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as caught:
            anonymous.load("minilm")
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <token>" in caught.value.details()
        # probes and reflection stay open
        assert anonymous.health() == "SERVING"
        assert anonymous.stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflection = reflection_pb2_grpc.ServerReflectionStub(anonymous.channel)
        listing = next(iter(reflection.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)))
        assert "inference.GRPCInferenceService" in {s.name for s in listing.list_services_response.service}
        # streams are refused the same way, before any message is read
        stream = anonymous.stub.ModelStreamInfer(iter([pb.ModelInferRequest(model_name="minilm")]), timeout=10)
        assert _code(lambda: list(stream)) == grpc.StatusCode.UNAUTHENTICATED
        generate = gg.GenerationStub(anonymous.channel).Generate(g.GenerateRequest(model="smollm2"), timeout=10)
        assert _code(lambda: list(generate)) == grpc.StatusCode.UNAUTHENTICATED
    with _client(secured, token=WRONG_TOKEN, **files) as wrong:
        with pytest.raises(grpc.RpcError) as caught:
            wrong.embed(["x"])
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED and WRONG_TOKEN not in caught.value.details()
    with _client(secured, token=INFER_TOKEN, **files) as infer:
        with pytest.raises(grpc.RpcError) as caught:
            infer.load("minilm")
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'admin'" in caught.value.details()
        assert _code(lambda: infer.unload("minilm")) == grpc.StatusCode.PERMISSION_DENIED
    with _client(secured, token=ADMIN_TOKEN, **files) as admin:
        admin.load("minilm")
        _embed_ok(admin)  # admin may infer too


def test_tokens_and_roles_over_https(secured, pki):
    context = ssl.create_default_context(cafile=pki.path("server_ca.pem"))
    context.load_cert_chain(pki.path("client.crt"), pki.path("client.key"))
    body = {"inputs": [{"name": "text", "shape": [1], "datatype": "BYTES", "data": ["hi"]}]}
    base = f"https://127.0.0.1:{secured.http_port}"
    with httpx.Client(verify=context, timeout=60) as http:
        assert http.get(f"{base}/v2/health/ready").status_code == 200
        assert http.get(f"{base}/v2/health/live").status_code == 200
        missing = http.post(f"{base}/v2/models/minilm/infer", json=body)
        assert missing.status_code == 401 and missing.headers["www-authenticate"].startswith("Bearer")
        assert "x-request-id" in missing.headers
        wrong = http.post(f"{base}/v2/models/minilm/infer", json=body,
                          headers={"authorization": f"Bearer {WRONG_TOKEN}"})
        assert wrong.status_code == 401 and WRONG_TOKEN not in wrong.text
        infer = {"authorization": f"Bearer {INFER_TOKEN}"}
        assert http.post(f"{base}/v2/models/minilm/infer", json=body, headers=infer).status_code == 200
        denied = http.post(f"{base}/v2/repository/models/minilm/load", headers=infer)
        assert denied.status_code == 403 and "admin" in denied.json()["error"]
        openai = http.post(f"{base}/v1/embeddings", json={"model": "minilm", "input": "x"})
        assert openai.status_code == 401 and "Bearer" in openai.json()["error"]["message"]
        admin = {"authorization": f"Bearer {ADMIN_TOKEN}"}
        assert http.post(f"{base}/v2/repository/models/minilm/load", headers=admin).status_code == 200
    # plaintext HTTP and HTTPS without a client certificate are refused
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{secured.http_port}/v2/health/ready", timeout=5)
    with pytest.raises(httpx.HTTPError):
        bare = ssl.create_default_context(cafile=pki.path("server_ca.pem"))
        httpx.get(f"{base}/v2/models/minilm", verify=bare, timeout=5)
    assert secured.proc.poll() is None


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "modeld.server.cli", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def test_command_line_with_tls_and_tokens(secured, pki, tmp_path):
    tls = ["--address", secured.address, "--tls-ca", pki.path("server_ca.pem"), "--tls-cert", pki.path("client.crt"),
           "--tls-key", pki.path("client.key")]
    admin_file = tmp_path / "admin-token"
    admin_file.write_text(ADMIN_TOKEN + "\n")
    loaded = _cli("load", "minilm", *tls, "--token-file", str(admin_file))
    assert loaded.returncode == 0, loaded.stderr
    listing = _cli("models", *tls, env={"MODELD_TOKEN": INFER_TOKEN})
    assert listing.returncode == 0 and "minilm\t1\tREADY" in listing.stdout
    denied = _cli("unload", "minilm", *tls, "--token", INFER_TOKEN)
    assert denied.returncode == 1 and "PERMISSION_DENIED" in denied.stderr
    missing = _cli("models", *tls, env={"MODELD_TOKEN": ""})
    assert missing.returncode == 1 and "UNAUTHENTICATED" in missing.stderr
    assert _cli("health", *tls, env={"MODELD_TOKEN": ""}).stdout.strip() == "SERVING"


_NODE_SCRIPT = """
const { ModeldClient } = require('./modeld');
const [address, token, ca, cert, key] = process.argv.slice(1);
(async () => {
  const out = {};
  const good = new ModeldClient(address, { token, caFile: ca, certFile: cert, keyFile: key });
  out.health = await good.health('');
  out.dim = (await good.embed(['hello from node']))[0].length;
  good.close();
  const anonymous = new ModeldClient(address, { caFile: ca, certFile: cert, keyFile: key });
  out.healthWithoutToken = await anonymous.health('');
  try { await anonymous.embed(['x']); out.anonymous = 'OK'; } catch (err) { out.anonymous = err.code; }
  anonymous.close();
  console.log(JSON.stringify(out));
})().catch((err) => { console.error(err); process.exit(1); });
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="Node.js is not installed")
def test_node_client_with_tls_and_token(secured, pki):
    if not (ROOT / "clients/node/node_modules/@grpc/grpc-js").is_dir():
        pytest.fail("run `make node` (npm install in clients/node) first")
    out = subprocess.run(["node", "-e", _NODE_SCRIPT, secured.address, INFER_TOKEN, pki.path("server_ca.pem"),
                          pki.path("client.crt"), pki.path("client.key")],
                         capture_output=True, text=True, timeout=60, cwd=ROOT / "clients/node")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {"health": "SERVING", "dim": 384, "healthWithoutToken": "SERVING",
                      "anonymous": grpc.StatusCode.UNAUTHENTICATED.value[0]}


def test_no_token_in_the_daemon_log(secured, pki):
    files = pki.client_files()
    for token in (INFER_TOKEN, ADMIN_TOKEN, WRONG_TOKEN):
        with _client(secured, token=token, **files) as client:
            try:
                client.load("minilm")
                client.embed(["x"])
            except grpc.RpcError:
                pass
    secured.proc.send_signal(signal.SIGHUP)  # reload logs too
    _wait(lambda: secured.events("auth_tokens_reloaded"), 60, "the token reload")
    # logged before the reload, so in by now; waited for all the same
    _wait(lambda: secured.events("call_refused"), 60, "the refused calls' log lines")
    text = "".join(secured._lines)
    for token in (INFER_TOKEN, ADMIN_TOKEN, WRONG_TOKEN):
        assert token not in text


def _wait(predicate, timeout: float, what: str):
    return wait_until(predicate, timeout, what)


def _check(address: str, ca: str, token: str | None = INFER_TOKEN) -> grpc.StatusCode:
    """One call on a fresh connection (no pooled subchannel to reuse)."""
    credentials = grpc.ssl_channel_credentials(Path(ca).read_bytes())
    with grpc.secure_channel(address, credentials, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        metadata = [("authorization", f"Bearer {token}")] if token else None
        try:
            stub.ServerMetadata(pb.ServerMetadataRequest(), timeout=10, metadata=metadata)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def test_sighup_swaps_certificates_and_tokens_without_dropping_a_stream(pki, repository, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    shutil.copy(pki.path("server.crt"), live / "server.crt")
    shutil.copy(pki.path("server.key"), live / "server.key")
    tokens = _token_file(live, f"{INFER_TOKEN} infer\n")
    daemon = start_daemon("--no-preload", "--tls-cert", str(live / "server.crt"), "--tls-key", str(live / "server.key"),
                          "--auth-token-file", str(tokens), repository=repository)
    try:
        ca_a, ca_b = pki.path("server_ca.pem"), pki.path("other_server_ca.pem")
        assert _check(daemon.address, ca_a) == grpc.StatusCode.OK
        assert _check(daemon.address, ca_b) == grpc.StatusCode.UNAVAILABLE
        with Client(daemon.address, token=INFER_TOKEN, ca_file=ca_a) as client:
            stream = gg.GenerationStub(client.channel).Generate(g.GenerateRequest(
                model="smollm2", prompt="Once upon a time",
                sampling=g.SamplingParams(max_tokens=128, ignore_eos=True)), timeout=300)
            first = next(stream)  # the call is up and streaming
            # new files written beside the old and renamed over them, as
            # cert-manager and most tools do: a reader never sees half a file
            for name in ("crt", "key"):
                shutil.copy(pki.path(f"other_server.{name}"), live / f"new.{name}")
                os.replace(live / f"new.{name}", live / f"server.{name}")
            tokens.write_text(f"{ADMIN_TOKEN} admin\n")
            daemon.proc.send_signal(signal.SIGHUP)
            _wait(lambda: daemon.events("tls_reloaded") and daemon.events("auth_tokens_reloaded"), 60, "the reload")
            rest = list(stream)
            assert rest[-1].finish_reason == g.FINISH_REASON_LENGTH and not rest[-1].error
            assert rest[-1].usage.completion_tokens == 128 and first.token_ids
            # the connection made before the reload still carries calls; only
            # the token it sends is no longer in the file
            assert _code(lambda: client.embed(["x"])) == grpc.StatusCode.UNAUTHENTICATED
        assert _check(daemon.address, ca_b, ADMIN_TOKEN) == grpc.StatusCode.OK
        assert _check(daemon.address, ca_a, ADMIN_TOKEN) == grpc.StatusCode.UNAVAILABLE
        assert _check(daemon.address, ca_b, INFER_TOKEN) == grpc.StatusCode.UNAUTHENTICATED
        # the HTTP front moved to the new certificate as well
        with httpx.Client(verify=ssl.create_default_context(cafile=ca_b), timeout=10) as http:
            assert http.get(f"https://127.0.0.1:{daemon.http_port}/v2/health/ready").status_code == 200
        with pytest.raises(httpx.HTTPError), httpx.Client(verify=ssl.create_default_context(cafile=ca_a)) as http:
            http.get(f"https://127.0.0.1:{daemon.http_port}/v2/health/ready")
        # a broken file keeps what is in use
        (live / "server.key").write_text("not a key")
        daemon.proc.send_signal(signal.SIGHUP)
        _wait(lambda: daemon.events("tls_reload_failed"), 60, "the failed reload")
        assert _check(daemon.address, ca_b, ADMIN_TOKEN) == grpc.StatusCode.OK
        assert daemon.proc.poll() is None
    finally:
        daemon.stop()


def test_a_bad_token_file_stops_the_start_with_the_line(tmp_path):
    tokens = _token_file(tmp_path, f"{INFER_TOKEN} infer\n{ADMIN_TOKEN} root\n")
    out = subprocess.run([sys.executable, "-m", "modeld.server.cli", "serve", "--grpc-port", "0", "--http-port", "-1",
                          "--metrics-port", "-1", "--model-repository", "", "--auth-token-file", str(tokens)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "line 2" in out.stderr and "unknown role 'root'" in out.stderr
    assert INFER_TOKEN not in out.stderr and ADMIN_TOKEN not in out.stderr
