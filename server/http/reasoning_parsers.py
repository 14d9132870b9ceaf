"""Splitting a thinking model's reasoning from its answer, as it streams.

Models that think in tags write `<think>reasoning</think>answer`. The
parser is fed the text piece by piece and returns `(reasoning, content)`
for each piece, holding back what may still be part of a tag; the answer
goes on to the tool-call parser and the user's `content`, the reasoning to
`reasoning_content`. The newlines a model puts between `</think>` and its
answer are dropped.
"""

from __future__ import annotations

from modeld.backends.model_config import ReasoningParser

OPEN, CLOSE = "<think>", "</think>"


def _held_back(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkParser:
    """`<think>...</think>` at the start of the answer (THINK), or
    reasoning from the first token until `</think>` (DEEPSEEK_R1, whose
    template opens the tag in the prompt); an answer that does not open
    with the tag under THINK is all content."""

    def __init__(self, starts_thinking: bool) -> None:
        self.starts_thinking = starts_thinking
        self.state = "start"
        self.buffer = ""
        self.after_close = False  # content right after </think>: its leading newlines go

    def feed(self, text: str) -> tuple[str, str]:
        self.buffer += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if OPEN.startswith(head) and len(head) < len(OPEN):
                return "", ""  # may still open the tag
            if head.startswith(OPEN):  # (DEEPSEEK_R1 models sometimes write the open tag again)
                self.state, self.buffer = "reasoning", head[len(OPEN):]
            else:
                self.state = "reasoning" if self.starts_thinking else "content"
        if self.state == "reasoning":
            at = self.buffer.find(CLOSE)
            if at < 0:
                keep = _held_back(self.buffer, CLOSE)
                reasoning, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE):]
            self.state, self.after_close = "content", True
        if self.after_close:
            self.buffer = self.buffer.lstrip("\n")
            if not self.buffer:
                return reasoning, ""
            self.after_close = False
        content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is held back, at the end of the answer."""
        text, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_thinking):
            return text, ""  # cut short while thinking
        return "", text.lstrip("\n") if self.after_close else text


def new_reasoning_parser(kind: ReasoningParser) -> ThinkParser:
    return ThinkParser(starts_thinking=kind is ReasoningParser.DEEPSEEK_R1)


def split_reasoning(kind: ReasoningParser, text: str) -> tuple[str, str]:
    """A whole answer's (reasoning, content)."""
    parser = new_reasoning_parser(kind)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return r1 + r2, c1 + c2
