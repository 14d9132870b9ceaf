"""The generation loop over onnxruntime-genai's own engine.

One asyncio task per model. Each step: drop requests whose callers left
while waiting, place waiting ones in batches (batches.py), then on the
compute thread start their og turns, cancel the turns that should end and
run every busy og Engine once (engines.py); back on the event loop, each
token goes to its caller as text that never splits a UTF-8 character, and
stop strings, stop token ids and max_tokens end a sequence at once (og's
turn is cancelled at the next step).

Why not the shared GenerationLoop with a runner per step: that loop owns
sampling and hands the runner KV operations and token positions, while og's
Engine owns its KV cache, scheduling and sampling and returns only tokens.
Driving og below its Engine (a Generator per sequence) would cost the
batched forward pass, which is the reason to use the Engine at all.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

import structlog

from modeld.backends.errors import ErrorKind, Unavailable, Unimplemented
from modeld.backends.generation.detokenize import IncrementalText
from modeld.backends.generation.loop import StepCounts, _Stream
from modeld.backends.generation.params import (
    FinalEvent, FinishReason, GenerateRequest, SpeculativeMode, TokenEvent, Usage,
)
from modeld.backends.generation.sequence import Sequence, SeqStatus
from modeld.backends.onnx_genai.batches import BatchScheduler
from modeld.backends.onnx_genai.engines import EngineEvent, EnginePlan, EngineSet, TurnEnd, TurnStart
from modeld.backends.onnx_genai.vocab import Vocabulary

log = structlog.get_logger("modeld.onnx_genai")

_END_REASONS = {TurnEnd.EOS: FinishReason.STOP, TurnEnd.LENGTH: FinishReason.LENGTH,
                TurnEnd.CANCELLED: FinishReason.CANCELLED, TurnEnd.FAILED: FinishReason.ERROR}


class EngineLoop:
    def __init__(self, engines: EngineSet, scheduler: BatchScheduler, vocab: Vocabulary,
                 worker: ThreadPoolExecutor, eos_token_id: int | None) -> None:
        self.engines = engines
        self.scheduler = scheduler
        self.vocab = vocab
        self.observer = None
        self.step_counts = StepCounts()
        self._worker = worker
        # og ends a turn at EOS without reporting the token; the other
        # backends stream and count it, so it is added back when og's
        # configuration names a single EOS id
        self._eos_token_id = eos_token_id
        self._sequences: dict[int, Sequence] = {}  # seq id -> every request whose og turn is not over
        self._cancel_sent: set[int] = set()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False

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

    # -- requests ----------------------------------------------------------------

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.token_ids:
            return self.vocab.check_token_ids(request.token_ids)
        if request.messages:
            return self.vocab.tokenize(self.vocab.apply_chat_template(request.messages), add_special=False)
        return self.vocab.tokenize(request.prompt)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenEvent | FinalEvent]:
        if self._stopping:
            raise Unavailable("the model is being unloaded; retry")
        request.validate()
        _refuse_unsupported(request)
        seq = Sequence(self.prompt_ids(request), request.params, priority=request.priority)
        seq.stream = _Stream(asyncio.Queue(), IncrementalText(request.params.stop,
                                                              request.params.include_stop_str_in_output))
        self.scheduler.add(seq)
        self._sequences[seq.seq_id] = seq
        self._wakeup.set()
        try:
            while True:
                event = await seq.stream.queue.get()
                yield event
                if isinstance(event, FinalEvent):
                    return
        finally:
            if seq.finish_reason is None:
                seq.is_cancelled = True  # the caller left: the next step ends its og turn
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
            except Exception as exc:  # a bug past the step's own fault handling: end what is in flight
                log.exception("onnx_genai_loop_failed")
                self._abandon_all(exc)
                await asyncio.sleep(0.1)
            finally:
                if self.observer is not None:
                    s = self.scheduler
                    self.observer.on_step(len(s.running), len(s.waiting), s.num_used_cells, s.kv_capacity)

    async def _step(self) -> None:
        for seq in self.scheduler.drop_cancelled_waiting():
            self._sequences.pop(seq.seq_id, None)  # never reached og; its caller is gone
        plan = self._plan()
        if not plan.batches:
            await asyncio.sleep(0.001)  # nothing runnable yet; let callers come and go
            return
        events = await asyncio.get_running_loop().run_in_executor(self._worker, self.engines.step, plan)
        self.scheduler.seal(list(plan.batches))
        self._count(events)
        for event in events:
            self._apply(event)

    def _plan(self) -> EnginePlan:
        starts = tuple(TurnStart(seq.seq_id, seq.slot, tuple(seq.prompt_ids), seq.params)
                       for seq in self.scheduler.admit())
        cancels = tuple(seq.seq_id for seq in self.scheduler.running
                        if (seq.is_cancelled or seq.finish_reason is not None) and seq.seq_id not in self._cancel_sent)
        self._cancel_sent.update(cancels)
        return EnginePlan(starts, cancels, tuple(self.scheduler.busy_batches()))

    def _count(self, events: list[EngineEvent]) -> None:
        """A step runs each busy engine once; an engine's run is one forward pass."""
        by_batch: dict[int, set[int]] = {}
        for event in events:
            seq = self._sequences.get(event.seq_id)
            if event.token_id is not None and seq is not None:
                by_batch.setdefault(seq.slot, set()).add(seq.seq_id)
        counts = self.step_counts
        for seq_ids in by_batch.values():
            counts.steps += 1
            counts.shared_steps += len(seq_ids) >= 2
            counts.most_sequences = max(counts.most_sequences, len(seq_ids))

    # -- results ---------------------------------------------------------------

    def _apply(self, event: EngineEvent) -> None:
        seq = self._sequences.get(event.seq_id)
        if seq is None:
            return
        if event.token_id is not None:
            self._on_token(seq, event.token_id)
        if event.end is not None:
            self._on_turn_end(seq, event)

    def _on_token(self, seq: Sequence, token: int) -> None:
        if seq.finish_reason is not None or seq.is_cancelled:
            return  # og ran one more step before the cancel reached it
        now = time.monotonic()
        first = None if seq.first_token_time else now - seq.arrival_time
        inter = None if seq.last_token_time is None else now - seq.last_token_time
        seq.first_token_time = seq.first_token_time or now
        seq.last_token_time = now
        seq.token_ids.append(token)
        reason = None
        if self._is_stop_token(seq, token):
            reason = FinishReason.STOP
        elif seq.num_output >= seq.params.max_tokens:
            reason = FinishReason.LENGTH
        text = "" if reason is FinishReason.STOP else seq.stream.text.push(self.vocab.token_bytes(token))
        if seq.stream.text.stopped:
            reason = FinishReason.STOP
        if reason is not None:
            text += seq.stream.text.flush()
        seq.stream.queue.put_nowait(TokenEvent((token,), text))
        if self.observer is not None:
            self.observer.on_tokens(1, first, inter)
        if reason is not None:
            self._finish(seq, reason)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return token in seq.params.stop_token_ids or (
            not seq.params.ignore_eos and self.vocab.is_end_of_generation(token))

    def _on_turn_end(self, seq: Sequence, event: EngineEvent) -> None:
        self.scheduler.leave(seq)
        self._sequences.pop(seq.seq_id, None)
        self._cancel_sent.discard(seq.seq_id)
        if seq.finish_reason is not None:
            return  # modeld ended it first (a stop, max_tokens); its final event went out
        if event.end is TurnEnd.EOS and self._eos_token_id is not None and not seq.is_cancelled:
            self._on_token(seq, self._eos_token_id)
            if seq.finish_reason is not None:
                return
        reason = _END_REASONS[event.end]
        self._finish(seq, reason, event.cached_prompt_tokens, event.error or None)

    def _finish(self, seq: Sequence, reason: FinishReason, cached_prompt_tokens: int = 0,
                error: str | None = None) -> None:
        seq.finish_reason = reason
        seq.num_cached_prompt = cached_prompt_tokens
        usage = Usage(
            prompt_tokens=seq.num_prompt, cached_prompt_tokens=seq.num_cached_prompt, completion_tokens=seq.num_output,
            time_to_first_token_s=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else 0.0,
        )
        if reason is not FinishReason.ERROR:
            seq.stream.queue.put_nowait(FinalEvent(reason, usage))
        else:
            message = f"{error}; retry the request" if error else "onnxruntime-genai failed; retry the request"
            seq.stream.queue.put_nowait(FinalEvent(reason, usage, message, ErrorKind.UNAVAILABLE))
        if self.observer is not None and not seq.is_cancelled:
            self.observer.on_finish(usage, reason)
        if seq.status is not SeqStatus.RUNNING:
            self._sequences.pop(seq.seq_id, None)

    def _abandon_all(self, exc: Exception) -> None:
        """Fail every request now; their og turns are cancelled at the next step."""
        for seq in list(self._sequences.values()):
            if seq.finish_reason is None:
                seq.is_cancelled, seq.finish_reason = True, FinishReason.ERROR
                usage = Usage(prompt_tokens=seq.num_prompt, completion_tokens=seq.num_output)
                seq.stream.queue.put_nowait(FinalEvent(FinishReason.ERROR, usage, f"generation failed: {exc}",
                                                       ErrorKind.INTERNAL))


def _refuse_unsupported(request: GenerateRequest) -> None:
    """What og's engine cannot do fails closed here, naming it (the engine's
    capability check refuses speculation and logprobs before this)."""
    params = request.params
    if request.tools or any(m.tool_calls for m in request.messages):
        raise Unimplemented("backend 'onnx-genai' lacks tool calling: onnxruntime-genai's chat template takes "
                            "each message's role and content only; serve the model with llamacpp or torch for tools")
    if params.speculative is not SpeculativeMode.NONE:
        raise Unimplemented("backend 'onnx-genai' lacks speculative_decoding: onnxruntime-genai drafts only for "
                            "models built with an MTP head or a block drafter")
    if params.logprobs:
        raise Unimplemented("backend 'onnx-genai' lacks logprobs: onnxruntime-genai's engine returns tokens, "
                            "not their scores")
    if params.seed is not None and not params.is_greedy:
        raise Unimplemented("backend 'onnx-genai' cannot seed sampling: onnxruntime-genai takes a per-request seed "
                            "only on its continuous-batching engine (PagedAttention models, CUDA or WebGPU); "
                            "leave seed out, or use temperature 0")
    if params.min_p > 0.0:
        raise Unimplemented("backend 'onnx-genai' cannot apply min_p: onnxruntime-genai samples with "
                            "temperature, top_k and top_p only")
    if params.constraint is not None:
        raise Unimplemented(f"backend 'onnx-genai' lacks constrained_decoding ({params.constraint.kind.value}): "
                            "onnxruntime-genai's engine samples inside itself and takes no token mask; "
                            "serve the model with llamacpp or torch for structured output")
    unsupported = [name for name, on in (
        ("presence_penalty", params.presence_penalty != 0.0), ("frequency_penalty", params.frequency_penalty != 0.0),
        ("repetition_penalty", params.repetition_penalty != 1.0), ("logit_bias", bool(params.logit_bias)),
        ("min_tokens", params.min_tokens > 0)) if on]
    if unsupported:
        raise Unimplemented(f"backend 'onnx-genai' cannot apply {', '.join(unsupported)}: onnxruntime-genai's "
                            "engine samples inside itself with temperature, top_k and top_p only")
