"""Issue 14 in the scheduler (pure Python): after unrelated finished requests
leave their prefixes cached, a burst of new streams must still occupy one
block of consecutive slots, as on a fresh scheduler. llama.cpp (one KV
stream per slot) runs a step as one forward pass per run of consecutive
slots, so the number of runs is the number of passes per step."""

from __future__ import annotations

import pytest

from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slots import slot_runs


def _scheduler() -> SlotScheduler:
    return SlotScheduler(SlotConfig(num_slots=8, kv_capacity=16384, context_length=2048))


def _prompt(i: int) -> list[int]:
    return [1000 + i, 2000 + i, 3000 + i, 7, 8, 9]  # no two share a first token


def _run(scheduler: SlotScheduler, seqs: list[Sequence]) -> list[list[int]]:
    """Greedy-like fake results until every sequence ends; the slots each step decoded."""
    for seq in seqs:
        scheduler.add(seq)
    steps = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        results = {}
        for work in plan.work:
            if work.num_logits:
                seq = next(s for s in seqs if s.seq_id == work.seq_id)
                done = seq.num_output + 1 >= seq.params.max_tokens
                results[work.seq_id] = SeqResult((5,), 0, FinishReason.LENGTH if done else None)
        steps.append([w.slot for w in plan.work])
        scheduler.update(plan, results)
    return steps


def _serve_unrelated(scheduler: SlotScheduler, count: int = 6) -> None:
    for i in range(count):
        _run(scheduler, [Sequence(_prompt(i), SamplingParams(max_tokens=32))])


@pytest.mark.parametrize("streams", [2, 3, 5, 8])
def test_after_unrelated_requests_a_burst_takes_one_block_of_slots(streams):
    runs = {}
    for warm in (False, True):
        scheduler = _scheduler()
        if warm:
            _serve_unrelated(scheduler)
            assert len(scheduler.slots.cached) == 6
        burst = [Sequence(_prompt(100 + i), SamplingParams(max_tokens=16, ignore_eos=True)) for i in range(streams)]
        steps = _run(scheduler, burst)
        full = [s for s in steps if len(s) == streams]
        assert full, steps
        runs[warm] = {slot_runs(s) for s in full}
    # before the fix the warm scheduler granted free slots 6, 7 and then the
    # least recently used cached ones from 0: {0, 6, 7} is two passes a step
    assert runs == {False: {1}, True: {1}}


def test_free_slots_next_to_the_block_go_before_cached_prefixes():
    scheduler = _scheduler()
    _serve_unrelated(scheduler)
    cached_before = dict(scheduler.slots.cached)
    burst = [Sequence(_prompt(100 + i), SamplingParams(max_tokens=4)) for i in range(2)]
    for seq in burst:
        scheduler.add(seq)
    scheduler.schedule()
    assert sorted(s.slot for s in burst) == [6, 7]  # the free ones: no cached prefix lost
    assert dict(scheduler.slots.cached) == cached_before


def test_a_cached_prefix_next_to_the_block_is_still_reused_in_place():
    scheduler = _scheduler()
    _serve_unrelated(scheduler)
    # a follow-up that shares slot 5's whole prompt, arriving after two unrelated streams took 6 and 7
    first = [Sequence(_prompt(100 + i), SamplingParams(max_tokens=4)) for i in range(2)]
    for seq in first:
        scheduler.add(seq)
    scheduler.schedule()
    follow = Sequence(_prompt(5) + [11, 12], SamplingParams(max_tokens=4))
    scheduler.add(follow)
    plan = scheduler.schedule()
    assert follow.slot == 5 and follow.num_cached_prompt == len(_prompt(5))
    assert slot_runs(scheduler.slots.active) == 1
    assert not [op for op in plan.kv_ops if op.kind.value == "copy"]
