"""What a generation request asks for and what comes back, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from modeld.backends.errors import ErrorKind, InvalidArgument


class SpeculativeMode(Enum):
    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int = 0  # top-n alternatives per token; 0: none
    ignore_eos: bool = False
    cache_prompt: bool = True
    speculative: SpeculativeMode = SpeculativeMode.NONE
    num_speculative_tokens: int = 4

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        checks = (
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (0.0 <= self.temperature <= 100.0, f"temperature must be in [0, 100], got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 turns it off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}"),
            (0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (1 <= self.num_speculative_tokens <= 16, f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"),
            (all(s for s in self.stop), "stop strings must not be empty"),
            (self.seed is None or 0 <= self.seed < 2**64, f"seed must be in [0, 2^64), got {self.seed}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgument(message)


@dataclass(frozen=True)
class GenerateRequest:
    model_name: str
    prompt: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    priority: int = 0  # 1 most urgent, larger less; 0: the default level, after every explicit one

    def validate(self) -> None:
        given = sum(bool(x) for x in (self.prompt, self.token_ids, self.messages))
        if given != 1:
            raise InvalidArgument("give exactly one of prompt, token_ids or messages")
        if self.priority < 0:
            raise InvalidArgument(f"priority must be >= 0 (1 is the most urgent, 0 the default), got {self.priority}")
        self.params.validate()


_DEFAULT_RANK = 2**63


def queue_rank(priority: int) -> int:
    """Sort key of a priority level (Triton's convention): 1 goes first,
    larger numbers later, and 0 (not given) after every explicit level."""
    return priority if priority > 0 else _DEFAULT_RANK


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[TokenLogprob, ...] = ()  # the chosen tokens'
    top_logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    completion_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    time_to_first_token_s: float = 0.0


@dataclass(frozen=True)
class FinalEvent:
    finish_reason: FinishReason
    usage: Usage
    error: str = ""
    error_kind: ErrorKind | None = None  # with FinishReason.ERROR: the status the failure maps to
