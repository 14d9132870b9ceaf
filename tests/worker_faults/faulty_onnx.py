"""The onnx backend with the faults of a native runtime, for the worker
tests: a model folder holding a file FAULT that says "abort" kills the
process loading it with SIGABRT (a runtime that crashes on a bad file);
"hang" never finishes the load."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from modeld.backends.model_config import ModelConfig
from modeld.backends.onnx.backend import OnnxBackend


class FaultyOnnxBackend(OnnxBackend):
    def load(self, config: ModelConfig, model_dir: Path):
        fault = model_dir / "FAULT"
        how = fault.read_text().strip() if fault.is_file() else ""
        if how == "abort":
            os.abort()
        if how == "hang":
            threading.Event().wait()
        return super().load(config, model_dir)
