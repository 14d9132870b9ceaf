"""The paged scheduler with LoRA adapters: adapter ids in plan items, at
most max_loras_per_batch adapters running, and a prefix cache keyed by
adapter (pure Python, no torch)."""

from __future__ import annotations

from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.paged_scheduler import REQUEST_ADAPTER, PagedConfig, PagedScheduler
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.sequence import Sequence

PROMPT = list(range(1, 41))  # 40 tokens: two whole 16-token blocks before the last


def _scheduler(**config) -> PagedScheduler:
    return PagedScheduler(PagedConfig(num_blocks=64, block_size=16, context_length=256, **config))


def _add(scheduler: PagedScheduler, adapter: int, prompt=PROMPT, max_tokens: int = 2) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens))
    token = REQUEST_ADAPTER.set(adapter)
    try:
        scheduler.add(seq)
    finally:
        REQUEST_ADAPTER.reset(token)
    return seq


def _run_to_end(scheduler: PagedScheduler) -> None:
    while scheduler.has_work():
        plan = scheduler.schedule()
        results = {}
        for work in plan.work:
            if work.num_logits:
                seq = next(s for s in scheduler.running if s.seq_id == work.seq_id)
                done = seq.num_output + 1 >= seq.params.max_tokens
                results[work.seq_id] = SeqResult((7,), 0, FinishReason.LENGTH if done else None)
        scheduler.update(plan, results)


def test_plan_items_carry_each_sequences_adapter():
    scheduler = _scheduler()
    base, first, second = _add(scheduler, 0), _add(scheduler, 5, [9] + PROMPT), _add(scheduler, 6, [8] + PROMPT)
    plan = scheduler.schedule()
    assert {w.seq_id: w.adapter for w in plan.work} == {base.seq_id: 0, first.seq_id: 5, second.seq_id: 6}
    _run_to_end(scheduler)
    assert scheduler.adapter_of == {}  # finished sequences leave no entry behind


def test_a_prompt_cached_under_one_adapter_is_never_served_to_another_or_the_base():
    scheduler = _scheduler()
    _add(scheduler, 3)
    _run_to_end(scheduler)
    # the same prompt under adapter 4 and under the base: computed anew
    other, base = _add(scheduler, 4), _add(scheduler, 0)
    scheduler.schedule()
    assert other.num_cached_prompt == 0 and base.num_cached_prompt == 0
    _run_to_end(scheduler)
    # under adapter 3 again (and 4, and the base, now that each has its own): its own blocks
    again = [_add(scheduler, a) for a in (3, 4, 0)]
    scheduler.schedule()
    assert [s.num_cached_prompt for s in again] == [32, 32, 32]
    _run_to_end(scheduler)


def test_at_most_max_loras_per_batch_adapters_run_and_the_others_wait():
    scheduler = _scheduler(max_loras_per_batch=2)
    seqs = [_add(scheduler, adapter, [adapter] + PROMPT, max_tokens=4) for adapter in (1, 2, 3, 1, 0)]
    plan = scheduler.schedule()
    running = {w.adapter for w in plan.work}
    assert running == {0, 1, 2}  # the base is no adapter; adapter 3 waits, adapter 1's second joins
    assert seqs[2].seq_id not in {w.seq_id for w in plan.work}
    _run_to_end(scheduler)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)  # adapter 3 ran once a place was free
