"""Pure-Python fallback on onnx.reference.ReferenceEvaluator.

Slow but always available and lowest in priority: it serves graphs that
onnxruntime refuses (such as modeld's own `ai.modeld` operators) and takes
over when an onnxruntime session fails at run time.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modeld.backends.base import Backend, Capability, Verdict
from modeld.backends.dtypes import DATATYPE_BY_ONNX_ELEM, shape_from_dims
from modeld.backends.errors import BackendFailure, InvalidArgument, LoadFailed
from modeld.backends.model_config import ModelConfig, ModelFormat, TensorSpec
from modeld.backends.onnx.external_data import check_model_file
from modeld.backends.tensor_model import GraphModel, process_rss


class ReferenceBackend(Backend):
    name = "reference"
    priority = 0
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        return self._serves_file(config, model_dir, ModelFormat.ONNX)

    def load(self, config: ModelConfig, model_dir: Path) -> ReferenceModel:
        return ReferenceModel(config, model_dir)


class ReferenceModel(GraphModel):
    def __init__(self, config: ModelConfig, model_dir: Path) -> None:
        import onnx
        from onnx.reference import ReferenceEvaluator

        from modeld.backends.reference.custom_ops import CUSTOM_OPS

        path = model_dir / config.artifact_path
        # onnx.load follows external data wherever the graph says: checked first
        check_model_file(config.name, path.parent, path)
        rss_before = process_rss()
        try:
            proto = onnx.load(str(path))
            onnx.checker.check_model(proto)
            self._evaluator = ReferenceEvaluator(proto, new_ops=CUSTOM_OPS)
        except Exception as exc:  # onnx raises DecodeError, ValidationError, ...
            raise LoadFailed(f"not a valid ONNX model {config.artifact_path!r}: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc
        self.nbytes = max(path.stat().st_size, process_rss() - rss_before)
        init_names = {i.name for i in proto.graph.initializer}
        graph_in = tuple(_spec(v) for v in proto.graph.input if v.name not in init_names)
        graph_out = tuple(_spec(v) for v in proto.graph.output)
        super().__init__(config, model_dir, graph_in, graph_out)

    def _run(self, feeds: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        try:
            results = self._evaluator.run(list(output_names), feeds)
        except (ValueError, TypeError, IndexError) as exc:
            raise InvalidArgument(f"the model rejected the input: {exc}") from exc
        except Exception as exc:
            raise BackendFailure(f"reference evaluator failed: {exc}") from exc
        return {name: np.asarray(value) for name, value in zip(output_names, results)}

    def unload(self) -> None:
        self._evaluator = None


def _spec(value) -> TensorSpec:
    tensor = value.type.tensor_type
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in tensor.shape.dim]
    return TensorSpec(value.name, DATATYPE_BY_ONNX_ELEM.get(tensor.elem_type, "FP32"), shape_from_dims(dims))
