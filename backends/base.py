"""The backend contract every runtime implements.

A backend is stateless apart from its loaded models: `can_serve` judges a
model config, `load` returns a LoadedModel that owns the runtime objects and
reports the bytes it holds, and the engine calls `execute` on it from a worker
thread. Backends never see gRPC; they raise errors from `backends.errors`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import numpy as np

    from modeld.backends.model_config import ModelConfig, TensorSpec


class Capability(Enum):
    TENSOR_INFERENCE = "tensor_inference"
    DYNAMIC_BATCHING = "dynamic_batching"
    GENERATION = "generation"
    STREAMING = "streaming"
    CONTINUOUS_BATCHING = "continuous_batching"
    PREFIX_CACHE = "prefix_cache"
    SPECULATIVE_DECODING = "speculative_decoding"
    LOGPROBS = "logprobs"
    SEQUENCE_BATCHING = "sequence_batching"  # Triton's stateful sequences
    SHARED_MEMORY = "shared_memory"  # Triton's shared-memory tensors
    GPU = "gpu"


@dataclass(frozen=True)
class Verdict:
    """Yes, or no with a reason a user can act on."""

    ok: bool
    reason: str = ""

    @classmethod
    def yes(cls) -> Verdict:
        return cls(True)

    @classmethod
    def no(cls, reason: str) -> Verdict:
        return cls(False, reason)


class LoadedModel(ABC):
    """One model held by one backend."""

    #: bytes this model holds (weights, caches, runtime arenas)
    nbytes: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]

    @abstractmethod
    def execute(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Run one (possibly merged) batch. Blocking; called off the event loop.

        Raises InvalidArgument for input the model rejects and BackendFailure
        for a fault of the runtime itself.
        """

    @abstractmethod
    def unload(self) -> None:
        """Release every resource counted in `nbytes`."""


class Backend(ABC):
    name: ClassVar[str]
    #: higher runs first when a model names no preference
    priority: ClassVar[int]
    capabilities: ClassVar[frozenset[Capability]]

    def availability(self) -> Verdict:
        """Whether this backend can run on this machine at all."""
        return Verdict.yes()

    @abstractmethod
    def can_serve(self, config: ModelConfig, model_dir: Path) -> Verdict:
        """Cheap check, before any loading, that this backend fits the model."""

    @abstractmethod
    def load(self, config: ModelConfig, model_dir: Path) -> LoadedModel:
        """Load the model (blocking). Raises LoadFailed with the reason."""

    def _serves_file(self, config: ModelConfig, model_dir: Path, *formats) -> Verdict:
        """The common can_serve: one of our formats, and its file is there."""
        if config.format not in formats:
            names = " or ".join(f.value for f in formats)
            return Verdict.no(f"{self.name} serves {names} models, not {config.format.value}")
        if not (model_dir / config.artifact_path).exists():
            return Verdict.no(f"model file {config.artifact_path!r} is missing")
        return Verdict.yes()

    def estimate_bytes(self, config: ModelConfig, model_dir: Path) -> int:
        """Bytes a load is expected to take, used to make room before loading."""
        if config.memory_estimate is not None:
            return config.memory_estimate
        artifact = model_dir / config.artifact_path
        return artifact.stat().st_size if artifact.is_file() else 0

    def missing(self, required: frozenset[Capability]) -> frozenset[Capability]:
        return required - self.capabilities


class GenerativeModel(LoadedModel):
    """A language model: serves token generation instead of tensor calls.

    Subclasses set `loop` (a GenerationLoop) and `runner` (its
    StepExecutor); `start`/`stop` bracket the loop and the engine awaits both.
    """

    loop: Any
    runner: Any

    def set_observer(self, observer) -> None:
        """Receive the generation loop's figures (the engine's metrics)."""
        self.loop.observer = observer

    async def start(self) -> None:
        self.loop.start()

    async def stop(self) -> None:
        """Finish running sequences and stop the loop."""
        await self.loop.stop()

    def execute(self, inputs, output_names):
        from modeld.backends.errors import Unimplemented

        raise Unimplemented("this is a language model: send text_input (KServe) or use modeld.v1.Generation/Generate")

    def generate(self, request):
        """An async iterator of TokenEvent, ending with one FinalEvent."""
        return self.loop.generate(request)

    def tokenize(self, text: str) -> list[int]:
        return self.runner.tokenize(text)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.runner.detokenize(token_ids)
