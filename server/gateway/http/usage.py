"""The generated tokens of the OpenAI generations the HTTP front relays,
counted from the answers as they pass (their bytes go to the client as the
node sent them), so that a tenant's tokens_per_minute is charged at the
gateway as its gRPC side charges Generate's tokens."""

from __future__ import annotations

from collections.abc import Callable

import orjson

Charge = Callable[[int], None]


class StreamTokens:
    """One event stream's generated tokens, charged as its events pass.

    An event whose choice carries new output (a completion's `text`; a
    chat delta's `content`, `reasoning_content` or `tool_calls`) counts one
    token per choice: the daemon sends one event per token it emits. An
    event that joins text held back (part of a character, a possible stop
    string) or several speculative tokens counts one for several, so the
    count errs low, never high. A usage event (the client asked for
    stream_options.include_usage) holds the exact number: the difference
    is charged then.
    """

    __slots__ = ("_charge", "counted", "_exact")

    def __init__(self, charge: Charge) -> None:
        self._charge = charge
        self.counted = 0
        self._exact = False

    def feed(self, events: bytes) -> None:
        """Whole events (the relay cuts at blank lines), in stream order."""
        if self._exact:
            return
        count = 0
        for event in events.split(b"\n\n"):
            chunk = _data(event)
            if chunk is None:
                continue
            usage = chunk.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                count = max(0, usage["completion_tokens"] - self.counted)
                self._exact = True
                break
            count += sum(1 for choice in chunk.get("choices") or () if _has_output(choice))
        if count:
            self.counted += count
            self._charge(count)


def charge_answer(body: bytes, charge: Charge) -> None:
    """A whole (non-streamed) completion's generated tokens, from its usage."""
    try:
        usage = orjson.loads(body).get("usage")
    except (orjson.JSONDecodeError, AttributeError):
        return
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        charge(usage["completion_tokens"])


def _data(event: bytes) -> dict | None:
    """An event's `data:` JSON object; None for [DONE], comments and anything else."""
    payload = b"".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))
    if not payload or payload == b"[DONE]":
        return None
    try:
        chunk = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return chunk if isinstance(chunk, dict) else None


def _has_output(choice) -> bool:
    if not isinstance(choice, dict):
        return False
    if choice.get("text"):
        return True
    delta = choice.get("delta")
    return isinstance(delta, dict) and bool(delta.get("content") or delta.get("reasoning_content")
                                            or delta.get("tool_calls"))
