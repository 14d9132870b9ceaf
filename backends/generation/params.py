"""What a generation request asks for and what comes back, as plain data."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum

from modeld.backends.errors import ErrorKind, InvalidArgument


class SpeculativeMode(Enum):
    NONE = "none"
    NGRAM = "ngram"
    DRAFT = "draft"


# Limits on caller-controlled lists and sizes (each refusal names the limit).
MAX_LOGIT_BIAS = 300  # OpenAI's own cap on logit_bias entries
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_N = 16
MAX_CONSTRAINT_BYTES = 64 * 1024
MAX_CHOICES = 256  # strings in a choice constraint


class ConstraintKind(Enum):
    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    REGEX = "regex"
    CHOICE = "choice"  # spec: a JSON array of strings, the output is exactly one of them
    LARK = "lark"
    GBNF = "gbnf"


@dataclass(frozen=True)
class Constraint:
    """What the output must match; compiled by the engine at admission
    (backends/generation/constraints.py), so a bad spec is refused before any
    token is generated."""
    kind: ConstraintKind
    spec: str = ""

    def validate(self) -> None:
        if not isinstance(self.kind, ConstraintKind):
            raise InvalidArgument(f"constraint kind must be one of {[k.value for k in ConstraintKind]}")
        size = len(self.spec.encode("utf-8", "surrogatepass"))
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidArgument(
                f"{self.kind.value} constraint is {size} bytes, over the limit of {MAX_CONSTRAINT_BYTES}")
        if self.kind is not ConstraintKind.JSON_OBJECT and not self.spec:
            raise InvalidArgument(f"{self.kind.value} constraint needs a non-empty spec")


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    ERROR = "error"


MAX_TOOLS = 128  # function definitions in one request
MAX_TOOL_SCHEMA_BYTES = 16 * 1024  # one function's parameters schema, as JSON text
MAX_TOOLS_BYTES = 128 * 1024  # all function definitions together
MAX_TOOL_CALLS = 128  # calls in one assistant message
_TOOL_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")
MAX_TOOL_NAME_CHARS = 64  # OpenAI's own rule for function names
MAX_TEMPLATE_KWARGS = 32  # chat_template_kwargs entries
MAX_TEMPLATE_KWARGS_BYTES = 8 * 1024  # chat_template_kwargs as JSON text
# the variables the server itself gives a chat template: a caller's kwargs may not replace them
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents"})


@dataclass(frozen=True)
class ToolCall:
    """A function call the assistant made: `arguments_json` is the arguments
    object as JSON text, as the model (or the client's history) wrote it."""
    id: str
    name: str
    arguments_json: str = "{}"


@dataclass(frozen=True)
class ToolSpec:
    """A function the model may call; `parameters_json` is the JSON schema of
    its arguments object ("" when it takes none)."""
    name: str
    description: str = ""
    parameters_json: str = ""

    def validate(self, where: str) -> None:
        if not self.name or len(self.name) > MAX_TOOL_NAME_CHARS or set(self.name) - _TOOL_NAME_CHARS:
            raise InvalidArgument(f"{where}.name must be 1 to {MAX_TOOL_NAME_CHARS} letters, digits, '_', '-' or "
                                  f"'.', got {self.name[:80]!r}")
        size = len(self.parameters_json.encode("utf-8", "surrogatepass"))
        if size > MAX_TOOL_SCHEMA_BYTES:
            raise InvalidArgument(f"{where}.parameters is {size} bytes, over the limit of {MAX_TOOL_SCHEMA_BYTES}")


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the function's name, where the client gave it


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
    presence_penalty: float = 0.0  # OpenAI: logit -= presence if the token was generated
    frequency_penalty: float = 0.0  # OpenAI: logit -= frequency * times generated
    repetition_penalty: float = 1.0  # HF/vLLM, over prompt and output: 1 is off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # eos and stop_token_ids are masked until this many tokens
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    constraint: Constraint | None = None

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
            (len(self.stop) <= MAX_STOPS, f"stop takes at most {MAX_STOPS} strings, got {len(self.stop)}"),
            (all(len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"each stop string must be at most {MAX_STOP_CHARS} characters"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative token ids"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 2.0,
             f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias takes at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"),
            (all(t >= 0 for t, _ in self.logit_bias), "logit_bias keys must be non-negative token ids"),
            (all(-100.0 <= b <= 100.0 for _, b in self.logit_bias), "logit_bias values must be in [-100, 100]"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"),
        )
        for ok, message in checks:
            if not ok:
                raise InvalidArgument(message)
        if self.constraint is not None:
            self.constraint.validate()

    @property
    def penalised(self) -> bool:
        """Whether any logit processor beyond temperature/top-k/top-p is on:
        the greedy fast path skips them all when not."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass(frozen=True)
class GenerateRequest:
    model_name: str
    prompt: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    params: SamplingParams = field(default_factory=SamplingParams)
    request_id: str = ""
    priority: int = 0  # 1 most urgent, larger less; 0: the default level, after every explicit one
    tools: tuple[ToolSpec, ...] = ()  # rendered by the chat template (messages only)
    # extra variables for the chat template (add_generation_prompt, enable_thinking, ...), as (name, JSON value)
    chat_template_kwargs: tuple[tuple[str, object], ...] = ()
    # KServe's model_version (a numbered version folder); "" the model's default version
    model_version: str = ""

    def validate(self) -> None:
        given = sum(bool(x) for x in (self.prompt, self.token_ids, self.messages))
        if given != 1:
            raise InvalidArgument("give exactly one of prompt, token_ids or messages")
        if self.priority < 0:
            raise InvalidArgument(f"priority must be >= 0 (1 is the most urgent, 0 the default), got {self.priority}")
        self.params.validate()
        self._validate_tools()
        check_template_kwargs(self.chat_template_kwargs, bool(self.messages))

    def _validate_tools(self) -> None:
        if self.tools and not self.messages:
            raise InvalidArgument("tools need chat messages (the chat template renders them)")
        if len(self.tools) > MAX_TOOLS:
            raise InvalidArgument(f"tools takes at most {MAX_TOOLS} functions, got {len(self.tools)}")
        for i, tool in enumerate(self.tools):
            tool.validate(f"tools[{i}].function")
        total = sum(len(t.parameters_json) + len(t.description) for t in self.tools)
        if total > MAX_TOOLS_BYTES:
            raise InvalidArgument(f"tools hold {total} bytes of definitions, over the limit of {MAX_TOOLS_BYTES}")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise InvalidArgument("tools must have distinct function names")
        call_ids: set[str] = set()
        for i, message in enumerate(self.messages):
            if len(message.tool_calls) > MAX_TOOL_CALLS:
                raise InvalidArgument(f"messages[{i}].tool_calls holds {len(message.tool_calls)} calls, over the "
                                      f"limit of {MAX_TOOL_CALLS}")
            call_ids.update(call.id for call in message.tool_calls)
            if message.role == "tool" and message.tool_call_id not in call_ids:
                raise InvalidArgument(f"messages[{i}].tool_call_id {message.tool_call_id[:64]!r} answers no earlier "
                                      "assistant tool call")


def check_template_kwargs(kwargs: tuple[tuple[str, object], ...], has_messages: bool = True) -> None:
    """chat_template_kwargs: a few variables with names a template can read,
    none the server sets itself, JSON values of bounded size."""
    if not kwargs:
        return
    if not has_messages:
        raise InvalidArgument("chat_template_kwargs need chat messages (the chat template reads them)")
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        raise InvalidArgument(f"chat_template_kwargs takes at most {MAX_TEMPLATE_KWARGS} entries, got {len(kwargs)}")
    for name, _ in kwargs:
        if not isinstance(name, str) or not name.isidentifier() or name.startswith("_"):
            raise InvalidArgument(f"chat_template_kwargs keys must be template variable names (letters, digits, "
                                  f"'_', not starting with '_'), got {str(name)[:64]!r}")
        if name in RESERVED_TEMPLATE_NAMES:
            raise InvalidArgument(f"chat_template_kwargs may not set {name!r}: the server renders "
                                  f"{', '.join(sorted(RESERVED_TEMPLATE_NAMES))} from the request itself")
    try:
        size = len(json.dumps(dict(kwargs), ensure_ascii=False, allow_nan=False).encode("utf-8", "surrogatepass"))
    except (TypeError, ValueError):
        raise InvalidArgument("chat_template_kwargs values must be JSON values") from None
    if size > MAX_TEMPLATE_KWARGS_BYTES:
        raise InvalidArgument(f"chat_template_kwargs is {size} bytes as JSON, over the limit of "
                              f"{MAX_TEMPLATE_KWARGS_BYTES}")


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
