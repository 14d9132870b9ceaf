"""Turn token bytes into text deltas that never split a UTF-8 character,
and hold back text that might be the start of a stop string.

Whether special tokens (chat markers, end of turn) have text at all is the
runner's choice per request (skip_special_tokens, see StepExecutor); a stop
string ends the text before it, or after it with include_stop. Below
`min_tokens` pushed tokens no stop string ends it, as vLLM has it: a stop
counts only where it ends in the text of the min_tokens-th token or later.
"""

from __future__ import annotations


class IncrementalText:
    def __init__(self, stop: tuple[str, ...], include_stop: bool = False, min_tokens: int = 0) -> None:
        self._pending = b""  # bytes of an unfinished character
        self._held = ""  # decoded text not yet released (possible stop prefix)
        self._stop = stop
        self._include_stop = include_stop
        self._min_tokens = min_tokens
        self._num_pushed = 0
        # how many leading characters of _held came from tokens before the
        # min_tokens-th: a stop must end after them to count
        self._num_early = 0
        self.stopped = False

    def push(self, piece: bytes) -> str:
        """Add a token's bytes; return the text now safe to send."""
        if self.stopped:
            return ""
        self._num_pushed += 1
        if not self._stop and not self._pending:
            # nearly every token of a request without stop strings: nothing is
            # held back (_held stays empty), so whole characters go out as they are
            try:
                return piece.decode("utf-8")
            except UnicodeDecodeError:
                pass  # part of a character, or invalid bytes: the general path
        self._pending += piece
        text, self._pending = _split_complete(self._pending)
        self._held += text
        if self._num_pushed < self._min_tokens:
            self._num_early = len(self._held)
        return self._release()

    def flush(self) -> str:
        """At the end: whatever is held (a partial character is replaced)."""
        if self.stopped:
            return ""
        tail = self._held + self._pending.decode("utf-8", errors="replace")
        self._held, self._pending = "", b""
        return tail

    def _release(self) -> str:
        if self._num_pushed >= self._min_tokens:
            # the earliest stop wins, whichever stop string it is
            early = self._num_early
            found = [(i, len(stop)) for stop in self._stop
                     if (i := self._held.find(stop, max(0, early - len(stop) + 1))) >= 0]
            if found:
                self.stopped = True
                at, length = min(found)
                out, self._held = self._held[:at + length if self._include_stop else at], ""
                return out
        # the end of the text may begin a stop string: hold it back
        cut = len(self._held) - _longest_stop_prefix_suffix(self._held, self._stop)
        out, self._held = self._held[:cut], self._held[cut:]
        self._num_early = max(0, self._num_early - cut)
        return out


def _split_complete(data: bytes) -> tuple[str, bytes]:
    """Decode the longest prefix of complete UTF-8 characters."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            return data[:cut].decode("utf-8"), data[cut:]
        except UnicodeDecodeError as exc:
            if exc.reason != "unexpected end of data" and cut == len(data):
                # invalid bytes, not an unfinished character: replace them
                return data.decode("utf-8", errors="replace"), b""
    return data.decode("utf-8", errors="replace"), b""


def _longest_stop_prefix_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
