"""Check a request against the model's signature before it is batched.

Catching bad input here, per request, is what keeps one bad request from
failing the batch it would have joined.
"""

from __future__ import annotations

import numpy as np

from modeld.backends.dtypes import NUMPY_BY_DATATYPE, datatype_of
from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import ModelConfig, TensorSpec
from modeld.server.requests import InferRequest


def validate_inputs(request: InferRequest, inputs: tuple[TensorSpec, ...], outputs: tuple[TensorSpec, ...],
                    config: ModelConfig) -> None:
    expected = {t.name: t for t in inputs}
    unknown = [n for n in request.inputs if n not in expected]
    if unknown:
        raise InvalidArgument(f"model {config.name!r} has no input {unknown[0]!r}; its inputs are {sorted(expected)}")
    missing = [n for n in expected if n not in request.inputs]
    if missing:
        raise InvalidArgument(f"model {config.name!r} needs input {missing[0]!r}; its inputs are {sorted(expected)}")
    for name, array in request.inputs.items():
        _check_tensor(config.name, expected[name], array)
    if config.is_batched:
        _check_batch(config, request)
    known_outputs = {t.name for t in outputs}
    for name in request.output_names:
        if name not in known_outputs:
            raise InvalidArgument(f"model {config.name!r} has no output {name!r}; its outputs are {sorted(known_outputs)}")


def _check_tensor(model: str, spec: TensorSpec, array: np.ndarray) -> None:
    datatype = datatype_of(array)
    if datatype != spec.datatype:
        raise InvalidArgument(f"input {spec.name!r} of model {model!r} must be {spec.datatype}, got {datatype}")
    if spec.shape and len(spec.shape) != array.ndim:
        raise InvalidArgument(
            f"input {spec.name!r} of model {model!r} must have {len(spec.shape)} dimensions {list(spec.shape)}, "
            f"got shape {list(array.shape)}"
        )
    for want, got in zip(spec.shape, array.shape):
        if want != -1 and want != got:
            raise InvalidArgument(
                f"input {spec.name!r} of model {model!r} must have shape {list(spec.shape)} (-1: any), got {list(array.shape)}"
            )


def _check_batch(config: ModelConfig, request: InferRequest) -> None:
    sizes = {arr.shape[0] if arr.ndim else 0 for arr in request.inputs.values()}
    if len(sizes) > 1:
        raise InvalidArgument(f"inputs of a batched model must share their first dimension, got {sorted(sizes)}")
    size = sizes.pop() if sizes else 0
    if size < 1 or size > config.max_batch_size:
        raise InvalidArgument(
            f"batch size {size} is outside 1..{config.max_batch_size} (max_batch_size of model {config.name!r})"
        )


def warmup_inputs(inputs: tuple[TensorSpec, ...], batched: bool) -> dict[str, np.ndarray]:
    """A small valid request: variable dimensions become 1, text is 'warm-up'."""
    feeds = {}
    for spec in inputs:
        shape = tuple(1 if d == -1 else d for d in spec.shape)
        if spec.datatype == "BYTES":
            feeds[spec.name] = np.full(shape, b"warm-up", dtype=object)
        else:
            feeds[spec.name] = np.zeros(shape, dtype=NUMPY_BY_DATATYPE[spec.datatype])
    return feeds
