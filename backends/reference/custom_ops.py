"""modeld's own ONNX operators (domain `ai.modeld`), implemented in Python.

onnxruntime has no kernels for them, so graphs that use them are served by
the reference backend: the registry's fallback chain in action, and a way to
ship an operator before a fast kernel exists.
"""

from __future__ import annotations

import numpy as np
from onnx.reference.op_run import OpRun

DOMAIN = "ai.modeld"


class Softcap(OpRun):
    """y = cap * tanh(x / cap): bounds logits smoothly (as Gemma 2 does)."""

    op_domain = DOMAIN

    def _run(self, x, cap=None):  # noqa: D401 - signature fixed by OpRun
        cap = np.float32(cap if cap is not None else 30.0)
        return ((cap * np.tanh(x / cap)).astype(x.dtype),)


CUSTOM_OPS = [Softcap]
