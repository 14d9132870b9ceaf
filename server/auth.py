"""Bearer tokens with roles, one rule for the gRPC services and the HTTP fronts.

The token file holds one `<token> <role>` per line; `#` starts a comment and
blank lines are skipped. Roles are ordered: `infer` may run models and read
what the daemon serves, `admin` may also load and unload them. The
`grpc.health.v1.Health` service, server reflection and the liveness and
readiness checks (gRPC ServerLive/ServerReady, HTTP /v2/health/*) stay open:
Kubernetes probes and grpcurl carry no credentials, and they reveal nothing
but that the daemon is up. Any gRPC method this table does not name needs
`admin`, so an RPC added later is closed until someone decides otherwise.

Tokens are compared as SHA-256 digests with hmac.compare_digest against every
entry, without stopping at a match, so neither the position of a match nor
the length of a guess shows in the time a refusal takes. No token is ever
logged or echoed in an error.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import re
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

log = structlog.get_logger("modeld.auth")

MIN_TOKEN_LENGTH = 16


class Role(enum.IntEnum):
    INFER = 1
    ADMIN = 2

    @property
    def label(self) -> str:
        return self.name.lower()


ROLES = {role.label: role for role in Role}

# Methods anyone may call (None), and what the others need.
_OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                  "/grpc.reflection.v1.ServerReflection/")
_INFERENCE = "/inference.GRPCInferenceService/"
GRPC_ROLES: dict[str, Role | None] = {
    _INFERENCE + "ServerLive": None,
    _INFERENCE + "ServerReady": None,
    _INFERENCE + "ServerMetadata": Role.INFER,
    _INFERENCE + "ModelReady": Role.INFER,
    _INFERENCE + "ModelMetadata": Role.INFER,
    _INFERENCE + "ModelInfer": Role.INFER,
    _INFERENCE + "ModelStreamInfer": Role.INFER,
    _INFERENCE + "ModelStatistics": Role.INFER,
    _INFERENCE + "RepositoryIndex": Role.INFER,
    _INFERENCE + "RepositoryModelLoad": Role.ADMIN,
    _INFERENCE + "RepositoryModelUnload": Role.ADMIN,
    "/modeld.v1.Generation/Generate": Role.INFER,
    "/modeld.v1.Generation/Tokenize": Role.INFER,
    "/modeld.v1.Generation/Detokenize": Role.INFER,
    "/modeld.v1.Node/Stats": Role.INFER,
    "/modeld.v1.Node/WatchStats": Role.INFER,
}


def grpc_role(method: str) -> Role | None:
    """The role a gRPC method needs; None when it is open to all."""
    if method.startswith(_OPEN_SERVICES):
        return None
    return GRPC_ROLES.get(method, Role.ADMIN)


_HTTP_OPEN = {"/v2/health/live", "/v2/health/ready"}
_HTTP_ADMIN = re.compile(r"^/v2/repository/(?!index$)")


def http_role(path: str) -> Role | None:
    """The role an HTTP path needs; None when it is open to all. Loading and
    unloading (everything under /v2/repository but the index) is admin."""
    if path in _HTTP_OPEN:
        return None
    if _HTTP_ADMIN.match(path):
        return Role.ADMIN
    return Role.INFER


class TokenFileError(ValueError):
    """A token file that cannot be used; the message never holds a token."""


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


@dataclass(frozen=True)
class TokenTable:
    entries: tuple[tuple[bytes, Role], ...]  # (SHA-256 of the token, role)

    def __len__(self) -> int:
        return len(self.entries)

    def role_of(self, token: str) -> Role | None:
        presented = _digest(token)
        found = None
        for digest, role in self.entries:  # every entry, always: see the module's note
            if hmac.compare_digest(digest, presented):
                found = role
        return found


def parse_tokens(text: str, source: str = "the token file") -> TokenTable:
    entries: list[tuple[bytes, Role]] = []
    first_line: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {number}"
        if len(fields) != 2:
            raise TokenFileError(f"{where}: expected '<token> <role>' (role one of {', '.join(ROLES)}), "
                                 f"found {len(fields)} field{'s' if len(fields) != 1 else ''}")
        token, role_name = fields
        role = ROLES.get(role_name.lower())
        if role is None:
            raise TokenFileError(f"{where}: unknown role {role_name!r}; use one of {', '.join(ROLES)}")
        if not (token.isascii() and token.isprintable()):
            raise TokenFileError(f"{where}: the token has characters an HTTP header or gRPC metadata "
                                 "cannot carry; use printable ASCII")
        if len(token) < MIN_TOKEN_LENGTH:
            raise TokenFileError(f"{where}: the token is {len(token)} characters, shorter than "
                                 f"{MIN_TOKEN_LENGTH}; make one with `python -c \"import secrets; "
                                 "print(secrets.token_urlsafe(32))\"`")
        digest = _digest(token)
        if digest in first_line:
            raise TokenFileError(f"{where}: the same token as line {first_line[digest]}; "
                                 "give each token one line and one role")
        first_line[digest] = number
        entries.append((digest, role))
    if not entries:
        raise TokenFileError(f"{source} holds no tokens, so every call would be refused; "
                             "add lines of '<token> <role>'")
    return TokenTable(tuple(entries))


def load_token_file(path: Path) -> TokenTable:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenFileError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"cannot read token file {path}: {exc}") from None
    return parse_tokens(text, f"token file {path}")


class Refusal(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"
    PERMISSION_DENIED = "permission_denied"


_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)


class Authenticator:
    """The daemon's current tokens; `reload` swaps them in on SIGHUP."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.table = load_token_file(self.path)

    def reload(self) -> bool:
        """Read the file again; on any error keep the tokens in use and say why."""
        try:
            table = load_token_file(self.path)
        except TokenFileError as exc:
            log.error("auth_tokens_reload_failed", path=str(self.path), reason=str(exc),
                      kept_tokens=len(self.table))
            return False
        self.table = table
        log.info("auth_tokens_reloaded", path=str(self.path), tokens=len(table))
        return True

    def check(self, authorization: str | None, needed: Role, action: str) -> tuple[Refusal, str] | None:
        """None when `authorization` (the header's value) may do `action`,
        else the refusal and a message saying what to send instead."""
        if not authorization:
            return Refusal.UNAUTHENTICATED, (
                f"{action} needs a token: send the header 'authorization: Bearer <token>' "
                "with a token from the daemon's token file")
        match = _BEARER.match(authorization)
        if match is None:
            return Refusal.UNAUTHENTICATED, (
                "the authorization header must be 'Bearer <token>'; other schemes are not accepted")
        role = self.table.role_of(match.group(1))
        if role is None:
            return Refusal.UNAUTHENTICATED, (
                "the token is not valid on this daemon; check it against the daemon's token file "
                "(the daemon rereads it on SIGHUP)")
        if role < needed:
            return Refusal.PERMISSION_DENIED, (
                f"{action} needs the '{needed.label}' role; this token has '{role.label}'")
        return None


_GRPC_CODES = {Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
               Refusal.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED}


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """A handler of the same streaming shape that aborts at once. It takes
    raw bytes: a refused request is never deserialized."""
    async def refuse(_request, context):
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(refuse)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        needed = grpc_role(method)
        handler = await continuation(handler_call_details)
        if needed is None or handler is None:
            return handler
        authorization = _metadata_value(handler_call_details.invocation_metadata, "authorization")
        refusal = self.authenticator.check(authorization, needed, method.rsplit("/", 1)[-1])
        if refusal is None:
            return handler
        kind, message = refusal
        log.info("call_refused", method=method, reason=kind.value)
        return _refusing_handler(handler, _GRPC_CODES[kind], message)


class HttpAuthMiddleware:
    """The same rule for the HTTP fronts: 401 with `WWW-Authenticate: Bearer`
    for a missing or unknown token, 403 for a token whose role falls short.
    Pure ASGI, as RequestIdMiddleware, so streaming bodies are untouched."""

    def __init__(self, app, authenticator: Authenticator) -> None:
        self.app = app
        self.authenticator = authenticator

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        needed = http_role(path)
        if needed is None:
            await self.app(scope, receive, send)
            return
        authorization = None
        for key, value in scope.get("headers") or ():
            if key == b"authorization":
                authorization = value.decode("latin-1")
                break
        refusal = self.authenticator.check(authorization, needed, f"{scope.get('method', 'GET')} {path}")
        if refusal is None:
            await self.app(scope, receive, send)
            return
        from starlette.responses import JSONResponse

        kind, message = refusal
        log.info("call_refused", path=path, reason=kind.value)
        if kind is Refusal.UNAUTHENTICATED:
            status, headers = 401, {"www-authenticate": 'Bearer realm="modeld"'}
        else:
            status, headers = 403, {}
        if path.startswith("/v1/"):  # the OpenAI SDK reads error.message
            body = {"error": {"message": message, "type": kind.value, "code": status}}
        else:  # KServe v2's error shape
            body = {"error": message}
        await JSONResponse(body, status_code=status, headers=headers)(scope, receive, send)
