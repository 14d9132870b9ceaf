"""CallOptions: what a client's metadata asks of a forwarded call, and the
metadata the node gets."""

from __future__ import annotations

import grpc

from modeld.server import tenants
from modeld.server.gateway.failure import CallFailed
from modeld.server.gateway.split import MAX_SESSION, SESSION_HEADER
from modeld.server.request_context import REQUEST_ID_HEADER, new_request_id, usable_client_id

REQUEST_TYPE_HEADER = "x-modeld-request-type"
URGENCY_HEADER = "x-modeld-urgency"
_REQUEST_TYPES = ("inference", "update")
_URGENCIES = ("low", "normal", "high", "critical")
# hop-by-hop and transport headers grpc sets itself on the next hop
_DROPPED = frozenset({"user-agent", "te", "content-type", "grpc-accept-encoding", "grpc-encoding", "grpc-timeout"})


def _one_of(header: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise CallFailed(grpc.StatusCode.INVALID_ARGUMENT,
                         f"{header} must be one of {', '.join(allowed)}, not {value!r}")
    return value


class CallOptions:
    """What the client's metadata asks of this call, and the metadata the
    node gets: the client's own, `authorization` included, so the node
    judges the client's token (the gateway's own token, --node-token-file,
    rides only on its health and Stats probes, never on a forwarded call)."""

    __slots__ = ("metadata", "request_id", "update", "urgent", "kserve_timeout_s", "session", "_context")

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context
        self.kserve_timeout_s: float | None = None  # the request's own KServe `timeout`, once read
        metadata, request_id, self.update, self.urgent = [], None, False, False
        self.session = ""  # the client's conversation, which keeps one target of a traffic split
        for key, value in context.invocation_metadata() or ():
            if key.startswith(":") or key in _DROPPED:
                continue
            if key == REQUEST_TYPE_HEADER:
                self.update = _one_of(key, value, _REQUEST_TYPES) == "update"
            elif key == URGENCY_HEADER:
                self.urgent = _one_of(key, value, _URGENCIES) in ("high", "critical")
            elif key == SESSION_HEADER:
                self.session = value[:MAX_SESSION]
            elif key == REQUEST_ID_HEADER:
                request_id = usable_client_id(value)
                continue
            metadata.append((key, value))
        tenant = tenants.current()  # set by the token check (server/auth.py) when the gateway has tokens
        if tenant is not None:
            if self.update and (why := tenant.update_refusal()) is not None:
                raise CallFailed(grpc.StatusCode.PERMISSION_DENIED, why)
            if self.urgent and not tenant.clamp_priority(1):
                self.urgent = False  # a tenant without the right to priority is served at the default urgency
        # the node's logs and ours carry one id for the call
        self.request_id = request_id or new_request_id()
        metadata.append((REQUEST_ID_HEADER, self.request_id))
        self.metadata = tuple(metadata)

    @property
    def timeout(self) -> float | None:
        """The client's time left, read per attempt: a retry or a hedge
        must not get the whole of the original deadline again."""
        return self._context.time_remaining()
