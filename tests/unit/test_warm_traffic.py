"""Issue 14 in the scheduler (pure Python): after unrelated finished requests
leave their prefixes cached, a burst of new streams must still occupy one
block of consecutive slots, as on a fresh scheduler. llama.cpp (one KV
stream per slot) runs a step as one forward pass per run of consecutive
slots, so the number of runs is the number of passes per step. A burst
that takes every empty slot ends as one block wherever its sequences go,
so it reuses its cached prompts in place."""

from __future__ import annotations

import random

import pytest

from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slots import slot_runs
from modeld.backends.llamacpp.lora import AdapterSlotScheduler
from modeld.backends.model_config import LoraSettings


def _scheduler(kind: str = "slots") -> SlotScheduler:
    config = SlotConfig(num_slots=8, kv_capacity=16384, context_length=2048)
    if kind == "adapters":  # llama.cpp's own: the same pool with LoRA adapters' runs kept apart
        return AdapterSlotScheduler(config, LoraSettings())
    return SlotScheduler(config)


def _prompt(i: int) -> list[int]:
    return [1000 + i, 2000 + i, 3000 + i, 7, 8, 9]  # no two share a first token


def _results(plan, seqs: list[Sequence]) -> dict[int, SeqResult]:
    """Greedy-like fake results of one step: token 5 for every sequence
    that asked for logits, the last one at its max_tokens."""
    results = {}
    for work in plan.work:
        if work.num_logits:
            seq = next(s for s in seqs if s.seq_id == work.seq_id)
            done = seq.num_output + 1 >= seq.params.max_tokens
            results[work.seq_id] = SeqResult((5,), 0, FinishReason.LENGTH if done else None)
    return results


def _run(scheduler: SlotScheduler, seqs: list[Sequence]) -> list[list[int]]:
    """Greedy-like fake results until every sequence ends; the slots each step decoded."""
    for seq in seqs:
        scheduler.add(seq)
    steps = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        results = _results(plan, seqs)
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


@pytest.mark.parametrize("kind", ["slots", "adapters"])
def test_a_burst_that_fills_every_slot_reuses_each_cached_prompt_in_place(kind):
    """The same 8 prompts again, the first alone a step ahead of the other 7
    (as concurrent clients' requests arrive): the 7 fill every empty slot,
    so the block ends whole wherever each goes, and each reuses its own
    cached prompt instead of being recomputed next to the first one, where
    it would evict another's."""
    scheduler = _scheduler(kind)
    prompts = [_prompt(100 + i) for i in range(8)]
    _run(scheduler, [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts])
    assert len(scheduler.slots.cached) == 8
    again = [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
    scheduler.add(again[3])
    scheduler.schedule()  # the first request's step; its results do not matter here
    for seq in again[:3] + again[4:]:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [s.num_cached_prompt for s in again] == [len(p) - 1 for p in prompts]
    assert sorted(w.slot for w in plan.work) == list(range(8))
    assert slot_runs(scheduler.slots.active) == 1
    assert not [op for op in plan.kv_ops if op.kind.value in ("copy", "clear")]


@pytest.mark.parametrize("kind", ["slots", "adapters"])
def test_a_burst_smaller_than_the_empty_slots_still_keeps_one_block(kind):
    """Two of the 8 cached prompts again, in slots apart: they do not fill
    the pool, so the second goes next to the first (recomputed) rather
    than splitting the block."""
    scheduler = _scheduler(kind)
    prompts = [_prompt(100 + i) for i in range(8)]
    _run(scheduler, [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts])
    assert [scheduler.slots.cached[slot][:len(prompts[slot])] for slot in (0, 4)] == [prompts[0], prompts[4]]
    again = [Sequence(prompts[i], SamplingParams(max_tokens=4, ignore_eos=True)) for i in (0, 4)]
    for seq in again:
        scheduler.add(seq)
    scheduler.schedule()
    assert slot_runs(scheduler.slots.active) == 1


@pytest.mark.parametrize("kind", ["slots", "adapters"])
def test_a_filling_burst_keeps_the_prefixes_its_own_sequences_reuse(kind):
    """Prompts P0..P7 cached in slots 0..7; two unrelated requests then took
    slots 0 and 1, and the burst's first request (P0, alone a step ahead)
    slot 2, the least recently used. Of the 7 after it, P1 and P2 (nothing
    cached) go to the unrelated requests' slots, not to slots whose prefix
    another of the 7 reuses (each such eviction would cascade down the
    burst), and a prompt sharing one token with P6, admitted before P6,
    leaves P6's slot to P6: the three take slots 0, 1 and 7 (P7 is not in
    the burst)."""
    scheduler = _scheduler(kind)
    prompts = [_prompt(100 + i) + [i] * i for i in range(8)]
    _run(scheduler, [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts])
    assert {slot: tokens[:len(prompts[slot])] for slot, tokens in scheduler.slots.cached.items()} == dict(
        enumerate(prompts))
    _serve_unrelated(scheduler, count=2)
    first = Sequence(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True))
    scheduler.add(first)
    scheduler.schedule()
    assert first.slot == 2
    again = {i: Sequence(prompts[i], SamplingParams(max_tokens=4, ignore_eos=True)) for i in range(1, 7)}
    sharer = Sequence(prompts[6][:1] + [99, 98], SamplingParams(max_tokens=4, ignore_eos=True))
    for seq in [again[1], again[2], again[3], again[4], again[5], sharer, again[6]]:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [again[i].num_cached_prompt for i in range(3, 7)] == [len(prompts[i]) - 1 for i in range(3, 7)]
    assert {again[1].slot, again[2].slot, sharer.slot} == {0, 1, 7}
    assert sharer.num_cached_prompt == 0
    assert sorted(w.slot for w in plan.work) == list(range(8))


@pytest.mark.parametrize("kind", ["slots", "adapters"])
def test_a_filling_burst_takes_over_answered_prompts_in_place(kind):
    """Three prompts answered alone first (each slot holds its prompt and a
    32-token answer, more than a block past the prompt), then a burst of all
    8 prompts: the round fills every slot, so the three are taken over in
    place though free slots remain, instead of being recomputed beside the
    block to spare their answers for a next turn."""
    scheduler = _scheduler(kind)
    prompts = [_prompt(100 + i) for i in range(8)]
    for p in prompts[:3]:
        _run(scheduler, [Sequence(p, SamplingParams(max_tokens=32, ignore_eos=True))])
    burst = [Sequence(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts]
    for seq in burst:
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [s.num_cached_prompt for s in burst[:3]] == [len(p) - 1 for p in prompts[:3]]
    assert slot_runs(scheduler.slots.active) == 1 and len(plan.work) == 8


def test_steady_load_beyond_the_slots_keeps_one_block_and_reuses_the_system_prompt():
    """aiperf at concurrency 32 on 8 slots: every finished request is
    replaced at once, so each admission round fills the pool. Every step
    must still run as one block, and each new request takes a finished
    one's slot over with their shared system prompt."""
    rng = random.Random(0)
    scheduler = _scheduler("adapters")
    system = list(range(1, 31))
    live = [Sequence(system + [rng.randrange(1000, 40000) for _ in range(110)],
                     SamplingParams(max_tokens=16, ignore_eos=True)) for _ in range(32)]
    for seq in live:
        scheduler.add(seq)
    finished = []
    for _ in range(10_000):  # about 300 steps; the bound only stops a scheduler that stalls
        if len(finished) >= 100:
            break
        plan = scheduler.schedule()
        assert slot_runs(w.slot for w in plan.work) == 1
        scheduler.update(plan, _results(plan, live))
        for seq in [s for s in live if s.finish_reason is not None]:
            live.remove(seq)
            finished.append(seq)
            fresh = Sequence(system + [rng.randrange(1000, 40000) for _ in range(110)],
                             SamplingParams(max_tokens=16, ignore_eos=True))
            live.append(fresh)
            scheduler.add(fresh)
    assert len(finished) >= 100
    assert all(s.num_cached_prompt == len(system) for s in finished[8:])
