"""The backend registry: names map to import paths, imported on first use.

Importing the daemon must not import torch or llama_cpp, so each backend's
module is only imported when the registry is asked for it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from modeld.backends.base import Backend, Verdict
from modeld.backends.errors import InvalidArgument

# name -> "module:Class"
BACKENDS: dict[str, str] = {
    "onnx": "modeld.backends.onnx.backend:OnnxBackend",
    "reference": "modeld.backends.reference.backend:ReferenceBackend",
    "iree": "modeld.backends.iree.backend:IreeBackend",  # ONNX compiled ahead of time (OpenXLA)
    "llamacpp": "modeld.backends.llamacpp.backend:LlamaCppBackend",
    "torch": "modeld.backends.torch.backend:TorchBackend",
    "onnx-genai": "modeld.backends.onnx_genai.backend:OnnxGenaiBackend",
    "coreml": "modeld.backends.coreml.backend:CoreMLBackend",  # macOS only; registered everywhere
    # remote engines (format = "remote" models): one module per wire protocol
    "openai": "modeld.backends.remote.openai_compat:OpenAIBackend",
    "vllm": "modeld.backends.remote.vllm:VllmBackend",
    "sglang": "modeld.backends.remote.sglang:SglangBackend",
    "tgi": "modeld.backends.remote.tgi:TgiBackend",
}
# the backends of format = "remote" models: a remote engine holds nothing here
REMOTE_BACKENDS = frozenset({"openai", "vllm", "sglang", "tgi"})
# isolation "auto" runs these in a worker: their native runtimes (C++ with
# their own threads and allocators) can take the daemon down with them, and
# their steps are long enough that the channel's cost is lost in them
NATIVE_LLM_BACKENDS = frozenset({"llamacpp", "torch", "onnx-genai"})


@dataclass(frozen=True)
class RegisteredBackend:
    name: str
    backend: Backend | None
    availability: Verdict


class BackendRegistry:
    def __init__(self, names: list[str] | None = None) -> None:
        self._entries: dict[str, RegisteredBackend] = {}
        for name in names or list(BACKENDS):
            self._entries[name] = _instantiate(name)

    def get(self, name: str) -> Backend:
        entry = self._entries.get(name)
        if entry is None:
            raise InvalidArgument(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
        if entry.backend is None:
            raise InvalidArgument(f"backend {name!r} is not available here: {entry.availability.reason}")
        return entry.backend

    def entries(self) -> list[RegisteredBackend]:
        return list(self._entries.values())

    def available(self) -> list[Backend]:
        """Usable backends, highest priority first."""
        usable = [e.backend for e in self._entries.values() if e.backend is not None]
        return sorted(usable, key=lambda b: -b.priority)

    def candidates(self, preferred: tuple[str, ...]) -> list[Backend]:
        """The order to try backends in: the model's preference, else priority."""
        if not preferred:
            return self.available()
        for name in preferred:
            if name not in BACKENDS:
                raise InvalidArgument(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
        return [self._entries[n].backend for n in preferred if n in self._entries and self._entries[n].backend]

    def load_order(self, preferred: tuple[str, ...], is_healthy: Callable[[str], bool],
                   after: Backend | None = None) -> list[Backend]:
        """The order to try backends in for a new load: `candidates` (only
        those ranked below `after` when the model's backend `after` failed),
        healthy first. An unhealthy backend (`is_healthy`, the engine's
        health tracker) is skipped while another can serve the model and
        tried last, not refused: a model only it serves would otherwise be
        down for the cool-down because other models failed there."""
        ranked = self.candidates(preferred)
        if after is not None:
            ranked = ranked[ranked.index(after) + 1:] if after in ranked else []
        healthy = [b for b in ranked if is_healthy(b.name)]
        return healthy + [b for b in ranked if b not in healthy]


def _instantiate(name: str) -> RegisteredBackend:
    if name not in BACKENDS:
        raise InvalidArgument(f"unknown backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
    module_name, class_name = BACKENDS[name].split(":")
    try:
        backend = getattr(importlib.import_module(module_name), class_name)()
    except ImportError as exc:
        return RegisteredBackend(name, None, Verdict.no(f"cannot import {module_name}: {exc}"))
    verdict = backend.availability()
    return RegisteredBackend(name, backend if verdict.ok else None, verdict)
