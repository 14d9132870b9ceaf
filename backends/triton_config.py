"""Triton's model-config JSON (what tritonclient's load_model(config=...)
sends) mapped onto modeld's own model.toml keys, so one parser checks both.
"""

from __future__ import annotations

from typing import Any

from modeld.backends.digits import ascii_digits
from modeld.backends.errors import InvalidArgument

# Triton `backend` / `platform` values that mean "an ONNX graph".
_TRITON_ONNX_NAMES = {"onnxruntime", "onnxruntime_onnx", "onnx"}


def triton_to_native(raw: dict[str, Any], known_keys: set[str]) -> dict[str, Any]:
    """Map the Triton model-config keys modeld understands onto ours.

    Keys already in our own spelling pass through, so one JSON may mix both.
    """
    out = {k: v for k, v in raw.items() if k in known_keys}
    for key, kind in (("batching", dict), ("dynamic_batching", dict), ("input", list), ("output", list)):
        if key in raw and not isinstance(raw[key], kind):
            raise InvalidArgument(f"config key {key} must be {'an object' if kind is dict else 'a list'}, got {raw[key]!r}")
    triton_backend = raw.get("backend") or raw.get("platform")
    if triton_backend is not None:
        if not isinstance(triton_backend, str) or triton_backend not in _TRITON_ONNX_NAMES:
            raise InvalidArgument(
                f"Triton backend/platform {triton_backend!r} is not served by modeld; "
                f"use one of {sorted(_TRITON_ONNX_NAMES)} or set 'format'"
            )
        out.setdefault("format", "onnx")
    batching = dict(out.get("batching", {}))
    max_batch = raw.get("max_batch_size", 0)
    if "max_batch_size" in raw:
        batching["max_batch_size"] = max_batch
    dyn = raw.get("dynamic_batching")
    if isinstance(dyn, dict) and "max_queue_delay_microseconds" in dyn:
        batching["max_queue_delay_us"] = _as_int(dyn["max_queue_delay_microseconds"])
    if isinstance(dyn, dict) and "preferred_batch_size" in dyn:
        sizes = dyn["preferred_batch_size"]
        batching["preferred_batch_sizes"] = [_as_int(v) for v in sizes] if isinstance(sizes, list) else sizes
    if batching:
        out["batching"] = batching
    for triton_key, ours in (("input", "inputs"), ("output", "outputs")):
        if triton_key in raw:
            out[ours] = [_triton_tensor(t, batched=isinstance(max_batch, int) and max_batch > 0) for t in raw[triton_key]]
    # Triton configs carry many scheduling keys modeld has no use for
    # (instance_group, optimization, ...); they don't change results, so they
    # are accepted and dropped rather than refused.
    return out


def _as_int(value: Any) -> Any:
    # Protobuf-JSON renders 64-bit integers as strings.
    if isinstance(value, str) and ascii_digits(value.lstrip("-")):
        return int(value)
    return value


def _triton_tensor(item: Any, batched: bool) -> dict[str, Any]:
    if not isinstance(item, dict):
        return item
    dtype = str(item.get("data_type", item.get("datatype", "")))
    dtype = dtype.removeprefix("TYPE_")
    dtype = "BYTES" if dtype == "STRING" else dtype
    dims = item.get("dims", item.get("shape", []))
    if not isinstance(dims, list):
        raise InvalidArgument(f"tensor {item.get('name')!r}: dims must be a list of integers, got {dims!r}")
    dims = [_as_int(d) for d in dims]
    return {"name": item.get("name"), "datatype": dtype, "shape": ([-1] if batched else []) + dims}
