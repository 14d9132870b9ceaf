"""The token file parser, the role tables and the refusal messages (server/auth.py)."""

from __future__ import annotations

import pytest

from modeld.server import auth
from modeld.server.auth import Authenticator, Refusal, Role, TokenFileError, grpc_role, http_role, parse_tokens
from modeld.server.config import ConfigError, load_settings

INFER_TOKEN = "infer-token-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789abcdef"


def test_parses_tokens_comments_and_blank_lines():
    table = parse_tokens(f"""
# who may call the daemon
{INFER_TOKEN} infer   # the web tier

{ADMIN_TOKEN}\tADMIN
""")
    assert len(table) == 2
    assert table.role_of(INFER_TOKEN) is Role.INFER
    assert table.role_of(ADMIN_TOKEN) is Role.ADMIN
    assert table.role_of("not-a-token-at-all-xxxxxxxx") is None
    assert table.role_of("") is None
    assert table.role_of(INFER_TOKEN[:-1]) is None


@pytest.mark.parametrize(("text", "line", "fragment"), [
    (f"{INFER_TOKEN} infer\n{ADMIN_TOKEN}\n", 2, "expected '<token> <role>'"),
    (f"\n\n{INFER_TOKEN} infer extra\n", 3, "found 3 fields"),
    (f"{INFER_TOKEN} superuser\n", 1, "unknown role 'superuser'"),
    ("short-token infer\n", 1, "shorter than 16"),
    (f"{INFER_TOKEN} infer\n# comment\n{INFER_TOKEN} admin\n", 3, "the same token as line 1"),
    (f"{INFER_TOKEN}\u00e9 infer\n", 1, "printable ASCII"),
    (f"{INFER_TOKEN}#not-part-of-it infer\n", 1, "expected '<token> <role>'"),
])
def test_bad_lines_name_the_line_and_never_echo_the_token(text, line, fragment):
    with pytest.raises(TokenFileError) as caught:
        parse_tokens(text, "tokens.txt")
    message = str(caught.value)
    assert f"tokens.txt line {line}:" in message and fragment in message
    assert INFER_TOKEN not in message and ADMIN_TOKEN not in message and "short-token" not in message


def test_a_file_without_tokens_is_refused():
    with pytest.raises(TokenFileError, match="holds no tokens"):
        parse_tokens("# nothing yet\n\n")


def test_grpc_role_table():
    assert grpc_role("/grpc.health.v1.Health/Check") is None
    assert grpc_role("/grpc.health.v1.Health/Watch") is None
    assert grpc_role("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo") is None
    assert grpc_role("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo") is None
    assert grpc_role("/inference.GRPCInferenceService/ServerLive") is None
    assert grpc_role("/inference.GRPCInferenceService/ServerReady") is None
    for method in ("ModelInfer", "ModelStreamInfer", "ModelMetadata", "ModelReady", "ServerMetadata",
                   "RepositoryIndex", "ModelStatistics"):
        assert grpc_role(f"/inference.GRPCInferenceService/{method}") is Role.INFER
    assert grpc_role("/modeld.v1.Generation/Generate") is Role.INFER
    assert grpc_role("/modeld.v1.Node/Stats") is Role.INFER
    assert grpc_role("/inference.GRPCInferenceService/RepositoryModelLoad") is Role.ADMIN
    assert grpc_role("/inference.GRPCInferenceService/RepositoryModelUnload") is Role.ADMIN
    # fail closed: an RPC nobody classified needs admin
    assert grpc_role("/modeld.v1.Node/SomethingNew") is Role.ADMIN


def test_every_served_method_is_classified():
    from modeld.gen import generation_pb2, inference_pb2, node_pb2

    for module in (inference_pb2, generation_pb2, node_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert f"/{service.full_name}/{method.name}" in auth.GRPC_ROLES, method.full_name


def test_http_role_table():
    assert http_role("/v2/health/live") is None and http_role("/v2/health/ready") is None
    assert http_role("/v2/models/minilm/infer") is Role.INFER
    assert http_role("/v2/repository/index") is Role.INFER
    assert http_role("/v1/chat/completions") is Role.INFER
    assert http_role("/v2/repository/models/minilm/load") is Role.ADMIN
    assert http_role("/v2/repository/models/minilm/unload") is Role.ADMIN


def test_check_refusals(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{INFER_TOKEN} infer\n{ADMIN_TOKEN} admin\n")
    a = Authenticator(path)
    assert a.check(f"Bearer {INFER_TOKEN}", Role.INFER, "ModelInfer") is None
    assert a.check(f"bearer   {ADMIN_TOKEN} ", Role.ADMIN, "RepositoryModelLoad") is None
    kind, message = a.check(None, Role.INFER, "ModelInfer")
    assert kind is Refusal.UNAUTHENTICATED and "authorization: Bearer <token>" in message
    kind, message = a.check(f"Basic {INFER_TOKEN}", Role.INFER, "ModelInfer")
    assert kind is Refusal.UNAUTHENTICATED and "Bearer" in message and INFER_TOKEN not in message
    kind, message = a.check("Bearer wrong-token-0123456789", Role.INFER, "ModelInfer")
    assert kind is Refusal.UNAUTHENTICATED and "not valid" in message and "wrong-token" not in message
    kind, message = a.check(f"Bearer {INFER_TOKEN}", Role.ADMIN, "RepositoryModelLoad")
    assert kind is Refusal.PERMISSION_DENIED and "'admin'" in message and INFER_TOKEN not in message


def test_reload_swaps_tokens_and_keeps_them_on_a_bad_file(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{INFER_TOKEN} infer\n")
    a = Authenticator(path)
    path.write_text(f"{ADMIN_TOKEN} admin\n")
    assert a.reload()
    assert a.check(f"Bearer {INFER_TOKEN}", Role.INFER, "x") is not None
    assert a.check(f"Bearer {ADMIN_TOKEN}", Role.ADMIN, "x") is None
    path.write_text("broken\n")
    assert not a.reload()
    assert a.check(f"Bearer {ADMIN_TOKEN}", Role.ADMIN, "x") is None


def test_settings_report_a_bad_token_file_with_its_origin(tmp_path):
    path = tmp_path / "tokens"
    path.write_text(f"{INFER_TOKEN} infer\n{INFER_TOKEN}x reader\n")
    with pytest.raises(ConfigError) as caught:
        load_settings({"auth_token_file": str(path), "model_repository": "", "memory_budget": "1GiB"}, environ={})
    message = str(caught.value)
    assert "line 2" in message and "unknown role 'reader'" in message and "--auth-token-file" in message
    assert INFER_TOKEN not in message


def test_settings_need_cert_and_key_together(tmp_path):
    with pytest.raises(ConfigError, match="tls_key is needed too"):
        load_settings({"tls_cert": str(tmp_path / "c.pem"), "model_repository": "", "memory_budget": "1GiB"},
                      environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_settings({"tls_cert": str(tmp_path / "c.pem"), "tls_key": str(tmp_path / "k.pem"),
                       "model_repository": "", "memory_budget": "1GiB"}, environ={})


def test_settings_from_toml(tmp_path):
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    cert.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    (tmp_path / "tokens").write_text(f"{ADMIN_TOKEN} admin\n")
    config = tmp_path / "modeld.toml"
    config.write_text(f'''[modeld]
model_repository = ""
memory_budget = "1GiB"
tls_cert = "{tmp_path / 'cert.pem'}"
tls_key = "{tmp_path / 'key.pem'}"
tls_client_ca = "{tmp_path / 'ca.pem'}"
auth_token_file = "{tmp_path / 'tokens'}"
''')
    s = load_settings({}, environ={}, config_file=config)
    assert s.tls_cert == tmp_path / "cert.pem" and s.tls_client_ca == tmp_path / "ca.pem"
    assert s.auth_token_file == tmp_path / "tokens"
    # a key from another certificate is caught at start, naming both files
    other = ca.issue_cert("localhost")
    other.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    with pytest.raises(ConfigError, match="do not make a pair"):
        load_settings({}, environ={}, config_file=config)


def test_the_kv_cache_calls_take_the_fleet_token_or_an_admin_token(tmp_path):
    # which prompt blocks are cached is the gateway's to read: an infer token
    # could otherwise test whether another tenant sent a guessed prompt
    fleet, other = "f" * 32, "o" * 32
    path = tmp_path / "tokens"
    path.write_text(f"{fleet} infer fleet=yes\n{other} infer tenant=acme\n{ADMIN_TOKEN} admin\n")
    a = Authenticator(path)
    for method in auth.FLEET_METHODS:
        assert grpc_role(method) is Role.INFER
        action = method.rsplit("/", 1)[-1]
        assert not isinstance(a.authorize(f"Bearer {fleet}", Role.INFER, action, fleet_only=True), auth.Denied)
        assert not isinstance(a.authorize(f"Bearer {ADMIN_TOKEN}", Role.INFER, action, fleet_only=True), auth.Denied)
        refused = a.authorize(f"Bearer {other}", Role.INFER, action, fleet_only=True)
        assert isinstance(refused, auth.Denied) and refused.kind is Refusal.PERMISSION_DENIED
        assert "fleet token" in refused.message and other not in refused.message
        # the same token may still run models
        assert not isinstance(a.authorize(f"Bearer {other}", Role.INFER, "ModelInfer"), auth.Denied)
