"""Draft-model speculation shared by the LLM backends: a second, smaller
model with the target's vocabulary proposes k greedy tokens per sequence,
batched across sequences; the target verifies them in its normal step.

DraftModel holds the propose loop and, per sequence, how many of its tokens
have KV in the draft's cache. A backend supplies only its KV handling
(`_prepare`, `_forget`) and one batched greedy decode (`_decode`).

No accept step is needed after verification: the target keeps the accepted
drafts and appends its own token, so the draft's KV is valid exactly for
the sequence's tokens but the last one (len(token_ids) - 1, the same
invariant as the target's), and the next `propose` cuts back to that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

from modeld.backends.generation.sequence import Sequence


class DraftRunner(Protocol):
    """What the generation loop needs from a draft model.

    `propose` runs in the loop's worker thread between steps; `release`
    runs on the event loop once a sequence finished (cancelled included).
    """

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]: ...
    def release(self, seq: Sequence) -> None: ...


class DraftModel(ABC):
    def __init__(self) -> None:
        self.computed: dict[int, int] = {}  # seq id -> its tokens whose KV the draft holds

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Greedy continuations of up to wanted[seq] tokens, one batched draft decode per token."""
        feeds: dict[Sequence, list[int]] = {}  # what each sequence feeds next
        for seq, k in wanted.items():
            fresh = seq.seq_id not in self.computed
            done = min(self.computed.get(seq.seq_id, 0), len(seq.token_ids) - 1)
            self.computed[seq.seq_id] = done  # before _prepare: release() must free what it takes
            if self._prepare(seq, done, len(seq.token_ids) + k, fresh):
                feeds[seq] = seq.token_ids[done:]
        proposals: dict[Sequence, list[int]] = {seq: [] for seq in wanted}
        for _ in range(max(wanted.values(), default=0)):
            active = [s for s in feeds if len(proposals[s]) < wanted[s]]
            if not active:
                break
            tokens = self._decode([(s, self.computed[s.seq_id], feeds[s]) for s in active])
            for seq, token in zip(active, tokens):
                self.computed[seq.seq_id] += len(feeds[seq])
                proposals[seq].append(token)
                feeds[seq] = [token]
        return proposals

    def release(self, seq: Sequence) -> None:
        if self.computed.pop(seq.seq_id, None) is not None:
            self._forget(seq)

    @abstractmethod
    def _prepare(self, seq: Sequence, num_valid: int, num_positions: int, fresh: bool) -> bool:
        """Drop the draft's KV of seq from num_valid on (all of another
        sequence's when fresh) and make room for num_positions; False when
        there is no room (no proposal this step)."""

    @abstractmethod
    def _decode(self, feeds: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        """One forward pass over (sequence, start position, tokens) for each
        entry; the greedy next token after each entry's last one."""

    @abstractmethod
    def _forget(self, seq: Sequence) -> None:
        """seq finished: free what the draft holds for it."""
