"""The onnx-genai backend's own parts, without onnxruntime-genai or weights:
the batch placement (og's static batches), the loop over a scripted engine,
its options, and the vocabulary's token bytes."""

from __future__ import annotations

import asyncio
import json
import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from modeld.backends.errors import ErrorKind, InvalidArgument, ResourceExhausted, Unimplemented
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SamplingParams, SpeculativeMode, TokenEvent,
)
from modeld.backends.generation.sequence import Sequence, SeqStatus
from modeld.backends.model_config import config_from_dict
from modeld.backends.onnx_genai.batches import BatchConfig, BatchScheduler
from modeld.backends.onnx_genai.engines import EngineEvent, EnginePlan, TurnEnd
from modeld.backends.onnx_genai.loop import EngineLoop
from polling import wait_until_async


def _seq(prompt_len: int = 3, max_tokens: int = 4, priority: int = 0) -> Sequence:
    return Sequence(list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens), priority=priority)


def _scheduler(max_running: int = 8, **kw) -> BatchScheduler:
    return BatchScheduler(BatchConfig(max_running=max_running, context_length=64, **kw))


# -- batch placement -------------------------------------------------------------


def test_requests_arriving_together_share_a_batch_of_at_most_four():
    s = _scheduler()
    seqs = [_seq() for _ in range(6)]
    for seq in seqs:
        s.add(seq)
    placed = s.admit()
    assert placed == seqs
    assert [seq.slot for seq in seqs] == [0, 0, 0, 0, 1, 1]
    assert s.busy_batches() == [0, 1]


def test_a_late_request_starts_its_own_batch_instead_of_waiting_for_a_running_one():
    s = _scheduler()
    first = _seq()
    s.add(first)
    s.admit()
    s.seal(s.busy_batches())  # batch 0 ran: og lets no one else in until it drains
    late = _seq()
    s.add(late)
    assert s.admit() == [late] and late.slot == 1


def test_an_unsealed_batch_takes_more_before_it_runs():
    s = _scheduler()
    a, b = _seq(), _seq()
    s.add(a)
    s.admit()
    s.add(b)
    s.admit()
    assert a.slot == b.slot == 0


def test_a_drained_batch_is_reused_and_max_running_bounds_admission():
    s = _scheduler(max_running=2)
    a, b, c = _seq(), _seq(), _seq()
    for seq in (a, b):
        s.add(seq)
        s.admit()
        s.seal(s.busy_batches())
    s.add(c)
    assert s.admit() == [] and s.waiting == [c]
    s.leave(a)
    assert a.status is SeqStatus.FINISHED
    assert s.admit() == [c] and c.slot == a.slot


def test_waiting_requests_go_in_priority_order():
    s = _scheduler(max_running=1)
    running = _seq()
    s.add(running)
    s.admit()
    s.seal([0])
    late_default, urgent = _seq(), _seq(priority=1)
    s.add(late_default)
    s.add(urgent)
    s.leave(running)
    assert s.admit() == [urgent]


def test_admission_refuses_what_cannot_fit():
    s = _scheduler(max_waiting=1)
    with pytest.raises(InvalidArgument, match="context window of 64"):
        s.add(_seq(prompt_len=60, max_tokens=8))
    s.add(_seq())
    with pytest.raises(ResourceExhausted, match="max_waiting"):
        s.add(_seq())


def test_callers_that_leave_while_waiting_never_reach_a_batch():
    s = _scheduler()
    gone, kept = _seq(), _seq()
    s.add(gone)
    s.add(kept)
    gone.is_cancelled = True
    assert s.drop_cancelled_waiting() == [gone]
    assert s.admit() == [kept]


def test_random_traffic_keeps_every_invariant_and_leaks_nothing():
    rng = random.Random(7)
    s = _scheduler(max_running=6, max_waiting=1000)
    for _ in range(500):
        for _ in range(rng.randint(0, 3)):
            s.add(_seq(priority=rng.randint(0, 2)))
        sealed_before = {b.index for b in s.batches if b.is_sealed and b.sequences}
        for seq in s.admit():
            assert seq.slot not in sealed_before, "joined a batch that had already run"
        s.seal(s.busy_batches())
        assert len(s.running) <= 6 and all(len(b.sequences) <= 4 for b in s.batches)
        assert sum(len(b.sequences) for b in s.batches) == len(s.running)
        for seq in list(s.running):
            if rng.random() < 0.3:
                s.leave(seq)
    while s.has_work():
        s.admit()
        s.seal(s.busy_batches())
        for seq in list(s.running):
            s.leave(seq)
    assert all(b.is_idle for b in s.batches) and len(s.batches) <= 6


# -- the loop over a scripted engine ----------------------------------------------------

EOS = 2


class ScriptedEngines:
    """og's static engine as the loop sees it: each run of a batch gives each
    of its turns its next token, ends a turn at max_tokens (the last token
    in the same event) or at the scripted EOS, and reports cancels."""

    def __init__(self, eos_after: dict[int, int] | None = None, fail_batch: int | None = None) -> None:
        self.turns: dict[int, dict] = {}
        self.plans: list[EnginePlan] = []
        self.eos_after = eos_after or {}  # prompt length -> tokens before EOS
        self.fail_batch = fail_batch

    def step(self, plan: EnginePlan) -> list[EngineEvent]:
        self.plans.append(plan)
        for start in plan.starts:
            self.turns[start.seq_id] = {"batch": start.batch, "n": 0, "max": start.params.max_tokens,
                                        "eos": self.eos_after.get(len(start.prompt_ids)), "cancel": False}
        for seq_id in plan.cancels:
            self.turns[seq_id]["cancel"] = True
        events = []
        for batch in plan.batches:
            for seq_id, turn in list(self.turns.items()):
                if turn["batch"] == batch:
                    events.extend(self._advance(seq_id, turn, batch))
        return events

    def _advance(self, seq_id: int, turn: dict, batch: int) -> list[EngineEvent]:
        if batch == self.fail_batch:
            del self.turns[seq_id]
            return [EngineEvent(seq_id, None, TurnEnd.FAILED, "onnxruntime-genai failed (boom)")]
        if turn["cancel"]:
            del self.turns[seq_id]
            return [EngineEvent(seq_id, None, TurnEnd.CANCELLED)]
        if turn["eos"] is not None and turn["n"] == turn["eos"]:
            del self.turns[seq_id]
            return [EngineEvent(seq_id, None, TurnEnd.EOS)]  # og does not report the EOS token
        turn["n"] += 1
        token = 100 + turn["n"]  # text "a", "b", ... (see ScriptedVocab)
        if turn["n"] == turn["max"]:
            del self.turns[seq_id]
            return [EngineEvent(seq_id, token), EngineEvent(seq_id, None, TurnEnd.LENGTH)]
        return [EngineEvent(seq_id, token)]


class ScriptedVocab:
    vocab_size = 200

    def tokenize(self, text, add_special=True):
        return [10 + (ord(c) % 50) for c in text]

    def token_bytes(self, token_id):
        return b"" if token_id == EOS else bytes([ord("a") + token_id - 101])

    def is_end_of_generation(self, token_id):
        return token_id == EOS

    def check_token_ids(self, ids):
        return list(ids)


@pytest.fixture
def worker():
    pool = ThreadPoolExecutor(max_workers=1)
    yield pool
    pool.shutdown()


async def _loop(engines, worker, max_running=8) -> EngineLoop:
    loop = EngineLoop(engines, _scheduler(max_running=max_running), ScriptedVocab(), worker, eos_token_id=EOS)
    loop.start()
    return loop


async def _collect(loop, request):
    events = [e async for e in loop.generate(request)]
    tokens = [t for e in events if isinstance(e, TokenEvent) for t in e.token_ids]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    return tokens, text, events[-1], len(events) - 1


def _req(prompt="hi", **params) -> GenerateRequest:
    return GenerateRequest("m", prompt=prompt, params=SamplingParams(**{"max_tokens": 5, **params}))


async def test_tokens_stream_one_event_each_with_real_usage(worker):
    loop = await _loop(ScriptedEngines(), worker)
    tokens, text, final, events = await _collect(loop, _req(max_tokens=5))
    assert tokens == [101, 102, 103, 104, 105] and text == "abcde" and events == 5
    assert final.finish_reason is FinishReason.LENGTH
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (2, 5)
    assert final.usage.time_to_first_token_s > 0
    await loop.stop()


async def test_eos_is_streamed_and_counted_as_the_other_backends_do(worker):
    loop = await _loop(ScriptedEngines(eos_after={3: 2}), worker)
    tokens, text, final, _ = await _collect(loop, _req("abc", max_tokens=9))
    assert tokens == [101, 102, EOS] and text == "ab"
    assert final.finish_reason is FinishReason.STOP and final.usage.completion_tokens == 3
    await loop.stop()


async def test_a_stop_string_ends_the_call_at_once_and_its_og_turn_at_the_next_step(worker):
    engines = ScriptedEngines()
    loop = await _loop(engines, worker)
    tokens, text, final, _ = await _collect(loop, _req(max_tokens=20, stop=("c",)))
    assert text == "ab" and final.finish_reason is FinishReason.STOP and tokens == [101, 102, 103]
    await loop.stop()
    cancelled = [seq_id for plan in engines.plans for seq_id in plan.cancels]
    assert len(cancelled) == 1 and not engines.turns and not loop.scheduler.running


async def test_concurrent_requests_share_runs_and_a_late_one_does_not_wait(worker):
    engines = ScriptedEngines()
    loop = await _loop(engines, worker)
    together = await asyncio.gather(*(_collect(loop, _req(p, max_tokens=6)) for p in ("a", "b", "c")))
    assert all(r[0] == [101, 102, 103, 104, 105, 106] for r in together)
    assert loop.step_counts.shared_steps >= 6 and loop.step_counts.most_sequences == 3

    long = asyncio.create_task(_collect(loop, _req("long", max_tokens=40)))
    while not loop.scheduler.running:
        await asyncio.sleep(0.001)
    short = await _collect(loop, _req("s", max_tokens=3))
    assert short[0] == [101, 102, 103] and not long.done()  # did not wait for the 40-token batch
    await long
    await loop.stop()


async def test_a_caller_that_leaves_cancels_its_og_turn_and_frees_its_place(worker):
    engines = ScriptedEngines()
    loop = await _loop(engines, worker)
    stream = loop.generate(_req(max_tokens=60))
    await stream.__anext__()
    await stream.aclose()
    await wait_until_async(lambda: not loop.scheduler.running, what="the sequence to leave the batch")
    assert not loop.scheduler.running and not engines.turns
    await loop.stop()


async def test_a_failed_batch_fails_its_requests_as_unavailable(worker):
    loop = await _loop(ScriptedEngines(fail_batch=0), worker)
    tokens, _, final, _ = await _collect(loop, _req())
    assert final.finish_reason is FinishReason.ERROR and final.error_kind is ErrorKind.UNAVAILABLE
    assert "boom" in final.error and "retry" in final.error
    await loop.stop()


@pytest.mark.parametrize("params, word", [
    ({"speculative": SpeculativeMode.NGRAM}, "speculative_decoding"),
    ({"logprobs": 2}, "logprobs"),
    ({"min_p": 0.1}, "min_p"),
    ({"temperature": 0.7, "seed": 3}, "seed"),
])
async def test_what_og_cannot_do_fails_closed_naming_it(worker, params, word):
    loop = await _loop(ScriptedEngines(), worker)
    with pytest.raises(Unimplemented, match=word):
        await _collect(loop, _req(**params))
    # a seed changes nothing in greedy decoding: accepted, as elsewhere
    tokens, _, _, _ = await _collect(loop, _req(seed=3))
    assert len(tokens) == 5
    await loop.stop()


# -- options and vocabulary ------------------------------------------------------------


def test_options_are_checked_when_the_config_is_read():
    config = config_from_dict("m", {"backends": ["onnx-genai"], "onnx_genai": {"max_running": 4}})
    assert config.backend_options.onnx_genai.max_running == 4
    with pytest.raises(InvalidArgument, match="onnx_genai.batch"):
        config_from_dict("m", {"onnx_genai": {"batch": 4}})
    with pytest.raises(InvalidArgument, match="onnx_genai.context_length must be an integer >= 1"):
        config_from_dict("m", {"onnx_genai": {"context_length": 0}})


def test_vocabulary_spells_raw_bytes_and_hides_control_tokens(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from modeld.backends.onnx_genai.vocab import Vocabulary

    vocab = {"<|im_end|>": 0, "Ġh": 1, "i": 2, "Ã": 3, "©": 4, "Ġ": 5, "h": 6}
    tokenizer = Tokenizer(models.BPE(vocab, [("Ġ", "h")]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<|im_end|>"])
    tokenizer.save(str(tmp_path / "tokenizer.json"))

    class OgTokenizer:
        def apply_chat_template(self, messages, add_generation_prompt):
            return "".join(m["content"] for m in json.loads(messages))

    v = Vocabulary(tmp_path, OgTokenizer(), {0})
    assert v.tokenize(" hi") == [1, 2]
    assert v.token_bytes(3) + v.token_bytes(4) == "é".encode()  # one character, two tokens
    assert v.token_bytes(0) == b"" and v.is_end_of_generation(0)
    assert v.detokenize([1, 2, 0]) == " hi"
    with pytest.raises(InvalidArgument, match="outside the vocabulary"):
        v.check_token_ids([7])


def test_prepare_builds_the_precision_model_toml_names(tmp_path):
    from modeld.server.prepare import _onnx_genai_precision

    toml = tmp_path / "model.toml"
    assert _onnx_genai_precision(toml) == "fp32"  # no config yet: the default
    toml.write_text('artifact = "int4/model.onnx"\n')
    assert _onnx_genai_precision(toml) == "int4"
    toml.write_text('artifact = "int8/model.onnx"\n')
    with pytest.raises(ValueError, match="fp32/model.onnx or int4/model.onnx"):
        _onnx_genai_precision(toml)


# -- the og side, over a stand-in for onnxruntime_genai ----------------------------------


class _FakeOg:
    """Just enough of onnxruntime_genai's Engine API for EngineSet: each run
    gives every live turn one token and ends it at its max."""

    class EngineEventFlags:
        TOKEN, TURN_FINISHED, FAILED = 1, 2, 8

    class FinishReason:
        EOS, STOP_STRING, MAX_GENERATED_TOKENS, MAX_SESSION_TOKENS, CANCELLED = range(1, 6)

    class RequestOptions:
        def set_max_session_tokens(self, n):
            self.session = n

    class TurnOptions:
        def __init__(self, request):
            self.request = request

        def __getattr__(self, name):  # set_temperature, set_top_k, ...
            return lambda value: setattr(self.request, name, value)

    class Engine:
        made = 0

        def __init__(self, model):
            type(self).made += 1
            self.requests = []

        def create_event_buffer(self, capacity):
            return None

        def create_request(self, options):
            request = _FakeRequest(self)
            self.requests.append(request)
            return request

        def has_pending_requests(self):
            return any(not r.done for r in self.requests)

        def run(self, buffer):
            events = []
            for r in [r for r in self.requests if not r.done]:
                if r.cancelled:
                    r.done = True
                    events.append(_FakeEvent(r, None, 2, _FakeOg.FinishReason.CANCELLED))
                    continue
                r.count += 1
                end = r.count == r.set_max_generated_tokens
                r.done = end
                events.append(_FakeEvent(r, 100 + r.count, 3 if end else 1,
                                         _FakeOg.FinishReason.MAX_GENERATED_TOKENS if end else 0))
            return events


class _FakeRequest:
    def __init__(self, engine):
        self.engine, self.count, self.done, self.cancelled, self.closed = engine, 0, False, False, False

    def begin_turn(self, tokens, options):
        return 1

    def cancel_turn(self, turn_id):
        self.cancelled = True

    def close(self):
        self.closed = True


class _FakeEvent:
    def __init__(self, request, token, flags, finish_reason):
        self.request, self.token, self.flags, self.finish_reason = request, token, flags, finish_reason
        self.usage = type("Usage", (), {"cached_prompt_tokens": 0})()


def test_engine_set_translates_og_events_and_drops_drained_engines(monkeypatch):
    import sys

    from modeld.backends.onnx_genai.engines import EngineSet, TurnStart

    monkeypatch.setitem(sys.modules, "onnxruntime_genai", _FakeOg)
    engines = EngineSet(model=object(), event_capacity=16)
    params = SamplingParams(max_tokens=2)
    first = engines.step(EnginePlan((TurnStart(1, 0, (5, 6), params), TurnStart(2, 0, (7,), params)), (), (0,)))
    assert first == [EngineEvent(1, 101), EngineEvent(2, 101)]
    second = engines.step(EnginePlan((), (2,), (0,)))  # 2 is cancelled before the run
    assert second == [EngineEvent(1, 102), EngineEvent(1, None, TurnEnd.LENGTH), EngineEvent(2, None, TurnEnd.CANCELLED)]
    # every turn of batch 0 is over: its engine (and the KV cache og keeps in it) is gone, requests closed
    assert not engines._engines and not engines._turns
    made = _FakeOg.Engine.made
    engines.step(EnginePlan((TurnStart(3, 0, (5,), params),), (), (0,)))
    assert _FakeOg.Engine.made == made + 1  # the next batch gets a fresh engine
