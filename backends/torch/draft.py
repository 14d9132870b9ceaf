"""Draft-model speculation for the torch runtime (the propose loop is
shared, in generation/draft.py).

The draft keeps its own paged KV cache and block tables, keyed by the
target's sequence ids; each proposal first cuts its blocks back to what the
target accepted.
"""

from __future__ import annotations

from modeld.backends.generation.block_manager import BlockManager
from modeld.backends.generation.draft import DraftModel
from modeld.backends.generation.interface import PagedWork, StepPlan
from modeld.backends.generation.sequence import Sequence
from modeld.backends.torch.model import tensor_bytes
from modeld.backends.torch.step import build_step


class TorchDraft(DraftModel):
    def __init__(self, model, num_blocks: int, block_size: int, device) -> None:
        super().__init__()
        self.model, self.device = model, device
        self.blocks = BlockManager(num_blocks, block_size)
        self.k_caches, self.v_caches = model.new_kv_caches(num_blocks * block_size)
        self.nbytes = model.weight_bytes() + tensor_bytes(self.k_caches + self.v_caches)

    def _prepare(self, seq: Sequence, num_valid: int, num_positions: int, fresh: bool) -> bool:
        if fresh:
            self.blocks.start_sequence(seq.seq_id)
        self.blocks.shrink(seq.seq_id, num_valid)
        return self.blocks.grow(seq.seq_id, num_positions)

    def _decode(self, feeds: list[tuple[Sequence, int, list[int]]]) -> list[int]:
        tables = self.blocks.tables
        plan = StepPlan((), tuple(PagedWork(seq.seq_id, start, tuple(tokens), 1, 0, tuple(tables[seq.seq_id]))
                                  for seq, start, tokens in feeds))
        logits = self.model(build_step(plan, self.blocks.block_size, self.device), self.k_caches, self.v_caches)
        return logits.argmax(dim=-1).tolist()

    def _forget(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq.seq_id)
