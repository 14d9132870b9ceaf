"""The gateway's wire reader (model names read off serialized requests) and
its settings (flags over a TOML file over defaults)."""

from __future__ import annotations

import numpy as np
import pytest

from modeld.clients.client import build_infer_request
from modeld.gen import generation_pb2 as gen
from modeld.gen import inference_pb2 as pb
from modeld.server.gateway import wire
from modeld.server.gateway.config import GatewayConfigError, load_gateway_settings


def test_the_model_name_is_read_off_real_requests():
    infer = build_infer_request("minilm", {"text": np.array(["a", "b"], dtype=object)}).SerializeToString()
    assert wire.string_field(infer, 1) == "minilm"
    # fields before and after the name, of every wire type proto3 writes
    request = pb.ModelInferRequest(id="r1", model_version="3", model_name="ünïcode-model")
    request.parameters["priority"].int64_param = 7
    request.raw_input_contents.append(b"\x00" * 100)
    assert wire.string_field(request.SerializeToString(), 1) == "ünïcode-model"
    assert wire.string_field(request.SerializeToString(), 3) == "r1"
    load = pb.RepositoryModelLoadRequest(model_name="m").SerializeToString()
    assert wire.string_field(load, 2) == "m" and wire.string_field(load, 1) == ""
    assert wire.string_field(gen.TokenizeRequest(model="smollm2", text="hi").SerializeToString(), 1) == "smollm2"
    assert wire.string_field(b"", 1) == ""


@pytest.mark.parametrize("data", [
    b"\x0a\xff\xff\xff\xff\x0f",  # a length past the end
    b"\x0a\x05abc",  # truncated string
    b"\x08",  # a varint cut short
    b"\x0b\x00",  # group start: proto3 never writes it
    b"\x00\x01",  # field number 0
    b"\x0a\x02\xff\xfe",  # not UTF-8
    b"\x09\x00\x00",  # a fixed64 cut short
])
def test_malformed_bytes_are_refused(data):
    with pytest.raises(wire.WireError):
        wire.string_field(data, 1)


def test_settings_take_flags_over_the_file_over_defaults(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text('[gateway]\nreplicas = 3\nhedge_models = ["minilm"]\nhedge_ratio = 0.1\n'
                      '[gateway.breaker]\nconsecutive_failures = 3\n[gateway.weights]\nerrors = 1\n')
    s = load_gateway_settings({"nodes": ["127.0.0.1:1", "127.0.0.1:2"], "replicas": 2, "grpc_port": None},
                              config_file=config)
    assert s.nodes == ("127.0.0.1:1", "127.0.0.1:2") and s.replicas == 2  # the flag wins
    assert s.hedge_models == ("minilm",) and s.hedge_ratio == 0.1 and s.grpc_port == 8001
    assert s.breaker.consecutive_failures == 3 and s.weights.errors == 1.0 and s.weights.latency == 0.3


@pytest.mark.parametrize("flags, text, message", [
    ({}, "", "--node HOST:PORT"),
    ({"nodes": ["a:1"], "dns": "b:2"}, "", "one of the three"),
    ({"nodes": ["no-port"]}, "", "not HOST:PORT"),
    ({"dns": "svc:99999"}, "", "not HOST:PORT"),
    ({"nodes": ["a:1"], "replicas": 0}, "", "at least 1"),
    ({"nodes": ["a:1"]}, "[gateway]\nreplica = 2\n", "unknown key gateway.replica"),
    ({"nodes": ["a:1"]}, "[gateway]\nreplicas = 'two'\n", "gateway.replicas must be int"),
    ({"nodes": ["a:1"]}, "[gateway]\nhedge_ratio = 2.0\n", "hedge_ratio"),
    ({"nodes": ["a:1"]}, "[gateway]\nload_bound = 0.9\n", "load_bound"),
    ({"nodes": ["a:1"]}, "[gateway.breaker]\nwindow = 3\n", "unknown key gateway.breaker.window"),
    ({"nodes": ["a:1"]}, "[gateway\n", "cannot read"),
    ({"nodes": ["a:1"]}, "[gateway.breaker]\nerror_rate = 3.0\n", "gateway.breaker:"),
])
def test_bad_settings_are_refused_with_the_reason(tmp_path, flags, text, message):
    config = tmp_path / "gateway.toml"
    config.write_text(text)
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_settings(flags, config_file=config if text else None)
    assert message in str(err.value)


# -- toward TLS / token daemons: --node-tls-*, --node-token-file ----------------


@pytest.fixture(scope="module")
def node_pki(tmp_path_factory):
    trustme = pytest.importorskip("trustme")
    folder = tmp_path_factory.mktemp("node-pki")
    ca, other = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    for name, issuer in (("client", ca), ("other", other)):
        leaf = issuer.issue_cert("gateway@example.com")
        leaf.cert_chain_pems[0].write_to_path(str(folder / f"{name}.crt"))
        leaf.private_key_pem.write_to_path(str(folder / f"{name}.key"))
    (folder / "not-pem.txt").write_text("just words\n")
    return folder


def test_node_tls_and_token_come_from_flags_or_the_file(node_pki, tmp_path):
    import grpc

    from modeld.server.gateway.config import NodeCredentials

    token = "gw-" + "x" * 30
    (tmp_path / "token").write_text(f"# the gateway's token\n\n{token} infer  # as in a daemon's file\nnext-line\n")
    config = tmp_path / "gateway.toml"
    config.write_text(f'[gateway]\nnode_tls_ca = "{node_pki / "ca.pem"}"\nnode_token_file = "{tmp_path / "token"}"\n')
    s = load_gateway_settings({"nodes": ["10.0.0.7:8001"], "node_tls_cert": str(node_pki / "client.crt"),
                               "node_tls_key": str(node_pki / "client.key"),
                               "node_tls_server_name": "modeld.example"}, config_file=config)
    assert s.node_tls_ca == str(node_pki / "ca.pem") and s.node_tls_server_name == "modeld.example"
    assert "mutual TLS to nodes" in s.describe() and token not in s.describe() and token not in repr(s)
    creds = NodeCredentials.load(s)
    assert creds.tls and isinstance(creds.channel_credentials, grpc.ChannelCredentials)
    assert ("grpc.ssl_target_name_override", "modeld.example") in creds.options
    assert creds.probe_metadata == (("authorization", f"Bearer {token}"),)
    assert token not in repr(creds)
    plain = NodeCredentials.load(load_gateway_settings({"nodes": ["a:1"]}))
    assert not plain.tls and plain.probe_metadata == () and plain.options == ()


@pytest.mark.parametrize("flags, message", [
    ({"node_tls_ca": "ca.pem", "node_tls_cert": "client.crt"}, "--node-tls-cert needs --node-tls-key"),
    ({"node_tls_ca": "ca.pem", "node_tls_key": "client.key"}, "--node-tls-key needs --node-tls-cert"),
    ({"node_tls_cert": "client.crt", "node_tls_key": "client.key"}, "--node-tls-cert needs --node-tls-ca"),
    ({"node_tls_server_name": "modeld.example"}, "--node-tls-server-name needs --node-tls-ca"),
    ({"node_tls_ca": "missing.pem"}, "--node-tls-ca file {dir}/missing.pem does not exist"),
    ({"node_tls_ca": "not-pem.txt"}, "--node-tls-ca file {dir}/not-pem.txt is not PEM"),
    ({"node_tls_ca": "ca.pem", "node_tls_cert": "client.crt", "node_tls_key": "missing.key"},
     "--node-tls-key file {dir}/missing.key does not exist"),
    ({"node_tls_ca": "ca.pem", "node_tls_cert": "client.crt", "node_tls_key": "other.key"}, "do not make a pair"),
    ({"node_token_file": "missing-token"}, "--node-token-file file {dir}/missing-token does not exist"),
])
def test_bad_node_security_settings_name_the_flag(node_pki, flags, message):
    flags = {k: str(node_pki / v) if k != "node_tls_server_name" else v for k, v in flags.items()}
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_settings({"nodes": ["a:1"], **flags})
    assert message.format(dir=node_pki) in str(err.value)


def test_a_token_file_without_a_token_is_refused_without_quoting_it(tmp_path):
    (tmp_path / "empty").write_text("# only a comment\n\n   \n")
    with pytest.raises(GatewayConfigError, match="holds no token"):
        load_gateway_settings({"nodes": ["a:1"], "node_token_file": str(tmp_path / "empty")})
    secret = "secret-" + "y" * 20
    (tmp_path / "bad").write_text(f"{secret}\x07\n")
    with pytest.raises(GatewayConfigError) as err:
        load_gateway_settings({"nodes": ["a:1"], "node_token_file": str(tmp_path / "bad")})
    assert "not printable" in str(err.value) and secret not in str(err.value)


def test_the_gateway_command_line_takes_the_node_flags():
    from modeld.server.cli import build_parser

    args = build_parser().parse_args(["gateway", "--node", "a:1", "--node-tls-ca", "ca.pem", "--node-tls-cert", "c",
                                      "--node-tls-key", "k", "--node-tls-server-name", "n",
                                      "--node-token-file", "t"])
    assert (args.node_tls_ca, args.node_tls_cert, args.node_tls_key, args.node_tls_server_name,
            args.node_token_file) == ("ca.pem", "c", "k", "n", "t")
