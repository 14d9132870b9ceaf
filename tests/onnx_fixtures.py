"""Tiny ONNX graphs built in code for tests (no committed binaries)."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def _save(graph, opset: int = 17, extra_domains: tuple[str, ...] = ()) -> bytes:
    imports = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in extra_domains]
    model = helper.make_model(graph, opset_imports=imports)
    model.ir_version = 8
    return model.SerializeToString()


def double_int64() -> bytes:
    """y = x * 2 for INT64 x of shape [batch, 3]."""
    two = numpy_helper.from_array(np.array(2, dtype=np.int64), "two")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.INT64, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, ["batch", 3])],
        initializer=[two],
    )
    return _save(graph)


def add_fp32(num_weights: int = 4) -> bytes:
    """y = x + sum(w) = x + 1 with a weight vector of num_weights floats: sized by it."""
    values = np.zeros(num_weights, dtype=np.float32)
    values[0] = 1.0
    weights = numpy_helper.from_array(values, "w")
    axes = numpy_helper.from_array(np.array([0], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [helper.make_node("ReduceSum", ["w", "axes"], ["s"], keepdims=0),
         helper.make_node("Add", ["x", "s"], ["y"])],
        "add", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializer=[weights, axes],
    )
    return _save(graph)


def softcap(cap: float = 2.0) -> bytes:
    """y = Softcap(x) with modeld's own operator: onnxruntime refuses it."""
    graph = helper.make_graph(
        [helper.make_node("Softcap", ["x"], ["y"], domain="ai.modeld", cap=cap)], "softcap",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    return _save(graph, extra_domains=("ai.modeld",))


def triton_config(name: str, inputs, outputs, max_batch_size: int = 8, delay_us: int = 0, **extra) -> dict:
    """A Triton-style model config, as a Triton user would write it."""
    def tensors(items):
        return [{"name": n, "data_type": f"TYPE_{t}", "dims": list(d)} for n, t, d in items]

    config = {"name": name, "platform": "onnxruntime_onnx", "max_batch_size": max_batch_size,
              "input": tensors(inputs), "output": tensors(outputs)}
    if delay_us:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": delay_us}
    config.update(extra)
    return config
