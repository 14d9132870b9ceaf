"""Events a consumer takes on the step thread, not on the event loop.

GenerationLoop hands a sequence's events to its stream's asyncio queue on
the event loop: one wake-up of the loop a step, then one task wake-up and
one async-generator hop per stream. A worker process only forwards those
events to the daemon, so it takes them where they are made instead: the
task that iterates `GenerationLoop.generate` sets STEP_SINK to
`(sink, key)` first, and the loop then calls `sink.event(key, event)` on
the step thread for each of that sequence's events and `sink.flush()`
once the step has given all of its own, and its `generate` yields
nothing: it returns once the final event is out. Cancelling still works
by leaving the generator, as for any stream.

An observer that says `on_step_thread = True` is likewise called on the
step thread and flushed with the sinks, so a step that only reports
figures wakes no event loop either. A loop that does both says
`takes_step_sinks = True`; other loops (onnxruntime-genai's) yield their
events and call their observer as before.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Protocol

from modeld.backends.generation.params import FinalEvent, TokenEvent


class StepSink(Protocol):
    """Takes events on the step thread (and, when a failing loop abandons
    its requests, on the event loop): implementations must be thread-safe."""

    def event(self, key: object, event: TokenEvent | FinalEvent) -> None:
        """Queue one event of the sequence the key names."""

    def flush(self) -> None:
        """Send what was queued; called once a step, after its events."""


# (sink, key) for the generation the current task starts; None: the stream's queue
STEP_SINK: ContextVar[tuple[StepSink, object] | None] = ContextVar("modeld_step_sink", default=None)
