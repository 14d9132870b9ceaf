"""What passes between the service layer and the engine."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import numpy as np

from modeld.backends.base import Capability


@dataclass(frozen=True)
class InferRequest:
    model_name: str
    inputs: dict[str, np.ndarray]  # in the order the client sent them
    model_version: str = ""
    id: str = ""
    output_names: tuple[str, ...] = ()  # empty: every output
    parameters: dict[str, Any] = field(default_factory=dict)
    required: frozenset[Capability] = frozenset({Capability.TENSOR_INFERENCE})
    priority: int = 0  # Triton's levels: 1 first, larger later, 0 the default (after every level)
    timeout_s: float | None = None  # KServe's `timeout` parameter, or the call's gRPC deadline if sooner
    # when timeout_s runs out, on time.monotonic(); set from timeout_s at
    # arrival, so time spent loading or queued counts against it
    deadline: float | None = None

    def __post_init__(self) -> None:
        if self.deadline is None and self.timeout_s is not None:
            object.__setattr__(self, "deadline", time.monotonic() + self.timeout_s)


@dataclass(frozen=True)
class InferResult:
    model_name: str
    model_version: str
    id: str
    outputs: dict[str, np.ndarray]
    backend: str


class ModelState(Enum):
    UNAVAILABLE = "UNAVAILABLE"  # known, not loaded
    PULLING = "PULLING"  # its files are being fetched from a store (bytes in ModelStatus)
    LOADING = "LOADING"
    READY = "READY"
    UNLOADING = "UNLOADING"


@dataclass(frozen=True)
class ModelStatus:
    name: str
    version: str
    state: ModelState
    reason: str = ""
    backend: str = ""
    nbytes: int = 0
    # while PULLING: bytes of its files fetched (or found in the cache) and in all
    pull_done: int = 0
    pull_total: int = 0
    waits_for_pull: bool = False  # while PULLING: the model's while_pulling = "wait"
    base: str = ""  # a LoRA adapter's base model; "" for every other model
