"""transformers' model of a GGUF checkpoint, loaded once a test session.

The torch runtime's tests and the backend contract compare against it; each
load reads the GGUF twice with gguf-py and dequantizes it (15-25 s here), so
the suites that only run it (never change it) share one instance."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def _load(path: Path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, torch_dtype=torch.float32)
    for parameter in model.parameters():
        parameter.requires_grad_(False)  # shared: nothing may train or change it
    return model.eval()


def reference_model(gguf: Path):
    return _load(Path(gguf).resolve())
