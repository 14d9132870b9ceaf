"""Draft-model speculation for the torch runtime: a second (smaller) model
with the same vocabulary proposes k greedy tokens per sequence, batched
across sequences; the target verifies them in one forward pass.

The draft keeps its own paged KV cache and block tables, keyed by the
target's sequence ids; after verification its computed length is cut back
to what the target accepted.
"""

from __future__ import annotations

from modeld.backends.generation.block_manager import BlockManager
from modeld.backends.generation.scheduler import SeqWork, StepPlan
from modeld.backends.generation.sequence import Sequence
from modeld.backends.torch.model import tensor_bytes
from modeld.backends.torch.step import build_step


class TorchDraft:
    def __init__(self, model, num_blocks: int, block_size: int, device) -> None:
        self.model, self.device = model, device
        self.blocks = BlockManager(num_blocks, block_size)
        self.k_caches, self.v_caches = model.new_kv_caches(num_blocks * block_size)
        self.nbytes = tensor_bytes(model.parameters()) + tensor_bytes(self.k_caches + self.v_caches)
        self._computed: dict[int, int] = {}  # seq id -> tokens whose KV the draft holds

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]:
        pending: dict[Sequence, list[int]] = {}
        for seq, k in wanted.items():
            if seq.seq_id not in self._computed:
                self.blocks.start_sequence(seq.seq_id)
                self._computed[seq.seq_id] = 0
            done = min(self._computed[seq.seq_id], len(seq.token_ids) - 1)
            self._computed[seq.seq_id] = done
            self.blocks.shrink(seq.seq_id, done)
            if self.blocks.grow(seq.seq_id, len(seq.token_ids) + k):
                pending[seq] = seq.token_ids[done:]
        proposals: dict[Sequence, list[int]] = {seq: [] for seq in wanted}
        for _ in range(max(wanted.values(), default=0)):
            active = [s for s in pending if len(proposals[s]) < wanted[s]]
            if not active:
                break
            plan = StepPlan((), tuple(SeqWork(s, -1, self._computed[s.seq_id], tuple(pending[s]), 1) for s in active))
            logits = self.model(build_step(plan, self.blocks, self.device), self.k_caches, self.v_caches)
            for seq, token in zip(active, logits.argmax(dim=-1).tolist()):
                self._computed[seq.seq_id] += len(pending[seq])
                proposals[seq].append(int(token))
                pending[seq] = [int(token)]
        return proposals

    def accept(self, seq: Sequence, num_valid: int) -> None:
        if seq.seq_id in self._computed:
            self._computed[seq.seq_id] = min(self._computed[seq.seq_id], num_valid)

    def release(self, seq: Sequence) -> None:
        if self._computed.pop(seq.seq_id, None) is not None:
            self.blocks.free_sequence(seq.seq_id)
