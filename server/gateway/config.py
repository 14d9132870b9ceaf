"""Gateway settings: command-line flags over a TOML file over defaults."""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from modeld.server.gateway.breaker import BreakerConfig
from modeld.server.gateway.score import ScoreWeights


class GatewayConfigError(ValueError):
    pass


@dataclass(frozen=True)
class GatewaySettings:
    nodes: tuple[str, ...] = ()          # static HOST:PORT list
    dns: str = ""                        # NAME:PORT, re-resolved every dns_interval_s
    host: str = "127.0.0.1"
    grpc_port: int = 8001
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
    max_message_bytes: int = 2**31 - 1
    log_level: str = "info"
    log_format: str = "json"
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def describe(self) -> str:
        source = f"dns {self.dns}" if self.dns else f"nodes {', '.join(self.nodes)}"
        return (f"gateway on {self.host}:{self.grpc_port}, {source}, {self.replicas} replicas per model, "
                f"metrics on {self.metrics_port}")


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
    values = _typed(GatewaySettings, {k: v for k, v in table.items()}, "gateway.")
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
    if bool(s.nodes) == bool(s.dns):
        raise GatewayConfigError("name the daemons with --node HOST:PORT (repeatable) or with --dns NAME:PORT, "
                                 "one of the two")
    for address in (*s.nodes, *((s.dns,) if s.dns else ())):
        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
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
