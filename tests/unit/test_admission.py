"""Batching strategies as admission rules (scheduler.Admission), on both
schedulers: continuous lets a late sequence join a running batch; dynamic
and static run a batch to completion and start the next one when it is
full or its oldest member has waited the window."""

from __future__ import annotations

import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.paged_scheduler import PagedConfig, PagedScheduler
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.scheduler import Admission
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from modeld.backends.generation.sequence import Sequence
from modeld.backends.options import parse_options


def _slots(admission: Admission) -> SlotScheduler:
    return SlotScheduler(SlotConfig(num_slots=8, kv_capacity=512, context_length=64, max_step_tokens=64,
                                     admission=admission))


def _paged(admission: Admission) -> PagedScheduler:
    return PagedScheduler(PagedConfig(num_blocks=64, block_size=4, context_length=64, max_step_tokens=64,
                                      admission=admission))


SCHEDULERS = [_slots, _paged]


def _seq(n: int = 3, max_tokens: int = 2) -> Sequence:
    return Sequence(list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens, cache_prompt=False))


def _step(scheduler, token: int = 9) -> set[int]:
    """One step where every sequence fed its last prompt token gets a
    token, finishing (as the loop's sampler says) at its max_tokens."""
    plan = scheduler.schedule()
    held = {s.seq_id: s for s in scheduler.running}
    results = {w.seq_id: SeqResult((token,), finish_reason=FinishReason.LENGTH
                                   if held[w.seq_id].num_output + 1 >= held[w.seq_id].params.max_tokens else None)
               for w in plan.work if w.num_logits}
    scheduler.update(plan, results)
    return {w.seq_id for w in plan.work}


@pytest.mark.parametrize("make", SCHEDULERS)
def test_continuous_lets_a_late_sequence_join_the_running_batch(make):
    scheduler = make(Admission("continuous"))
    first = _seq(max_tokens=4)
    scheduler.add(first)
    _step(scheduler)
    late = _seq()
    scheduler.add(late)
    assert _step(scheduler) == {first.seq_id, late.seq_id}


@pytest.mark.parametrize("make", SCHEDULERS)
@pytest.mark.parametrize("policy", ["dynamic", "static"])
def test_a_batch_runs_to_completion_before_the_next_starts(make, policy):
    scheduler = make(Admission(policy, batch=2, window_s=60.0))
    a, b = _seq(max_tokens=3), _seq(max_tokens=3)
    scheduler.add(a)
    assert _step(scheduler) == set(), "one of two: the batch waits to fill"
    scheduler.add(b)
    assert _step(scheduler) == {a.seq_id, b.seq_id}
    # a full batch arrives while one runs: it waits for the running one to end
    late = [_seq(), _seq()]
    for s in late:
        scheduler.add(s)
    ran = [_step(scheduler) for _ in range(2)]
    assert all(s.seq_id not in r for r in ran for s in late) and a.finish_reason is FinishReason.LENGTH
    assert not scheduler.running
    assert _step(scheduler) == {s.seq_id for s in late}
    _step(scheduler)
    # alone, a request waits for the window (60 s here) before starting a batch of one
    alone = _seq()
    scheduler.add(alone)
    assert not scheduler.running and _step(scheduler) == set()
    alone.arrival_time -= 61
    assert _step(scheduler) == {alone.seq_id}


@pytest.mark.parametrize("make", SCHEDULERS)
def test_a_full_batch_takes_at_most_batch_sequences(make):
    scheduler = make(Admission("dynamic", batch=2, window_s=0.0))
    seqs = [_seq() for _ in range(3)]
    for s in seqs:
        scheduler.add(s)
    assert _step(scheduler) == {seqs[0].seq_id, seqs[1].seq_id}


def test_the_policy_is_a_checked_option():
    options = parse_options("m", "llamacpp", {"admission": "static", "admission_batch": 4, "admission_window_ms": 2000})
    assert (options.admission, options.admission_batch, options.admission_window_ms) == ("static", 4, 2000)
    with pytest.raises(InvalidArgument, match="admission.*continuous, dynamic, static"):
        parse_options("m", "torch", {"admission": "greedy"})


def test_prompt_tokens_per_step_are_capped_and_decodes_are_not_counted():
    scheduler = SlotScheduler(SlotConfig(num_slots=8, kv_capacity=512, context_length=64, max_step_tokens=64,
                                          max_prefill_tokens=8))
    running = _seq(n=3, max_tokens=10)
    scheduler.add(running)
    _step(scheduler)
    waiting = [_seq(n=5) for _ in range(3)]
    for s in waiting:
        scheduler.add(s)
    plan = scheduler.schedule()
    fed = {w.seq_id: (len(w.token_ids), w.num_logits) for w in plan.work}
    # the running sequence decodes; the first prompt goes in whole, the second's first 3 tokens follow it
    # without logits, and the third waits
    assert fed == {running.seq_id: (1, 1), waiting[0].seq_id: (5, 1), waiting[1].seq_id: (3, 0)}
    scheduler.update(plan, {running.seq_id: SeqResult((9,)), waiting[0].seq_id: SeqResult((9,))})
    plan = scheduler.schedule()
    fed = {w.seq_id: (w.start_pos, len(w.token_ids)) for w in plan.work}
    assert fed == {running.seq_id: (4, 1), waiting[0].seq_id: (5, 1), waiting[1].seq_id: (3, 2),
                   waiting[2].seq_id: (0, 5)}


def test_llamacpp_prompt_tokens_per_step_default_and_bounds():
    assert parse_options("m", "llamacpp", {}).max_prefill_tokens == 2048
    assert parse_options("m", "llamacpp", {"max_prefill_tokens": 32}).max_prefill_tokens == 32
    with pytest.raises(Exception, match="max_prefill_tokens"):
        parse_options("m", "llamacpp", {"max_prefill_tokens": 0})
