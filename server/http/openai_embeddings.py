"""/v1/embeddings: a text embedding model's vectors, in OpenAI's shape."""

from __future__ import annotations

import asyncio
import base64

import numpy as np

from modeld.backends.errors import InvalidArgument
from modeld.backends.model_config import TensorSpec
from modeld.server.dataplane import DataPlane, ModelMetadata
from modeld.server.http.common import json_type_name
from modeld.server.http.openai_fields import IGNORED, FieldError, check_fields, get_field, get_int, model_name, priority
from modeld.server.requests import InferRequest

_EMBEDDING_FIELDS = {"model", "input", "encoding_format", "dimensions", "priority"} | IGNORED


async def embeddings(plane: DataPlane, body: dict) -> dict:
    """The answer to one /v1/embeddings body."""
    model = model_name(body)
    check_fields(body, _EMBEDDING_FIELDS, "/v1/embeddings")
    texts = _texts(body, plane)
    encoding = get_field(body, "encoding_format", (str,), "float or base64", "float")
    if encoding not in ("float", "base64"):
        raise FieldError("encoding_format", f"encoding_format must be float or base64, got {encoding!r}")
    dimensions = get_int(body, "dimensions")
    urgency = priority(body)
    metadata = await plane.model(model)
    if dimensions is not None:
        _check_dimensions(metadata, dimensions)
    vectors = await _embed(plane, metadata, texts, urgency)
    if dimensions is not None and dimensions != vectors.shape[1]:
        vectors = _truncate(vectors, dimensions, model)
    prompt_tokens = plane.count_text_tokens(model, texts) or 0
    return {
        "object": "list", "model": model,
        "data": [{"object": "embedding", "index": i, "embedding": _encode_vector(v, encoding)}
                 for i, v in enumerate(vectors)],
        # from the model's own [text] tokenizer; 0 where it has none
        # (a graph that takes text some other way): not counted, not a guess
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def _check_dimensions(model: ModelMetadata, dimensions: int) -> None:
    """Before any vector is computed: the length must be one the model
    declares (Matryoshka training), or its own."""
    declared = model.matryoshka_dimensions
    full = [t.shape[-1] for t in model.outputs if t.datatype == "FP32" and len(t.shape) == 2 and t.shape[-1] > 0]
    if dimensions in declared or (full and dimensions == full[0]):
        return
    if not declared:
        raise FieldError("dimensions", f"model {model.name!r} does not declare shorter embeddings (no "
                                       "[embedding] matryoshka_dimensions in its model.toml), so its vectors cannot be "
                                       f"truncated; leave dimensions out{f' or send {full[0]}' if full else ''}")
    raise FieldError("dimensions", f"model {model.name!r} takes dimensions in {list(declared)}"
                                   f"{f' or {full[0]}' if full else ''}, got {dimensions}")


def _truncate(vectors: np.ndarray, dimensions: int, model: str) -> np.ndarray:
    """Matryoshka truncation: the first `dimensions` values, re-normalised
    to unit length (cosine similarity then stays a dot product)."""
    if dimensions > vectors.shape[1]:
        raise FieldError("dimensions", f"model {model!r} gives {vectors.shape[1]} dimensions; dimensions must not "
                                       f"exceed that, got {dimensions}")
    short = vectors[:, :dimensions]
    norms = np.linalg.norm(short, axis=1, keepdims=True)
    return (short / np.where(norms > 0, norms, 1.0)).astype(np.float32, copy=False)


def _texts(body: dict, plane: DataPlane) -> list[str]:
    value = body.get("input")
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise FieldError("input", "input must be a string or a non-empty array of strings")
    plane.limits.check_embedding_inputs(len(value))  # max_embedding_inputs, before looking at one of them
    for i, text in enumerate(value):
        if not isinstance(text, str):
            raise FieldError("input", f"input[{i}] must be a string, got {json_type_name(text)} (token arrays are not "
                                      "accepted: this server tokenizes text itself)")
        if not text:
            raise FieldError("input", f"input[{i}] is empty; embeddings need text")
    return value


def _embedder(model: ModelMetadata) -> tuple[TensorSpec, TensorSpec]:
    """The text input and the vector output of a one-BYTES-input text
    embedder; anything else is refused with what it is instead."""
    name = model.name
    if model.is_generative:
        raise InvalidArgument(f"model {name!r} is a language model, not an embedding model; use "
                              "/v1/chat/completions or /v1/completions")
    inputs, outputs = model.inputs, model.outputs
    if len(inputs) != 1 or inputs[0].datatype != "BYTES" or len(inputs[0].shape) != 1:
        found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in inputs)
        raise InvalidArgument(f"model {name!r} is not a text embedding model: /v1/embeddings needs one BYTES input "
                              f"[batch] of text, it takes {found}; use the KServe API (ModelInfer) instead")
    vectors = [t for t in outputs if t.datatype == "FP32" and len(t.shape) == 2]
    if len(vectors) != 1:
        found = ", ".join(f"{t.name} {t.datatype} {list(t.shape)}" for t in outputs)
        raise InvalidArgument(f"model {name!r} is not a text embedding model: /v1/embeddings needs exactly one FP32 "
                              f"output [batch, dimensions], it has {found}; use the KServe API (ModelInfer) instead")
    return inputs[0], vectors[0]


async def _embed(plane: DataPlane, model: ModelMetadata, texts: list[str], level: int) -> np.ndarray:
    text_input, vector_output = _embedder(model)
    # One infer call per HTTP request carries all its strings, split only
    # where the model's max_batch_size would refuse them; the dynamic
    # batcher merges these with concurrent gRPC calls all the same
    # (bench/bench_http.py measures this against one call per string).
    step = model.max_batch_size or len(texts)
    chunks = [texts[i:i + step] for i in range(0, len(texts), step)]
    results = await _all_or_none(
        plane.infer(InferRequest(model.name, {text_input.name: np.array([t.encode() for t in chunk], dtype=object)},
                                 output_names=(vector_output.name,), priority=level))
        for chunk in chunks)
    return np.concatenate([r.outputs[vector_output.name] for r in results]).astype(np.float32, copy=False)


async def _all_or_none(calls) -> list:
    """Every call's result in order; the first failure (a full queue's 429,
    say) cancels the others, which asyncio.gather would leave running for an
    answer nobody reads. A cancelled caller (the client left) cancels them all."""
    tasks = [asyncio.ensure_future(call) for call in calls]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        left = [task for task in tasks if not task.done()]
        for task in left:
            task.cancel()
        if left:
            await asyncio.wait(left)  # their clean-up (leaving the batch queue) before the caller answers
    failed = next((t for t in tasks if not t.cancelled() and t.exception() is not None), None)
    if failed is not None:
        raise failed.exception()
    return [task.result() for task in tasks]


def _encode_vector(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()
