"""One generation request's state as it moves through the scheduler.

Invariant once the prompt is prefilled: every token but the last has its KV
in the cache (num_computed == len(token_ids) - 1); the last one is fed next.
Only the scheduler's `update()` advances num_computed, appends tokens and
finishes a sequence; `schedule()` may only reset progress (admission from
the prefix cache, preemption).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from modeld.backends.generation.params import FinishReason, SamplingParams

_ids = itertools.count()


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    slot: int | None = None
    num_computed: int = 0
    num_cached_prompt: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    priority: int = 0  # see params.queue_rank
    finish_reason: FinishReason | None = None
    is_cancelled: bool = False
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    last_token_time: float | None = None
    rng: Any = None  # the backend's random generator for sampled decoding
    matcher: Any = None  # llguidance's matcher when the output is constrained (constraints.py)
    stream: Any = None  # where the loop sends this sequence's events

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < len(self.token_ids) - 1

    @property
    def num_reserved(self) -> int:
        """KV cells this sequence may come to hold, drafts included."""
        return self.num_prompt + self.params.max_tokens + self.params.num_speculative_tokens
