"""inference.GRPCInferenceService: the KServe v2 protocol, as Triton serves it.

Thin by design: decode, delegate to the engine, encode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata

import structlog

from modeld.backends.errors import ErrorKind, InvalidArgument, ModeldError
from modeld.backends.generation.params import FinalEvent
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.engine import MODEL_VERSION, Engine
from modeld.server.lifecycle import Lifecycle
from modeld.server.requests import ModelState
from modeld.server.services.convert import parameter_value, request_from_proto, response_to_proto
from modeld.server.services.kserve_text import complete_text, text_request, text_response
from modeld.server.services.limits import call_timeout_s, check_request_size, sooner
from modeld.server.services.parsing import UndecodableRequest, parse_request, raw_request_stream, request_nbytes
from modeld.server.services.status import count_failure, current_request_id, grpc_errors
from modeld.server.stats import Duration, ModelStats

log = structlog.get_logger("modeld.rpc")

SERVER_NAME = "modeld"
SERVER_VERSION = importlib.metadata.version("modeld")
EXTENSIONS = ["model_repository", "model_repository(unload_dependents)", "statistics", "parameters"]


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine: Engine, lifecycle: Lifecycle, max_request_bytes: int | None = None) -> None:
        self.engine = engine
        self.lifecycle = lifecycle
        self.max_request_bytes = max_request_bytes  # a model's cap unless its [limits] sets one

    @grpc_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=not self.lifecycle.is_draining)

    @grpc_errors
    async def ModelReady(self, request, context):
        self.engine.check_version(request.name, request.version)
        return pb.ModelReadyResponse(ready=self.engine.state_of(request.name) is ModelState.READY)

    @grpc_errors
    async def ServerMetadata(self, request, context):
        return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION, extensions=EXTENSIONS)

    @grpc_errors
    async def ModelMetadata(self, request, context):
        served = await self.engine.ensure_loaded(request.name, request.version)
        response = pb.ModelMetadataResponse(
            name=request.name, versions=[MODEL_VERSION], platform=f"modeld_{served.backend.name}",
        )
        for spec in served.loaded.inputs:
            response.inputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        for spec in served.loaded.outputs:
            response.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        return response

    @grpc_errors
    async def ModelInfer(self, request, context):
        grpc_timeout_s = call_timeout_s(context)
        check_request_size(self.engine, request.model_name, request_nbytes(), self.max_request_bytes)
        if await self._is_language_model(request):
            return await complete_text(self.engine, request, current_request_id(), grpc_timeout_s)
        return response_to_proto(await self.engine.infer(_with_timeout(
            request_from_proto(request, current_request_id()), grpc_timeout_s)))

    async def _is_language_model(self, request) -> bool:
        served = await self.engine.ensure_loaded(request.model_name, request.model_version)
        return served.is_generative

    async def _stream_text(self, request, put, grpc_timeout_s: float | None) -> None:
        """One response per token chunk; the last carries triton_final_response.

        Each chunk is held back one event so the last text chunk can carry
        the final flag; with triton_enable_empty_final_response the chunks
        all go out as they come and an empty response closes the request.
        """
        empty_final = _wants_empty_final(request)
        pending = None
        generation, timeout_s = text_request(request, current_request_id())
        async for event in self.engine.generate(generation, sooner(timeout_s, grpc_timeout_s)):
            if isinstance(event, FinalEvent):
                if empty_final or pending is None:
                    await put(_flagged(text_response(request, None, event), True))
                else:
                    await put(_flagged(text_response(request, pending.text, event, [pending]), True))
                return
            if empty_final:
                await put(_flagged(text_response(request, event.text, tokens=[event]), False))
                continue
            if pending is not None:
                await put(_flagged(text_response(request, pending.text, tokens=[pending]), False))
            pending = event

    @raw_request_stream
    @grpc_errors
    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; each gets its own answers.

        A failed request becomes an error_message on the stream, which stays
        open, as tritonclient expects; the message starts with the status
        the same failure gets from ModelInfer, and is counted the same way.
        So does a message that is no valid ModelInferRequest (the stream
        reads its messages as bytes and parses each itself). Language
        models answer with one response per token chunk. The stream's
        request id covers every request on it; the call's deadline covers
        every request on it as well.
        """
        responses: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()
        request_id = current_request_id()

        async def put(response: pb.ModelInferResponse) -> None:
            await responses.put(pb.ModelStreamInferResponse(infer_response=response))

        async def fail(msg: pb.ModelInferRequest, kind: ErrorKind, message: str) -> None:
            count_failure(self, msg.model_name, kind)
            await responses.put(pb.ModelStreamInferResponse(
                error_message=f"{kind.value}: {message}",
                infer_response=pb.ModelInferResponse(model_name=msg.model_name, id=msg.id)))

        async def run_one(msg: pb.ModelInferRequest, nbytes: int) -> None:
            structlog.contextvars.bind_contextvars(request_id=request_id, client_request_id=msg.id)
            try:
                grpc_timeout_s = call_timeout_s(context)
                check_request_size(self.engine, msg.model_name, nbytes, self.max_request_bytes)
                if await self._is_language_model(msg):
                    await self._stream_text(msg, put, grpc_timeout_s)
                    return
                result = await self.engine.infer(_with_timeout(request_from_proto(msg, request_id), grpc_timeout_s))
                if _wants_empty_final(msg):
                    await put(_flagged(response_to_proto(result), False))
                    await put(_flagged(pb.ModelInferResponse(model_name=msg.model_name, id=msg.id), True))
                    return
                # A tensor model answers each request once: that answer is the last.
                await put(_flagged(response_to_proto(result), True))
            except ModeldError as exc:
                log.info("stream_request_failed", model=msg.model_name, status=exc.kind.value, reason=str(exc))
                await fail(msg, exc.kind, str(exc))
            except Exception:  # a bug: keep the stream and the daemon alive
                log.exception("stream_request_bug", model=msg.model_name)
                await fail(msg, ErrorKind.INTERNAL, f"internal error (request id {request_id}); see the daemon log")

        async def read_requests() -> None:
            async for data in request_iterator:
                try:
                    msg = parse_request(pb.ModelInferRequest.FromString, data)
                except UndecodableRequest as exc:
                    log.info("stream_request_failed", status=exc.kind.value, reason=str(exc))
                    await fail(pb.ModelInferRequest(), exc.kind, str(exc))
                    continue
                if self.lifecycle.is_draining:
                    await fail(msg, ErrorKind.UNAVAILABLE, "the daemon is shutting down")
                    continue
                task = asyncio.get_running_loop().create_task(run_one(msg, len(data)))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            while tasks:
                await asyncio.gather(*list(tasks))
            await responses.put(None)

        reader = asyncio.get_running_loop().create_task(read_requests())
        try:
            while (item := await responses.get()) is not None:
                yield item
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    @grpc_errors
    async def ModelStatistics(self, request, context):
        names = [request.name] if request.name else [s.name for s in self.engine.statuses()]
        if request.name:
            self.engine.check_version(request.name, request.version)
            if request.name not in self.engine.repository.names() and not self.engine.served(request.name):
                self.engine.repository.resolve(request.name)  # raises NOT_FOUND
        response = pb.ModelStatisticsResponse()
        for name in names:
            target = response.model_stats.add(name=name, version=MODEL_VERSION)
            _fill_stats(target, self.engine.stats(name))
            served = self.engine.served(name)
            if served is not None:
                target.memory_usage.add(type="CPU", id=0, byte_size=served.loaded.nbytes)
        return response

    @grpc_errors
    async def RepositoryIndex(self, request, context):
        response = pb.RepositoryIndexResponse()
        for status in self.engine.statuses():
            if request.ready and status.state is not ModelState.READY:
                continue
            response.models.add(name=status.name, version=status.version, state=status.state.value, reason=status.reason)
        return response

    @grpc_errors
    async def RepositoryModelLoad(self, request, context):
        params = {k: parameter_value(v) for k, v in request.parameters.items()}
        files = {k: v for k, v in params.items() if k.startswith("file:")}
        for key, value in files.items():
            if not isinstance(value, bytes):
                raise InvalidArgument(f"load parameter {key!r} must carry bytes_param (the file's contents)")
        config = params.get("config")
        if config is not None and not isinstance(config, str):
            raise InvalidArgument("load parameter 'config' must be a string_param holding JSON")
        if files and config is None:
            raise InvalidArgument("model files in a load request need a 'config' parameter as well")
        source = None
        if config is not None:
            source = self.engine.repository.add_inline(request.model_name, config, files)
        await self.engine.load(request.model_name, source)
        return pb.RepositoryModelLoadResponse()

    @grpc_errors
    async def RepositoryModelUnload(self, request, context):
        await self.engine.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


def _with_timeout(request, grpc_timeout_s: float | None):
    """The request with the call's gRPC deadline as its timeout where that is sooner."""
    timeout_s = sooner(request.timeout_s, grpc_timeout_s)
    if timeout_s == request.timeout_s:
        return request
    return dataclasses.replace(request, timeout_s=timeout_s, deadline=None)


def _wants_empty_final(request: pb.ModelInferRequest) -> bool:
    flag = "triton_enable_empty_final_response"
    return flag in request.parameters and request.parameters[flag].bool_param


def _flagged(response: pb.ModelInferResponse, final: bool) -> pb.ModelInferResponse:
    response.parameters["triton_final_response"].bool_param = final
    return response


def _duration(target, value: Duration) -> None:
    target.count, target.ns = value.count, value.ns


def _fill_stats(target, stats: ModelStats) -> None:
    target.last_inference = stats.last_inference_ms
    target.inference_count = stats.inference_count
    target.execution_count = stats.execution_count
    s = target.inference_stats
    for name in ("success", "fail", "queue", "compute_infer"):
        _duration(getattr(s, name), getattr(stats, name))
    for size, duration in sorted(stats.batches.items()):
        batch = target.batch_stats.add(batch_size=size)
        _duration(batch.compute_infer, duration)
