"""KServe v2 REST (/v2): the HTTP half of the protocol the gRPC
`inference.GRPCInferenceService` speaks, as Triton serves it, so the stock
`tritonclient.http` works unmodified.

Each endpoint decodes (kserve_json.py turns an infer body into the gRPC
service's `ModelInferRequest`), asks the data plane, and encodes; an infer
call then runs exactly as gRPC's ModelInfer does (services/inference.py).
"""

from __future__ import annotations

import functools

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError, NotFound
from modeld.server.dataplane import DataPlane, ModelStatistics
from modeld.server.http.common import (
    CLIENT_GONE_STATUS, ClientGone, json_object, read_body, status_of_error, unless_client_leaves,
)
from modeld.server.http.kserve_json import (
    HEADER_LENGTH, dumps, file_contents, infer_request, infer_response, parameters_of, spec_json,
)
from modeld.server.request_context import internal_message, release_frames
from modeld.server.requests import ModelState
from modeld.server.services.inference import model_infer
from modeld.server.services.parsing import decode_off_loop

log = structlog.get_logger("modeld.http")


def routes(plane: DataPlane) -> list[Route]:
    return KServeApi(plane).routes()


def _endpoint(method):
    """Errors as Triton's REST errors, `{"error": message}`, with the status
    the gRPC table gives them, counted as gRPC counts them."""

    @functools.wraps(method)
    async def wrapper(self: KServeApi, request: Request) -> Response:
        try:
            return await method(self, request)
        except Exception as exc:  # noqa: BLE001 - mapped to a status below
            model = request.path_params.get("name", "")
            release_frames(exc)  # after the status is chosen nothing reads them; see release_frames
            if isinstance(exc, ModeldError):
                log.info("http_failed", path=request.url.path, status=exc.kind.value, reason=str(exc))
                self.plane.count_failure(model, exc.kind)
                return JSONResponse({"error": str(exc)}, status_code=status_of_error(exc))
            log.exception("http_bug", path=request.url.path)
            self.plane.count_failure(model, ErrorKind.INTERNAL)
            return JSONResponse({"error": internal_message()}, status_code=500)
    return wrapper


def _json(value, status_code: int = 200) -> Response:
    return Response(dumps(value), status_code=status_code, media_type="application/json")


class KServeApi:
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    def routes(self) -> list[Route]:
        model = "/v2/models/{name}"
        versioned = "/v2/models/{name}/versions/{version}"
        return [
            Route("/v2/health/live", self.live, methods=["GET"]),
            Route("/v2/health/ready", self.ready, methods=["GET"]),
            Route("/v2", self.server_metadata, methods=["GET"]),
            # before /v2/models/{name}, which would take "stats" for a model name
            Route("/v2/models/stats", self.statistics, methods=["GET"]),
            Route(model + "/stats", self.statistics, methods=["GET"]),
            Route(versioned + "/stats", self.statistics, methods=["GET"]),
            Route(model + "/ready", self.model_ready, methods=["GET"]),
            Route(versioned + "/ready", self.model_ready, methods=["GET"]),
            Route(model + "/infer", self.infer, methods=["POST"]),
            Route(versioned + "/infer", self.infer, methods=["POST"]),
            Route(model, self.model_metadata, methods=["GET"]),
            Route(versioned, self.model_metadata, methods=["GET"]),
            Route("/v2/repository/index", self.repository_index, methods=["POST"]),
            Route("/v2/repository/models/{name}/load", self.load, methods=["POST"]),
            Route("/v2/repository/models/{name}/unload", self.unload, methods=["POST"]),
            Route("/v2/{path:path}", self.unknown, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
        ]

    # -- health and metadata -------------------------------------------------

    @_endpoint
    async def live(self, request: Request) -> Response:
        return _json({"live": True})

    @_endpoint
    async def ready(self, request: Request) -> Response:
        # while draining the middleware answers 503 before this runs
        return _json({"ready": self.plane.is_ready()})

    @_endpoint
    async def model_ready(self, request: Request) -> Response:
        name, version = _model_of(request)
        state = self.plane.model_state(name, version)  # NOT_FOUND for a name nobody knows
        if state is ModelState.READY:
            return _json({"name": name, "ready": True})
        # a probe's answer, not a failed call: not counted
        return _json({"error": f"model {name!r} is not ready: it is {state.value}"}, status_code=503)

    @_endpoint
    async def server_metadata(self, request: Request) -> Response:
        server = self.plane.server_metadata()
        return _json({"name": server.name, "version": server.version, "extensions": list(server.extensions)})

    @_endpoint
    async def model_metadata(self, request: Request) -> Response:
        name, version = _model_of(request)
        model = await self.plane.model(name, version)
        return _json({
            "name": name, "versions": list(model.versions), "platform": model.platform,
            "inputs": [spec_json(s) for s in model.inputs], "outputs": [spec_json(s) for s in model.outputs],
        })

    @_endpoint
    async def statistics(self, request: Request) -> Response:
        name, version = _model_of(request)
        return _json({"model_stats": [_statistics_json(m) for m in self.plane.statistics(name, version)]})

    # -- repository ----------------------------------------------------------

    @_endpoint
    async def repository_index(self, request: Request) -> Response:
        body = await _json_body(request)
        ready_only = body.get("ready", False)
        if not isinstance(ready_only, bool):
            raise InvalidArgument(f"'ready' must be true or false, got {ready_only!r}")
        return _json([
            {"name": s.name, "version": s.version, "state": s.state.value, "reason": s.reason}
            for s in self.plane.version_statuses() if not ready_only or s.state is ModelState.READY
        ])

    @_endpoint
    async def load(self, request: Request) -> Response:
        """Triton's load: by name from the repository, or inline with a
        `config` parameter (JSON text) and `file:<path>` parameters holding
        base64 file contents, as tritonclient.http sends them."""
        params = parameters_of(await _json_body(request), "load request")
        files = {key: file_contents(key, value) for key, value in params.items() if key.startswith("file:")}
        await self.plane.load(request.path_params["name"], params.get("config"), files)
        return Response(status_code=200)

    @_endpoint
    async def unload(self, request: Request) -> Response:
        # `unload_dependents` needs no handling: a model here has no dependents
        parameters_of(await _json_body(request), "unload request")
        await self.plane.unload(request.path_params["name"])
        return Response(status_code=200)

    @_endpoint
    async def unknown(self, request: Request) -> Response:
        raise NotFound(f"no KServe v2 endpoint {request.method} {request.url.path}; this daemon serves health, "
                       "metadata, infer, stats and the model repository (see the README)")

    # -- inference -----------------------------------------------------------

    @_endpoint
    async def infer(self, request: Request) -> Response:
        name, version = _model_of(request)
        body = await read_body(request)
        header_length = request.headers.get(HEADER_LENGTH)
        # JSON and BYTES decode of a large body run off the event loop (services/parsing.py)
        msg, binary = await decode_off_loop(lambda data: infer_request(name, version, data, header_length), body,
                                            len(body))
        try:
            response = await unless_client_leaves(request, model_infer(self.plane, msg, nbytes=len(body)))
        except ClientGone:
            log.info("http_client_disconnected", path=request.url.path)
            return Response(status_code=CLIENT_GONE_STATUS)
        return infer_response(response, binary)


def _model_of(request: Request) -> tuple[str, str]:
    return request.path_params.get("name", ""), request.path_params.get("version", "")


async def _json_body(request: Request) -> dict:
    """An optional JSON object body (repository calls may send none)."""
    body = await read_body(request)
    if not body.strip():
        return {}
    return json_object(body)


def _statistics_json(model: ModelStatistics) -> dict:
    stats = model.stats
    zero = {"count": 0, "ns": 0}  # Triton's fields modeld does not measure apart

    def duration(value) -> dict:
        return {"count": value.count, "ns": value.ns}

    return {
        "name": model.name, "version": model.version, "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count, "execution_count": stats.execution_count,
        "inference_stats": {
            "success": duration(stats.success), "fail": duration(stats.fail), "queue": duration(stats.queue),
            "compute_input": zero, "compute_infer": duration(stats.compute_infer), "compute_output": zero,
            "cache_hit": zero, "cache_miss": zero,
        },
        "batch_stats": [{"batch_size": size, "compute_input": zero, "compute_infer": duration(d),
                         "compute_output": zero} for size, d in sorted(stats.batches.items())],
        "memory_usage": [] if model.nbytes is None else [{"type": "CPU", "id": 0, "byte_size": model.nbytes}],
    }
