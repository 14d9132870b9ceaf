"""Bearer tokens with roles, one rule for the gRPC services and the HTTP fronts.

The token file holds one `<token> <role> [key=value ...]` per line; `#`
starts a comment and blank lines are skipped. The optional keys name the
token's tenant and its quotas (server/tenants.py: `tenant`, `rps`, `burst`,
`tokens_per_minute`, `streams`, `models`, `priority`, `update`) and mark the
fleet token (`fleet=yes`), whose digest a daemon uses to prove to a gateway
that it belongs to the fleet (`fleet_proof`). Roles are ordered: `infer` may run models and read
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

import asyncio
import enum
import hashlib
import hmac
import json
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import structlog

from modeld.backends.errors import InvalidArgument, ModeldError
from modeld.server.tenants import (MAX_MODELS, ModelNotAllowed, Tenant, TenantLimits, TenantMetrics, Tenants,
                                   set_current)

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
    "/modeld.v1.Node/WatchKvEvents": Role.INFER,
    "/modeld.v1.Node/PromptBlocks": Role.INFER,
}
# Methods for the gateway alone: the fleet token (fleet=yes) or an admin
# token. The KV events show which prompt blocks are cached, and a caller who
# can hash a guessed prompt (PromptBlocks) could tell whether another tenant
# sent it.
FLEET_METHODS = frozenset({"/modeld.v1.Node/WatchKvEvents", "/modeld.v1.Node/PromptBlocks"})


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
    tenants: tuple[str, ...] = ()  # each entry's tenant ("" for none), in the same order
    limits: dict[str, TenantLimits] = field(default_factory=dict)  # by tenant name
    fleet: bytes | None = None  # the digest of the token marked fleet=yes

    def __len__(self) -> int:
        return len(self.entries)

    def identify(self, token: str) -> tuple[Role, str] | None:
        """The token's role and tenant name, or None."""
        presented = _digest(token)
        found = None
        for index, (digest, role) in enumerate(self.entries):  # every entry, always: see the module's note
            if hmac.compare_digest(digest, presented):
                found = (role, self.tenants[index] if self.tenants else "")
        return found

    def role_of(self, token: str) -> Role | None:
        found = self.identify(token)
        return found[0] if found is not None else None


FLEET_CHALLENGE_HEADER = "x-modeld-fleet-challenge"
FLEET_PROOF_HEADER = "x-modeld-fleet-proof"
_MAX_CHALLENGE = 128


def fleet_proof(token_digest: bytes, challenge: str) -> str:
    """What a daemon answers a gateway's fleet challenge with: an HMAC keyed
    by the fleet token's digest, so the token itself never travels to a node
    that has not shown it knows it."""
    return hmac.new(token_digest, b"modeld-fleet-v1:" + challenge.encode("ascii", "replace"),
                    hashlib.sha256).hexdigest()


def token_digest(token: str) -> bytes:
    return _digest(token)


_YES, _NO = ("yes", "true", "1", "on"), ("no", "false", "0", "off")
_TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,255}")
_KEYS = ("tenant", "rps", "burst", "tokens_per_minute", "streams", "models", "priority", "update", "fleet")


def _flag(where: str, key: str, value: str) -> bool:
    if value.lower() in _YES:
        return True
    if value.lower() in _NO:
        return False
    raise TokenFileError(f"{where}: {key}={value!r} must be yes or no")


def _positive(where: str, key: str, value: str, integer: bool) -> float:
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = -1
    if not number > 0 or number != number or number == float("inf"):
        raise TokenFileError(f"{where}: {key}={value!r} must be a positive {'whole ' if integer else ''}number")
    return number


def _attributes(where: str, words: list[str]) -> dict[str, object]:
    found: dict[str, object] = {}
    for word in words:
        key, sep, value = word.partition("=")
        if not sep:
            raise TokenFileError(f"{where}: expected '<token> <role>' and optional key=value settings, found "
                                 f"{len(words) + 2} fields, {len(words)} of them not key=value")
        if key not in _KEYS:
            raise TokenFileError(f"{where}: {word.split('=')[0]!r} is not a token setting; use key=value with "
                                 f"key one of {', '.join(_KEYS)}")
        if key in found:
            raise TokenFileError(f"{where}: {key} is given twice")
        if key == "tenant":
            if not _TENANT_NAME.fullmatch(value):
                raise TokenFileError(f"{where}: tenant={value!r} must be 1-64 letters, digits, '.', '_' or '-'")
            found[key] = value
        elif key in ("rps", "burst"):
            found[key] = _positive(where, key, value, integer=False)
        elif key in ("tokens_per_minute", "streams"):
            found[key] = int(_positive(where, key, value, integer=True))
        elif key == "models":
            names = [name for name in value.split(",") if name]
            if not names or len(names) > MAX_MODELS or not all(_MODEL_NAME.fullmatch(n) for n in names):
                raise TokenFileError(f"{where}: models= takes 1 to {MAX_MODELS} model names separated by commas")
            found[key] = frozenset(names)
        else:
            found[key] = _flag(where, key, value)
    limited = set(found) - {"tenant", "fleet"}
    if limited and "tenant" not in found:
        raise TokenFileError(f"{where}: {', '.join(sorted(limited))} need tenant=NAME: limits belong to a tenant")
    return found


def _tenant_limits(attrs: list[tuple[str, dict]]) -> dict[str, TenantLimits]:
    """One TenantLimits per tenant; lines of one tenant that both set a key must agree."""
    merged: dict[str, dict[str, tuple[object, str]]] = {}
    for where, found in attrs:
        tenant = found.get("tenant")
        if tenant is None:
            continue
        keys = merged.setdefault(tenant, {})
        for key, value in found.items():
            if key in ("tenant", "fleet"):
                continue
            if key in keys and keys[key][0] != value:
                raise TokenFileError(f"{where}: {key} of tenant {tenant!r} differs from {keys[key][1]}; "
                                     "give a tenant's limits once, or the same on each of its lines")
            keys.setdefault(key, (value, where))
    limits = {}
    for tenant, keys in merged.items():
        get = {k: v for k, (v, _) in keys.items()}
        limits[tenant] = TenantLimits(
            requests_per_s=get.get("rps"), burst=get.get("burst"), tokens_per_minute=get.get("tokens_per_minute"),
            max_streams=get.get("streams"), models=get.get("models"),
            priority=get.get("priority", False), update=get.get("update", False))
    return limits


def parse_tokens(text: str, source: str = "the token file") -> TokenTable:
    entries: list[tuple[bytes, Role]] = []
    tenants: list[str] = []
    attrs: list[tuple[str, dict]] = []
    fleet: tuple[bytes, str] | None = None
    first_line: dict[bytes, int] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split("#", 1)[0].split()
        if not fields:
            continue
        where = f"{source} line {number}"
        if len(fields) < 2:
            raise TokenFileError(f"{where}: expected '<token> <role>' (role one of {', '.join(ROLES)}) and "
                                 f"optional key=value settings, found {len(fields)} "
                                 f"field{'s' if len(fields) != 1 else ''}")
        token, role_name, *extra = fields
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
        found = _attributes(where, extra)
        digest = _digest(token)
        if digest in first_line:
            raise TokenFileError(f"{where}: the same token as line {first_line[digest]}; "
                                 "give each token one line and one role")
        if found.get("fleet"):
            if fleet is not None:
                raise TokenFileError(f"{where}: a second token marked fleet=yes (the first is on {fleet[1]}); "
                                     "a fleet has one token")
            fleet = (digest, where)
        first_line[digest] = number
        entries.append((digest, role))
        tenants.append(str(found.get("tenant", "")))
        attrs.append((where, found))
    if not entries:
        raise TokenFileError(f"{source} holds no tokens, so every call would be refused; "
                             "add lines of '<token> <role>'")
    return TokenTable(tuple(entries), tuple(tenants), _tenant_limits(attrs),
                      fleet[0] if fleet is not None else None)


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
    RESOURCE_EXHAUSTED = "resource_exhausted"


_BEARER = re.compile(r"^\s*bearer\s+(\S+)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class Denied:
    """A refused call: its kind, what to tell the caller, and for a quota
    the seconds after which a retry may pass."""

    kind: Refusal
    message: str
    retry_after: str | None = None  # whole seconds, as Retry-After and the retry-after trailer carry them


class Authenticator:
    """The daemon's (or the gateway's) current tokens and tenants; `reload`
    swaps them in on SIGHUP, keeping each tenant's buckets."""

    def __init__(self, path: Path, registry=None, clock=time.monotonic) -> None:
        """`registry`: where the per-tenant metrics go; `clock`: the
        buckets' time (a test steps it)."""
        self.path = Path(path)
        self.table = load_token_file(self.path)
        self.tenants = Tenants(TenantMetrics(registry), clock)
        self.tenants.update(self.table.limits)

    def reload(self) -> bool:
        """Read the file again; on any error keep the tokens in use and say why."""
        try:
            table = load_token_file(self.path)
        except TokenFileError as exc:
            log.error("auth_tokens_reload_failed", path=str(self.path), reason=str(exc),
                      kept_tokens=len(self.table))
            return False
        self.table = table
        self.tenants.update(table.limits)
        log.info("auth_tokens_reloaded", path=str(self.path), tokens=len(table), tenants=len(table.limits))
        return True

    def authorize(self, authorization: str | None, needed: Role, action: str,
                  fleet_only: bool = False) -> Denied | Tenant:
        """The caller's tenant when `authorization` (the header's value) may
        do `action` and its tenant's rate admits one more call (spent),
        else why not. `fleet_only`: the fleet token or an admin token only."""
        if not authorization:
            return Denied(Refusal.UNAUTHENTICATED, (
                f"{action} needs a token: send the header 'authorization: Bearer <token>' "
                "with a token from the daemon's token file"))
        match = _BEARER.match(authorization)
        if match is None:
            return Denied(Refusal.UNAUTHENTICATED,
                          "the authorization header must be 'Bearer <token>'; other schemes are not accepted")
        found = self.table.identify(match.group(1))
        if found is None:
            return Denied(Refusal.UNAUTHENTICATED, (
                "the token is not valid on this daemon; check it against the daemon's token file "
                "(the daemon rereads it on SIGHUP)"))
        role, tenant_name = found
        if role < needed:
            return Denied(Refusal.PERMISSION_DENIED,
                          f"{action} needs the '{needed.label}' role; this token has '{role.label}'")
        if fleet_only and role < Role.ADMIN and not (
                self.table.fleet is not None and hmac.compare_digest(self.table.fleet, _digest(match.group(1)))):
            return Denied(Refusal.PERMISSION_DENIED,
                          f"{action} is the gateway's call: it takes the fleet token (fleet=yes) or an admin token")
        tenant = self.tenants.get(tenant_name)
        over = tenant.admit() if tenant.limited else None
        if over is not None:
            return Denied(Refusal.RESOURCE_EXHAUSTED, over.message, over.retry_after_header)
        return tenant

    def check(self, authorization: str | None, needed: Role, action: str) -> tuple[Refusal, str] | None:
        """None when `authorization` may do `action`, else the refusal and a
        message saying what to send instead (authorize, without the tenant)."""
        verdict = self.authorize(authorization, needed, action)
        return (verdict.kind, verdict.message) if isinstance(verdict, Denied) else None

    def fleet_proof(self, challenge: str | None) -> str | None:
        """The answer to a gateway's fleet challenge, when this daemon has a
        fleet token and the challenge is one a gateway would send."""
        fleet = self.table.fleet
        if fleet is None or not challenge or len(challenge) > _MAX_CHALLENGE or not challenge.isascii():
            return None
        return fleet_proof(fleet, challenge)


_GRPC_CODES = {Refusal.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
               Refusal.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED,
               Refusal.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED}
RETRY_AFTER = "retry-after"

# The request field that names the model, per method (its name, and its
# number for a handler that takes the request's bytes and parses them
# itself): a tenant's `models` list is checked against it.
_MODEL_FIELD = {
    _INFERENCE + "ModelReady": ("name", 1),
    _INFERENCE + "ModelMetadata": ("name", 1),
    _INFERENCE + "ModelInfer": ("model_name", 1),
    _INFERENCE + "ModelStreamInfer": ("model_name", 1),
    _INFERENCE + "ModelStatistics": ("name", 1),
    _INFERENCE + "RepositoryModelLoad": ("model_name", 2),
    _INFERENCE + "RepositoryModelUnload": ("model_name", 2),
    "/modeld.v1.Generation/Generate": ("model", 1),
    "/modeld.v1.Generation/Tokenize": ("model", 1),
    "/modeld.v1.Generation/Detokenize": ("model", 1),
}


def _model_of(request, field: tuple[str, int]) -> str | None:
    """The request's model name; None when its bytes cannot be read (then a
    tenant with a model list is refused: protobuf might still read a name
    out of bytes this reader gives up on)."""
    if isinstance(request, (bytes, bytearray, memoryview)):
        from modeld.server.gateway.wire import WireError, string_field  # the reader the gateway routes by

        try:
            return string_field(bytes(request), field[1], max_fields=_MAX_MODEL_WALK)
        except WireError:
            return None
    return getattr(request, field[0], "") or ""


_MAX_MODEL_WALK = 1_000_000  # top-level fields walked for the model name; a real request has a few hundred
_UNREADABLE = "cannot read the request's model name, so the tenant's model list cannot be checked"


def _metadata_value(metadata, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else None
    return None


def _trailers(denied: Denied) -> tuple[tuple[str, str], ...]:
    return ((RETRY_AFTER, denied.retry_after),) if denied.retry_after is not None else ()


def _same_shape(handler: grpc.RpcMethodHandler, behaviour, raw: bool = False):
    """A handler of `handler`'s streaming shape running `behaviour`; `raw`
    drops the (de)serializers, so a refused request is never deserialized."""
    kwargs = {} if raw else {"request_deserializer": handler.request_deserializer,
                             "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(behaviour, **kwargs)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(behaviour, **kwargs)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(behaviour, **kwargs)
    return grpc.unary_unary_rpc_method_handler(behaviour, **kwargs)


def _behaviour(handler: grpc.RpcMethodHandler):
    return (handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary)


def _refusing_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str, trailers=()):
    """A handler of the same streaming shape that aborts at once. It takes
    raw bytes: a refused request is never deserialized."""
    async def refuse(_request, context):
        await context.abort(code, message, trailing_metadata=tuple(trailers))

    return _same_shape(handler, refuse, raw=True)


def _proving_handler(handler: grpc.RpcMethodHandler, proof: str):
    """The same unary handler, answering with the fleet proof in its trailers."""
    inner = handler.unary_unary

    async def proving(request, context):
        context.set_trailing_metadata(((FLEET_PROOF_HEADER, proof),))
        return await inner(request, context)

    return _same_shape(handler, proving)


def _tenant_handler(handler: grpc.RpcMethodHandler, tenant: Tenant, method: str):
    """The handler run as `tenant`'s call: the tenant is the call's current
    one (the data plane meters generations and clamps priority by it), and
    each request's model is checked against the tenant's list."""
    inner = _behaviour(handler)
    model_field = _MODEL_FIELD.get(method) if tenant.limits.models is not None else None

    async def check(request) -> None:
        if model_field is None:
            return
        if isinstance(request, bytes) and len(request) > _PEEK_IN_THREAD_BYTES:
            model = await asyncio.to_thread(_model_of, request, model_field)  # a large message: off the loop
        else:
            model = _model_of(request, model_field)
        if model is None:
            raise InvalidArgument(_UNREADABLE)
        tenant.check_model(model)

    async def checked(requests):
        # a refusal is raised to whoever reads the messages, not aborted here:
        # ModelStreamInfer reads them in a task of its own, and an abort from
        # it while the call's task writes an answer is a second operation grpc
        # refuses (the call then hangs until its deadline). The handler ends
        # the call with the error's status from the call's own task.
        async for request in requests:
            await check(request)
            yield request

    async def start(request, context):
        set_current(tenant)
        if handler.request_streaming:
            return inner(checked(request), context)
        try:
            await check(request)
        except ModeldError as exc:
            await context.abort(grpc.StatusCode[exc.kind.value], str(exc))
        return inner(request, context)

    if handler.response_streaming:
        # an async generator: grpc iterates it, so the tenant is set in it
        async def streaming(request, context):
            result = await start(request, context)
            if hasattr(result, "__aiter__"):
                async for reply in result:
                    yield reply
            else:
                await result
        return _same_shape(handler, streaming)

    async def unary(request, context):
        return await (await start(request, context))
    return _same_shape(handler, unary)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, authenticator: Authenticator) -> None:
        self.authenticator = authenticator

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        needed = grpc_role(method)
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        metadata = handler_call_details.invocation_metadata
        if needed is None:
            challenge = _metadata_value(metadata, FLEET_CHALLENGE_HEADER)
            proof = self.authenticator.fleet_proof(challenge) if challenge else None
            if proof is not None and handler.unary_unary is not None:
                return _proving_handler(handler, proof)
            return handler
        authorization = _metadata_value(metadata, "authorization")
        verdict = self.authenticator.authorize(authorization, needed, method.rsplit("/", 1)[-1],
                                               fleet_only=method in FLEET_METHODS)
        if isinstance(verdict, Denied):
            if verdict.kind is not Refusal.RESOURCE_EXHAUSTED:  # quota refusals: the tenant's own, rate-limited line
                log.info("call_refused", method=method, reason=verdict.kind.value)
            return _refusing_handler(handler, _GRPC_CODES[verdict.kind], verdict.message, _trailers(verdict))
        if not verdict.limited:
            return handler
        return _tenant_handler(handler, verdict, method)


_V2_MODEL = re.compile(r"^/v2/(?:repository/)?models/([^/]+)")
_PEEK_IN_THREAD_BYTES = 1 << 20  # a body this large is parsed off the event loop


def _http_error(path: str, status: int, kind: str, message: str, headers: dict | None = None):
    from starlette.responses import JSONResponse

    if path.startswith("/v1/"):  # the OpenAI SDK reads error.message
        body = {"error": {"message": message, "type": kind, "code": status}}
    else:  # KServe v2's error shape
        body = {"error": message}
    return JSONResponse(body, status_code=status, headers=headers or {})


class _BodyTooLarge(Exception):
    pass


async def _read_whole(receive, limit: int | None) -> tuple[bytes, list]:
    """Every body message of the request (kept to replay), and the bytes."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            break
        size += len(message.get("body", b""))
        if limit and size > limit:
            raise _BodyTooLarge(size)
        if not message.get("more_body", False):
            break
    return b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request"), messages


def _model_in_body(body: bytes, encoding: str, limit: int | None) -> str | None:
    """The `model` of a JSON body, read as the route reads it (json.loads,
    the same bounded inflation); None when it cannot be read."""
    if encoding not in ("", "identity"):
        if encoding not in ("gzip", "deflate"):
            return None
        inflater = zlib.decompressobj(wbits=31 if encoding == "gzip" else 15)
        try:
            body = inflater.decompress(body, limit + 1 if limit else 0)
        except zlib.error:
            return None
        if inflater.unconsumed_tail or (limit and len(body) > limit):
            return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    model = value.get("model") if isinstance(value, dict) else None
    return model if isinstance(model, str) else None


class HttpAuthMiddleware:
    """The same rule for the HTTP fronts: 401 with `WWW-Authenticate: Bearer`
    for a missing or unknown token, 403 for a token whose role falls short
    or a model its tenant may not use, 429 with `Retry-After` for a tenant
    over its quota. Pure ASGI, as RequestIdMiddleware, so streaming bodies
    are untouched, and the endpoint runs in this task: the tenant set here
    is the one the data plane meters."""

    def __init__(self, app, authenticator: Authenticator, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.authenticator = authenticator
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        needed = http_role(path)
        if needed is None:
            await self.app(scope, receive, send)
            return
        authorization = encoding = None
        for key, value in scope.get("headers") or ():
            if key == b"authorization":
                authorization = value.decode("latin-1")
            elif key == b"content-encoding":
                encoding = value.decode("latin-1").strip().lower()
        verdict = self.authenticator.authorize(authorization, needed, f"{scope.get('method', 'GET')} {path}")
        if isinstance(verdict, Denied):
            if verdict.kind is not Refusal.RESOURCE_EXHAUSTED:
                log.info("call_refused", path=path, reason=verdict.kind.value)
            if verdict.kind is Refusal.UNAUTHENTICATED:
                status, headers = 401, {"www-authenticate": 'Bearer realm="modeld"'}
            elif verdict.kind is Refusal.RESOURCE_EXHAUSTED:
                status, headers = 429, ({"retry-after": verdict.retry_after} if verdict.retry_after else {})
            else:
                status, headers = 403, {}
            await _http_error(path, status, verdict.kind.value, verdict.message, headers)(scope, receive, send)
            return
        set_current(verdict if verdict.limited else None)
        if verdict.limits.models is not None:
            receive = await self._check_model(verdict, scope, receive, send, path, encoding or "identity")
            if receive is None:
                return
        await self.app(scope, receive, send)

    async def _check_model(self, tenant: Tenant, scope, receive, send, path: str, encoding: str):
        """`receive` (replaying the body when it had to be read), or None
        once the call was refused."""
        match = _V2_MODEL.match(path)
        if match is not None and path != "/v2/models/stats":
            model = match.group(1)
        elif scope.get("method") == "POST" and path.startswith("/v1/"):
            try:
                body, messages = await _read_whole(receive, self.max_body_bytes)
            except _BodyTooLarge as exc:
                message = (f"request body of more than {exc.args[0]} bytes is larger than the daemon's "
                           f"max_message_bytes ({self.max_body_bytes} bytes); send less per request")
                await _http_error(path, 413, "request_too_large", message)(scope, receive, send)
                return None
            if len(body) > _PEEK_IN_THREAD_BYTES:
                model = await asyncio.to_thread(_model_in_body, body, encoding, self.max_body_bytes)
            else:
                model = _model_in_body(body, encoding, self.max_body_bytes)
            pending = list(messages)

            async def replay():
                return pending.pop(0) if pending else await receive()
            receive = replay
        elif path.startswith("/v1/models/"):
            model = path[len("/v1/models/"):]
        else:
            model = ""
        if model is None:
            message = f"{_UNREADABLE}: send a JSON object with a string 'model'"
            await _http_error(path, 400, "invalid_request_error", message)(scope, receive, send)
            return None
        try:
            tenant.check_model(model)
        except ModelNotAllowed as exc:
            await _http_error(path, 403, Refusal.PERMISSION_DENIED.value, str(exc))(scope, receive, send)
            return None
        return receive
