"""Draft-model speculation on llama.cpp: a second, smaller GGUF with the same
vocabulary proposes k tokens per sequence; the target verifies them in its
normal batched step.

The draft context mirrors the target's slots: slot s holds the draft's KV
for whichever sequence occupies target slot s. Per slot we know how many of
that sequence's tokens the draft has computed; after verification the
accepted length caps it, and the stale cells are cut before the next
proposal.
"""

from __future__ import annotations

from dataclasses import dataclass

from modeld.backends.generation.sequence import Sequence
from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama


@dataclass
class _SlotState:
    seq_id: int = -1
    num_computed: int = 0  # the sequence's tokens whose KV the draft holds


class LlamaDraft:
    nbytes: int = 0  # set by the loader: weights plus KV
    def __init__(self, model: LlamaModel, context: LlamaContext, num_slots: int) -> None:
        self.model, self.context = model, context
        self._slots = [_SlotState() for _ in range(num_slots)]

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        """Greedy k-token continuations, one batched draft decode per token."""
        llama = _llama()
        pending: dict[Sequence, list[int]] = {}
        for seq in wanted:
            state = self._slots[seq.slot]
            if state.seq_id != seq.seq_id:  # a new occupant: start from nothing
                llama.llama_memory_seq_rm(self.context.memory, seq.slot, -1, -1)
                state.seq_id, state.num_computed = seq.seq_id, 0
            state.num_computed = min(state.num_computed, len(seq.token_ids) - 1)
            llama.llama_memory_seq_rm(self.context.memory, seq.slot, state.num_computed, -1)
            pending[seq] = seq.token_ids[state.num_computed:]
        proposals: dict[Sequence, list[int]] = {seq: [] for seq in wanted}
        for _ in range(max(wanted.values())):
            items, owners = [], []
            for seq, feed in pending.items():
                if len(proposals[seq]) >= wanted[seq]:
                    continue
                base = self._slots[seq.slot].num_computed
                for i, token in enumerate(feed):
                    items.append((token, base + i, seq.slot, i == len(feed) - 1))
                owners.append(seq)
            if not items:
                break
            logits = self.context.decode(items)
            for row, seq in zip(logits, owners):
                self._slots[seq.slot].num_computed += len(pending[seq])
                token = int(row.argmax())
                proposals[seq].append(token)
                pending[seq] = [token]
        return proposals

    def accept(self, seq: Sequence, num_valid: int) -> None:
        state = self._slots[seq.slot]
        if state.seq_id == seq.seq_id:
            state.num_computed = min(state.num_computed, num_valid)

    def release(self, seq: Sequence) -> None:
        state = self._slots[seq.slot] if seq.slot is not None else None
        if state is not None and state.seq_id == seq.seq_id:
            state.seq_id = -1  # cleared lazily when the slot is next used

    def close(self) -> None:
        self.context.close()
        self.model.close()
