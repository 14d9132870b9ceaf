"""`modeld`: serve, prepare the embedded models, and talk to a running daemon."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from modeld.backends.model_config import Isolation

DEFAULT_ADDRESS = "127.0.0.1:8001"


def _serve_args(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon in the foreground")
    p.add_argument("--model-repository", dest="model_repository", help="folder of <name>/model.toml (default: ./models)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--grpc-port", dest="grpc_port", type=int, help="gRPC port (default 8001; 0 picks a free one)")
    p.add_argument("--http-port", dest="http_port", type=int,
                   help="HTTP port for KServe v2 REST and the OpenAI API (default 8000; 0 picks a free one; -1 off)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="Prometheus port (default 8002; -1 off)")
    p.add_argument("--memory-budget", dest="memory_budget", help="bytes all models may hold, e.g. 2GiB (default: half of RAM)")
    p.add_argument("--max-streams", dest="max_streams", type=int,
                   help="generations in progress at once, daemon-wide (default 1024); beyond: RESOURCE_EXHAUSTED")
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--chat-template", dest="chat_templates", action="append", metavar="NAME=FILE",
                   help="a Jinja chat template file replacing model NAME's own (repeatable)")
    p.add_argument("--no-lazy-load", dest="lazy_load", action="store_const", const=False, help="never load a model on first request")
    p.add_argument("--no-preload", dest="preload", action="store_const", const=False, help="don't load repository models at start")
    p.add_argument("--log-format", dest="log_format", choices=["json", "console"])
    p.add_argument("--isolation", choices=[i.value for i in Isolation],
                   help="where models run unless their model.toml sets isolation: each in a worker process, "
                        "in the daemon, or auto (default: native LLM backends in a worker, the rest in-process)")
    _client_security_args(p, "the gRPC and HTTP ports",
                          "lines of '<token> <role>' (infer or admin); calls then need 'authorization: Bearer <token>'")
    p.add_argument("--insecure", action="store_const", const=True,
                   help="serve a non-loopback --host without a token file (anyone who reaches the port may call "
                        "and load models); refused otherwise")


def _client_security_args(p, ports: str, tokens_help: str) -> None:
    """TLS and tokens where clients connect: the daemon and the gateway take the same flags."""
    p.add_argument("--tls-cert", dest="tls_cert", metavar="FILE",
                   help=f"PEM certificate chain: serve TLS on {ports} (with --tls-key)")
    p.add_argument("--tls-key", dest="tls_key", metavar="FILE", help="PEM private key of --tls-cert")
    p.add_argument("--tls-client-ca", dest="tls_client_ca", metavar="FILE",
                   help=f"mutual TLS on {ports}: clients need a certificate this CA signed")
    p.add_argument("--auth-token-file", dest="auth_token_file", metavar="FILE", help=tokens_help)


def _token_args(sub) -> None:
    p = sub.add_parser("token", help="make a random token and the token-file line that grants it a role")
    p.add_argument("--role", default="infer", choices=["infer", "admin"], help="the token's role (default infer)")



def _gateway_args(sub) -> None:
    p = sub.add_parser("gateway", help="route calls across many daemons (one address in front of a fleet)")
    p.add_argument("--node", action="append", default=[], metavar="HOST:PORT",
                   help="a daemon's gRPC address (repeatable)")
    p.add_argument("--dns", metavar="NAME:PORT",
                   help="a name resolving to every daemon (a Kubernetes headless Service), re-resolved periodically")
    p.add_argument("--nodes-file", dest="nodes_file", metavar="FILE",
                   help="a file of daemon addresses, HOST:PORT one a line, re-read periodically (a mounted ConfigMap)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--grpc-port", dest="grpc_port", type=int, help="gRPC port (default 8001; 0 picks a free one)")
    p.add_argument("--http-port", dest="http_port", type=int,
                   help="HTTP port for the OpenAI and KServe v2 REST routes (default 8000; 0 picks a free one, -1 off)")
    p.add_argument("--node-http", dest="node_http", action="append", default=[], metavar="GRPC_ADDR=HTTP_ADDR",
                   help="where a daemon serves HTTP, by its --node address (repeatable); else --node-http-port")
    p.add_argument("--node-http-port", dest="node_http_port", type=int,
                   help="every daemon's HTTP port, on its gRPC host (a StatefulSet's pods share one)")
    p.add_argument("--metrics-port", dest="metrics_port", type=int, help="Prometheus port (default 8002; -1 off)")
    p.add_argument("--replicas", type=int, help="nodes that serve each model (default 2)")
    p.add_argument("--config", type=Path, help="TOML file with a [gateway] table")
    p.add_argument("--log-format", dest="log_format", choices=["json", "console"])
    p.add_argument("--node-tls-ca", dest="node_tls_ca", metavar="FILE",
                   help="PEM CA that signed the daemons' certificates: connect to them with TLS")
    p.add_argument("--node-tls-cert", dest="node_tls_cert", metavar="FILE",
                   help="PEM client certificate for daemons with mutual TLS (with --node-tls-key)")
    p.add_argument("--node-tls-key", dest="node_tls_key", metavar="FILE", help="PEM private key of --node-tls-cert")
    p.add_argument("--node-tls-server-name", dest="node_tls_server_name", metavar="NAME",
                   help="check this name in every daemon's certificate instead of the dialled host "
                        "(daemons dialled by IP)")
    p.add_argument("--node-token-file", dest="node_token_file", metavar="FILE",
                   help="the gateway's own token (first word of the first non-comment line, role infer), "
                        "sent on its health and Stats probes; forwarded calls keep the client's own. Without "
                        "--node-tls-ca it is also the fleet token a node must prove it holds to join the ring")
    _client_security_args(p, "the gateway's client port",
                          "client tokens, roles and tenants in the daemon's format; every call but probes needs one")


def _client_args(sub) -> None:
    for name, help_text in (("models", "list models and their state"), ("health", "check daemon or model health")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--address", default=DEFAULT_ADDRESS)
        if name == "health":
            p.add_argument("service", nargs="?", default="", help="model name; empty for the daemon")
    for name in ("load", "unload"):
        p = sub.add_parser(name, help=f"{name} a model")
        p.add_argument("model")
        p.add_argument("--address", default=DEFAULT_ADDRESS)
    p = sub.add_parser("infer", help="embed texts with a text model, or run a model on JSON inputs")
    p.add_argument("model")
    p.add_argument("--text", action="append", help="a sentence (repeatable) for models with a BYTES 'text' input")
    p.add_argument("--inputs", help='JSON: {"x": [[1.0, 2.0]], ...}; floats become FP32, ints INT64')
    p.add_argument("--prompt", help="a prompt for a language model (sent as text_input)")
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=64)
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p = sub.add_parser("prepare", help="build the embedded default models' artifacts")
    p.add_argument("--model-repository", dest="model_repository", type=Path, default=Path("models"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modeld", description="gRPC model-serving daemon")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_args(sub)
    _gateway_args(sub)
    _client_args(sub)
    _token_args(sub)
    from modeld.server.store.cli import add_store_args

    add_store_args(sub, _credential_args)
    for name in ("models", "health", "load", "unload", "infer"):
        _credential_args(sub.choices[name])
    return parser


def _credential_args(p) -> None:
    p.add_argument("--token", help="bearer token (default: $MODELD_TOKEN); prefer --token-file, "
                                   "as other users can read a process's arguments")
    p.add_argument("--token-file", dest="token_file", type=Path, help="file whose first word is the token")
    p.add_argument("--tls", action="store_true", help="connect with TLS, trusting the system's CAs")
    p.add_argument("--tls-ca", dest="tls_ca", type=Path,
                   help="PEM CA that signed the daemon's certificate (implies --tls)")
    p.add_argument("--tls-cert", dest="tls_cert", type=Path, help="PEM client certificate, for mutual TLS")
    p.add_argument("--tls-key", dest="tls_key", type=Path, help="PEM key of --tls-cert")


def _client_credentials(args) -> dict:
    """Client keyword arguments from the flags; OSError names a file that can't be read."""
    import os

    token = args.token or os.environ.get("MODELD_TOKEN") or None
    if args.token_file is not None:
        lines = args.token_file.read_text(encoding="utf-8").split()
        token = lines[0] if lines else None
    return {"token": token, "tls": args.tls, "ca_file": args.tls_ca, "cert_file": args.tls_cert,
            "key_file": args.tls_key}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    if args.command == "gateway":
        return gateway(args)
    if args.command == "token":
        return make_token(args.role)
    if args.command in ("pull", "push"):
        from modeld.server.store.cli import run_store_command

        return run_store_command(args, _client_credentials)
    if args.command == "prepare":
        from modeld.server.prepare import prepare_repository

        prepare_repository(args.model_repository)
        return 0
    return run_client_command(args)


def serve(args) -> int:
    from modeld.server.app import Daemon
    from modeld.server.config import ConfigError, load_settings

    flags = {k: getattr(args, k) for k in ("model_repository", "host", "grpc_port", "http_port", "metrics_port",
                                           "memory_budget", "lazy_load", "preload", "log_format", "max_streams")}
    flags.update({k: getattr(args, k) for k in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file")})
    flags["isolation"] = args.isolation
    flags["insecure"] = args.insecure
    flags["chat_templates"] = args.chat_templates
    return _run_until_signalled(lambda: load_settings(flags, config_file=args.config), ConfigError, Daemon,
                                loop="uvloop")


def make_token(role: str) -> int:
    """The token on the first line (for the client: MODELD_TOKEN or
    --token-file), the line for the daemon's token file on the second. Its
    comment is the SHA-256 the daemon compares (server/auth.py), which names
    the token in notes and tickets without revealing it."""
    import hashlib
    import secrets

    token = secrets.token_urlsafe(32)
    print(token)
    print(f"{token} {role}  # sha256:{hashlib.sha256(token.encode()).hexdigest()}")
    return 0


def gateway(args) -> int:
    from modeld.server.gateway.app import Gateway
    from modeld.server.gateway.config import GatewayConfigError, load_gateway_settings

    flags = {"nodes": args.node, "node_http": args.node_http,
             **{k: getattr(args, k) for k in ("dns", "nodes_file", "host", "grpc_port", "http_port", "node_http_port", "metrics_port",
                                                                   "replicas", "log_format", "node_tls_ca",
                                                                   "node_tls_cert", "node_tls_key",
                                                                   "node_tls_server_name", "node_token_file",
                                                                   "tls_cert", "tls_key", "tls_client_ca",
                                                                   "auth_token_file")}}
    return _run_until_signalled(lambda: load_gateway_settings(flags, config_file=args.config),
                                GatewayConfigError, Gateway, loop="uvloop")


def _run_until_signalled(load_settings, config_error: type[Exception], server, loop: str) -> int:
    """Settings first (a bad one exits 2 with its reason), then logging, then
    the daemon or gateway until a signal ends it."""
    from modeld.server.logging import configure_logging

    try:
        settings = load_settings()
    except config_error as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level, settings.log_format)
    print(f"modeld: {settings.describe()}", file=sys.stderr, flush=True)
    from modeld.server.event_loop import run

    # `loop`: the default, MODELD_EVENT_LOOP overrides it (server/event_loop.py)
    run(server(settings).run_until_signalled(), default=loop)
    return 0


def run_client_command(args) -> int:
    import grpc
    import numpy as np

    from modeld.clients import Client

    try:
        credentials = _client_credentials(args)
    except (OSError, UnicodeDecodeError) as exc:
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    try:
        with Client(args.address, **credentials) as client:
            if args.command == "models":
                for m in client.models():
                    print(f"{m.name}\t{m.version}\t{m.state}\t{m.reason}")
                for b in _unhealthy_backends(client):
                    print(f"{b.name}\tbackend\tUNHEALTHY\t{b.reason}; new loads skip it for {b.retry_in_s:.0f}s more")
            elif args.command == "health":
                status = client.health(args.service)
                print(status)
                return 0 if status == "SERVING" else 1
            elif args.command == "load":
                client.load(args.model)
            elif args.command == "unload":
                client.unload(args.model)
            elif args.command == "infer" and args.prompt is not None:
                print(client.complete(args.model, args.prompt, max_tokens=args.max_tokens))
            elif args.command == "infer":
                if args.text:
                    inputs = {"text": np.array(args.text, dtype=object)}
                else:
                    inputs = {k: np.asarray(v, dtype=np.float32 if _has_float(v) else np.int64)
                              for k, v in json.loads(args.inputs or "{}").items()}
                outputs = client.infer(args.model, inputs)
                print(json.dumps({k: v.tolist() if v.dtype != object else [x.decode() for x in v.reshape(-1)]
                                  for k, v in outputs.items()}))
    except grpc.RpcError as exc:
        print(f"modeld: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:  # a TLS or token file that can't be used, bad --inputs JSON
        print(f"modeld: {exc}", file=sys.stderr)
        return 2
    return 0


def _unhealthy_backends(client) -> list:
    import grpc

    try:
        return list(client.node_stats().unhealthy_backends)
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:  # a gateway serves no node stats of its own
            return []
        raise


def _has_float(value) -> bool:
    if isinstance(value, list):
        return any(_has_float(v) for v in value)
    return isinstance(value, float)


if __name__ == "__main__":
    sys.exit(main())
