"""HttpCallOptions: what an HTTP client's headers ask of a forwarded call,
and the headers the node gets; the HTTP twin of call_options.CallOptions
(the router reads `update` and `request_id` of either)."""

from __future__ import annotations

from modeld.server import tenants
from modeld.server.gateway.split import MAX_SESSION, SESSION_HEADER
from modeld.server.gateway.call_options import REQUEST_TYPE_HEADER, URGENCY_HEADER
from modeld.server.request_context import REQUEST_ID_HEADER

_REQUEST_TYPES = ("inference", "update")
_URGENCIES = ("low", "normal", "high", "critical")
# hop-by-hop headers (RFC 9110 7.6.1) and those the gateway sets for the next hop itself
_DROPPED = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"te", b"trailer",
                      b"upgrade", b"host", b"content-length", b"proxy-authorization", b"proxy-authenticate",
                      b"expect",  # the gateway sends the body it already holds at once
                      REQUEST_ID_HEADER.encode()})


class HeaderError(ValueError):
    """A modeld header with a value it does not take (400)."""


def _one_of(header: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise HeaderError(f"{header} must be one of {', '.join(allowed)}, not {value!r}")
    return value


class HttpCallOptions:
    """The client's headers, as the node gets them (its `authorization`
    included, so the node judges the client's own token), and what the
    modeld headers among them ask: update traffic, urgency, a session."""

    __slots__ = ("headers", "request_id", "update", "urgent", "session", "kserve_timeout_s", "encoding")

    timeout = None  # HTTP carries no deadline; the client's disconnect cancels the call instead

    def __init__(self, raw_headers, request_id: str) -> None:
        self.request_id = request_id
        self.update = self.urgent = False
        self.session = ""
        self.kserve_timeout_s = None
        self.encoding = "identity"
        headers = []
        for key, value in raw_headers:
            if key in _DROPPED:
                continue
            if key == b"x-modeld-request-type":
                self.update = _one_of(REQUEST_TYPE_HEADER, value.decode("latin-1"), _REQUEST_TYPES) == "update"
            elif key == b"x-modeld-urgency":
                self.urgent = _one_of(URGENCY_HEADER, value.decode("latin-1"), _URGENCIES) in ("high", "critical")
            elif key == SESSION_HEADER.encode():
                self.session = value.decode("latin-1")[:MAX_SESSION]
            elif key == b"content-encoding":
                self.encoding = value.decode("latin-1").strip().lower() or "identity"
            headers.append((key, value))
        tenant = tenants.current()  # set by the token check (server/auth.py) when the gateway has tokens
        if tenant is not None:
            if self.update and (why := tenant.update_refusal()) is not None:
                raise PermissionError(why)
            if self.urgent and not tenant.clamp_priority(1):
                self.urgent = False
        headers.append((REQUEST_ID_HEADER.encode(), request_id.encode()))
        self.headers = headers
