"""Draft-model speculation on llama.cpp (the propose loop is shared, in
generation/draft.py).

The draft context mirrors the target's slots: slot s holds the draft's KV
for whichever sequence occupies target slot s. A new occupant clears the
previous one's cells first; stale cells past what the draft still trusts are
cut before each proposal.
"""

from __future__ import annotations

from modeld.backends.generation.draft import DraftModel
from modeld.backends.generation.sequence import Sequence
from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama


class LlamaDraft(DraftModel):
    nbytes: int = 0  # set by the loader: weights plus KV

    def __init__(self, model: LlamaModel, context: LlamaContext) -> None:
        super().__init__()
        self.model, self.context = model, context

    def _prepare(self, seq: Sequence, num_valid: int, num_positions: int, fresh: bool) -> bool:
        llama = _llama()
        if fresh:
            llama.llama_memory_seq_rm(self.context.memory, seq.slot, -1, -1)
        llama.llama_memory_seq_rm(self.context.memory, seq.slot, num_valid, -1)
        return True  # the slot's stream has room for the target's whole context

    def _decode(self, feeds: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        items = [(token, start + i, seq.slot, i == len(tokens) - 1)
                 for seq, start, tokens in feeds for i, token in enumerate(tokens)]
        return self.context.decode(items, argmax_only=True).tolist()

    def _forget(self, seq: Sequence) -> None:
        """Nothing now: the next occupant of the slot clears its cells."""

    def close(self) -> None:
        self.context.close()
        self.model.close()
