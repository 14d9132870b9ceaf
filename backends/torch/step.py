"""Turn a scheduler step (plain data) into the tensors of one forward pass."""

from __future__ import annotations

import torch

from modeld.backends.generation.interface import PagedWork, StepPlan
from modeld.backends.torch.model import StepBatch


def _cache_index(table: tuple[int, ...], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Flat KV-cache index of each position through a block table."""
    blocks = torch.tensor(table, dtype=torch.long)
    return blocks[positions // block_size] * block_size + positions % block_size


def build_step(plan: StepPlan[PagedWork], block_size: int, device: torch.device) -> StepBatch:
    """Everything comes from the plan's items; block_size is the cache's layout."""
    bs = block_size
    num_seqs = len(plan.work)
    lengths = [len(w.token_ids) for w in plan.work]
    contexts = [w.start_pos + n for w, n in zip(plan.work, lengths)]
    max_q, max_c = max(lengths), max(contexts)
    input_ids = torch.tensor([t for w in plan.work for t in w.token_ids], dtype=torch.long)
    positions = torch.cat([torch.arange(w.start_pos, w.start_pos + n) for w, n in zip(plan.work, lengths)])
    starts = torch.tensor([w.start_pos for w in plan.work])
    offsets = torch.tensor([0] + lengths[:-1]).cumsum(0)
    q_range = torch.arange(max_q)
    query_valid = q_range[None, :] < torch.tensor(lengths)[:, None]  # [S, Q]
    query_index = torch.where(query_valid, offsets[:, None] + q_range[None, :], 0)
    kv_index = torch.zeros((num_seqs, max_c), dtype=torch.long)
    slots = []
    for s, (work, n, ctx) in enumerate(zip(plan.work, lengths, contexts)):
        index = _cache_index(work.block_table, torch.arange(ctx), bs)
        kv_index[s, :ctx] = index
        slots.append(index[work.start_pos:])
    logit_rows = torch.cat([torch.arange(o + n - w.num_logits, o + n)
                            for w, o, n in zip(plan.work, offsets.tolist(), lengths)])
    query_rows, mask = None, None
    if max_q > 1:
        query_rows = query_valid.view(-1).nonzero().view(-1).to(device)
    else:
        query_index = None  # one token per sequence: the queries are already in sequence order
    if max_q > 1 or min(contexts) != max_c:
        q_pos = starts[:, None] + q_range[None, :]  # [S, Q]
        kv_pos = torch.arange(max_c)
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]  # causal; also hides padding past each context
        # padded query rows attend to position 0 only, so softmax never sees an empty row
        mask = torch.where(query_valid[:, :, None], mask, kv_pos[None, None, :] == 0)[:, None].to(device)
    return StepBatch(
        input_ids=input_ids.to(device), positions=positions.to(device), slots=torch.cat(slots).to(device),
        query_index=None if query_index is None else query_index.to(device), query_rows=query_rows,
        kv_index=kv_index.to(device), mask=mask, logit_rows=logit_rows.to(device),
    )


def warmup_steps(block_size: int, device: torch.device) -> list[StepBatch]:
    """Steps of each shape the scheduler produces, on two scratch sequences in
    KV blocks 0 and 1: a one-token prompt, a prompt, one-sequence decode, two
    prompts of unequal length, two-sequence decode at equal and at unequal
    context. Run at load, they compile every graph variant before the first
    request needs one. What they write into the caches is scratch: a request
    writes each cell of its blocks before it reads it."""
    def plan(*work: tuple[int, int, int]) -> StepPlan[PagedWork]:
        # scratch sequence s lives in block s
        return StepPlan((), tuple(PagedWork(seq, start, tuple(range(1, n + 1)), 1, 0, (seq,))
                                  for seq, start, n in work))

    plans = [plan((0, 0, 1)), plan((0, 0, 3)), plan((0, 3, 1)), plan((0, 0, 3), (1, 0, 2)),
             plan((0, 3, 1), (1, 3, 1)), plan((0, 4, 1), (1, 3, 1))]
    return [build_step(p, block_size, device) for p in plans]
