"""Datatype names: KServe v2 strings, numpy dtypes and ONNX element types."""

from __future__ import annotations

import numpy as np

NUMPY_BY_DATATYPE: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

DATATYPE_BY_NUMPY = {dtype: name for name, dtype in NUMPY_BY_DATATYPE.items()}

# onnxruntime's type strings, as NodeArg.type reports them
DATATYPE_BY_ORT = {
    "tensor(bool)": "BOOL",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
    "tensor(bfloat16)": "BF16",
}

# onnx.TensorProto element types
DATATYPE_BY_ONNX_ELEM = {
    9: "BOOL", 3: "INT8", 5: "INT16", 6: "INT32", 7: "INT64", 2: "UINT8", 4: "UINT16",
    12: "UINT32", 13: "UINT64", 10: "FP16", 1: "FP32", 11: "FP64", 8: "BYTES", 16: "BF16",
}


def datatype_of(array: np.ndarray) -> str:
    if array.dtype.kind in ("O", "S", "U"):
        return "BYTES"
    return DATATYPE_BY_NUMPY[array.dtype]


def shape_from_dims(dims: list) -> tuple[int, ...]:
    """Symbolic or unknown dimensions become -1."""
    return tuple(d if isinstance(d, int) and d >= 0 else -1 for d in dims)
