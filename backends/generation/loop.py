"""The generation loop shared by the LLM backends.

One asyncio task per model hands bursts of steps to the model's worker
thread. Each step, on that thread: propose drafts, take the scheduler's
plan, run it on the model runner, then per sequence sample, verify drafts
and detokenize, and hand the results back to `scheduler.update()`, which
alone moves sequences on and reports the ones that finished (cancelled ones
included). A step's token and final events reach their streams on the event
loop in one call, while the thread goes on to the next step: handing every
step to the thread and back cost ~0.4 ms a step here, 3-4% of a one-stream
decode on llama.cpp. A burst ends when no work is left, or after BURST_S
once another job waits for the thread (another model's burst, an adapter
load), so other models sharing the thread get their turn; a thread that
cannot tell (a plain executor) ends it after BURST_S. Requests join between steps
(under the scheduler lock); a request whose consumer leaves is dropped, and
its KV freed, by the next update. A consumer that takes its events on the
step thread (a worker process forwarding them to the daemon) names a sink
instead (step_sink.py): the step then hands them there and wakes no event
loop.

Sampling a step: each sequence's rows get its logit processors (penalties,
logit_bias, min_tokens; sampling.adjust_logits), then, for constrained
sequences, the grammar's token masks, computed for every constrained row of
the step in one llguidance call off the GIL (constraints.py). Draft tokens
are verified against the masked rows, so a draft the grammar refuses is
rejected like any other; the matcher then consumes the tokens kept, and a
grammar that can take nothing more ends the sequence (STOP).

Rows nothing in numpy needs stay in the runtime (run_picking): a plain
greedy row's argmax, a sampled row the runtime's own sampler can draw
exactly (native_sampler; llama.cpp's sampler chain), and a sampled row
over the whole vocabulary (WholeDraw: draw_whole reads the runtime's
buffer in place), so only the rows that logit processors, masks,
logprobs or draft verification read are copied out as [vocab] floats.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import numpy as np
import structlog

from modeld.backends.errors import ErrorKind, Unavailable, Unimplemented
from modeld.backends.generation.constraints import ConstraintCompiler, allowed
from modeld.backends.generation.detokenize import IncrementalText
from modeld.backends.generation.draft import DraftRunner
from modeld.backends.generation.executor import StepExecutor
from modeld.backends.generation.interface import GenerationScheduler, SeqResult, SeqWork, StepPlan
from modeld.backends.generation.ngram import propose_ngram
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SpeculativeMode, TokenEvent, Usage,
)
from modeld.backends.generation.sampling import (
    WholeDraw, adjust_logits, draw, logprobs_of, make_rng, needs_adjusting, probabilities, sample_rows, truncates,
)
from modeld.backends.generation.sequence import Sequence
from modeld.backends.generation.step_sink import STEP_SINK, StepSink

log = structlog.get_logger("modeld.generation")

_NO_WORK: StepPlan = StepPlan((), ())

# The most one burst of steps holds the worker thread (one step always runs
# whole): the llama.cpp and torch backends share one compute thread
# (compute_thread.py), and a model's steps must not starve another's.
BURST_S = 0.05


class GenerationObserver(Protocol):
    """Where the loop reports figures (the server turns them into metrics).

    Called on the event loop, after the step; an observer with a true
    `on_step_thread` attribute is called on the step thread instead, as
    the step makes them, and flushed (`flush()`) with the step's sinks
    (step_sink.py)."""

    def on_step(self, num_running: int, num_waiting: int, kv_used: int, kv_capacity: int) -> None: ...
    def on_tokens(self, count: int, first_token_s: float | None, inter_token_s: float | None) -> None: ...
    def on_finish(self, usage: Usage, reason: FinishReason) -> None: ...


@dataclass
class StepCounts:
    """A trace of the runner's steps, for tests: whether sequences really
    shared forward passes."""

    steps: int = 0  # runs that carried tokens
    shared_steps: int = 0  # runs that carried tokens of two or more sequences
    most_sequences: int = 0  # the most sequences one run carried
    prompt_tokens: int = 0  # prompt tokens the runner computed (cached and shared ones are not)


@dataclass
class _Stream:
    queue: asyncio.Queue
    text: IncrementalText
    target: tuple[StepSink, object] | None = None  # (sink, key): events go there, on the step thread


# put on a sink-fed stream's queue once its final event went to the sink: generate() returns
_SENT = object()


class GenerationLoop:
    # hands a stream's events to its STEP_SINK and calls an on_step_thread
    # observer on the step thread (step_sink.py)
    takes_step_sinks = True

    def __init__(self, runner: StepExecutor, scheduler: GenerationScheduler,
                 observer: GenerationObserver | None = None, draft: DraftRunner | None = None,
                 worker: ThreadPoolExecutor | None = None) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.observer = observer
        self.draft = draft
        self.step_counts = StepCounts()
        self._constraints: ConstraintCompiler | None = None
        self._sequences: dict[int, Sequence] = {}  # seq id -> every request not yet finished
        # seq id -> its native sampler (runner.native_sampler), or False where the loop samples it
        self._native: dict[int, object] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        # The scheduler is used from the event loop (add) and the worker
        # thread (schedule, update); this lock keeps them apart.
        self._lock = threading.Lock()
        # What the current step has for the event loop: (queue, event) pairs
        # and observer calls, delivered together after the step.
        self._outbox: list[tuple] = []
        self._touched: set = set()  # the sinks the current step gave events to (step_sink.py)
        self._event_loop: asyncio.AbstractEventLoop | None = None
        # Always the same worker thread, and backends pass the thread they
        # loaded on: OpenMP keeps a thread team per calling thread, and
        # stepping on another thread than the loader's ran 1.5-2x slower here.
        self._worker = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-step")

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._wakeup = asyncio.Event()  # bound to the loop that runs it
        self._event_loop = asyncio.get_running_loop()
        self._task = self._event_loop.create_task(self._run())

    async def stop(self) -> None:
        """Let running sequences finish, then end the loop."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    @property
    def constraints(self) -> ConstraintCompiler:
        """Grammar compiler and mask figures for this model's vocabulary."""
        if self._constraints is None:
            self._constraints = ConstraintCompiler(self.runner.constraint_tokenizer, self.runner.vocab_size)
        return self._constraints

    # -- requests ------------------------------------------------------------

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.token_ids:
            return self.runner.check_token_ids(request.token_ids)
        if request.messages:
            if request.chat_template_kwargs:
                text = self.runner.apply_chat_template(request.messages, request.tools,
                                                       dict(request.chat_template_kwargs))
            else:  # runners that take no template arguments still serve every other request
                text = self.runner.apply_chat_template(request.messages, request.tools)
            return self.runner.tokenize(text, add_special=False)
        return self.runner.tokenize(request.prompt)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        if self._stopping:
            raise Unavailable("the model is being unloaded; retry")
        request.validate()
        if request.params.speculative is SpeculativeMode.DRAFT and self.draft is None:
            raise Unimplemented("this model has no draft model configured (set draft_model in its backend's table "
                                "in model.toml)")
        params = request.params
        # compiled before the sequence exists: a bad grammar is refused before any work
        matcher = await self.constraints.matcher(params.constraint) if params.constraint is not None else None
        seq = Sequence(self.prompt_ids(request), params, priority=request.priority)
        seq.rng = make_rng(params.seed)
        seq.matcher = matcher
        seq.stream = _Stream(asyncio.Queue(), IncrementalText(params.stop, params.include_stop_str_in_output,
                                                                     params.min_tokens), STEP_SINK.get())
        with self._lock:
            self.scheduler.add(seq)
            self._sequences[seq.seq_id] = seq
        self._wakeup.set()
        try:
            while True:
                event = await seq.stream.queue.get()
                if event is _SENT:
                    return  # every event went to the stream's sink, on the step thread
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            if seq.finish_reason is None:
                seq.is_cancelled = True  # the consumer left: the next update drops it
                self._wakeup.set()

    # -- the loop ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            if not self.scheduler.has_work():
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            try:
                ran = await self._in_worker(self._burst)
            except Exception as exc:  # a bug past the step's own fault handling: end what is in flight
                log.exception("generation_loop_failed")
                self._outbox.clear()
                self._abandon_all(exc)
                await asyncio.sleep(0.1)  # the same fault is likely to recur: do not spin on it
                continue
            if not ran:
                await asyncio.sleep(0.001)  # waiting for room; let finished sequences leave

    def _burst(self) -> bool:
        """Steps on the worker thread until no work is left, or BURST_S has
        passed and something else waits for the thread; False when a step
        found nothing it could run. Each return costs a hand-off through the
        event loop: ~0.35 ms and a wake-up of its thread, every step at 8
        streams (a 50 ms step) if bursts ended at BURST_S regardless."""
        deadline = time.monotonic() + BURST_S
        others_waiting = getattr(self._worker, "has_waiting", None)
        while True:
            try:
                ran = self._step()
            finally:
                if self.observer is not None:
                    s = self.scheduler
                    self._observe(self.observer.on_step, len(s.running), len(s.waiting), s.num_used_cells,
                                  s.kv_capacity)
                self._send_outbox()
            if not ran or not self.scheduler.has_work():
                return ran
            if time.monotonic() >= deadline and (others_waiting is None or others_waiting()):
                return ran

    def _send_outbox(self) -> None:
        """The step's events and figures: to the sinks that took some, then
        what is left to the event loop, in one wake-up."""
        if self._touched:
            touched, self._touched = self._touched, set()
            for sink in touched:
                try:
                    sink.flush()
                except Exception:  # a consumer that fails must not fail the step or the sinks after it
                    log.exception("generation_delivery_failed")
        if self._outbox:
            out, self._outbox = self._outbox, []
            self._event_loop.call_soon_threadsafe(_deliver, out)

    def _send(self, seq: Sequence, event: TokenEvent | FinalEvent) -> None:
        if seq.stream.target is None:
            self._outbox.append((seq.stream.queue.put_nowait, event))
            return
        sink, key = seq.stream.target
        sink.event(key, event)
        self._touched.add(sink)

    def _observe(self, method, *args) -> None:
        if getattr(self.observer, "on_step_thread", False):
            try:
                method(*args)
            except Exception:  # as _deliver: figures that fail hold back no event
                log.exception("generation_delivery_failed")
            self._touched.add(self.observer)
        else:
            self._outbox.append((method, *args))

    def _step(self) -> bool:
        plan, results = _NO_WORK, {}
        doing = "proposing draft tokens"
        try:
            drafts = self._propose_drafts()
            doing = "scheduling"
            with self._lock:
                plan = self.scheduler.schedule(drafts)
            if plan.work or plan.kv_ops:
                doing = "computing constraint masks"
                masks = self._start_masks(plan)
                doing = "running the model"
                if masks is None and self._plain_greedy(plan):
                    tokens = self.runner.run_greedy(plan)
                    self._count(plan)
                    doing = "sampling"
                    results = self._take_greedy(plan, tokens)
                else:
                    picks = self._picks(plan)
                    picked, logits = self.runner.run_picking(plan, picks) if picks else (None, self.runner.run(plan))
                    self._count(plan)
                    doing = "computing constraint masks"
                    masks = masks.result() if masks is not None else {}
                    doing = "sampling"
                    results = self._sample(plan, logits, masks, picked)
        except Exception as exc:  # a runtime fault: fail the sequences in it, keep serving
            log.exception("generation_step_failed", stage=doing)
            failed = SeqResult(finish_reason=FinishReason.ERROR, error_kind=ErrorKind.UNAVAILABLE,
                               error=f"the model failed while {doing} ({type(exc).__name__}: {exc}); retry the request")
            with self._lock:
                results = {seq.seq_id: failed for seq in self.scheduler.running}
        with self._lock:
            finished = self.scheduler.update(plan, results)
        for seq in finished:
            self._finished(seq, results.get(seq.seq_id))
        return bool(plan.work or plan.kv_ops)

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    def _count(self, plan: StepPlan) -> None:
        n = len(plan.work)
        for work in plan.work:
            seq = self._sequences.get(work.seq_id)
            if seq is not None and work.start_pos < seq.num_prompt:
                self.step_counts.prompt_tokens += min(len(work.token_ids), seq.num_prompt - work.start_pos)
        if n:
            counts = self.step_counts
            counts.steps += 1
            counts.shared_steps += n >= 2
            counts.most_sequences = max(counts.most_sequences, n)

    def _propose_drafts(self) -> dict[int, list[int]]:
        drafts: dict[int, list[int]] = {}
        wanted: dict[Sequence, int] = {}
        with self._lock:
            running = list(self.scheduler.running)
        for seq in running:
            if seq.is_prefilling or seq.params.speculative is SpeculativeMode.NONE or seq.is_cancelled:
                continue
            room = min(seq.params.num_speculative_tokens, seq.params.max_tokens - seq.num_output - 1)
            if room <= 0:
                continue
            if seq.params.speculative is SpeculativeMode.NGRAM:
                proposal = propose_ngram(seq.token_ids, room)
                if proposal:
                    drafts[seq.seq_id] = proposal
            else:
                wanted[seq] = room
        if wanted and self.draft is not None:
            # the draft model decodes k tokens for every sequence, batched
            proposals = self.draft.propose(wanted)
            for seq, proposal in proposals.items():
                if proposal:
                    drafts[seq.seq_id] = proposal
        return drafts

    # -- results ---------------------------------------------------------------

    def _sample(self, plan: StepPlan, logits: np.ndarray, masks: dict[int, np.ndarray] | None = None,
                picked: np.ndarray | None = None) -> dict[int, SeqResult]:
        """picked: from run_picking, each row's token where the runtime took
        it (-1 where not); logits then holds only the other rows."""
        results: dict[int, SeqResult] = {}
        live: list[tuple[Sequence, SeqWork, np.ndarray]] = []
        row = wanted = 0
        for work in plan.work:
            first, wanted = wanted, wanted + work.num_logits
            if work.num_logits == 0:
                continue  # a prompt chunk: no token yet
            seq = self._sequences.get(work.seq_id)
            live_seq = seq is not None and not seq.is_cancelled
            if picked is not None and picked[first] >= 0:
                if live_seq:
                    results[work.seq_id] = self._picked(seq, work, picked[first:wanted].tolist())
                continue
            rows = logits[row:row + work.num_logits]
            row += work.num_logits
            if live_seq:
                live.append((seq, work, rows))
        masks = masks or {}
        for seq, work, rows in live:
            results[work.seq_id] = self._result(seq, work, rows, masks.get(seq.seq_id))
        return results

    def _plain_greedy(self, plan: StepPlan) -> bool:
        """Whether every row of the step is decoded greedily with nothing
        applied to its logits and no log-probabilities asked: then only each
        row's argmax is needed, taken in the runtime (run_greedy)."""
        for work in plan.work:
            if not work.num_logits:
                continue
            seq = self._sequences.get(work.seq_id)
            if seq is None or seq.is_cancelled:
                continue
            params = seq.params
            if (not params.is_greedy or params.logprobs or seq.matcher is not None
                    or needs_adjusting(params, seq.num_output)):
                return False
        return True

    def _take_greedy(self, plan: StepPlan, argmax: np.ndarray) -> dict[int, SeqResult]:
        """_sample for a plain greedy step, from each row's argmax: drafts
        are accepted while they equal it (as _verify does), then one token."""
        results: dict[int, SeqResult] = {}
        picked = argmax.tolist()
        row = 0
        for work in plan.work:
            first, row = row, row + work.num_logits
            if not work.num_logits:
                continue
            seq = self._sequences.get(work.seq_id)
            if seq is None or seq.is_cancelled:
                continue
            results[work.seq_id] = self._picked(seq, work, picked[first:row])
        return results

    def _picked(self, seq: Sequence, work: SeqWork, tokens: list[int]) -> SeqResult:
        """A sequence's result from the tokens the runtime took for its rows
        (argmax, or its native sampler's draw for a row without drafts):
        drafts are accepted while they equal them (as _verify does), then one token."""
        drafts = _drafts(work)
        accepted = 0
        while accepted < len(drafts) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        taken, reason = self._emit(seq, tokens[:accepted + 1], None)
        return SeqResult(tuple(taken), accepted, reason)

    def _picks(self, plan: StepPlan) -> dict:
        """seq id -> how the runtime takes that sequence's tokens where its
        logits lie (StepExecutor.run_picking): None for each row's argmax
        (plain greedy, or a sequence no longer served), the sequence's
        native sampler, or a WholeDraw. Empty when the runtime has no native
        sampling: every row is then copied out, as before."""
        if not self.runner.samples_natively:
            return {}
        picks = {}
        for work in plan.work:
            if not work.num_logits:
                continue
            seq = self._sequences.get(work.seq_id)
            if seq is None or seq.is_cancelled:
                picks[work.seq_id] = None  # its rows are thrown away: copy none of them
                continue
            params = seq.params
            if params.is_greedy:
                if not (params.logprobs or seq.matcher is not None or needs_adjusting(params, seq.num_output)):
                    picks[work.seq_id] = None
                continue
            sampler = self._native.get(seq.seq_id)
            if sampler is None:
                # decided once per sequence: its tokens come from one generator all its life
                sampler = self._native[seq.seq_id] = self.runner.native_sampler(seq) or False
            if work.num_drafts:
                continue
            if sampler is not False:
                picks[work.seq_id] = sampler
            elif self._draws_whole(seq):
                picks[work.seq_id] = WholeDraw(seq.rng, params.temperature)
        return picks

    def _draws_whole(self, seq: Sequence) -> bool:
        """Whether seq's row is drawn by draw_whole with nothing read or
        changed beside it: no filter, logit processor, mask or logprobs."""
        params = seq.params
        return not (params.logprobs or seq.matcher is not None or needs_adjusting(params, seq.num_output)
                    or truncates(params, self.runner.vocab_size))

    def _start_masks(self, plan: StepPlan):
        """The step's constraint masks, computed while the model runs: they
        depend only on each matcher's state and the plan's drafts, both
        known before the forward pass, and llguidance releases the GIL."""
        items, owners, num_rows = [], [], 0
        for work in plan.work:
            seq = self._sequences.get(work.seq_id)
            if work.num_logits and seq is not None and seq.matcher is not None and not seq.is_cancelled:
                items.append((seq.matcher, num_rows, _drafts(work)))
                owners.append((seq.seq_id, num_rows, work.num_logits))
                num_rows += work.num_logits
        if not items:
            return None
        if not self.constraints.parallel:
            # few cores: a thread beside the forward pass would take one from it
            done: Future = Future()
            done.set_result(self._masks(items, owners, num_rows))
            return done
        return _MASK_THREAD.submit(self._masks, items, owners, num_rows)

    def _masks(self, items: list, owners: list, num_rows: int) -> dict[int, np.ndarray]:
        """The allowed tokens [rows, vocab] of every constrained sequence in
        the step, from one batched llguidance call."""
        compiler = self.constraints
        bits = compiler.fill_masks(items, num_rows)
        started = time.perf_counter()
        every = allowed(bits, self.runner.vocab_size)
        compiler.stats.apply_s += time.perf_counter() - started
        return {seq_id: every[first:first + n] for seq_id, first, n in owners}

    def _result(self, seq: Sequence, work: SeqWork, rows: np.ndarray, mask: np.ndarray | None) -> SeqResult:
        drafts = _drafts(work)
        scored = rows  # what logprobs report: the model's own distribution, as vLLM's default
        if mask is not None or needs_adjusting(seq.params, seq.num_output):
            if seq.params.logprobs:
                scored = rows.copy()
            self._adjust(seq, drafts, rows, mask)
        accepted, tokens, rows = self._verify(seq, drafts, rows)
        grammar_done = False
        if seq.matcher is not None:
            if not seq.matcher.consume_tokens(tokens):
                error = seq.matcher.get_error() or "token refused"
                log.error("constraint_consume_failed", error=error)
                return SeqResult(finish_reason=FinishReason.ERROR, error_kind=ErrorKind.INTERNAL,
                                 error=f"the constraint engine refused a token it allowed ({error})")
            grammar_done = seq.matcher.is_stopped()
        taken, reason = self._emit(seq, tokens, scored[:len(tokens)], grammar_done)
        return SeqResult(tuple(taken), accepted, reason)

    def _adjust(self, seq: Sequence, drafts: list[int], rows: np.ndarray, mask: np.ndarray | None) -> None:
        params = seq.params
        if needs_adjusting(params, seq.num_output):
            end_ids = self.runner.end_of_generation_ids() if params.min_tokens else _NO_IDS
            adjust_logits(rows, params, seq.prompt_ids, seq.token_ids[seq.num_prompt:], drafts, end_ids)
        if mask is not None:
            rows[~mask] = -np.inf
            dead = np.isneginf(rows.max(axis=1))
            if dead.any():
                # min_tokens held back the only tokens the grammar allows (its end): the grammar wins
                for i in np.flatnonzero(dead):
                    rows[i, mask[i]] = 0.0

    def _verify(self, seq: Sequence, drafts: list[int], rows: np.ndarray) -> tuple[int, list[int], np.ndarray]:
        """Accept drafts left to right; the first rejection is replaced by a
        token from the target, and a full acceptance earns one bonus token.

        Greedy: accept while the target's argmax equals the draft, so the
        output is exactly plain greedy decoding. Sampled: the draft is a
        point mass q = 1 on token d, so accept d with probability p(d) and on
        rejection sample from p with d removed, i.e. normalise(max(p - q, 0)):
        the standard rule that leaves the target distribution unchanged.
        """
        params = seq.params
        for i, draft in enumerate(drafts):
            if params.is_greedy:
                target = int(rows[i].argmax())
                if target != draft:
                    return i, drafts[:i] + [target], rows[:i + 1]
                continue
            probs = probabilities(rows[i], params)
            if seq.rng.random() >= probs[draft]:
                residual = probs.copy()
                residual[draft] = 0.0
                if residual.sum() <= 0:
                    residual = probs
                token = draw(residual / residual.sum(), seq.rng)
                return i, drafts[:i] + [token], rows[:i + 1]
        last = sample_rows(rows[len(drafts):len(drafts) + 1], [params], [seq.rng])
        return len(drafts), drafts + [int(last[0])], rows

    def _emit(self, seq: Sequence, tokens: list[int], rows: np.ndarray | None,
              grammar_done: bool = False) -> tuple[list[int], FinishReason | None]:
        """Send the tokens the sequence keeps (up to a stop) and their text;
        returns them with the reason it ends, if it does (grammar_done: its
        constraint can take no more tokens)."""
        now = time.monotonic()
        first = None if seq.first_token_time else now - seq.arrival_time
        inter = None if seq.last_token_time is None else (now - seq.last_token_time) / len(tokens)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        taken, reason = self._take_until_stop(seq, tokens)
        # only the last token taken can be a stop token, and then _take_until_stop says STOP
        stop_token_last = reason is FinishReason.STOP
        if reason is None and grammar_done:
            reason = FinishReason.STOP
        params = seq.params
        piece = self.runner.token_bytes if params.skip_special_tokens else self.runner.special_token_bytes
        shown = taken[:-1] if stop_token_last and not params.include_stop_str_in_output else taken
        if len(shown) == 1:
            text = seq.stream.text.push(piece(shown[0]))
        else:
            text = "".join([seq.stream.text.push(piece(t)) for t in shown])
        if seq.stream.text.stopped:
            reason = FinishReason.STOP
        if reason is not None:
            text += seq.stream.text.flush()
        logprobs, tops = (), ()
        if seq.params.logprobs and taken:
            chosen, top = logprobs_of(rows[:len(taken)], np.array(taken), seq.params.logprobs)
            logprobs, tops = tuple(chosen), tuple(top)
        if taken or text:
            self._send(seq, TokenEvent(tuple(taken), text, logprobs, tops))
        if self.observer is not None:
            self._observe(self.observer.on_tokens, len(taken), first, inter)
        return taken, reason

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (
            not seq.params.ignore_eos and self.runner.is_end_of_generation(token))

    def _take_until_stop(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        taken: list[int] = []
        room = seq.params.max_tokens - seq.num_output
        for token in tokens:
            taken.append(token)
            if self._is_stop_token(seq, token):
                return taken, FinishReason.STOP
            if len(taken) >= room:
                return taken, FinishReason.LENGTH
        return taken, None

    def _finished(self, seq: Sequence, result: SeqResult | None) -> None:
        """The scheduler let seq go (its KV is released): send its final event."""
        if self.draft is not None:
            self.draft.release(seq)
        sampler = self._native.pop(seq.seq_id, False)
        if sampler is not False:
            sampler.close()
        if self._sequences.pop(seq.seq_id, None) is None:
            return  # abandoned: its final event went out already
        usage = Usage(
            prompt_tokens=seq.num_prompt, cached_prompt_tokens=seq.num_cached_prompt,
            completion_tokens=seq.num_output, drafted_tokens=seq.num_drafted, accepted_tokens=seq.num_accepted,
            time_to_first_token_s=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else 0.0,
        )
        error, kind = (result.error, result.error_kind) if result is not None else ("", None)
        self._send(seq, FinalEvent(seq.finish_reason, usage, error, kind))
        if seq.stream.target is not None:
            self._outbox.append((seq.stream.queue.put_nowait, _SENT))  # ends its generate() once sent
        if self.observer is not None:
            self._observe(self.observer.on_finish, usage, seq.finish_reason)

    def _abandon_all(self, exc: Exception) -> None:
        """Fail every request now; the scheduler drops them (as cancelled) at its next update."""
        for seq in self._sequences.values():
            seq.is_cancelled = True
            usage = Usage(prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output)
            final = FinalEvent(FinishReason.ERROR, usage, f"generation failed: {exc}", ErrorKind.INTERNAL)
            if seq.stream.target is None:
                seq.stream.queue.put_nowait(final)
                continue
            sink, key = seq.stream.target
            sink.event(key, final)
            sink.flush()
            seq.stream.queue.put_nowait(_SENT)
        self._sequences.clear()
        for sampler in self._native.values():
            if sampler is not False:
                sampler.close()
        self._native.clear()


_NO_IDS = np.zeros(0, dtype=np.int64)
# where a step's masks are computed beside its forward pass (llguidance fans out to its own threads)
_MASK_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-masks")


def _drafts(work: SeqWork) -> list[int]:
    return list(work.token_ids[len(work.token_ids) - work.num_drafts:]) if work.num_drafts else []


def _deliver(outbox: list[tuple]) -> None:
    """On the event loop: one step's events to their streams, and its figures
    to the observer, in the order the step made them."""
    for call, *args in outbox:
        try:
            call(*args)
        except Exception:  # an observer that fails must not hold back the events after it
            log.exception("generation_delivery_failed")
