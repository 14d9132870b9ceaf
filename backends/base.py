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
from typing import TYPE_CHECKING, AsyncIterator, Callable, ClassVar, Protocol, runtime_checkable

import anyio

if TYPE_CHECKING:
    import numpy as np

    from modeld.backends.errors import Unavailable
    from modeld.backends.generation.params import FinalEvent, GenerateRequest, TokenEvent
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
    # token masks from a grammar (JSON schema, regex, choice, Lark/GBNF), in
    # the sampler or passed to a remote engine that applies them
    CONSTRAINED_DECODING = "constrained_decoding"
    LORA = "lora"  # LoRA adapters applied on top of a loaded base model (repository models, format = "lora")


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

    async def execute_async(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        """`execute` awaited from the event loop. The default runs it on a
        thread; a model that lives elsewhere (a worker process) overrides it
        and then never blocks."""
        return await anyio.to_thread.run_sync(self.execute, inputs, output_names)

    async def unload_async(self) -> None:
        """`unload` awaited from the event loop; the engine always calls this one."""
        await anyio.to_thread.run_sync(self.unload)


# Optional facets. A model that has one of them says so by its shape (these
# are runtime-checkable Protocols), so the engine asks `isinstance` once per
# load instead of probing attributes.


class WorkerHandle(Protocol):
    """The process a worker model runs in, as the engine follows it."""

    started: float  # time.monotonic() at spawn
    death: Unavailable | None  # why it ended, once it has
    on_death: Callable[[str], None] | None  # told how it died


@runtime_checkable
class InWorkerProcess(Protocol):
    """A model running in a worker process: its batches go out on the event
    loop (`execute_async`), its memory is the process's resident memory."""

    worker: WorkerHandle

    def watch_memory(self, on_change: Callable[[int], None], interval_s: float) -> None:
        """Report the process's resident bytes each time they change."""


@runtime_checkable
class RemoteHealth(Protocol):
    """A model served by a remote engine whose health is tracked."""

    @property
    def is_healthy(self) -> bool: ...

    def set_health_listener(self, listener: Callable[[bool], None]) -> None:
        """Called with the new verdict each time the engine turns (un)healthy."""


class GenerationLoopLike(Protocol):
    """What a local language model's loop offers its model (GenerationLoop,
    onnx-genai's EngineLoop)."""

    observer: object

    def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]: ...


class TokenCodec(Protocol):
    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, token_ids: list[int]) -> str: ...


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

    Local models set `loop` and `runner` (its StepExecutor, or any token
    codec); a model without them (a remote engine, a worker's stand-in)
    overrides the methods below instead. `start`/`stop` bracket the loop and
    the engine awaits both. `tokenize`/`detokenize` may return a coroutine
    where the answer comes from elsewhere.
    """

    loop: GenerationLoopLike | None
    runner: TokenCodec | None

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

    def prompt_ids(self, request) -> list[int]:
        """The prompt's token ids exactly as generation would feed them
        (chat template and tools rendered)."""
        return self.loop.prompt_ids(request)

    def detokenize(self, token_ids: list[int]) -> str:
        return self.runner.detokenize(token_ids)
