"""Daemon settings: flags override MODELD_* environment variables, which
override an optional TOML file, which overrides the defaults.

Validated once at start-up into a frozen dataclass; a bad value stops the
daemon with a message naming the setting and where it came from.
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modeld.backends.model_config import Isolation
from modeld.backends.sizes import format_size, parse_size
from modeld.server.backend_health import HealthPolicy

DEFAULT_BUDGET_FRACTION = 0.5


class ConfigError(ValueError):
    pass


def default_memory_budget() -> int:
    import psutil

    return int(psutil.virtual_memory().total * DEFAULT_BUDGET_FRACTION)


@dataclass(frozen=True)
class Settings:
    model_repository: Path | None = Path("models")
    host: str = "127.0.0.1"
    grpc_port: int = 8001
    http_port: int = 8000  # KServe v2 REST and the OpenAI API; -1 turns HTTP off
    metrics_port: int = 8002  # -1 turns the metrics endpoint off
    memory_budget: int = 0  # 0: DEFAULT_BUDGET_FRACTION of physical memory
    lazy_load: bool = True
    preload: bool = True  # load every repository model that fits at start
    max_message_bytes: int = 256 * 1024**2
    # a model's request cap unless its [limits] sets one; 0: max_message_bytes
    max_request_bytes: int = 0
    max_streams: int = 1024  # generations in progress at once, over every model and front
    shutdown_grace_s: float = 10.0
    drain_delay_s: float = 0.5  # NOT_SERVING is visible this long before the port closes
    log_level: str = "info"
    log_format: str = "json"
    # fallbacks that mark a backend unhealthy within the window, and how long
    # new loads then skip it (server/backend_health.py gives the reasons)
    backend_unhealthy_after: int = HealthPolicy.unhealthy_after
    backend_health_window_s: float = HealthPolicy.window_s
    backend_cooldown_s: float = HealthPolicy.cooldown_s
    # worker processes (server/workers): where a model runs unless its
    # model.toml says (auto: native LLM backends in a worker, the rest in-process)
    isolation: str = Isolation.AUTO  # a string until checked; worker_policy hands on the Isolation
    worker_load_timeout_s: float = 300.0  # a worker still loading after this is killed
    worker_restart_backoff_s: float = 1.0  # wait before restarting a model whose worker died, doubling
    worker_restart_backoff_max_s: float = 60.0
    # transport security (server/tls.py, server/auth.py); all reread on SIGHUP
    tls_cert: Path | None = None  # PEM chain; with tls_key, both ports serve TLS
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # mutual TLS: clients need a certificate this CA signed
    auth_token_file: Path | None = None  # lines of '<token> <role>'; set, every call but probes needs a token
    # what a model's own config and files may reach (backends/load_policy.py):
    # environment variables a [remote] api_key_env may name (none: no key leaves),
    # the hosts remote engines may be at (none: any but link-local and metadata),
    # genai_config.json keys that load code, and where IREE keeps compiled modules
    remote_api_key_envs: tuple[str, ...] = ()
    remote_allowed_hosts: tuple[str, ...] = ()
    onnx_genai_allowed_keys: tuple[str, ...] = ()
    iree_cache_dir: Path | None = None  # None: $XDG_CACHE_HOME/modeld/iree (~/.cache/modeld/iree)
    # (model, Jinja file): the file replaces that model's chat template (--chat-template NAME=FILE)
    chat_templates: tuple[tuple[str, Path], ...] = ()
    # a host other than loopback needs auth_token_file unless this is set (server/limits.py, is_loopback)
    insecure: bool = False
    # what one caller may hold (server/limits.py); each refusal names its setting
    max_concurrent_rpcs: int = 4096  # gRPC calls in progress at once, daemon-wide; 0: no cap
    max_streams_per_connection: int = 0  # HTTP/2 streams one gRPC connection may open at once; 0: gRPC's default
    http_max_concurrency: int = 4096  # HTTP requests in progress, daemon-wide (uvicorn's limit_concurrency above it); 0: no cap
    max_embedding_inputs: int = 2048  # strings in one /v1/embeddings call
    stream_infer_window: int = 64  # ModelStreamInfer requests one stream may have in flight or unread
    inline_disk_quota: int = 8 * 1024**3  # bytes every uploaded (inline) model's folder may hold together; 0: none
    # models from a store (server/store): the disk cache below the memory budget, and how to reach stores
    store_cache_dir: Path = Path.home() / ".cache" / "modeld" / "store"
    store_cache_budget: int = 50 * 1024**3  # bytes the pulled models' files may hold on disk
    store_oci_mirror: str = ""  # host:port tried first for every oci:// pull; the named registry on its failure
    store_oci_plain_http: tuple[str, ...] = ()  # registries (host:port) reached without TLS
    store_oci_ca_file: Path | None = None  # PEM CA bundle for registries; None: the system's
    store_oci_auth_file: Path | None = None  # Docker config.json with "auths"; None: $DOCKER_CONFIG or ~/.docker
    store_s3_endpoint: str = ""  # empty: boto3's own (AWS_ENDPOINT_URL, else AWS)
    store_s3_region: str = ""
    store_s3_addressing_style: str = "auto"  # path, virtual or auto

    def health_policy(self) -> HealthPolicy:
        return HealthPolicy(self.backend_unhealthy_after, self.backend_health_window_s, self.backend_cooldown_s)

    def worker_policy(self):
        from modeld.server.workers.supervisor import WorkerPolicy

        return WorkerPolicy(Isolation(self.isolation), self.worker_load_timeout_s, self.worker_restart_backoff_s,
                            self.worker_restart_backoff_max_s, log_level=self.log_level, log_format=self.log_format)

    def request_limits(self):
        from modeld.server.limits import RequestLimits

        return RequestLimits(self.max_embedding_inputs, self.stream_infer_window, self.inline_disk_quota)

    def load_policy(self):
        from modeld.backends.load_policy import LoadPolicy

        return LoadPolicy(frozenset(self.remote_api_key_envs), self.remote_allowed_hosts,
                          frozenset(self.onnx_genai_allowed_keys), str(self.iree_cache_dir or ""),
                          tuple((name, str(path.resolve())) for name, path in self.chat_templates))

    def store_settings(self):
        from modeld.server.store import OciSettings, S3Settings, StoreSettings

        auth_file = self.store_oci_auth_file
        if auth_file is None:
            docker = os.environ.get("DOCKER_CONFIG")
            auth_file = (Path(docker) if docker else Path.home() / ".docker") / "config.json"
        return StoreSettings(
            self.store_cache_dir, self.store_cache_budget,
            OciSettings(self.store_oci_mirror, self.store_oci_plain_http, self.store_oci_ca_file, auth_file),
            S3Settings(self.store_s3_endpoint, self.store_s3_region, self.store_s3_addressing_style))

    def describe(self) -> str:
        return (f"repository={self.model_repository} grpc={self.host}:{self.grpc_port} "
                f"http_port={self.http_port} metrics_port={self.metrics_port} memory_budget={format_size(self.memory_budget)}")


_PARSERS = {
    "model_repository": lambda v: Path(v) if v not in ("", None) else None,
    "host": str,
    "grpc_port": int,
    "http_port": int,
    "metrics_port": int,
    "memory_budget": parse_size,
    "lazy_load": lambda v: _parse_bool(v),
    "preload": lambda v: _parse_bool(v),
    "max_message_bytes": parse_size,
    "max_request_bytes": parse_size,
    "max_streams": int,
    "shutdown_grace_s": float,
    "drain_delay_s": float,
    "log_level": str,
    "log_format": str,
    "backend_unhealthy_after": int,
    "backend_health_window_s": float,
    "backend_cooldown_s": float,
    "isolation": str,
    "worker_load_timeout_s": float,
    "worker_restart_backoff_s": float,
    "worker_restart_backoff_max_s": float,
    "tls_cert": lambda v: _optional_path(v),
    "tls_key": lambda v: _optional_path(v),
    "tls_client_ca": lambda v: _optional_path(v),
    "auth_token_file": lambda v: _optional_path(v),
    "remote_api_key_envs": lambda v: _names(v),
    "remote_allowed_hosts": lambda v: _names(v),
    "onnx_genai_allowed_keys": lambda v: _names(v),
    "iree_cache_dir": lambda v: _optional_path(v),
    "chat_templates": lambda v: _chat_templates(v),
    "insecure": lambda v: _parse_bool(v),
    "max_concurrent_rpcs": int,
    "max_streams_per_connection": int,
    "http_max_concurrency": int,
    "max_embedding_inputs": int,
    "stream_infer_window": int,
    "inline_disk_quota": parse_size,
    "store_cache_dir": Path,
    "store_cache_budget": parse_size,
    "store_oci_mirror": str,
    "store_oci_plain_http": lambda v: _host_list(v),
    "store_oci_ca_file": lambda v: _optional_path(v),
    "store_oci_auth_file": lambda v: _optional_path(v),
    "store_s3_endpoint": str,
    "store_s3_region": str,
    "store_s3_addressing_style": lambda v: _one_of(v, ("auto", "path", "virtual")),
}


def _names(value: Any) -> tuple[str, ...]:
    """A TOML list, or a comma-separated string (a flag, an environment variable)."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(i, str) for i in items):
        raise ValueError("not a list of names")
    return tuple(i.strip() for i in items if i.strip())


def _chat_templates(value: Any) -> tuple[tuple[str, Path], ...]:
    """NAME=FILE pairs: a TOML list, repeated flags, or a comma-separated string."""
    out = []
    for item in _names(value):
        name, _, path = item.partition("=")
        if not name.strip() or not path.strip():
            raise ValueError(f"{item!r} is not NAME=FILE (a model's name and its Jinja chat template)")
        if not Path(path.strip()).is_file():
            raise ValueError(f"the chat template {path.strip()!r} of model {name.strip()!r} is not a file")
        out.append((name.strip(), Path(path.strip())))
    return tuple(out)


def _host_list(value: Any) -> tuple[str, ...]:
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(v, str) for v in items):
        raise ValueError("a list of host:port names (or a comma-separated string)")
    return tuple(v.strip() for v in items if v.strip())


def _one_of(value: Any, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ValueError(f"one of {', '.join(choices)}")
    return value


def _optional_path(value: Any) -> Path | None:
    return Path(value) if value not in ("", None) else None


def _parse_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value!r}")


def load_settings(flags: dict[str, Any], environ: dict[str, str] | None = None,
                  config_file: Path | None = None) -> Settings:
    environ = os.environ if environ is None else environ
    values: dict[str, tuple[Any, str]] = {}
    config_file = config_file or (Path(environ["MODELD_CONFIG"]) if environ.get("MODELD_CONFIG") else None)
    if config_file is not None:
        for key, value in _read_toml(config_file).items():
            values[key] = (value, f"{config_file}")
    for key in _PARSERS:
        env_key = f"MODELD_{key.upper()}"
        if env_key in environ:
            values[key] = (environ[env_key], f"${env_key}")
    for key, value in flags.items():
        if value is not None:
            values[key] = (value, f"--{key.replace('_', '-')}")
    parsed = {}
    for key, (value, origin) in values.items():
        if key not in _PARSERS:
            raise ConfigError(f"unknown setting {key!r} in {origin}; known settings: {', '.join(_PARSERS)}")
        try:
            parsed[key] = _PARSERS[key](value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"invalid {key} {value!r} from {origin}: {exc}") from None
    settings = Settings(**parsed)
    if not settings.memory_budget:
        settings = dataclasses.replace(settings, memory_budget=default_memory_budget())
    try:
        _validate(settings)
        _validate_security(settings)
        _validate_exposure(settings)
    except ConfigError as exc:
        key = exc.args[1] if len(exc.args) > 1 else None
        origin = values[key][1] if key in values else "the default"
        raise ConfigError(f"{exc.args[0]} (set by {origin})") from None
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    return data.get("modeld", data)


def _validate_security(s: Settings) -> None:
    """Read the certificates and the token file now, so a bad one stops the
    start with its reason rather than failing the first handshake or call."""
    if (s.tls_cert is None) != (s.tls_key is None):
        missing = "tls_key" if s.tls_key is None else "tls_cert"
        raise ConfigError(f"{missing} is needed too: TLS takes a certificate and its key",
                          "tls_cert" if missing == "tls_key" else "tls_key")
    if s.tls_client_ca is not None and s.tls_cert is None:
        raise ConfigError("tls_client_ca (mutual TLS) needs tls_cert and tls_key too", "tls_client_ca")
    if s.tls_cert is not None:
        from modeld.server.tls import TlsError, TlsFiles, check_files

        try:
            check_files(TlsFiles(s.tls_cert, s.tls_key, s.tls_client_ca))
        except TlsError as exc:
            key = "tls_client_ca" if "client CA" in str(exc) else "tls_key" if "TLS key" in str(exc) else "tls_cert"
            raise ConfigError(str(exc), key) from None
    if s.auth_token_file is not None:
        from modeld.server.auth import TokenFileError, load_token_file

        try:
            load_token_file(s.auth_token_file)
        except TokenFileError as exc:
            raise ConfigError(str(exc), "auth_token_file") from None


def _validate_exposure(s: Settings) -> None:
    """Any address but loopback takes calls from the network: without tokens
    anyone who reaches the port could load models (RepositoryModelLoad)."""
    from modeld.server.limits import is_loopback

    if s.auth_token_file is None and not s.insecure and not is_loopback(s.host):
        raise ConfigError(
            f"refusing to serve on {s.host} without tokens: anyone who reaches the port could run and load models. "
            "Set auth_token_file (--auth-token-file; `modeld token` makes one), listen on 127.0.0.1, "
            "or pass --insecure to serve openly anyway", "host")


def _validate(s: Settings) -> None:
    """Raises ConfigError(message, setting) so the caller can name the origin."""
    checks = (
        ("grpc_port", 0 <= s.grpc_port <= 65535, f"grpc_port {s.grpc_port} must be 0..65535 (0 picks a free port)"),
        ("http_port", -1 <= s.http_port <= 65535,
         f"http_port {s.http_port} must be -1 (off) or 0..65535 (0 picks a free port)"),
        ("metrics_port", -1 <= s.metrics_port <= 65535, f"metrics_port {s.metrics_port} must be -1 (off) or 0..65535"),
        ("model_repository", s.model_repository is None or s.model_repository.is_dir(),
         f"model_repository {s.model_repository} is not a directory"),
        ("store_cache_budget", s.store_cache_budget > 0, "store_cache_budget must be a positive size such as 20GiB"),
        ("max_message_bytes", 1024 <= s.max_message_bytes < 2**31,
         "max_message_bytes must be between 1KiB and 2GiB (protobuf's limit)"),
        ("max_request_bytes", 0 <= s.max_request_bytes <= s.max_message_bytes,
         f"max_request_bytes {s.max_request_bytes} must be 0 (max_message_bytes) up to max_message_bytes "
         f"{s.max_message_bytes}: gRPC refuses larger messages before any model sees them"),
        ("max_streams", s.max_streams >= 1, f"max_streams {s.max_streams} must be at least 1"),
        ("max_concurrent_rpcs", s.max_concurrent_rpcs >= 0, "max_concurrent_rpcs must be 0 (no cap) or more"),
        ("max_streams_per_connection", s.max_streams_per_connection >= 0,
         "max_streams_per_connection must be 0 (gRPC's default) or more"),
        ("http_max_concurrency", s.http_max_concurrency >= 0, "http_max_concurrency must be 0 (no cap) or more"),
        ("max_embedding_inputs", s.max_embedding_inputs >= 1, "max_embedding_inputs must be at least 1"),
        ("stream_infer_window", s.stream_infer_window >= 1, "stream_infer_window must be at least 1"),
        ("inline_disk_quota", s.inline_disk_quota >= 0, "inline_disk_quota must be 0 (no quota) or more"),
        ("shutdown_grace_s", s.shutdown_grace_s >= 0, "shutdown_grace_s must not be negative"),
        ("drain_delay_s", s.drain_delay_s >= 0, "drain_delay_s must not be negative"),
        ("log_format", s.log_format in ("json", "console"), f"log_format {s.log_format!r} must be json or console"),
        ("backend_unhealthy_after", s.backend_unhealthy_after >= 1, "backend_unhealthy_after must be at least 1"),
        ("backend_health_window_s", s.backend_health_window_s > 0, "backend_health_window_s must be positive"),
        ("backend_cooldown_s", s.backend_cooldown_s > 0, "backend_cooldown_s must be positive"),
        ("isolation", s.isolation in tuple(Isolation),
         f"isolation {s.isolation!r} must be {', '.join(list(Isolation)[:-1])} or {list(Isolation)[-1]}"),
        ("worker_load_timeout_s", s.worker_load_timeout_s > 0, "worker_load_timeout_s must be positive"),
        ("worker_restart_backoff_s", s.worker_restart_backoff_s >= 0, "worker_restart_backoff_s must not be negative"),
        ("worker_restart_backoff_max_s", s.worker_restart_backoff_max_s >= s.worker_restart_backoff_s,
         "worker_restart_backoff_max_s must be at least worker_restart_backoff_s"),
        ("remote_api_key_envs", all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in s.remote_api_key_envs),
         "remote_api_key_envs must be environment variable names (letters, digits, '_'), comma-separated"),
    )
    for key, ok, message in checks:
        if not ok:
            raise ConfigError(message, key)
