"""Core ML backend (macOS): `format = "coreml"` models on Apple's runtime.

It serves three kinds of artifact, told apart by the file name:
- `model.mlpackage` (the default) or `*.mlmodel`: a Core ML model, as
  coremltools saves it;
- `*.pt2`: a PyTorch program saved by `torch.export.save`, converted to an
  ML program at load; its shapes and variable dimensions come from the
  export, and the config's `inputs` / `outputs`, where given, name and type
  its tensors in order. (Not TorchScript: torch deprecates torch.jit.)
Either is compiled to `.mlmodelc` at the first load and cached (convert.py);
Core ML picks the compute units (CPU, GPU, Neural Engine) per layer.

On any other system it is registered but unavailable: Core ML is a macOS
framework, and coremltools there can convert models but not run them.
"""

from __future__ import annotations

import importlib.util
import platform
from pathlib import Path

from modeld.backends.base import Backend, Capability, Verdict
from modeld.backends.coreml.convert import (
    ArtifactKind, artifact_kind, conversion_problem, default_cache_dir, tree_bytes,
)
from modeld.backends.model_config import ModelConfig, ModelFormat

NOT_MACOS = "Core ML runs only on macOS"


class CoreMLBackend(Backend):
    name = "coreml"
    # below the ONNX and LLM runtimes, which serve other formats anyway, above
    # the pure-Python reference backend
    priority = 10
    capabilities = frozenset({Capability.TENSOR_INFERENCE, Capability.DYNAMIC_BATCHING})

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_dir = cache_dir

    def availability(self) -> Verdict:
        if platform.system() != "Darwin":
            return Verdict.no(NOT_MACOS)
        # find_spec, not import: importing coremltools imports torch (seconds)
        if importlib.util.find_spec("coremltools") is None:
            return Verdict.no("coremltools is not installed (pip install 'modeld[coreml]')")
        return Verdict.yes()

    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        verdict = self._serves_file(config, model_dir, ModelFormat.COREML)
        if not verdict.ok:
            return verdict
        kind = artifact_kind(config.artifact_path)
        if kind is None:
            return Verdict.no(f"coreml serves .mlpackage, .mlmodel and torch.export .pt2 artifacts, "
                              f"not {config.artifact_path!r}")
        if config.text is not None:
            return Verdict.no("coreml has no [text] front end: it feeds INT64 token ids, which Core ML "
                              "programs take as INT32; send the tensors")
        if kind is ArtifactKind.EXPORTED_PROGRAM:
            return self._can_convert(config)
        return Verdict.yes()

    def _can_convert(self, config: ModelConfig) -> Verdict:
        problem = conversion_problem(config)
        if problem:
            return Verdict.no(problem)
        if importlib.util.find_spec("torch") is None:
            return Verdict.no("converting a torch.export artifact needs torch, which is not installed")
        return Verdict.yes()

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        if config.memory_estimate is not None:
            return config.memory_estimate
        artifact = model_dir / config.artifact_path
        return tree_bytes(artifact) if artifact.exists() else 0  # a package is a folder

    def load(self, config: ModelConfig, model_dir: Path):
        from modeld.backends.coreml.model import CoreMLModel

        return CoreMLModel(config, model_dir, self.cache_dir or default_cache_dir())
