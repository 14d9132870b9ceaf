"""The scheduler interface both schedulers implement (pure Python): the
plan is plain data, `schedule()` never moves a sequence on, and
`update(plan, results)` alone advances, appends, trims drafts, finishes and
drops cancelled sequences; waiting sequences are admitted by priority."""

from __future__ import annotations

import pytest

from modeld.backends.errors import ErrorKind, InvalidArgument
from modeld.backends.generation.interface import PagedWork, SeqResult, SlotWork, StepPlan
from modeld.backends.generation.paged_scheduler import PagedConfig, PagedScheduler
from modeld.backends.generation.params import FinishReason, GenerateRequest, SamplingParams, queue_rank
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from modeld.backends.generation.sequence import Sequence, SeqStatus
from modeld.backends.generation.slots import KvOp, KvOpKind

BLOCK = 4


def _slots(**overrides) -> SlotScheduler:
    return SlotScheduler(SlotConfig(**{"num_slots": 4, "kv_capacity": 256, "context_length": 64,
                                        "max_step_tokens": 64, **overrides}))


def _paged(**overrides) -> PagedScheduler:
    return PagedScheduler(PagedConfig(**{"num_blocks": 32, "block_size": BLOCK, "context_length": 64,
                                         "max_step_tokens": 64, **overrides}))


SCHEDULERS = {"slots": _slots, "paged": _paged}


def _seq(tokens, max_tokens=8, cache=True, priority=0) -> Sequence:
    return Sequence(list(tokens), SamplingParams(max_tokens=max_tokens, cache_prompt=cache), priority=priority)


def _state(seq: Sequence):
    return seq.num_computed, list(seq.token_ids), seq.num_drafted, seq.num_accepted, seq.finish_reason


def _item(plan: StepPlan, seq: Sequence):
    items = [w for w in plan.work if w.seq_id == seq.seq_id]
    assert len(items) == 1, plan
    return items[0]


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_only_update_moves_a_sequence_on(kind):
    scheduler = SCHEDULERS[kind]()
    seq = _seq(range(1, 7), max_tokens=4)
    scheduler.add(seq)

    before = _state(seq)
    plan = scheduler.schedule()
    assert _state(seq) == before and seq.status is SeqStatus.RUNNING
    item = _item(plan, seq)
    assert (item.start_pos, item.token_ids, item.num_logits, item.num_drafts) == (0, (1, 2, 3, 4, 5, 6), 1, 0)
    assert scheduler.update(plan, {seq.seq_id: SeqResult((7,))}) == []
    assert seq.num_computed == 6 and seq.token_ids[-1] == 7

    # drafts ride along with the last token; one is accepted, the other replaced
    before = _state(seq)
    plan = scheduler.schedule({seq.seq_id: [8, 9]})
    assert _state(seq) == before
    item = _item(plan, seq)
    assert (item.start_pos, item.token_ids, item.num_logits, item.num_drafts) == (6, (7, 8, 9), 3, 2)
    if kind == "paged":
        assert len(scheduler.blocks.tables[seq.seq_id]) == 3  # room for position 8
    assert scheduler.update(plan, {seq.seq_id: SeqResult((8, 42), num_accepted=1)}) == []
    assert seq.token_ids[6:] == [7, 8, 42] and seq.num_computed == 8
    assert (seq.num_drafted, seq.num_accepted) == (2, 1)
    # the rejected draft's KV (position 8) is dropped before the next step
    if kind == "paged":
        assert len(scheduler.blocks.tables[seq.seq_id]) == 2
    plan = scheduler.schedule()
    if kind == "slots":
        assert plan.kv_ops == (KvOp(KvOpKind.TRIM, seq.slot, pos=8),)
    assert _state(seq)[:2] == (8, [1, 2, 3, 4, 5, 6, 7, 8, 42])

    finished = scheduler.update(plan, {seq.seq_id: SeqResult((43,), finish_reason=FinishReason.LENGTH)})
    assert finished == [seq]
    assert seq.finish_reason is FinishReason.LENGTH and seq.status is SeqStatus.FINISHED
    assert not scheduler.running and seq.num_computed == 9
    if kind == "slots":
        assert scheduler.slots.cached[seq.slot] == [1, 2, 3, 4, 5, 6, 7, 8, 42]  # kept for the prefix cache
    else:
        assert scheduler.blocks.num_free == 32 and not scheduler.blocks.tables


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_stop_inside_accepted_drafts_keeps_kv_only_for_the_text(kind):
    scheduler = SCHEDULERS[kind]()
    seq = _seq(range(1, 5), max_tokens=8)
    scheduler.add(seq)
    plan = scheduler.schedule()
    scheduler.update(plan, {seq.seq_id: SeqResult((5,))})
    plan = scheduler.schedule({seq.seq_id: [6, 7, 8]})
    # all three accepted, but the loop saw a stop at the first: only it is kept
    finished = scheduler.update(plan, {seq.seq_id: SeqResult((6,), 3, FinishReason.STOP)})
    assert finished == [seq] and seq.token_ids == [1, 2, 3, 4, 5, 6]
    assert seq.num_computed == 5  # == len(token_ids) - 1: the invariant holds at the end too


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_cancelled_sequences_leave_through_update(kind):
    scheduler = SCHEDULERS[kind](**({"num_slots": 1} if kind == "slots" else {"max_running": 1}))
    running, waiting = _seq(range(1, 6)), _seq(range(10, 15))
    scheduler.add(running)
    scheduler.add(waiting)
    plan = scheduler.schedule()
    assert [w.seq_id for w in plan.work] == [running.seq_id]
    running.is_cancelled = waiting.is_cancelled = True
    finished = scheduler.update(plan, {})
    assert finished == [running, waiting]
    assert all(s.finish_reason is FinishReason.CANCELLED for s in finished)
    assert running.num_computed == 0  # its chunk ran, but it was cancelled meanwhile: not moved on
    assert not scheduler.running and not scheduler.waiting
    if kind == "paged":
        assert scheduler.blocks.num_free == 32
    else:
        assert scheduler.slots.can_grant() and not scheduler.slots.active


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_sequence_cancelled_before_its_step_is_not_planned(kind):
    scheduler = SCHEDULERS[kind]()
    seq = _seq(range(1, 6))
    scheduler.add(seq)
    seq.is_cancelled = True
    plan = scheduler.schedule()
    assert plan.work == ()
    assert scheduler.update(plan, {}) == [seq]
    assert seq.finish_reason is FinishReason.CANCELLED and not scheduler.has_work()


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_failure_finishes_sequences_the_plan_did_not_carry(kind):
    scheduler = SCHEDULERS[kind]()
    seq = _seq(range(1, 6))
    scheduler.add(seq)
    scheduler.update(scheduler.schedule(), {})
    failed = SeqResult(finish_reason=FinishReason.ERROR, error="boom", error_kind=ErrorKind.UNAVAILABLE)
    assert scheduler.update(StepPlan((), ()), {seq.seq_id: failed}) == [seq]
    assert seq.finish_reason is FinishReason.ERROR and not scheduler.running


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_plan_items_are_plain_data(kind):
    scheduler = SCHEDULERS[kind]()
    for tokens in (range(1, 10), range(20, 23)):
        scheduler.add(_seq(tokens))
    plan = scheduler.schedule()
    assert len(plan.work) == 2
    for item in plan.work:
        assert isinstance(item, SlotWork if kind == "slots" else PagedWork)
        for name, value in item._asdict().items():
            assert isinstance(value, int) or all(isinstance(v, int) for v in value), (name, value)
        if kind == "paged":
            # the table covers every position the step writes
            assert len(item.block_table) * BLOCK >= item.start_pos + len(item.token_ids)
        else:
            assert item.slot >= 0


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_an_urgent_request_is_admitted_before_earlier_default_ones(kind):
    scheduler = SCHEDULERS[kind](**({"num_slots": 2} if kind == "slots" else {"max_running": 2}))
    first = _seq(range(1, 5))
    scheduler.add(first)
    scheduler.update(scheduler.schedule(), {})  # one of the two places taken
    default, low, urgent = _seq(range(10, 14)), _seq(range(20, 24), priority=5), _seq(range(30, 34), priority=1)
    for seq in (default, low, urgent):
        scheduler.add(seq)
    plan = scheduler.schedule()
    assert [w.seq_id for w in plan.work][1:] == [urgent.seq_id]
    assert scheduler.waiting == [low, default]  # explicit levels before the default one


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_a_level_is_first_come_first_served(kind):
    scheduler = SCHEDULERS[kind]()
    seqs = [_seq(range(i, i + 4), priority=p) for i, p in enumerate([0, 2, 0, 2, 1])]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.waiting == [seqs[4], seqs[1], seqs[3], seqs[0], seqs[2]]


def test_queue_rank_puts_the_default_level_last():
    assert queue_rank(1) < queue_rank(2) < queue_rank(1000) < queue_rank(0)
    GenerateRequest("m", prompt="x", priority=3).validate()
    with pytest.raises(InvalidArgument, match="priority must be >= 0"):
        GenerateRequest("m", prompt="x", priority=-1).validate()
