"""The generation loop over both schedulers with a numpy stand-in for a
model: every token is followed by (token + 1) % VOCAB. Shared steps, draft
speculation, cancellation releasing the draft's state, and failures that
carry their own status."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from modeld.backends.compute_thread import ComputeThread
from modeld.backends.errors import ErrorKind
from modeld.backends.generation.draft import DraftModel
from modeld.backends.generation.executor import StepExecutor
from modeld.backends.generation import loop as loop_module
from modeld.backends.generation.loop import GenerationLoop
from modeld.backends.generation.paged_scheduler import PagedConfig, PagedScheduler
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SamplingParams, SpeculativeMode,
)
from modeld.backends.generation.slot_scheduler import SlotConfig, SlotScheduler
from polling import wait_until_async

VOCAB = 32


def _next(token: int) -> int:
    return (token + 1) % VOCAB


class CountingRunner(StepExecutor):
    vocab_size = VOCAB

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        self.plans = []

    def run(self, plan):
        self.plans.append(plan)
        if self.fail is not None:
            raise self.fail
        rows = [t for w in plan.work for t in w.token_ids[len(w.token_ids) - w.num_logits:]]
        logits = np.zeros((len(rows), VOCAB), dtype=np.float32)
        logits[np.arange(len(rows)), [_next(t) for t in rows]] = 10.0
        return logits

    def tokenize(self, text, add_special=True):
        return [ord(c) % VOCAB for c in text]

    def token_bytes(self, token_id):
        return bytes([ord("a") + token_id % 26])

    def is_end_of_generation(self, token_id):
        return False

    def apply_chat_template(self, messages, tools=()):
        raise NotImplementedError


class CountingDraft(DraftModel):
    """Proposes what the runner will confirm; remembers what it released."""

    def __init__(self) -> None:
        super().__init__()
        self.released: list[int] = []

    def _prepare(self, seq, num_valid, num_positions, fresh):
        return True

    def _decode(self, feeds):
        return [_next(tokens[-1]) for _, _, tokens in feeds]

    def _forget(self, seq):
        self.released.append(seq.seq_id)


def _schedulers():
    return {
        "slots": SlotScheduler(SlotConfig(num_slots=4, kv_capacity=1024, context_length=256)),
        "paged": PagedScheduler(PagedConfig(num_blocks=64, block_size=4, context_length=256)),
    }


def _request(prompt: str, **params) -> GenerateRequest:
    return GenerateRequest("m", token_ids=tuple(ord(c) % VOCAB for c in prompt),
                           params=SamplingParams(**{"max_tokens": 8, **params}))


async def _collect(loop: GenerationLoop, request: GenerateRequest):
    tokens = []
    async for event in loop.generate(request):
        if isinstance(event, FinalEvent):
            return tokens, event
        tokens.extend(event.token_ids)


def _expected(request: GenerateRequest) -> list[int]:
    out, token = [], request.token_ids[-1]
    for _ in range(request.params.max_tokens):
        token = _next(token)
        out.append(token)
    return out


def _serve(loop: GenerationLoop, body):
    async def main():
        loop.start()
        try:
            return await body()
        finally:
            await loop.stop()
    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_concurrent_requests_share_steps_and_get_their_own_tokens(kind):
    loop = GenerationLoop(runner=CountingRunner(), scheduler=_schedulers()[kind])
    requests = [_request("hello", max_tokens=6), _request("abc", max_tokens=9), _request("xyzzy", max_tokens=3)]

    async def body():
        return await asyncio.gather(*(_collect(loop, r) for r in requests))
    for request, (tokens, final) in zip(requests, _serve(loop, body)):
        assert tokens == _expected(request)
        assert final.finish_reason is FinishReason.LENGTH and final.usage.completion_tokens == len(tokens)
    counts = loop.step_counts
    assert counts.shared_steps > 0 and counts.most_sequences == 3
    assert counts.steps == sum(1 for p in loop.runner.plans if p.work)  # runs with only KV operations do not count


@pytest.mark.parametrize("kind", ["slots", "paged"])
@pytest.mark.parametrize("mode", [SpeculativeMode.DRAFT, SpeculativeMode.NGRAM])
def test_speculation_gives_the_plain_tokens(kind, mode):
    loop = GenerationLoop(runner=CountingRunner(), scheduler=_schedulers()[kind], draft=CountingDraft())
    # the prompt repeats its start, so the n-gram proposer finds what follows
    request = _request("abcdefghijklmnopqrstuvwxyzabcdefgh", max_tokens=12, speculative=mode,
                       num_speculative_tokens=3)
    tokens, final = _serve(loop, lambda: _collect(loop, request))
    assert tokens == _expected(request)
    assert 0 < final.usage.accepted_tokens <= final.usage.drafted_tokens
    assert loop.draft.computed == {}  # released at the end


class GatedRunner(CountingRunner):
    """Runs `num_free` steps, then each waits for `gate`: the sequence is
    still mid-generation when the test looks, however fast the steps are
    and however late the test's task gets the event loop."""

    def __init__(self, num_free: int) -> None:
        super().__init__()
        self.num_free = num_free
        self.gate = threading.Event()

    def run(self, plan):
        if len(self.plans) >= self.num_free:
            assert self.gate.wait(30), "the test never let the step run"
        return super().run(plan)


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_cancelling_a_draft_stream_releases_the_draft_state(kind):
    draft = CountingDraft()
    scheduler = _schedulers()[kind]
    runner = GatedRunner(num_free=2)  # the prefill and one decode step: one event each
    loop = GenerationLoop(runner=runner, scheduler=scheduler, draft=draft)

    async def body():
        request = _request("hello", max_tokens=200, speculative=SpeculativeMode.DRAFT, num_speculative_tokens=2)
        stream = loop.generate(request)
        await stream.__anext__()
        await stream.__anext__()
        assert draft.computed  # the draft holds state for the running sequence
        await stream.aclose()  # the client went away
        runner.gate.set()
        await wait_until_async(lambda: not scheduler.has_work(), what="the sequence to leave the batch")
    _serve(loop, body)
    assert not scheduler.running and len(draft.released) == 1 and draft.computed == {}
    assert len(runner.plans) <= runner.num_free + 2  # it left at the next step, not after 200 tokens


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_runtime_fault_finishes_the_sequences_as_unavailable(kind):
    loop = GenerationLoop(runner=CountingRunner(fail=RuntimeError("device lost")), scheduler=_schedulers()[kind])
    tokens, final = _serve(loop, lambda: _collect(loop, _request("hello")))
    assert tokens == [] and final.finish_reason is FinishReason.ERROR
    assert final.error_kind is ErrorKind.UNAVAILABLE
    assert "running the model" in final.error and "device lost" in final.error
    assert not loop.scheduler.has_work()


class SlowRunner(CountingRunner):
    """A step that takes as long as a real one might."""

    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.step_s = step_s

    def run(self, plan):
        time.sleep(self.step_s)
        return super().run(plan)


def _count_handoffs(loop: GenerationLoop) -> list[int]:
    calls = []
    real = loop._in_worker

    async def counting(fn, *args):
        calls.append(1)
        return await real(fn, *args)
    loop._in_worker = counting
    return calls


def test_consecutive_steps_run_on_the_worker_without_a_hand_off_each():
    loop = GenerationLoop(runner=SlowRunner(0.001), scheduler=_schedulers()["slots"])
    handoffs = _count_handoffs(loop)
    request = _request("hello", max_tokens=30)
    tokens, final = _serve(loop, lambda: _collect(loop, request))
    assert tokens == _expected(request) and final.finish_reason is FinishReason.LENGTH
    steps = len(loop.runner.plans)
    assert steps >= 30 and len(handoffs) <= steps // 3


def test_a_burst_gives_the_worker_back_after_burst_s(monkeypatch):
    monkeypatch.setattr(loop_module, "BURST_S", 0.02)
    loop = GenerationLoop(runner=SlowRunner(0.01), scheduler=_schedulers()["slots"])
    handoffs = _count_handoffs(loop)
    request = _request("hello", max_tokens=20)
    tokens, _ = _serve(loop, lambda: _collect(loop, request))
    assert tokens == _expected(request)
    # a burst ends at the first step that ends past 20 ms: at most 3 steps of 10 ms
    assert len(handoffs) >= len(loop.runner.plans) // 3


def test_a_burst_on_a_compute_thread_keeps_it_while_nothing_else_waits(monkeypatch):
    monkeypatch.setattr(loop_module, "BURST_S", 0.02)
    thread = ComputeThread(thread_name_prefix="test-compute")
    try:
        loop = GenerationLoop(runner=SlowRunner(0.01), scheduler=_schedulers()["slots"], worker=thread)
        handoffs = _count_handoffs(loop)
        request = _request("hello", max_tokens=20)
        tokens, _ = _serve(loop, lambda: _collect(loop, request))
        assert tokens == _expected(request)
        # 200 ms of steps, ten times BURST_S, in one burst: no other job asked for the thread
        assert len(handoffs) == 1 and len(loop.runner.plans) >= 20
    finally:
        thread.shutdown()


def test_a_burst_on_a_compute_thread_gives_it_to_a_waiting_job_after_burst_s(monkeypatch):
    monkeypatch.setattr(loop_module, "BURST_S", 0.02)
    thread = ComputeThread(thread_name_prefix="test-compute")
    try:
        loop = GenerationLoop(runner=SlowRunner(0.01), scheduler=_schedulers()["slots"], worker=thread)
        request = _request("hello", max_tokens=100)  # 1 s of steps: room for a slow event loop to submit the job
        steps_when_run = []

        async def body():
            events = loop.generate(request)
            tokens = list((await events.__anext__()).token_ids)
            job = thread.submit(lambda: steps_when_run.append(len(loop.runner.plans)))
            async for event in events:
                if isinstance(event, FinalEvent):
                    return tokens, job
                tokens.extend(event.token_ids)

        tokens, job = _serve(loop, body)
        assert tokens == _expected(request) and job.done() and not thread.has_waiting()
        # the job ran between two steps of the burst that was running, not once the request was done
        assert steps_when_run and steps_when_run[0] < len(loop.runner.plans)
    finally:
        thread.shutdown()


def test_a_compute_thread_counts_jobs_until_they_start_or_are_cancelled():
    thread = ComputeThread(thread_name_prefix="test-compute")
    release = threading.Event()
    try:
        running = thread.submit(release.wait)
        queued = thread.submit(lambda: None)
        assert thread.has_waiting()
        assert queued.cancel()
        assert not thread.has_waiting()  # the cancelled job will never start
        later = thread.submit(lambda: 7)
        assert thread.has_waiting()
        release.set()
        assert later.result(timeout=30) == 7 and running.result(timeout=30)
        assert not thread.has_waiting()
    finally:
        release.set()
        thread.shutdown()


class FailingObserver:
    def on_step(self, *args):
        raise ConnectionResetError("the channel is closed")

    def on_tokens(self, *args):
        raise ConnectionResetError("the channel is closed")

    def on_finish(self, *args):
        raise ConnectionResetError("the channel is closed")


def test_an_observer_that_fails_holds_back_no_event():
    loop = GenerationLoop(runner=CountingRunner(), scheduler=_schedulers()["slots"], observer=FailingObserver())
    request = _request("hello", max_tokens=5)
    tokens, final = _serve(loop, lambda: asyncio.wait_for(_collect(loop, request), 30))
    assert tokens == _expected(request) and final.finish_reason is FinishReason.LENGTH


class ArgmaxCountingRunner(CountingRunner):
    """Counts the steps that asked for argmax only (run_greedy) and those
    that asked for whole logit rows (run)."""

    def __init__(self) -> None:
        super().__init__()
        self.greedy_steps = self.full_steps = 0

    def run_greedy(self, plan):
        self.greedy_steps += 1
        return super().run(plan).argmax(axis=1)

    def run(self, plan):
        self.full_steps += 1
        return super().run(plan)


def test_plain_greedy_steps_take_only_the_argmax_and_others_whole_rows():
    runner = ArgmaxCountingRunner()
    loop = GenerationLoop(runner=runner, scheduler=_schedulers()["slots"])
    greedy = _request("abc", temperature=0.0)
    tokens, final = _serve(loop, lambda: _collect(loop, greedy))
    assert tokens == _expected(greedy) and final.finish_reason is FinishReason.LENGTH
    assert runner.greedy_steps > 0 and runner.full_steps == 0
    for asks_rows in (_request("abc", temperature=0.0, logprobs=1), _request("abc", temperature=0.0,
                                                                             presence_penalty=0.5)):
        runner = ArgmaxCountingRunner()
        loop = GenerationLoop(runner=runner, scheduler=_schedulers()["slots"])
        tokens, _ = _serve(loop, lambda: _collect(loop, asks_rows))
        assert tokens == _expected(asks_rows)  # the stand-in's one 10.0 logit outweighs the penalty
        # every step that made a token read whole rows (one without rows, a KV operation alone, need not)
        assert runner.full_steps == asks_rows.params.max_tokens


def test_greedy_drafts_are_verified_from_the_argmax_alone():
    runner = ArgmaxCountingRunner()
    loop = GenerationLoop(runner=runner, scheduler=_schedulers()["slots"])
    request = _request("abcabcabcabc", temperature=0.0, max_tokens=12, speculative=SpeculativeMode.NGRAM,
                       num_speculative_tokens=3)
    tokens, final = _serve(loop, lambda: _collect(loop, request))
    assert tokens == _expected(request)
    assert runner.full_steps == 0 and runner.greedy_steps > 0


class RecordingSink:
    """A step sink and step-thread observer (step_sink.py) that records which
    thread gave it what, and each flush."""

    on_step_thread = True

    def __init__(self) -> None:
        self.events: list[tuple[object, object, str]] = []
        self.figures: list[tuple[str, str]] = []
        self.flushes: list[int] = []  # how many events and figures each flush found

    def event(self, key, event) -> None:
        self.events.append((key, event, threading.current_thread().name))

    def on_step(self, *figures) -> None:
        self.figures.append(("on_step", threading.current_thread().name))

    def on_tokens(self, *figures) -> None:
        self.figures.append(("on_tokens", threading.current_thread().name))

    def on_finish(self, *figures) -> None:
        self.figures.append(("on_finish", threading.current_thread().name))

    def flush(self) -> None:
        self.flushes.append(len(self.events) + len(self.figures))


async def _sunk(loop: GenerationLoop, sink: RecordingSink, key, request: GenerateRequest) -> list:
    """generate() with the sink set, as a worker's task sets it: what it yields itself."""
    from modeld.backends.generation.step_sink import STEP_SINK

    STEP_SINK.set((sink, key))
    return [event async for event in loop.generate(request)]


@pytest.mark.parametrize("kind", ["slots", "paged"])
def test_a_stream_with_a_step_sink_gets_its_events_on_the_step_thread(kind):
    sink = RecordingSink()
    loop = GenerationLoop(runner=CountingRunner(), scheduler=_schedulers()[kind], observer=sink)
    requests = {"a": _request("hello", max_tokens=6), "b": _request("other", max_tokens=4)}

    async def body():
        plain = _request("plain", max_tokens=5)
        *yielded, (tokens, final) = await asyncio.gather(*(_sunk(loop, sink, k, r) for k, r in requests.items()),
                                                          _collect(loop, plain))
        return yielded, tokens, final, plain
    yielded, tokens, final, plain = _serve(loop, body)
    assert yielded == [[], []]  # the sink took every event: generate() yielded none
    assert tokens == _expected(plain) and final.finish_reason is FinishReason.LENGTH  # a queue stream beside them
    for key, request in requests.items():
        events = [event for k, event, _ in sink.events if k == key]
        assert [t for e in events[:-1] for t in e.token_ids] == _expected(request)
        assert isinstance(events[-1], FinalEvent) and events[-1].finish_reason is FinishReason.LENGTH
    threads = {name for *_, name in sink.events} | {name for _, name in sink.figures}
    assert threads == {"modeld-step_0"}, threads
    assert {name for name, _ in sink.figures} == {"on_step", "on_tokens", "on_finish"}
    # flushed once a step after its events (a step flushes what it and the steps before gave)
    assert sink.flushes == sorted(sink.flushes) and sink.flushes[-1] == len(sink.events) + len(sink.figures)


def test_leaving_a_sink_fed_stream_cancels_its_sequence():
    sink = RecordingSink()
    loop = GenerationLoop(runner=SlowRunner(0.005), scheduler=_schedulers()["slots"], observer=sink)

    async def body():
        task = asyncio.ensure_future(_sunk(loop, sink, "gone", _request("hello", max_tokens=200)))
        await wait_until_async(lambda: len(sink.events) >= 3, 30, "the stream's first tokens")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until_async(lambda: not loop.scheduler.has_work(), 30, "the sequence to leave")
    _serve(loop, body)
    finals = [e for _, e, _ in sink.events if isinstance(e, FinalEvent)]
    assert len(sink.events) < 200 and len(finals) <= 1


class FailingStepSink(RecordingSink):
    """A sink whose figures and sends fail, as a closed channel's might."""

    def on_tokens(self, *figures) -> None:
        raise ConnectionResetError("the channel is closed")

    def flush(self) -> None:
        raise ConnectionResetError("the channel is closed")


def test_a_failing_step_sink_fails_no_step():
    sink = FailingStepSink()
    loop = GenerationLoop(runner=CountingRunner(), scheduler=_schedulers()["slots"], observer=sink)
    request = _request("hello", max_tokens=5)
    yielded = _serve(loop, lambda: asyncio.wait_for(_sunk(loop, sink, "k", request), 30))
    assert yielded == []
    events = [event for _, event, _ in sink.events]
    assert [t for e in events[:-1] for t in e.token_ids] == _expected(request)
    assert events[-1].finish_reason is FinishReason.LENGTH


class EndAtZeroRunner(CountingRunner):
    def is_end_of_generation(self, token_id):
        return token_id == 0


@pytest.mark.parametrize("tokens, grammar_done, include_stop, text, reason", [
    ([3], True, False, "d", FinishReason.STOP),  # a constraint that is done: its last token's text stays
    ([3, 4], False, False, "de", None),  # drafts accepted: every token's text, in order
    ([3, 0], False, False, "d", FinishReason.STOP),  # an end token: its text is left out...
    ([3, 0], False, True, "da", FinishReason.STOP),  # ...unless the request keeps stop text
    ([0], True, False, "", FinishReason.STOP),
])
def test_a_steps_tokens_are_sent_with_their_text(tokens, grammar_done, include_stop, text, reason):
    from modeld.backends.generation.detokenize import IncrementalText
    from modeld.backends.generation.loop import _Stream
    from modeld.backends.generation.sequence import Sequence

    loop = GenerationLoop(runner=EndAtZeroRunner(), scheduler=_schedulers()["slots"])
    params = SamplingParams(max_tokens=8, include_stop_str_in_output=include_stop)
    seq = Sequence([5, 6], params)
    seq.stream = _Stream(asyncio.Queue(), IncrementalText((), include_stop), None)
    taken, got_reason = loop._emit(seq, tokens, None, grammar_done)
    [(_put, event)] = loop._outbox
    assert (event.text, got_reason, taken) == (text, reason, tokens)
    assert event.token_ids == tuple(tokens)
