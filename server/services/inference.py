"""inference.GRPCInferenceService: the KServe v2 protocol, as Triton serves it.

Thin by design: decode, ask the data plane, encode.
"""

from __future__ import annotations

from modeld.backends.errors import InvalidArgument
from modeld.gen import inference_pb2 as pb
from modeld.gen import inference_pb2_grpc as pb_grpc
from modeld.server.dataplane import DataPlane
from modeld.server.requests import ModelState
from modeld.server.services.convert import parameter_value, request_from_proto, response_to_proto
from modeld.server.services.infer_stream import InferStream
from modeld.server.services.kserve_text import complete_text
from modeld.server.services.limits import call_timeout_s, with_call_timeout
from modeld.server.services.parsing import decode_off_loop, raw_request_stream, request_nbytes
from modeld.server.services.status import current_request_id, grpc_errors
from modeld.server.stats import Duration, ModelStats


async def model_infer(plane: DataPlane, msg: pb.ModelInferRequest,
                      call_timeout: float | None = None, nbytes: int = 0) -> pb.ModelInferResponse:
    """One ModelInfer, on gRPC or REST: a language model's whole completion,
    or a tensor model's answer. A request of `nbytes` or more than
    parsing.OFF_LOOP_BYTES decodes its tensors off the event loop."""
    if await plane.is_language_model(msg.model_name, msg.model_version):
        return await complete_text(plane, msg, current_request_id(), call_timeout)
    request = await decode_off_loop(request_from_proto, msg, nbytes)
    return response_to_proto(await plane.infer(with_call_timeout(request, call_timeout)))


class InferenceService(pb_grpc.GRPCInferenceServiceServicer):
    def __init__(self, plane: DataPlane) -> None:
        self.plane = plane

    @grpc_errors
    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    @grpc_errors
    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.plane.is_ready())

    @grpc_errors
    async def ModelReady(self, request, context):
        return pb.ModelReadyResponse(ready=self.plane.is_model_ready(request.name, request.version))

    @grpc_errors
    async def ServerMetadata(self, request, context):
        server = self.plane.server_metadata()
        return pb.ServerMetadataResponse(name=server.name, version=server.version, extensions=server.extensions)

    @grpc_errors
    async def ModelMetadata(self, request, context):
        model = await self.plane.model(request.name, request.version)
        response = pb.ModelMetadataResponse(name=request.name, versions=list(model.versions), platform=model.platform)
        for spec in model.inputs:
            response.inputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        for spec in model.outputs:
            response.outputs.add(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))
        return response

    @grpc_errors
    async def ModelInfer(self, request, context):
        timeout_s = call_timeout_s(context)
        self.plane.check_request_size(request.model_name, request_nbytes())
        return await model_infer(self.plane, request, timeout_s, request_nbytes())

    @raw_request_stream
    @grpc_errors
    async def ModelStreamInfer(self, request_iterator, context):
        """Requests on one stream run concurrently, each answered on it (infer_stream.py)."""
        async for answer in InferStream(self.plane, context, current_request_id()).answers(request_iterator):
            yield answer

    @grpc_errors
    async def ModelStatistics(self, request, context):
        response = pb.ModelStatisticsResponse()
        for model in self.plane.statistics(request.name, request.version):
            target = response.model_stats.add(name=model.name, version=model.version)
            _fill_stats(target, model.stats)
            if model.nbytes is not None:
                target.memory_usage.add(type="CPU", id=0, byte_size=model.nbytes)
        return response

    @grpc_errors
    async def RepositoryIndex(self, request, context):
        response = pb.RepositoryIndexResponse()
        for status in self.plane.version_statuses():
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
        await self.plane.load(request.model_name, params.get("config"), files)
        return pb.RepositoryModelLoadResponse()

    @grpc_errors
    async def RepositoryModelUnload(self, request, context):
        await self.plane.unload(request.model_name)
        return pb.RepositoryModelUnloadResponse()


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
