"""A rerank request as rows of the dynamic batcher, and its answer in order.

A rerank model (`kind = "rerank"`, backends/rerank.py) takes BYTES `query`
[1] and `documents` [n] and answers FP32 `scores` and INT64 `indices`:
scores[i] is the score of documents[indices[i]]. By default they follow the
documents (indices 0..n-1); the request parameter `sort = true` puts the
highest score first, and `top_n = k` keeps the k highest, highest first.
Ties keep the documents' order.

Each document becomes one row, the pair (query, document): the batcher
merges the pairs of concurrent requests into shared runs of the graph (32
callers with 4 documents each fill batches of up to max_batch_size pairs
rather than making 32 runs), and a request with more documents than
max_batch_size is cut into pieces that queue side by side. The scores come
back in document order; the order asked for is made here, after the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass
from typing import Awaitable, Callable

import numpy as np

from modeld.backends.dtypes import datatype_of
from modeld.backends.errors import InvalidArgument, NotFound
from modeld.backends.model_config import (
    RERANK_DOCUMENTS, RERANK_INDICES, RERANK_QUERY, RERANK_SCORES, ModelConfig, ModelFormat, ModelKind,
)
from modeld.server.repository import ModelRepository, ModelSource
from modeld.server.requests import InferRequest

# Request parameters only a rerank model understands (convert.py lets them
# through; plan_rerank refuses them for every other model).
PARAMETERS = ("sort", "top_n")
OUTPUTS = (RERANK_SCORES, RERANK_INDICES)

# the dynamic batcher's submit(inputs, output_names, priority)
Submit = Callable[[dict[str, np.ndarray], tuple[str, ...], int], Awaitable[dict[str, np.ndarray]]]


@dataclass(frozen=True)
class RerankCall:
    """One request's pairs, in pieces of at most max_batch_size rows, and
    the order its answer is to take."""

    pieces: tuple[dict[str, np.ndarray], ...]
    output_names: tuple[str, ...]  # empty: both outputs
    is_sorted: bool
    top_n: int | None  # None: every document
    priority: int = 0

    async def run(self, submit: Submit) -> dict[str, np.ndarray]:
        tasks = [asyncio.ensure_future(submit(piece, (RERANK_SCORES,), self.priority)) for piece in self.pieces]
        try:
            results = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one piece failed: its siblings' rows need not run
                task.cancel()
            raise
        return self.answer(np.concatenate([r[RERANK_SCORES] for r in results]))

    def answer(self, scores: np.ndarray) -> dict[str, np.ndarray]:
        """scores: [n] in document order -> the outputs asked for, in the order asked for."""
        order = np.argsort(-scores, kind="stable") if self.is_sorted else np.arange(scores.shape[0])
        order = order[:self.top_n]
        outputs = {RERANK_SCORES: scores[order], RERANK_INDICES: order.astype(np.int64)}
        return {name: outputs[name] for name in self.output_names or OUTPUTS}


def plan_rerank(request: InferRequest, config: ModelConfig) -> RerankCall | None:
    """A rerank model's request as rows, checked; None for any other model,
    after refusing the rerank parameters, which it would silently ignore."""
    if config.kind is not ModelKind.RERANK:
        present = [p for p in PARAMETERS if p in request.parameters]
        if present:
            raise InvalidArgument(f"parameter {present[0]!r} is for rerank models; model {config.name!r} is not one")
        return None
    query, documents = _checked_inputs(request, config.name)
    unknown = [name for name in request.output_names if name not in OUTPUTS]
    if unknown:
        raise InvalidArgument(f"model {config.name!r} has no output {unknown[0]!r}; its outputs are {list(OUTPUTS)}")
    is_sorted, top_n = _order(request.parameters, documents.shape[0])
    step = config.max_batch_size or documents.shape[0]
    pieces = tuple(_pairs(query, documents[i:i + step]) for i in range(0, documents.shape[0], step))
    if len(pieces) > config.max_queue_size:
        raise InvalidArgument(f"{documents.shape[0]} documents make {len(pieces)} batches of max_batch_size "
                              f"{step}, more than model {config.name!r} queues ({config.max_queue_size}); "
                              "send fewer documents per request")
    return RerankCall(pieces, request.output_names, is_sorted, top_n, request.priority)


def _pairs(query: bytes, documents: np.ndarray) -> dict[str, np.ndarray]:
    """Rows: query [k] (the one query, repeated) beside documents [k]."""
    queries = np.empty(documents.shape[0], dtype=object)
    queries[:] = [query] * documents.shape[0]
    return {RERANK_QUERY: queries, RERANK_DOCUMENTS: documents}


_WHAT = {RERANK_QUERY: "BYTES [1], the text to rank the documents by",
         RERANK_DOCUMENTS: "BYTES [n], the texts to rank"}


def _checked_inputs(request: InferRequest, model: str) -> tuple[bytes, np.ndarray]:
    for name in request.inputs:
        if name not in _WHAT:
            raise InvalidArgument(f"rerank model {model!r} has no input {name!r}; it takes "
                                  f"{RERANK_QUERY} and {RERANK_DOCUMENTS}")
    for name, what in _WHAT.items():
        if name not in request.inputs:
            raise InvalidArgument(f"rerank model {model!r} needs input {name!r}: {what}")
        if datatype_of(request.inputs[name]) != "BYTES":
            raise InvalidArgument(f"input {name!r} of model {model!r} must be BYTES, "
                                  f"got {datatype_of(request.inputs[name])}")
    query, documents = request.inputs[RERANK_QUERY], request.inputs[RERANK_DOCUMENTS]
    if query.shape != (1,):
        raise InvalidArgument(f"input {RERANK_QUERY!r} of model {model!r} must have shape [1] (one query per "
                              f"request), got {list(query.shape)}")
    if documents.ndim != 1:
        raise InvalidArgument(f"input {RERANK_DOCUMENTS!r} of model {model!r} must have shape [n], "
                              f"got {list(documents.shape)}")
    if documents.shape[0] == 0:
        raise InvalidArgument(f"input {RERANK_DOCUMENTS!r} of model {model!r} is empty: send at least one document")
    if not _text(query[0], RERANK_QUERY):
        raise InvalidArgument(f"input {RERANK_QUERY!r} of model {model!r} is an empty string")
    for index, document in enumerate(documents):
        _text(document, f"{RERANK_DOCUMENTS}[{index}]")
    # checked here, per request: inside a merged batch bad text would fail
    # its neighbours' first attempt too
    return _as_bytes(query[0]), documents


def _text(value: object, where: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(f"{where} is not valid UTF-8: {exc}") from None


def _as_bytes(value: object) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


def _order(parameters: dict, num_documents: int) -> tuple[bool, int | None]:
    """(sorted, top_n) from the `sort` and `top_n` parameters."""
    sort = parameters.get("sort")
    if sort is not None and not isinstance(sort, bool):
        raise InvalidArgument(f"parameter sort must be true or false, got {sort!r}")
    top_n = parameters.get("top_n")
    if top_n is None:
        return bool(sort), None
    if isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1:
        raise InvalidArgument(f"parameter top_n must be an integer >= 1, got {top_n!r}")
    if sort is False:
        raise InvalidArgument("parameter top_n keeps the highest scores, highest first: leave sort out or set it "
                              "true, not false")
    return True, min(top_n, num_documents)


def resolve_embedding_model(source: ModelSource, repository: ModelRepository) -> ModelSource:
    """A bi-encoder rerank model takes its graph and tokenizer from
    `[rerank] embedding_model`, another model in the repository: its files
    are named by absolute path, so any graph backend loads them as this
    model's own. Other models come back as they are."""
    config = source.config
    if config.kind is not ModelKind.RERANK or not config.rerank.is_bi_encoder:
        return source
    name = config.rerank.embedding_model
    try:
        embedder = repository.resolve(name)
    except NotFound:
        raise InvalidArgument(f"model {config.name!r}: rerank.embedding_model {name!r} is not in the repository; "
                              f"it has {', '.join(repository.names()) or 'no models'}") from None
    found = embedder.config
    if found.kind is not ModelKind.TENSOR or found.format is not ModelFormat.ONNX or found.text is None:
        raise InvalidArgument(f"model {config.name!r}: rerank.embedding_model {name!r} must be a text embedding "
                              "model, an ONNX graph with a [text] tokenizer such as minilm")
    text = dataclasses.replace(found.text, tokenizer=str((embedder.model_dir / found.text.tokenizer).resolve()))
    resolved = dataclasses.replace(config, artifact=str((embedder.model_dir / found.artifact_path).resolve()),
                                   text=text, backends=config.backends or found.backends)
    return dataclasses.replace(source, config=resolved)
