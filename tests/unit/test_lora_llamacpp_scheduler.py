"""The llama.cpp slot scheduler with LoRA adapters: each step carries one
adapter set, sets take turns, slots are placed by adapter, and the prefix
cache is keyed by adapter (pure Python, no llama.cpp)."""

from __future__ import annotations

from modeld.backends.generation.interface import SeqResult
from modeld.backends.generation.paged_scheduler import REQUEST_ADAPTER
from modeld.backends.generation.params import FinishReason, SamplingParams
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.slot_scheduler import SlotConfig
from modeld.backends.generation.slots import KvOpKind
from modeld.backends.llamacpp.lora import AdapterSlotScheduler
from modeld.backends.model_config import LoraSettings

PROMPT = list(range(1, 41))


def _scheduler(num_slots: int = 8, **lora) -> AdapterSlotScheduler:
    config = SlotConfig(num_slots=num_slots, kv_capacity=num_slots * 256, context_length=256, max_step_tokens=512,
                        min_copy_tokens=4)
    return AdapterSlotScheduler(config, LoraSettings(**lora))


def _add(scheduler, adapter: int, prompt=PROMPT, max_tokens: int = 3) -> Sequence:
    seq = Sequence(list(prompt), SamplingParams(max_tokens=max_tokens))
    token = REQUEST_ADAPTER.set(adapter)
    try:
        scheduler.add(seq)
    finally:
        REQUEST_ADAPTER.reset(token)
    return seq


def _step(scheduler) -> set[int]:
    """One step; the adapters its work ran under (by the pool's slot map)."""
    plan = scheduler.schedule()
    results = {}
    for work in plan.work:
        if work.num_logits:
            seq = next(s for s in scheduler.running if s.seq_id == work.seq_id)
            done = seq.num_output + 1 >= seq.params.max_tokens
            results[work.seq_id] = SeqResult((7,), 0, FinishReason.LENGTH if done else None)
    adapters = {scheduler.slots.slot_adapter.get(w.slot, 0) for w in plan.work}
    scheduler.update(plan, results)
    return adapters


def _run_to_end(scheduler) -> list[set[int]]:
    steps = []
    while scheduler.has_work():
        steps.append(_step(scheduler))
    return steps


def test_each_step_runs_one_adapter_set_and_the_sets_take_turns():
    scheduler = _scheduler()
    seqs = [_add(scheduler, adapter, [adapter + 100] + PROMPT) for adapter in (0, 5, 6, 0, 5, 6)]
    steps = _run_to_end(scheduler)
    assert all(len(step) == 1 for step in steps if step), steps
    ran = [next(iter(step)) for step in steps if step]
    assert ran[:6] == [0, 5, 6, 0, 5, 6]  # in turn, not one set to its end first
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)
    assert scheduler.adapter_of == {}


def test_with_the_base_alone_every_sequence_shares_each_step():
    scheduler = _scheduler()
    seqs = [_add(scheduler, 0, [i + 100] + PROMPT) for i in range(4)]
    plan = scheduler.schedule()
    assert {w.seq_id for w in plan.work} == {s.seq_id for s in seqs}


def test_a_slot_cached_under_one_adapter_is_never_reused_by_another_or_the_base():
    scheduler = _scheduler(num_slots=4)
    _add(scheduler, 3)
    _run_to_end(scheduler)
    other, base = _add(scheduler, 4), _add(scheduler, 0)
    _run_to_end(scheduler)
    assert other.num_cached_prompt == 0 and base.num_cached_prompt == 0
    again = [_add(scheduler, a) for a in (3, 4, 0)]
    _run_to_end(scheduler)
    assert [s.num_cached_prompt for s in again] == [len(PROMPT) - 1] * 3  # each its own cached copy


def test_a_running_prefix_is_copied_only_within_its_adapter():
    scheduler = _scheduler()
    first = _add(scheduler, 2, max_tokens=8)
    _step(scheduler)  # its prompt is in
    same, other = _add(scheduler, 2, max_tokens=2), _add(scheduler, 9, max_tokens=2)
    plans = [scheduler.schedule() for _ in range(3)]
    copies = [op for plan in plans for op in plan.kv_ops if op.kind is KvOpKind.COPY]
    assert [op.src for op in copies] == [first.slot]
    assert same.num_cached_prompt > 0 and other.num_cached_prompt == 0


def test_sequences_of_one_adapter_get_neighbouring_slots():
    scheduler = _scheduler()
    for i, adapter in enumerate((1, 2, 1, 2, 1, 2)):  # arriving one by one, alternating
        _add(scheduler, adapter, [adapter * 50 + i] + PROMPT, max_tokens=40)
        _step(scheduler)
        _step(scheduler)
    slots = {a: sorted(s.slot for s in scheduler.running if scheduler.adapter_of[s.seq_id] == a) for a in (1, 2)}
    for adapter_slots in slots.values():  # one run of consecutive slots each: one forward pass per step
        assert adapter_slots == list(range(adapter_slots[0], adapter_slots[0] + 3)), slots


def test_at_most_max_loras_per_batch_adapters_run_and_the_others_wait():
    scheduler = _scheduler(max_loras_per_batch=2)
    seqs = [_add(scheduler, adapter, [adapter] + PROMPT, max_tokens=4) for adapter in (1, 2, 3, 0)]
    for _ in range(3):
        _step(scheduler)
    running = {scheduler.adapter_of.get(s.seq_id, 0) for s in scheduler.running}
    assert running == {0, 1, 2} and seqs[2] in scheduler.waiting
    _run_to_end(scheduler)
    assert all(s.finish_reason is FinishReason.LENGTH for s in seqs)


def test_an_adapters_slots_report_their_blocks_in_the_adapters_namespace():
    from modeld.backends.generation.paged_scheduler import adapter_salt

    scheduler = _scheduler()
    prompt = list(range(1, 70))
    _add(scheduler, 7, prompt, max_tokens=1)
    _add(scheduler, 0, prompt, max_tokens=1)
    _run_to_end(scheduler)
    pool = scheduler.slots
    reported = pool.kv_block_hashes()
    under_adapter = pool.kv_prompt_hashes(prompt, salt=adapter_salt(7))
    under_base = pool.kv_prompt_hashes(prompt)
    assert set(under_adapter) <= reported and set(under_base) <= reported
    assert not set(under_adapter) & set(under_base)
