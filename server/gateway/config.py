"""Gateway settings: command-line flags over a TOML file over defaults."""

from __future__ import annotations

import dataclasses
import ssl
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from modeld.server.gateway.breaker import BreakerConfig
from modeld.server.gateway.discovery import is_address
from modeld.server.gateway.score import ScoreWeights
from modeld.server.gateway.split import SplitConfigError, TrafficSplit, parse_splits


class GatewayConfigError(ValueError):
    pass


@dataclass(frozen=True)
class GatewaySettings:
    nodes: tuple[str, ...] = ()          # static HOST:PORT list
    dns: str = ""                        # NAME:PORT, re-resolved every dns_interval_s
    nodes_file: str = ""                 # a file of HOST:PORT lines, re-read every dns_interval_s
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000                # the OpenAI and KServe v2 REST routes; -1: no HTTP
    metrics_port: int = 8002
    replicas: int = 2                    # k: ring nodes that serve one model
    vnodes: int = 150
    load_bound: float = 1.25             # consistent hashing with bounded loads
    min_score: float = 0.2               # nodes scoring at or below this take no calls
    dns_interval_s: float = 5.0
    stats_interval_s: float = 0.25       # how often each node's Stats is polled
    stats_timeout_s: float = 0.5         # a poll slower than this counts as a failure (a frozen node)
    hedge_models: tuple[str, ...] = ()   # hedge every unary call of these models, urgent or not
    hedge_ratio: float = 0.05            # extra requests hedging may add
    hedge_max_fleet_load: float = 4.0    # no hedging while the mean in-flight per node is above this
    hedge_min_delay_s: float = 0.002
    # routed on the prompt-text guess (prefix.py), never on the daemons' KV events (kv_index.py)
    prefix_guess_models: tuple[str, ...] = ()
    max_message_bytes: int = 2**31 - 1
    log_level: str = "info"
    log_format: str = "json"
    # toward the nodes (the gateway as a client): TLS, mutual TLS, a token
    node_tls_ca: str = ""                # PEM CA that signed the nodes' certificates; set: TLS to every node
    node_tls_cert: str = ""              # PEM client certificate for nodes with mutual TLS (with node_tls_key)
    node_tls_key: str = ""
    node_tls_server_name: str = ""       # the name checked in each node's certificate instead of the dialled host
    node_token_file: str = ""            # the gateway's own token, for its Stats polls and health watches only
    # its own client port: TLS, mutual TLS, tokens and tenants, as the daemon's
    # (server/tls.py, server/auth.py), all reread on SIGHUP
    tls_cert: str = ""                   # PEM chain; with tls_key the client port serves TLS
    tls_key: str = ""
    tls_client_ca: str = ""              # mutual TLS: clients need a certificate this CA signed
    auth_token_file: str = ""            # the daemon's token file format; set: every call but probes needs a token
    # a request this large has its routing fields read in a thread, so the
    # event loop (other calls, health answers) never walks it
    parse_in_thread_bytes: int = 1 << 20
    max_request_fields: int = 100_000    # top-level protobuf fields (or JSON keys) a request may have
    # HTTP toward the nodes (server/gateway/http/): where each serves it, and how
    node_http: tuple[str, ...] = ()      # GRPC_HOST:PORT=HTTP_HOST:PORT, one per node whose HTTP port differs
    node_http_port: int = 0              # else every node's HTTP port on its gRPC host (0: the port it advertises)
    http_max_body_bytes: int = 256 * 1024**2  # larger HTTP bodies are refused with 413 before they are read whole
    http_node_keepalive: int = 64        # idle keep-alive connections kept per node
    http_connect_timeout_s: float = 5.0
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    # [gateway.splits.<model>] target = weight: calls for <model> shared among targets (server/gateway/split.py)
    splits: TrafficSplit = field(default_factory=TrafficSplit)

    def client_tls_files(self):
        from modeld.server.tls import TlsFiles

        return TlsFiles(Path(self.tls_cert), Path(self.tls_key), Path(self.tls_client_ca) if self.tls_client_ca else None)

    @property
    def fleet_proof_required(self) -> bool:
        """Whether a node must prove it holds the fleet token before it joins
        the ring: with a token and no TLS toward the nodes, nothing else
        tells a daemon of the fleet from any pod that answers on the port.
        (With TLS, the node's certificate, signed by --node-tls-ca, is the proof.)"""
        return bool(self.node_token_file) and not self.node_tls_ca

    def describe(self) -> str:
        source = (f"dns {self.dns}" if self.dns else f"nodes from {self.nodes_file}" if self.nodes_file
                  else f"nodes {', '.join(self.nodes)}")
        security = []
        if self.node_tls_ca:
            security.append("mutual TLS to nodes" if self.node_tls_cert else "TLS to nodes")
        if self.node_token_file:
            security.append("a token for its node probes")
        if self.tls_cert:
            security.append("mutual TLS for clients" if self.tls_client_ca else "TLS for clients")
        if self.auth_token_file:
            security.append("client tokens")
        if self.splits:
            security.append(f"traffic splits for {', '.join(sorted(self.splits.splits))}")
        http = f", HTTP on {self.http_port}" if self.http_port >= 0 else ""
        return (f"gateway on {self.host}:{self.grpc_port}{http}, {source}, {self.replicas} replicas per model, "
                f"metrics on {self.metrics_port}" + "".join(f", {part}" for part in security))


class NodeCredentials:
    """What the gateway presents to its nodes, read from the files the
    settings name: channel credentials (None: plaintext), channel options,
    and the metadata of the gateway's own calls (its bearer token).

    Forwarded client calls never carry the gateway's token: they keep the
    client's own `authorization`, so a client gets through the gateway what
    its token allows at the node and no more. The token is never logged and
    never part of a repr."""

    __slots__ = ("channel_credentials", "options", "probe_metadata", "_token")

    def __init__(self, channel_credentials=None, options: tuple = (), token: str | None = None) -> None:
        self.channel_credentials = channel_credentials
        self.options = tuple(options)
        self._token = token
        self.probe_metadata: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {token}"),) if token else ())

    @property
    def tls(self) -> bool:
        return self.channel_credentials is not None

    @property
    def has_token(self) -> bool:
        return self._token is not None

    def expected_proof(self, challenge: str) -> str | None:
        """What a node holding the fleet token answers `challenge` with."""
        if self._token is None:
            return None
        from modeld.server.auth import fleet_proof, token_digest

        return fleet_proof(token_digest(self._token), challenge)

    def __repr__(self) -> str:
        return f"NodeCredentials(tls={self.tls}, token={'set' if self.has_token else 'none'})"

    @classmethod
    def load(cls, s: GatewaySettings) -> NodeCredentials:
        """Read and check every file; GatewayConfigError names the flag and
        the file (never the token)."""
        credentials, options = None, []
        if s.node_tls_ca:
            import grpc

            ca = _read_pem(s.node_tls_ca, "--node-tls-ca")
            cert = key = None
            if s.node_tls_cert:
                cert = _read_pem(s.node_tls_cert, "--node-tls-cert")
                key = _read_pem(s.node_tls_key, "--node-tls-key")
                try:
                    ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_cert_chain(s.node_tls_cert, s.node_tls_key)
                except ssl.SSLError as exc:
                    raise GatewayConfigError(
                        f"--node-tls-cert {s.node_tls_cert} and --node-tls-key {s.node_tls_key} do not make a pair "
                        f"({exc.reason})") from None
            try:
                ssl.create_default_context(cadata=ca.decode("ascii", "replace"))
            except (ssl.SSLError, ValueError) as exc:
                raise GatewayConfigError(f"--node-tls-ca file {s.node_tls_ca} holds no usable certificate "
                                         f"({getattr(exc, 'reason', None) or exc})") from None
            credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
            if s.node_tls_server_name:
                options.append(("grpc.ssl_target_name_override", s.node_tls_server_name))
        token = _read_token(s.node_token_file) if s.node_token_file else None
        return cls(credentials, options, token)


def _read_file(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        raise GatewayConfigError(f"{flag} file {path} does not exist") from None
    except OSError as exc:
        raise GatewayConfigError(f"cannot read {flag} file {path}: {exc.strerror}") from None


def _read_pem(path: str, flag: str) -> bytes:
    data = _read_file(path, flag)
    if b"-----BEGIN" not in data:
        raise GatewayConfigError(f"{flag} file {path} is not PEM (no '-----BEGIN' line)")
    return data


def _read_token(path: str) -> str:
    """The first word of the first line that is not blank or a comment (so a
    daemon's own `<token> <role>` line works too); errors never quote it."""
    try:
        text = _read_file(path, "--node-token-file").decode("ascii")
    except UnicodeDecodeError:
        raise GatewayConfigError(f"--node-token-file file {path} is not ASCII text") from None
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        token = words[0]
        if not token.isprintable():
            raise GatewayConfigError(f"--node-token-file file {path}, line {number}: the token holds "
                                     "characters that are not printable ASCII")
        return token
    raise GatewayConfigError(f"--node-token-file file {path} holds no token (only blank lines and comments)")


_SECTIONS = {"weights": ScoreWeights, "breaker": BreakerConfig}


def _typed(cls, table: dict, where: str):
    known = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in table.items():
        if key not in known:
            raise GatewayConfigError(f"unknown key {where}{key}; known: {', '.join(sorted(known))}")
        default = getattr(cls(), key)
        if isinstance(default, tuple):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise GatewayConfigError(f"{where}{key} must be a list of strings, not {value!r}")
            value = tuple(value)
        elif isinstance(default, bool) or not isinstance(value, type(default)) and not (
                isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool)):
            raise GatewayConfigError(f"{where}{key} must be {type(default).__name__}, not {value!r}")
        values[key] = value
    return values


def load_gateway_settings(flags: dict, config_file: Path | None = None) -> GatewaySettings:
    """Defaults, then the file's [gateway] table (and its [gateway.weights]
    and [gateway.breaker]), then flags that were given."""
    table: dict = {}
    if config_file is not None:
        try:
            table = tomllib.loads(config_file.read_text()).get("gateway", {})
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise GatewayConfigError(f"cannot read {config_file}: {exc}") from None
    nested = {name: table.pop(name) for name in list(table) if name in _SECTIONS}
    raw_splits = table.pop("splits", None)
    values = _typed(GatewaySettings, {k: v for k, v in table.items()}, "gateway.")
    try:
        values["splits"] = parse_splits(raw_splits)
    except SplitConfigError as exc:
        raise GatewayConfigError(str(exc)) from None
    for name, cls in _SECTIONS.items():
        if name in nested:
            try:
                values[name] = cls(**_typed(cls, nested[name], f"gateway.{name}."))
            except ValueError as exc:
                raise GatewayConfigError(f"gateway.{name}: {exc}") from None
    for key, value in flags.items():
        if value is None or value == [] or value == ():
            continue
        values[key] = tuple(value) if isinstance(value, list) else value
    settings = GatewaySettings(**values)
    _check(settings)
    return settings


def _check(s: GatewaySettings) -> None:
    if sum(map(bool, (s.nodes, s.dns, s.nodes_file))) != 1:
        raise GatewayConfigError("name the daemons with --node HOST:PORT (repeatable), --dns NAME:PORT or "
                                 "--nodes-file FILE, one of the three")
    for address in (*s.nodes, *((s.dns,) if s.dns else ())):
        if not is_address(address):
            raise GatewayConfigError(f"{address!r} is not HOST:PORT")
    if s.replicas < 1:
        raise GatewayConfigError(f"--replicas must be at least 1, not {s.replicas}")
    if s.vnodes < 1:
        raise GatewayConfigError(f"gateway.vnodes must be at least 1, not {s.vnodes}")
    if s.load_bound < 1.0:
        raise GatewayConfigError(f"gateway.load_bound must be at least 1.0, not {s.load_bound}")
    if not 0.0 <= s.hedge_ratio <= 1.0:
        raise GatewayConfigError(f"gateway.hedge_ratio must be within [0, 1], not {s.hedge_ratio}")
    if s.stats_interval_s <= 0 or s.stats_timeout_s <= 0 or s.dns_interval_s <= 0:
        raise GatewayConfigError("gateway intervals and timeouts must be positive")
    if bool(s.node_tls_cert) != bool(s.node_tls_key):
        given, missing = (("--node-tls-cert", "--node-tls-key") if s.node_tls_cert
                          else ("--node-tls-key", "--node-tls-cert"))
        raise GatewayConfigError(f"{given} needs {missing} (a client certificate and its key, both or neither)")
    if not s.node_tls_ca and (s.node_tls_cert or s.node_tls_server_name):
        given = "--node-tls-cert" if s.node_tls_cert else "--node-tls-server-name"
        raise GatewayConfigError(f"{given} needs --node-tls-ca (the CA that signed the nodes' certificates), "
                                 "which turns TLS toward the nodes on")
    _check_http(s)
    if s.parse_in_thread_bytes < 0 or s.max_request_fields < 1:
        raise GatewayConfigError("gateway.parse_in_thread_bytes must not be negative and "
                                 "gateway.max_request_fields must be at least 1")
    NodeCredentials.load(s)  # every file readable and usable now, not at the first node
    _check_client_security(s)


def _check_http(s: GatewaySettings) -> None:
    if not -1 <= s.http_port < 65536:
        raise GatewayConfigError(f"--http-port must be a port, 0 for a free one or -1 for no HTTP, not {s.http_port}")
    if not 0 <= s.node_http_port < 65536:
        raise GatewayConfigError(f"gateway.node_http_port must be a port (0: the one each node advertises), "
                                 f"not {s.node_http_port}")
    for entry in s.node_http:
        grpc_address, sep, http_address = entry.partition("=")
        if not sep or not is_address(grpc_address) or not is_address(http_address):
            raise GatewayConfigError(f"--node-http {entry!r} is not GRPC_HOST:PORT=HTTP_HOST:PORT (a node's gRPC "
                                     "address as --node names it, then where it serves HTTP)")
    if s.http_max_body_bytes < 1024:
        raise GatewayConfigError(f"gateway.http_max_body_bytes must be at least 1024, not {s.http_max_body_bytes}")
    if s.http_node_keepalive < 0 or s.http_connect_timeout_s <= 0:
        raise GatewayConfigError("gateway.http_node_keepalive must not be negative and "
                                 "gateway.http_connect_timeout_s must be positive")


def _check_client_security(s: GatewaySettings) -> None:
    """The client port's certificates and tokens, read now, as the daemon does."""
    if bool(s.tls_cert) != bool(s.tls_key):
        given, missing = ("--tls-cert", "--tls-key") if s.tls_cert else ("--tls-key", "--tls-cert")
        raise GatewayConfigError(f"{given} needs {missing}: TLS takes a certificate and its key")
    if s.tls_client_ca and not s.tls_cert:
        raise GatewayConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key too")
    if s.tls_cert:
        from modeld.server.tls import TlsError, check_files

        try:
            check_files(s.client_tls_files())
        except TlsError as exc:
            raise GatewayConfigError(str(exc)) from None
    if s.auth_token_file:
        from modeld.server.auth import TokenFileError, load_token_file

        try:
            load_token_file(Path(s.auth_token_file))
        except TokenFileError as exc:
            raise GatewayConfigError(str(exc)) from None
