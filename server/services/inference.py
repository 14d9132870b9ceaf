"""inference.GRPCInferenceService: the KServe v2 protocol, as Triton serves it.

Thin by design: decode, delegate to the engine, encode.
"""

from __future__ import annotations

import asyncio
import importlib.metadata

import structlog

from modeld.backends.errors import InvalidArgument, ModeldError
from modeld.backends.generation.params import FinalEvent
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.engine import MODEL_VERSION, Engine
from modeld.server.lifecycle import Lifecycle
from modeld.server.requests import ModelState
from modeld.server.services.convert import parameter_value, request_from_proto, response_to_proto
from modeld.server.services.kserve_text import text_request, text_response
from modeld.server.services.status import grpc_errors, new_request_id
from modeld.server.stats import Duration, ModelStats

log = structlog.get_logger("modeld.rpc")

SERVER_NAME = "modeld"
SERVER_VERSION = importlib.metadata.version("modeld")
EXTENSIONS = ["model_repository", "model_repository(unload_dependents)", "statistics", "parameters"]


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, engine: Engine, lifecycle: Lifecycle) -> None:
        self.engine = engine
        self.lifecycle = lifecycle

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
        if await self._is_language_model(request):
            return await self._complete_text(request)
        result = await self.engine.infer(request_from_proto(request, new_request_id()))
        return response_to_proto(result)

    async def _is_language_model(self, request) -> bool:
        served = await self.engine.ensure_loaded(request.model_name, request.model_version)
        return served.is_generative

    async def _complete_text(self, request) -> pb.ModelInferResponse:
        """The whole completion in one response."""
        chunks, final = [], None
        async for event in self.engine.generate(text_request(request, new_request_id())):
            if isinstance(event, FinalEvent):
                final = event
            else:
                chunks.append(event.text)
        if final.error:
            raise ModeldError(final.error)
        return text_response(request, "".join(chunks), final)

    async def _stream_text(self, request, put) -> None:
        """One response per token chunk; the last carries triton_final_response.

        Each chunk is held back one event so the last text chunk can carry
        the final flag; with triton_enable_empty_final_response the chunks
        all go out as they come and an empty response closes the request.
        """
        flag = "triton_enable_empty_final_response"
        empty_final = flag in request.parameters and request.parameters[flag].bool_param
        pending = None
        async for event in self.engine.generate(text_request(request, new_request_id())):
            if isinstance(event, FinalEvent):
                await put(_flagged(text_response(request, None if empty_final else pending, event), True))
                return
            if empty_final:
                await put(_flagged(text_response(request, event.text), False))
                continue
            if pending is not None:
                await put(_flagged(text_response(request, pending), False))
            pending = event.text

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently; each gets its own answers.

        A failed request becomes an error_message on the stream, which stays
        open, as tritonclient expects. Language models answer with one
        response per token chunk.
        """
        responses: asyncio.Queue = asyncio.Queue()
        tasks: set[asyncio.Task] = set()

        async def put(response: pb.ModelInferResponse) -> None:
            await responses.put(pb.ModelStreamInferResponse(infer_response=response))

        async def fail(msg: pb.ModelInferRequest, message: str) -> None:
            await responses.put(pb.ModelStreamInferResponse(
                error_message=message, infer_response=pb.ModelInferResponse(model_name=msg.model_name, id=msg.id)))

        async def run_one(msg: pb.ModelInferRequest) -> None:
            try:
                if await self._is_language_model(msg):
                    await self._stream_text(msg, put)
                    return
                result = await self.engine.infer(request_from_proto(msg, new_request_id()))
                # A tensor model answers each request once: that answer is the last.
                await put(_flagged(response_to_proto(result), True))
            except ModeldError as exc:
                await fail(msg, f"{exc.kind.value}: {exc}")
            except Exception:  # a bug: keep the stream and the daemon alive
                log.exception("stream_request_bug", model=msg.model_name)
                await fail(msg, "INTERNAL: internal error; see the daemon log")

        async def read_requests() -> None:
            async for msg in request_iterator:
                if self.lifecycle.is_draining:
                    await fail(msg, "UNAVAILABLE: the daemon is shutting down")
                    continue
                task = asyncio.get_running_loop().create_task(run_one(msg))
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
