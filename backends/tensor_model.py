"""What the two ONNX-graph backends share: signature, validation, text and rerank front ends."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from modeld.backends.base import LoadedModel
from modeld.backends.errors import LoadFailed
from modeld.backends.model_config import ModelConfig, ModelKind, TensorSpec
from modeld.backends.rerank import RerankFront
from modeld.backends.text import TOKENIZER_INPUTS, TextEncoder


class GraphModel(LoadedModel):
    """A loaded ONNX graph, optionally fronted by a tokenizer.

    Subclasses supply `_run(feeds, output_names)`; this class turns the
    public signature (what clients send) into graph feeds.
    """

    def __init__(self, config: ModelConfig, model_dir: Path, graph_inputs: tuple[TensorSpec, ...],
                 graph_outputs: tuple[TensorSpec, ...]) -> None:
        self.config = config
        self.graph_inputs = graph_inputs
        self.text = TextEncoder(config.text, model_dir) if config.text else None
        if self.text is not None:
            unknown = {t.name for t in graph_inputs} - TOKENIZER_INPUTS
            if unknown:
                raise LoadFailed(f"a [text] model's graph may only take {sorted(TOKENIZER_INPUTS)}, not {sorted(unknown)}")
            self.inputs = (TensorSpec(config.text.input, "BYTES", (-1,)),)
        else:
            self.inputs = graph_inputs
        self.outputs = graph_outputs
        self.rerank = None
        if config.kind is ModelKind.RERANK:
            self.rerank = RerankFront(config, self.text, graph_inputs, graph_outputs)
            self.inputs, self.outputs = self.rerank.inputs, self.rerank.outputs
        _check_declared(config.inputs, self.inputs, "input")
        _check_declared(config.outputs, self.outputs, "output")

    def execute(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        if self.rerank is not None:
            return self.rerank.execute(inputs, self._run_buckets)
        names = output_names or tuple(t.name for t in self.outputs)
        if self.text is None:
            return self._run(inputs, names)
        texts = inputs[self.config.text.input]
        buckets = self.text.encode_buckets(texts, {t.name for t in self.graph_inputs})
        return self._run_buckets(texts.shape[0], buckets, names)

    def _run_buckets(self, num_rows: int, buckets, names: tuple[str, ...]) -> dict[str, np.ndarray]:
        parts = [(rows, self._run(feeds, names)) for rows, feeds in buckets]
        return {name: _scatter(num_rows, [(rows, out[name]) for rows, out in parts]) for name in names}

    def _run(self, feeds: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        raise NotImplementedError


def _check_declared(declared: tuple[TensorSpec, ...], actual: tuple[TensorSpec, ...], kind: str) -> None:
    by_name = {t.name: t for t in actual}
    for spec in declared:
        found = by_name.get(spec.name)
        if found is None:
            raise LoadFailed(f"config declares {kind} {spec.name!r} but the graph has {sorted(by_name)}")
        if found.datatype != spec.datatype:
            raise LoadFailed(f"config declares {kind} {spec.name!r} as {spec.datatype}, the graph has {found.datatype}")


def _scatter(num_rows: int, parts: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """Put each bucket's output rows back in request order."""
    first = parts[0][1]
    out = np.empty((num_rows,) + first.shape[1:], dtype=first.dtype)
    for rows, values in parts:
        out[rows] = values
    return out


def process_rss() -> int:
    """This process's resident bytes, once the heap it has freed is handed
    back to the system (glibc's malloc_trim): a load's figure (the growth
    across it) is then what the model keeps, not parse buffers it already
    freed, which otherwise stay resident for a while by chance and made the
    same model count 8 or 12 MiB from one load to the next."""
    import psutil

    _trim_heap()
    return psutil.Process().memory_info().rss


@functools.cache
def _malloc_trim():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return getattr(libc, "malloc_trim", None)  # glibc only


def _trim_heap() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
