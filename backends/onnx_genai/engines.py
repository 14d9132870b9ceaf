"""onnxruntime-genai's side of a step: og Engines over one og Model, one
static batch each (see batches.py).

Every og object is created, used and freed on the compute thread only, by
`step`; the event loop sees plain data (TurnStart in, EngineEvent out), so
no og call ever runs beside another. og's Engine.run releases the GIL while
its forward pass runs, so streaming goes on meanwhile.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import numpy as np

from modeld.backends.generation.params import SamplingParams


class TurnEnd(Enum):
    """How og ended a turn (its FinishReason, folded onto modeld's)."""

    EOS = "eos"
    LENGTH = "length"
    CANCELLED = "cancelled"
    FAILED = "failed"


class EngineEvent(NamedTuple):
    seq_id: int
    token_id: int | None  # a generated token, or None
    end: TurnEnd | None = None  # set on the sequence's last event
    error: str = ""
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class TurnStart:
    seq_id: int
    batch: int
    prompt_ids: tuple[int, ...]
    params: SamplingParams


@dataclass(frozen=True)
class EnginePlan:
    starts: tuple[TurnStart, ...]
    cancels: tuple[int, ...]  # seq ids whose turn og should end at this step
    batches: tuple[int, ...]  # engines to run once each, in this order


@dataclass
class _Turn:
    request: object  # og.Request
    turn_id: int
    batch: int


class EngineSet:
    def __init__(self, model, event_capacity: int) -> None:
        self.model = model
        self._capacity = event_capacity
        self._engines: dict[int, tuple[object, object]] = {}  # batch -> (og.Engine, og.EngineEventBuffer)
        self._turns: dict[int, _Turn] = {}  # seq id -> its og request

    def step(self, plan: EnginePlan) -> list[EngineEvent]:
        events = [self._start(start) for start in plan.starts]
        events = [e for e in events if e is not None]
        for seq_id in plan.cancels:
            turn = self._turns.get(seq_id)
            if turn is not None:
                turn.request.cancel_turn(turn.turn_id)
        for batch in plan.batches:
            events.extend(self._run(batch))
        return events

    def _engine(self, batch: int):
        import onnxruntime_genai as og

        if batch not in self._engines:
            engine = og.Engine(self.model)
            self._engines[batch] = engine, engine.create_event_buffer(self._capacity)
        return self._engines[batch]

    def _start(self, start: TurnStart) -> EngineEvent | None:
        import onnxruntime_genai as og

        engine, _ = self._engine(start.batch)
        try:
            options = og.RequestOptions()
            # og sizes the batch's contiguous KV cache by its requests' session lengths
            options.set_max_session_tokens(len(start.prompt_ids) + start.params.max_tokens)
            request = engine.create_request(options=options)
            turn_id = request.begin_turn(np.asarray(start.prompt_ids, dtype=np.int32),
                                         _turn_options(og, request, start.params))
        except Exception as exc:  # og refused this request: it fails alone
            return EngineEvent(start.seq_id, None, TurnEnd.FAILED, f"onnxruntime-genai refused the request: {exc}")
        self._turns[start.seq_id] = _Turn(request, turn_id, start.batch)
        return None

    def _run(self, batch: int) -> list[EngineEvent]:
        import onnxruntime_genai as og

        engine, buffer = self._engine(batch)
        if not engine.has_pending_requests():
            return []
        try:
            og_events = list(engine.run(buffer))
        except Exception as exc:
            # og marks the engine unhealthy after a failed run: fail its batch, use a new engine next time
            return self._fail_batch(batch, f"onnxruntime-genai failed while running the model ({exc})")
        events = []
        for ev in og_events:
            seq_id = self._seq_of(ev.request)
            if seq_id is None:
                continue  # a request already ended and closed
            events.extend(self._translate(og, seq_id, ev))
        if not any(turn.batch == batch for turn in self._turns.values()):
            # A drained engine keeps its batch's KV cache until its next batch
            # (measured: 360 MB for 4 x 2,048 positions, per engine); dropping
            # it frees that now, and a new Engine costs next to nothing.
            del self._engines[batch]
        return events

    def _translate(self, og, seq_id: int, ev) -> list[EngineEvent]:
        flags = int(ev.flags)
        out = []
        if flags & int(og.EngineEventFlags.TOKEN) and ev.token is not None:
            out.append(EngineEvent(seq_id, int(ev.token)))
        if flags & int(og.EngineEventFlags.FAILED):
            out.append(EngineEvent(seq_id, None, TurnEnd.FAILED, f"onnxruntime-genai failed ({ev.error_code.name})"))
            self._close(seq_id)
        elif flags & int(og.EngineEventFlags.TURN_FINISHED):
            out.append(EngineEvent(seq_id, None, _end_of(og, ev.finish_reason),
                                   cached_prompt_tokens=int(ev.usage.cached_prompt_tokens)))
            self._close(seq_id)
        return out

    def _seq_of(self, request) -> int | None:
        # og hands back the same Python object begin_turn was called on
        return next((seq_id for seq_id, turn in self._turns.items() if turn.request is request), None)

    def _close(self, seq_id: int) -> None:
        turn = self._turns.pop(seq_id, None)
        if turn is not None:
            turn.request.close()

    def _fail_batch(self, batch: int, error: str) -> list[EngineEvent]:
        events = []
        for seq_id in [s for s, turn in self._turns.items() if turn.batch == batch]:
            events.append(EngineEvent(seq_id, None, TurnEnd.FAILED, error))
            self._turns.pop(seq_id)  # their engine is gone; closing into it could fail again
        self._engines.pop(batch, None)
        return events

    def close(self) -> None:
        for seq_id in list(self._turns):
            self._close(seq_id)
        self._engines.clear()
        self.model = None


def _turn_options(og, request, params: SamplingParams):
    options = og.TurnOptions(request)
    options.set_max_generated_tokens(params.max_tokens)
    if params.ignore_eos:
        # og masks end-of-sequence until this many tokens are out; other
        # backends emit it and go on, so the two part ways where EOS was the pick
        options.set_min_generated_tokens(params.max_tokens)
    options.set_do_sample(not params.is_greedy)
    if not params.is_greedy:
        options.set_temperature(params.temperature)
        options.set_top_k(params.top_k)  # 0: off, as in modeld
        options.set_top_p(params.top_p)
    return options


def _end_of(og, reason) -> TurnEnd:
    return {
        og.FinishReason.EOS: TurnEnd.EOS,
        og.FinishReason.STOP_STRING: TurnEnd.EOS,  # not used: modeld matches stop strings itself
        og.FinishReason.MAX_GENERATED_TOKENS: TurnEnd.LENGTH,
        og.FinishReason.MAX_SESSION_TOKENS: TurnEnd.LENGTH,
        og.FinishReason.CANCELLED: TurnEnd.CANCELLED,
    }.get(reason, TurnEnd.FAILED)
