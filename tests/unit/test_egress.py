"""What a remote model may reach and send (backends/remote/egress.py), what
its errors show, and the paths a model's files may name
(backends/artifact_paths.py). No sockets: host names resolve through the
system resolver only where noted (localhost), else a resolver function
given in place of DNS."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from modeld.backends.artifact_paths import ArtifactPathError, resolve_inside, scrub_paths
from modeld.backends.errors import ErrorKind
from modeld.backends.load_policy import LoadPolicy
from modeld.backends.remote.egress import (
    EgressRefused, check_api_key_env, check_destination, check_key_transport, redact_text, redact_url,
)
from modeld.backends.remote.http import Endpoint, error_for_status

LOCKED = LoadPolicy()


def _resolving_to(address: str):
    """A resolver answering every name with `address` (how DNS may answer for a name the caller chose)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    return lambda host, port, type=0: [(family, socket.SOCK_STREAM, 6, "", (address, port))]


def test_an_api_key_env_not_on_the_operators_list_is_refused():
    with pytest.raises(EgressRefused, match="api_key_env AWS_SECRET_ACCESS_KEY is not a variable") as err:
        check_api_key_env("m", "AWS_SECRET_ACCESS_KEY", LOCKED)
    assert err.value.kind is ErrorKind.INVALID_ARGUMENT and "remote_api_key_envs" in str(err.value)
    check_api_key_env("m", "VLLM_API_KEY", LoadPolicy(remote_api_key_envs=frozenset({"VLLM_API_KEY"})))
    check_api_key_env("m", "", LOCKED)  # no key: nothing to allow


@pytest.mark.parametrize("url", [
    "http://169.254.169.254/latest/meta-data/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://METADATA.GOOGLE.INTERNAL./",
    "http://[fe80::1]:8000",
    "http://[::ffff:169.254.169.254]/",
    "http://[fd00:ec2::254]/",
    "http://100.100.100.200/",
    "https://169.254.10.20:8443",
])
def test_link_local_and_metadata_addresses_are_refused(url):
    with pytest.raises(EgressRefused, match="link-local or cloud metadata"):
        check_destination("m", url, LOCKED, resolve=_resolving_to("192.0.2.1"))


def test_a_name_that_resolves_to_a_metadata_address_is_refused():
    with pytest.raises(EgressRefused, match="metadata"):
        check_destination("m", "http://engine.example:8000", LOCKED, resolve=_resolving_to("169.254.169.254"))
    with pytest.raises(EgressRefused, match="metadata"):
        check_destination("m", "http://engine.example:8000", LOCKED, resolve=_resolving_to("fe80::9%eth0"))
    assert check_destination("m", "http://engine.example:8000", LOCKED,
                             resolve=_resolving_to("10.0.0.7")).addresses == ("10.0.0.7",)


def test_the_host_allow_list_limits_remote_engines_and_admits_what_it_names():
    policy = LoadPolicy(remote_allowed_hosts=("vllm.internal", "169.254.1.1"))
    with pytest.raises(EgressRefused, match="remote_allowed_hosts"):
        check_destination("m", "http://other.internal:8000", policy, resolve=_resolving_to("10.0.0.7"))
    check_destination("m", "http://VLLM.internal:8000", policy, resolve=_resolving_to("10.0.0.7"))
    check_destination("m", "http://169.254.1.1:8000", policy)  # named by the operator: allowed


def test_a_key_goes_over_plain_http_only_to_loopback():
    with pytest.raises(EgressRefused, match="clear text"):
        check_key_transport("m", check_destination("m", "http://10.1.2.3:8000", LOCKED))
    with pytest.raises(EgressRefused, match="clear text"):  # a name that does not resolve now is not loopback
        check_key_transport("m", check_destination("m", "http://engine.invalid:8000", LOCKED))
    for url in ("http://127.0.0.1:8000", "http://[::1]:8000", "http://localhost:8000", "https://10.1.2.3"):
        check_key_transport("m", check_destination("m", url, LOCKED))


def test_urls_lose_their_userinfo_in_messages():
    assert redact_url("https://user:s3cret@engine:8000/v1") == "https://engine:8000/v1"
    assert redact_url("http://engine:8000") == "http://engine:8000"
    assert redact_text("at http://u:p@a:1 and https://tok@b/c") == "at http://a:1 and https://b/c"
    assert Endpoint("vllm", "http://u:s3cret@engine:1").where == "the vllm engine at http://engine:1"
    assert "s3cret" not in repr(Endpoint("vllm", "http://engine:1", api_key="s3cret"))


def test_a_remote_error_body_is_summarised_not_quoted():
    page = "<html><pre>root:x:0:0:root:/root:/bin/bash\nAuthorization: Bearer abc</pre></html>"
    error = error_for_status("the openai engine at http://engine:1 (GET /v1/models)", 404, page)
    assert str(error) == "the openai engine at http://engine:1 (GET /v1/models) answered HTTP 404: Not Found (no message)"
    engine = '{"error": {"message": "prompt too long for /srv/models/x/config.json\\nTraceback: ...", "type": "x"}}'
    text = str(error_for_status("the vllm engine at http://engine:1", 400, engine))
    assert text.endswith("answered HTTP 400: prompt too long for …/config.json")
    assert len(str(error_for_status("e", 400, '{"message": "' + "x" * 5000 + '"}'))) < 250


def test_paths_named_inside_model_files_stay_inside_the_folder(tmp_path):
    folder = tmp_path / "m"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "secret").write_text("s")
    (folder / "link").symlink_to(tmp_path / "secret")
    assert resolve_inside("m", folder, "sub/w.bin", "f") == (folder / "sub" / "w.bin").resolve()
    for name, words in (("../secret", "by '..'"), ("sub/../../secret", "by '..'"), ("link", "symbolic link"),
                        (str(tmp_path / "secret"), "absolute path"), ("C:\\secret", "absolute path"),
                        ("", "must be a file name"), (7, "must be a file name")):
        with pytest.raises(ArtifactPathError, match=words) as err:
            resolve_inside("m", folder, name, "tensor 'w' external data location")
        assert str(tmp_path) not in str(err.value) and "model 'm'" in str(err.value)


def test_absolute_paths_are_scrubbed_from_runtime_messages(tmp_path):
    folder = tmp_path / "inline" / "m"
    text = f"Load model from {folder}/model.onnx failed: see /etc/passwd (GET /v1/models) http://h:1/a/b"
    assert scrub_paths(text, (folder,)) == ("Load model from model.onnx failed: see …/passwd (GET /v1/models) "
                                            "http://h:1/a/b")
    assert scrub_paths(f"cannot read {Path('/x/y')}: 3/4 done") == "cannot read …/y: 3/4 done"
    # a remote engine's routes are no machine paths
    assert scrub_paths("the tgi engine at http://h:1 (/generate_stream) failed") == (
        "the tgi engine at http://h:1 (/generate_stream) failed")


def test_the_settings_become_the_policy_every_load_gets(tmp_path):
    from modeld.server.config import ConfigError, load_settings

    environ = {"MODELD_REMOTE_API_KEY_ENVS": "VLLM_API_KEY, TGI_TOKEN", "MODELD_REMOTE_ALLOWED_HOSTS": "vllm.internal",
               "MODELD_IREE_CACHE_DIR": str(tmp_path / "iree")}
    policy = load_settings({"model_repository": ""}, environ).load_policy()
    assert policy == LoadPolicy(frozenset({"VLLM_API_KEY", "TGI_TOKEN"}), ("vllm.internal",), frozenset(),
                                str(tmp_path / "iree"))
    assert load_settings({"model_repository": ""}, {}).load_policy() == LOCKED
    with pytest.raises(ConfigError, match="remote_api_key_envs must be environment variable names"):
        load_settings({"model_repository": ""}, {"MODELD_REMOTE_API_KEY_ENVS": "NOT-A-NAME"})
