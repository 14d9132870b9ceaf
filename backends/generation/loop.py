"""The generation loop shared by the LLM backends.

One asyncio task per model: schedule a step (plain Python), run it on the
executor in a worker thread, then sample, verify drafts, detokenize and
hand each sequence its events. Requests join and leave between steps;
cancelling a request's consumer removes the sequence at the next step and
frees its KV slot.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import AsyncIterator, Protocol

import numpy as np
import structlog

from modeld.backends.errors import Unavailable, Unimplemented
from modeld.backends.generation.detokenize import IncrementalText
from modeld.backends.generation.executor import StepExecutor
from modeld.backends.generation.ngram import propose_ngram
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SpeculativeMode, TokenEvent, Usage,
)
from modeld.backends.generation.sampling import logprobs_of, make_rng, probabilities, sample_rows
from modeld.backends.generation.scheduler import Scheduler, SeqWork
from modeld.backends.generation.sequence import Sequence

log = structlog.get_logger("modeld.generation")


class GenerationObserver(Protocol):
    """Where the loop reports figures (the server turns them into metrics)."""

    def on_step(self, num_running: int, num_waiting: int, kv_used: int, kv_capacity: int) -> None: ...
    def on_tokens(self, count: int, first_token_s: float | None, inter_token_s: float | None) -> None: ...
    def on_finish(self, usage: Usage, reason: FinishReason) -> None: ...


@dataclass
class _Stream:
    queue: asyncio.Queue
    text: IncrementalText


class GenerationLoop:
    def __init__(self, executor: StepExecutor, scheduler: Scheduler, observer: GenerationObserver | None = None,
                 draft: "DraftRunner | None" = None, worker: ThreadPoolExecutor | None = None) -> None:
        self.executor = executor
        self.scheduler = scheduler
        self.observer = observer
        self.draft = draft
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        # Always the same worker thread, and backends pass the thread they
        # loaded on: OpenMP keeps a thread team per calling thread, and
        # stepping on another thread than the loader's ran 1.5-2x slower here.
        self._executor = worker or ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-step")

    # -- lifecycle -------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._wakeup = asyncio.Event()  # bound to the loop that runs it
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Let running sequences finish, then end the loop."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await self._task

    # -- requests ------------------------------------------------------------

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.token_ids:
            return self.executor.check_token_ids(request.token_ids)
        if request.messages:
            return self.executor.tokenize(self.executor.apply_chat_template(request.messages), add_special=False)
        return self.executor.tokenize(request.prompt)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        if self._stopping:
            raise Unavailable("the model is being unloaded; retry")
        request.validate()
        if request.params.speculative is SpeculativeMode.DRAFT and self.draft is None:
            raise Unimplemented("this model has no draft model configured (set draft_model in its backend's table "
                                "in model.toml)")
        seq = Sequence(self.prompt_ids(request), request.params)
        seq.rng = make_rng(request.params.seed)
        seq.stream = _Stream(asyncio.Queue(), IncrementalText(request.params.stop))
        self.scheduler.add(seq)
        self._wakeup.set()
        try:
            while True:
                event = await seq.stream.queue.get()
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            if seq.finish_reason is None:
                seq.is_cancelled = True  # the consumer left: drop it at the next step
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
                await self._step()
            except Exception as exc:  # a runtime fault: fail the sequences in it, keep serving
                log.exception("generation_step_failed")
                for seq in list(self.scheduler.running):
                    self._finish(seq, FinishReason.ERROR, f"the model failed while generating: {exc}")

    async def _step(self) -> None:
        try:
            await self._run_step()
        finally:
            if self.observer is not None:
                s = self.scheduler
                self.observer.on_step(len(s.running), len(s.waiting), s.num_used_cells, s.config.kv_capacity)

    async def _run_step(self) -> None:
        await self._propose_drafts()
        plan = self.scheduler.schedule()
        if not plan.work:
            if plan.kv_ops:
                await self._in_worker(self.executor.run, plan)
            else:
                await asyncio.sleep(0.001)  # waiting for room; let finished sequences leave
            return
        logits = await self._in_worker(self.executor.run, plan)
        row = 0
        for work in plan.work:
            rows = logits[row:row + work.num_logits]
            row += work.num_logits
            if not work.seq.is_cancelled and work.seq.finish_reason is None:
                self._apply(work, rows)

    async def _in_worker(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _propose_drafts(self) -> None:
        wanted: dict[Sequence, int] = {}
        for seq in self.scheduler.running:
            seq.draft_ids = []
            if seq.is_prefilling or seq.params.speculative is SpeculativeMode.NONE or seq.is_cancelled:
                continue
            room = min(seq.params.num_speculative_tokens, seq.params.max_tokens - seq.num_output - 1)
            if room <= 0:
                continue
            if seq.params.speculative is SpeculativeMode.NGRAM:
                seq.draft_ids = propose_ngram(seq.token_ids, room)
            else:
                wanted[seq] = room
        if wanted and self.draft is not None:
            # the draft model decodes k tokens for every sequence, batched, off the loop
            proposals = await self._in_worker(self.draft.propose, wanted)
            for seq, draft_ids in proposals.items():
                seq.draft_ids = draft_ids

    def _apply(self, work: SeqWork, rows: np.ndarray) -> None:
        seq = work.seq
        if work.num_logits == 0:  # a prompt chunk; no token yet
            seq.num_computed += len(work.token_ids)
            return
        num_real = len(work.token_ids) - len(seq.draft_ids)
        drafts = list(work.token_ids[num_real:])
        accepted, new_tokens, kept_rows = self._verify(seq, drafts, rows)
        seq.num_computed += num_real + accepted
        if drafts:
            seq.num_drafted += len(drafts)
            seq.num_accepted += accepted
            if accepted < len(drafts):
                self.scheduler.trim(seq, seq.num_computed)
            if self.draft is not None:
                self.draft.accept(seq, seq.num_computed)
        self._emit(seq, new_tokens, kept_rows)

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
                token = int(seq.rng.choice(residual.shape[0], p=residual / residual.sum()))
                return i, drafts[:i] + [token], rows[:i + 1]
        last = sample_rows(rows[len(drafts):len(drafts) + 1], [params], [seq.rng])
        return len(drafts), drafts + [int(last[0])], rows

    def _emit(self, seq: Sequence, tokens: list[int], rows: np.ndarray) -> None:
        now = time.monotonic()
        first = None if seq.first_token_time else now - seq.arrival_time
        inter = None if seq.last_token_time is None else (now - seq.last_token_time) / len(tokens)
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        taken, reason = self._take_until_stop(seq, tokens)
        text = "".join(seq.stream.text.push(self.executor.token_bytes(t)) for t in taken if not self._is_stop_token(seq, t))
        if seq.stream.text.stopped:
            reason = FinishReason.STOP
        if reason is not None:
            text += seq.stream.text.flush()
        logprobs, tops = (), ()
        if seq.params.logprobs and taken:
            chosen, top = logprobs_of(rows[:len(taken)], np.array(taken), seq.params.logprobs)
            logprobs, tops = tuple(chosen), tuple(top)
        if taken or text:
            seq.stream.queue.put_nowait(TokenEvent(tuple(taken), text, logprobs, tops))
        if self.observer is not None:
            self.observer.on_tokens(len(taken), first, inter)
        if reason is not None:
            self._finish(seq, reason)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (
            not seq.params.ignore_eos and self.executor.is_end_of_generation(token))

    def _take_until_stop(self, seq: Sequence, tokens: list[int]) -> tuple[list[int], FinishReason | None]:
        taken: list[int] = []
        for token in tokens:
            seq.token_ids.append(token)
            taken.append(token)
            if self._is_stop_token(seq, token):
                return taken, FinishReason.STOP
            if seq.num_output >= seq.params.max_tokens:
                return taken, FinishReason.LENGTH
        return taken, None

    def _finish(self, seq: Sequence, reason: FinishReason, error: str = "") -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = reason
        # KV is valid only for tokens fed through the model
        seq.num_computed = min(seq.num_computed, len(seq.token_ids) - 1)
        self.scheduler.finish(seq)
        if self.draft is not None:
            self.draft.release(seq)
        usage = Usage(
            prompt_tokens=seq.num_prompt, cached_prompt_tokens=seq.num_cached_prompt,
            completion_tokens=seq.num_output, drafted_tokens=seq.num_drafted, accepted_tokens=seq.num_accepted,
            time_to_first_token_s=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else 0.0,
        )
        seq.stream.queue.put_nowait(FinalEvent(reason, usage, error))
        if self.observer is not None:
            self.observer.on_finish(usage, reason)


class DraftRunner(Protocol):
    """A draft model kept in step with the target's sequences.

    `propose` runs in a worker thread between steps; `accept` and `release`
    only record state on the event loop (the KV fix-ups happen in the next
    `propose`).
    """

    def propose(self, wanted: dict[Sequence, int]) -> dict[Sequence, list[int]]: ...
    def accept(self, seq: Sequence, num_valid: int) -> None: ...
    def release(self, seq: Sequence) -> None: ...
