"""Tenants: who a token belongs to, and the quotas that tenant lives under.

A token line in the token file may name a tenant and its limits
(server/auth.py parses them):

    <token> <role> tenant=acme rps=20 burst=40 tokens_per_minute=60000 streams=8 models=chat,embed priority=no update=no

Every token of one tenant shares one set of buckets, whichever front (gRPC,
HTTP) or process (the daemon, the gateway) its calls come in by. A line
without `tenant=` is its own unnamed tenant with no limits, as tokens were
before tenants existed.

- `rps` (and `burst`, default max(1, rps)): calls per second, a token bucket
  charged one per call when the call starts; over it, RESOURCE_EXHAUSTED / 429
  with the seconds until the next call fits (`retry-after`).
- `tokens_per_minute`: generated tokens, charged as they stream (a call in
  progress is never cut short; it may overdraw the bucket), refill
  tokens_per_minute / 60 per second; while the bucket is empty new calls
  get RESOURCE_EXHAUSTED / 429 with the time until it holds a token again.
- `streams`: generations in progress at once; one more is RESOURCE_EXHAUSTED.
- `models`: the models the tenant may call; another is PERMISSION_DENIED / 403.
- `priority`: whether the tenant may ask for a priority level above the
  default; a named tenant may not unless `priority=yes`, and its requests'
  levels are clamped to the default (0), not refused.
- `update`: whether the gateway honours the tenant's
  `x-modeld-request-type: update`; without it the call is refused.

Buckets take an injectable clock so tests step time instead of sleeping.
"""

from __future__ import annotations

import contextvars
import dataclasses
import math
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import structlog

from modeld.backends.errors import PermissionDenied, ResourceExhausted

log = structlog.get_logger("modeld.tenants")

Clock = Callable[[], float]
UNNAMED = ""  # a token line without tenant=: no limits, today's rights
MAX_MODELS = 256  # models one tenant may be allowed; a longer list is a mistake, not a policy
REFUSAL_LOG_INTERVAL_S = 10.0


class QuotaExceeded(ResourceExhausted):
    """A call over one of its tenant's limits: RESOURCE_EXHAUSTED / 429,
    with `retry_after_s` when waiting would help. A ResourceExhausted, so a
    front maps one raised inside a generation as it maps the engine's own."""

    def __init__(self, reason: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.retry_after_s = reason, message, retry_after_s

    @property
    def retry_after_header(self) -> str | None:
        """Whole seconds, at least 1, as HTTP's Retry-After takes them."""
        if self.retry_after_s is None:
            return None
        return str(max(1, math.ceil(self.retry_after_s)))


class ModelNotAllowed(PermissionDenied):
    """PERMISSION_DENIED / 403: the tenant's token does not cover this model."""


@dataclass(frozen=True)
class TenantLimits:
    requests_per_s: float | None = None
    burst: float | None = None  # None: max(1, requests_per_s)
    tokens_per_minute: int | None = None
    max_streams: int | None = None
    models: frozenset[str] | None = None  # None: every model
    priority: bool = True  # may ask for a level above the default
    update: bool = True  # may send update traffic through the gateway

    @property
    def bucket_size(self) -> float:
        return self.burst if self.burst is not None else max(1.0, self.requests_per_s or 1.0)


class TokenBucket:
    """`rate` units per second up to `capacity`. `take` spends only when
    the units are there; `charge` always spends, and may leave a debt the
    refill pays off first."""

    def __init__(self, rate: float, capacity: float, clock: Clock = time.monotonic) -> None:
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"a bucket needs a positive rate and capacity, got {rate} and {capacity}")
        self.rate, self.capacity, self._clock = float(rate), float(capacity), clock
        self._level = float(capacity)
        self._at = clock()
        self._lock = threading.Lock()  # the gateway and the daemon call from their loops; tests from threads

    def _refill(self) -> None:
        now = self._clock()
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now

    @property
    def level(self) -> float:
        with self._lock:
            self._refill()
            return self._level

    def take(self, units: float = 1.0) -> float:
        """0.0 when `units` were spent; otherwise the seconds until they
        would be there (nothing spent)."""
        with self._lock:
            self._refill()
            if self._level >= units:
                self._level -= units
                return 0.0
            return (units - self._level) / self.rate

    def charge(self, units: float) -> None:
        with self._lock:
            self._refill()
            self._level -= units

    def wait_for(self, units: float = 1.0) -> float:
        """Seconds until the bucket holds `units` (0.0: it does now)."""
        with self._lock:
            self._refill()
            return max(0.0, (units - self._level) / self.rate)

    def reshape(self, rate: float, capacity: float) -> None:
        with self._lock:
            self._refill()
            self.rate, self.capacity = float(rate), float(capacity)
            self._level = min(self._level, self.capacity)


class TenantMetrics:
    """Per-tenant counters in the daemon's (or the gateway's) registry."""

    def __init__(self, registry=None) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter("modeld_tenant_requests", "Calls admitted, by tenant", ["tenant"], registry=r)
        self.refusals = Counter("modeld_tenant_refusals",
                                "Calls refused by a tenant's quota or rights, by reason", ["tenant", "reason"],
                                registry=r)
        self.generated_tokens = Counter("modeld_tenant_generated_tokens", "Completion tokens generated, by tenant",
                                        ["tenant"], registry=r)
        self.streams = Gauge("modeld_tenant_streams", "Generations in progress, by tenant", ["tenant"], registry=r)


class Tenant:
    """One tenant's live state: its limits and its buckets."""

    def __init__(self, name: str, limits: TenantLimits, metrics: TenantMetrics | None,
                 clock: Clock = time.monotonic) -> None:
        self.name, self.metrics, self._clock = name, metrics, clock
        self.streams = 0
        self._logged: dict[str, tuple[float, int]] = {}  # reason: (last logged at, refusals since)
        self.calls: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.limits = TenantLimits()
        self.configure(limits)

    @property
    def label(self) -> str:
        return self.name or "unnamed"

    @property
    def limited(self) -> bool:
        """Whether anything about this tenant needs watching per call."""
        return bool(self.name) or self.limits != TenantLimits()

    def configure(self, limits: TenantLimits) -> None:
        """New limits (a reload); the buckets keep what they hold, so a
        reload is no way to refill one."""
        self.limits = limits
        if limits.requests_per_s is None:
            self.calls = None
        elif self.calls is None:
            self.calls = TokenBucket(limits.requests_per_s, limits.bucket_size, self._clock)
        else:
            self.calls.reshape(limits.requests_per_s, limits.bucket_size)
        if limits.tokens_per_minute is None:
            self.tokens = None
        elif self.tokens is None:
            self.tokens = TokenBucket(limits.tokens_per_minute / 60.0, limits.tokens_per_minute, self._clock)
        else:
            self.tokens.reshape(limits.tokens_per_minute / 60.0, limits.tokens_per_minute)

    def _refuse(self, reason: str, message: str, retry_after_s: float | None = None) -> QuotaExceeded:
        if self.metrics is not None:
            self.metrics.refusals.labels(self.label, reason).inc()
        self._log_refusal(reason, retry_after_s=retry_after_s)
        return QuotaExceeded(reason, message, retry_after_s)

    def _log_refusal(self, reason: str, **fields) -> None:
        """One line per tenant and reason every REFUSAL_LOG_INTERVAL_S, with
        how many it stands for: a tenant far over its quota must not turn
        each refusal into a log line (the metrics count every one)."""
        now = self._clock()
        last, suppressed = self._logged.get(reason, (None, 0))
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._logged[reason] = (last, suppressed + 1)
            return
        self._logged[reason] = (now, 0)
        log.info("tenant_refused", tenant=self.label, reason=reason, not_logged_since=suppressed, **fields)

    def admit(self) -> QuotaExceeded | None:
        """A new call: None when the tenant's rate and token budget allow it
        (one call is then spent), else the refusal."""
        if self.tokens is not None:
            wait = self.tokens.wait_for(1.0)
            if wait > 0:
                return self._refuse("tokens_per_minute", (
                    f"tenant {self.label!r} has used its {self.limits.tokens_per_minute} generated tokens per "
                    f"minute; retry in {wait:.1f} s"), wait)
        if self.calls is not None:
            wait = self.calls.take()
            if wait > 0:
                return self._refuse("rate", (
                    f"tenant {self.label!r} is over its rate of {self.limits.requests_per_s:g} calls per second; "
                    f"retry in {wait:.2f} s"), wait)
        if self.metrics is not None:
            self.metrics.requests.labels(self.label).inc()
        return None

    def check_model(self, model: str) -> None:
        allowed = self.limits.models
        if allowed is not None and model and model not in allowed:
            if self.metrics is not None:
                self.metrics.refusals.labels(self.label, "model").inc()
            self._log_refusal("model", model=model)
            raise ModelNotAllowed(f"tenant {self.label!r} may not use model {model!r}; "
                                  "its token allows: " + ", ".join(sorted(allowed)))

    def update_refusal(self) -> str | None:
        """The gateway's check of `x-modeld-request-type: update`: None when
        the tenant may send it, else why not (PERMISSION_DENIED)."""
        if self.limits.update:
            return None
        if self.metrics is not None:
            self.metrics.refusals.labels(self.label, "update").inc()
        self._log_refusal("update")
        return (f"tenant {self.label!r} may not send update traffic (x-modeld-request-type: update); "
                "send it as inference, or ask the operator for update=yes on its token")

    def clamp_priority(self, priority: int) -> int:
        """A level above the default (1 is the most urgent, 0 the default)
        becomes the default for a tenant without the right to it."""
        if priority > 0 and not self.limits.priority:
            if self.metrics is not None:
                self.metrics.refusals.labels(self.label, "priority_clamped").inc()
            return 0
        return priority

    def start_stream(self) -> None:
        limit = self.limits.max_streams
        if limit is not None and self.streams >= limit:
            raise self._refuse("streams", f"tenant {self.label!r} already has {self.streams} generations in "
                                          f"progress, its limit; wait for one to finish")
        self.streams += 1
        if self.metrics is not None:
            self.metrics.streams.labels(self.label).set(self.streams)

    def end_stream(self) -> None:
        self.streams -= 1
        if self.metrics is not None:
            self.metrics.streams.labels(self.label).set(self.streams)

    def charge_tokens(self, count: int) -> None:
        if count <= 0:
            return
        if self.tokens is not None:
            self.tokens.charge(count)
        if self.metrics is not None:
            self.metrics.generated_tokens.labels(self.label).inc(count)


class Tenants:
    """Every tenant by name, kept across token-file reloads."""

    def __init__(self, metrics: TenantMetrics | None = None, clock: Clock = time.monotonic) -> None:
        self.metrics, self._clock = metrics, clock
        self.by_name: dict[str, Tenant] = {}
        self.unlimited = Tenant(UNNAMED, TenantLimits(), metrics, clock)

    def update(self, limits_by_name: dict[str, TenantLimits]) -> None:
        for name, limits in limits_by_name.items():
            tenant = self.by_name.get(name)
            if tenant is None:
                self.by_name[name] = Tenant(name, limits, self.metrics, self._clock)
            else:
                tenant.configure(limits)
        for name in self.by_name.keys() - limits_by_name.keys():
            del self.by_name[name]

    def get(self, name: str) -> Tenant:
        return self.by_name.get(name, self.unlimited) if name else self.unlimited


# The tenant of the call in progress, set by the token check (gRPC
# interceptor, HTTP middleware) in the task that runs the call, read where
# requests reach the engine (server/dataplane.py): priority and generation.
_current: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("tenant", default=None)


def set_current(tenant: Tenant | None) -> contextvars.Token:
    return _current.set(tenant)


def current() -> Tenant | None:
    return _current.get()


def with_allowed_priority(request):
    """`request` (an InferRequest or a GenerateRequest) with its priority
    clamped to what the call's tenant may ask for."""
    tenant = _current.get()
    priority = getattr(request, "priority", 0)
    if tenant is None or priority <= 0:
        return request
    allowed = tenant.clamp_priority(priority)
    return request if allowed == priority else dataclasses.replace(request, priority=allowed)


def metered(stream: AsyncIterator) -> AsyncIterator:
    """A generation's events, counted against the call's tenant: one of its
    streams while it runs, and each token as it is generated."""
    tenant = _current.get()
    if tenant is None or not tenant.limited:
        return stream
    return _metered(stream, tenant)


async def _metered(stream: AsyncIterator, tenant: Tenant) -> AsyncIterator:
    tenant.start_stream()
    try:
        async for event in stream:
            ids = getattr(event, "token_ids", None)
            if ids:
                tenant.charge_tokens(len(ids))
            yield event
    finally:
        tenant.end_stream()
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()
