"""The runtime seam: what a scheduler hands out, what comes back, and the
interface both schedulers implement.

In vLLM v1's vocabulary: `schedule()` returns a StepPlan, the only thing an
executor reads, holding plain data (ids, positions, KV operations, block
tables); the loop runs it, samples, and hands back one SeqResult per
sequence; `update(plan, results)` alone advances sequences, appends their
tokens, trims rejected draft KV and finishes them. No numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, Mapping, NamedTuple, Protocol, TypeVar

from modeld.backends.errors import ErrorKind
from modeld.backends.generation.params import FinishReason
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slots import KvOp


# Plan items and results are NamedTuples: immutable plain data, and built
# per sequence per step in a few hundred nanoseconds, where a frozen
# dataclass took 3 microseconds here.


class SeqWork(Protocol):
    """One sequence's share of a step: what the loop reads of any plan item."""

    @property
    def seq_id(self) -> int: ...
    @property
    def start_pos(self) -> int: ...  # position of token_ids[0]
    @property
    def token_ids(self) -> tuple[int, ...]: ...  # uncomputed tokens, then this step's drafts
    @property
    def num_logits(self) -> int: ...  # logits wanted for the last num_logits tokens (0: a prompt chunk)
    @property
    def num_drafts(self) -> int: ...  # draft tokens at the end of token_ids


class SlotWork(NamedTuple):
    """SeqWork for llama.cpp: the sequence's KV lives in slot `slot` (a llama seq id)."""

    seq_id: int
    start_pos: int
    token_ids: tuple[int, ...]
    num_logits: int
    num_drafts: int
    slot: int


class PagedWork(NamedTuple):
    """SeqWork for a paged KV cache: block_table[i] holds positions
    [i * block_size, (i + 1) * block_size) and covers every position up to
    start_pos + len(token_ids). The executor derives the flat cache indices
    (slot mapping) from it with tensor ops; a Python tuple of every context
    position would cost a millisecond a step."""

    seq_id: int
    start_pos: int
    token_ids: tuple[int, ...]
    num_logits: int
    num_drafts: int
    block_table: tuple[int, ...]
    adapter: int = 0  # the LoRA adapter the sequence runs under (0: the base model alone)


W = TypeVar("W", bound=SeqWork)


@dataclass(frozen=True)
class StepPlan(Generic[W]):
    kv_ops: tuple[KvOp, ...]  # applied before the forward pass, in order
    work: tuple[W, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(w.token_ids) for w in self.work)


class SeqResult(NamedTuple):
    """What the loop made of one sequence's logits.

    new_token_ids: tokens to append (accepted drafts, then the target's own),
    already cut at a stop token or max_tokens. num_accepted: how many of the
    step's drafts the target confirmed. finish_reason: set when the loop
    saw the sequence end (stop, length) or fail (error, with error and
    error_kind).
    """

    new_token_ids: tuple[int, ...] = ()
    num_accepted: int = 0
    finish_reason: FinishReason | None = None
    error: str = ""
    error_kind: ErrorKind | None = None


class GenerationScheduler(Protocol):
    """What the generation loop needs from a scheduler (Scheduler for
    llama.cpp's slots, PagedScheduler for the torch runtime's blocks)."""

    @property
    def running(self) -> list[Sequence]: ...

    @property
    def waiting(self) -> list[Sequence]: ...

    @property
    def num_used_cells(self) -> int: ...

    @property
    def kv_capacity(self) -> int: ...

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence; raise InvalidArgument or ResourceExhausted."""

    def has_work(self) -> bool: ...

    def schedule(self, drafts: Mapping[int, list[int]] | None = None) -> StepPlan:
        """The next step. drafts: proposed tokens per seq id, to verify in it."""

    def update(self, plan: StepPlan, results: Mapping[int, SeqResult]) -> list[Sequence]:
        """Apply a step's results (by seq id; a prompt chunk needs none) and
        drop cancelled sequences. Returns every sequence that finished, with
        its finish_reason set and its KV released."""
