"""Rerank models: one relevance score per (query, document) pair.

A rerank model (`kind = "rerank"`) is an ONNX graph behind a tokenizer,
served by the graph backends (GraphModel) in one of two ways:

- cross-encoder: the graph reads query and document as one tokenized pair
  ([CLS] query [SEP] document [SEP] for BERT, token_type_ids 0 then 1)
  and gives one score per pair, [pairs] or [pairs, 1];
- bi-encoder (`[rerank] embedding_model`): the graph is a text embedder
  ([texts, dimensions]) and a pair's score is the cosine similarity of the
  query's vector and the document's.

What the backend sees is rows, not requests: row i pairs `query[i]` with
`documents[i]`, both [rows] BYTES. The server turns a request's query [1]
and documents [n] into n such rows, so the dynamic batcher merges the pairs
of concurrent requests into one run, and orders the scores afterwards
(server/rerank.py). The scores are the graph's own numbers (a
cross-encoder's logits, or cosines in [-1, 1]): a graph that should answer
probabilities ends in a Sigmoid.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from modeld.backends.errors import InvalidArgument, LoadFailed
from modeld.backends.model_config import (
    RERANK_DOCUMENTS, RERANK_INDICES, RERANK_QUERY, RERANK_SCORES, ModelConfig, TensorSpec,
)
from modeld.backends.text import TextEncoder

# (num_rows, buckets of (row indices, graph feeds), output names) -> outputs in row order
RunBuckets = Callable[[int, list, tuple[str, ...]], dict[str, np.ndarray]]

SIGNATURE_INPUTS = (TensorSpec(RERANK_QUERY, "BYTES", (1,)), TensorSpec(RERANK_DOCUMENTS, "BYTES", (-1,)))
SIGNATURE_OUTPUTS = (TensorSpec(RERANK_SCORES, "FP32", (-1,)), TensorSpec(RERANK_INDICES, "INT64", (-1,)))

# cosine of a zero vector: 0 rather than a division by zero
_MIN_NORM = 1e-12


class RerankFront:
    """The rerank signature in front of a graph: rows of pairs -> scores."""

    inputs = SIGNATURE_INPUTS
    outputs = SIGNATURE_OUTPUTS

    def __init__(self, config: ModelConfig, text: TextEncoder | None, graph_inputs: tuple[TensorSpec, ...],
                 graph_outputs: tuple[TensorSpec, ...]) -> None:
        if text is None:
            raise LoadFailed("a rerank model needs a tokenizer: a [text] table, or an embedding_model that has one")
        self.text = text
        self.is_bi_encoder = config.rerank.is_bi_encoder
        self.graph_input_names = {t.name for t in graph_inputs}
        self.output = _score_output(graph_outputs, self.is_bi_encoder)

    def execute(self, inputs: dict[str, np.ndarray], run_buckets: RunBuckets) -> dict[str, np.ndarray]:
        """Rows of pairs -> {scores: [rows] FP32}; `run_buckets` runs the graph."""
        queries, documents = _rows(inputs)
        if self.is_bi_encoder:
            return {RERANK_SCORES: self._cosines(queries, documents, run_buckets)}
        buckets = self.text.encode_buckets(queries, self.graph_input_names, pairs=documents)
        scores = run_buckets(queries.shape[0], buckets, (self.output,))[self.output]
        return {RERANK_SCORES: scores.reshape(queries.shape[0]).astype(np.float32, copy=False)}

    def _cosines(self, queries: np.ndarray, documents: np.ndarray, run_buckets: RunBuckets) -> np.ndarray:
        unique, query_of_row = _unique(queries)
        texts = np.concatenate([unique, documents])  # one graph run embeds both, bucketed by length
        vectors = run_buckets(texts.shape[0], self.text.encode_buckets(texts, self.graph_input_names),
                              (self.output,))[self.output]  # [queries + rows, dimensions]
        return cosine(vectors[:unique.shape[0]][query_of_row], vectors[unique.shape[0]:])


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [rows, dimensions] arrays -> [rows] FP32."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    norms = np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), _MIN_NORM)
    return ((a * b).sum(axis=1) / norms).astype(np.float32)


def _rows(inputs: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    queries, documents = inputs.get(RERANK_QUERY), inputs.get(RERANK_DOCUMENTS)
    if queries is None or documents is None or queries.shape != documents.shape or queries.ndim != 1:
        # the server always sends rows; this guards direct callers of execute
        raise InvalidArgument(f"a rerank model's rows are {RERANK_QUERY} and {RERANK_DOCUMENTS}, "
                              "[rows] BYTES each, row i pairing query i with document i")
    return queries, documents


def _unique(queries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct queries (first-seen order) and each row's index into them: the
    rows of one request share a query, which is embedded once, not n times."""
    index: dict = {}
    of_row = np.fromiter((index.setdefault(q, len(index)) for q in queries), dtype=np.int64, count=queries.shape[0])
    unique = np.empty(len(index), dtype=object)
    unique[:] = list(index)
    return unique, of_row


def _score_output(outputs: tuple[TensorSpec, ...], is_bi_encoder: bool) -> str:
    if len(outputs) != 1:
        raise LoadFailed(f"a rerank graph must have one output, it has {[t.name for t in outputs]}")
    out = outputs[0]
    if out.datatype not in ("FP32", "FP16", "FP64"):
        raise LoadFailed(f"a rerank graph's output must be floating point, {out.name!r} is {out.datatype}")
    if is_bi_encoder and len(out.shape) != 2:
        raise LoadFailed(f"an embedding model's output must be [texts, dimensions]; {out.name!r} is {list(out.shape)}")
    if not is_bi_encoder and not (len(out.shape) == 1 or (len(out.shape) == 2 and out.shape[1] in (1, -1))):
        raise LoadFailed(f"a cross-encoder's output must be one score per pair, [pairs] or [pairs, 1]; "
                         f"{out.name!r} is {list(out.shape)}")
    return out.name
