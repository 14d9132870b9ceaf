"""What the two ONNX-graph backends share: signature, validation, text front end."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from modeld.backends.base import LoadedModel
from modeld.backends.errors import LoadFailed
from modeld.backends.model_config import ModelConfig, TensorSpec
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
        _check_declared(config.inputs, self.inputs, "input")
        _check_declared(config.outputs, self.outputs, "output")

    def execute(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        feeds = inputs
        if self.text is not None:
            feeds = self.text.encode(inputs[self.config.text.input], {t.name for t in self.graph_inputs})
        names = output_names or tuple(t.name for t in self.outputs)
        return self._run(feeds, names)

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


def process_rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss
