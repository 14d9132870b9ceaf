"""One compiled Core ML model, run through coremltools (macOS only)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import structlog

from modeld.backends.coreml.convert import compile_cached, tree_bytes
from modeld.backends.dtypes import NUMPY_BY_DATATYPE
from modeld.backends.errors import BackendFailure, LoadFailed
from modeld.backends.model_config import ModelConfig
from modeld.backends.tensor_model import GraphModel, process_rss

log = structlog.get_logger("modeld.coreml")


class CoreMLModel(GraphModel):
    def __init__(self, config: ModelConfig, model_dir: Path, cache_dir: Path) -> None:
        import coremltools as ct  # first, so its own import (torch's too) is not counted as the model's bytes

        compiled = compile_cached(config, model_dir / config.artifact_path, cache_dir)
        log.info("coreml_compiled", model=config.name, path=str(compiled.path), cached=compiled.is_cached)
        rss_before = process_rss()
        try:
            self._model = ct.models.CompiledMLModel(str(compiled.path), compute_units=ct.ComputeUnit.ALL)
        except Exception as exc:
            raise LoadFailed(f"Core ML cannot load {config.artifact_path!r}: {_first_line(exc)}") from exc
        # The weights are at least the compiled files; what Core ML maps or
        # copies at load shows up as resident growth (loads are serialised).
        # GPU and Neural Engine memory are not visible here.
        self.nbytes = max(tree_bytes(compiled.path), process_rss() - rss_before)
        super().__init__(config, model_dir, compiled.inputs, compiled.outputs)
        self._output_types = {spec.name: NUMPY_BY_DATATYPE[spec.datatype] for spec in compiled.outputs}

    def _run(self, feeds: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        try:
            results = self._model.predict({name: np.ascontiguousarray(a) for name, a in feeds.items()})
        except Exception as exc:  # the engine validated shapes and types: this is the runtime's fault
            raise BackendFailure(f"Core ML failed while running: {_first_line(exc)}") from exc
        # predict's numpy types follow Core ML's feature values, not always the
        # spec's (an FP16 array may come back as float32): give the declared one
        return {name: np.asarray(results[name], dtype=self._output_types.get(name)) for name in output_names}

    def unload(self) -> None:
        self._model = None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
