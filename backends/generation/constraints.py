"""Constrained decoding: a grammar per request, a token mask per step.

The grammar engine is llguidance (Microsoft's guidance project; the engine
llama.cpp's `--grammar`/`json_schema` and vLLM's `guidance` backend use):
Rust, CPU-native, a pip wheel, and it computes a mask over the 49k-token
vocabulary in tens of microseconds without a precompiled automaton, so a
new schema costs about a millisecond rather than the seconds an
ahead-of-time compiler spends. It takes JSON schema, regex, Lark and (via
its converter) GBNF, and computes the masks of a whole batch on its own
threads with the GIL released (`fill_next_token_bitmask_par`), so a step's
masks do not serialise on Python.

A Constraint is compiled once per (kind, spec) per tokenizer, at admission:
a bad schema, grammar or regex is refused with InvalidArgument before any
token is generated. Compilation runs off the event loop under a timeout;
llguidance's parser limits bound the work a grammar can ask of each step.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import Constraint, ConstraintKind

# A grammar still compiling after this is refused: a request must not hold
# admission for longer, and the cache keeps the ones that made it.
COMPILE_TIMEOUT_S = 10.0
CACHE_ENTRIES = 128
# llguidance's thread pool only where cores are left over beside the model's
# own threads: on 2 cores its workers, spinning after each batch, stalled
# llama.cpp's barrier-synchronised threads (8 constrained streams ran at a
# fraction of the unconstrained rate while the masks themselves took 2 ms a
# step). Below this, a step's masks are computed one matcher after another
# on the step's thread (each call still releases the GIL).
PARALLEL_MIN_CPUS = 8
_MAX_ERROR_CHARS = 400

# Compiles happen off the event loop; two at once keeps one slow grammar
# from blocking every other request's.
_COMPILE_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="modeld-grammar")


def _llg():
    import llguidance

    return llguidance


def _limits():
    # verbose errors would echo parser state, not something a caller can act on
    return _llg().LLParserLimits(verbose_errors=False)


def _grammar(constraint: Constraint) -> str:
    """llguidance's grammar text for a constraint; InvalidArgument when the
    spec is not even well-formed."""
    llg = _llg()
    kind, spec = constraint.kind, constraint.spec
    if kind is ConstraintKind.JSON_OBJECT:
        return llg.LLMatcher.grammar_from_json_schema(spec or '{"type": "object"}')
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"json_schema constraint is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidArgument("json_schema constraint must be a JSON object (a schema)")
        if isinstance(schema, dict) and "schema" in schema and "name" in schema and "type" not in schema:
            schema = schema["schema"]  # OpenAI's response_format.json_schema wrapper: {"name", "schema", "strict"}
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        return llg.LLMatcher.grammar_from_json_schema(json.dumps(schema))
    if kind is ConstraintKind.REGEX:
        # \d as [0-9]: Rust's Unicode \d lets a small model fill a phone number with
        # segmented-display digits; JSON schema patterns get the same ASCII reading
        return llg.LLMatcher.grammar_from_lark("start: /" + llg.regex_to_lark(spec, "d") + "/")
    if kind is ConstraintKind.CHOICE:
        try:
            choices = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise InvalidArgument(f"choice constraint must be a JSON array of strings: {exc}") from None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidArgument("choice constraint must be a non-empty JSON array of non-empty strings")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    if kind is ConstraintKind.LARK:
        return llg.LLMatcher.grammar_from_lark(spec)
    if kind is ConstraintKind.GBNF:
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            lark = any_to_lark(spec)
        except Exception as exc:  # the converter raises its own parse errors
            raise InvalidArgument(f"gbnf constraint does not parse: {_short(str(exc))}") from None
        return llg.LLMatcher.grammar_from_lark(lark)
    raise InvalidArgument(f"constraint kind {kind!r} is not supported")


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= _MAX_ERROR_CHARS else message[:_MAX_ERROR_CHARS] + "..."


@dataclass
class MaskStats:
    """Where constrained steps spend their time (read by tests and the bench)."""

    steps: int = 0  # steps that computed at least one mask
    rows: int = 0  # masks computed
    mask_s: float = 0.0  # computing masks (llguidance, all rows of a step at once)
    apply_s: float = 0.0  # applying them to the logits
    compiles: int = 0  # grammars compiled (cache misses)
    compile_s: float = 0.0
    cache_hits: int = 0


class ConstraintCompiler:
    """Compiles Constraints for one vocabulary, caches them, and computes
    the batch's token masks.

    `make_tokenizer` builds llguidance's LLTokenizer from the runner's
    vocabulary (about half a second for 49k tokens): called once, at the
    first constrained request, so models that never see one never pay it.
    """

    def __init__(self, make_tokenizer: Callable[[], Any], vocab_size: int,
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self._make_tokenizer = make_tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[ConstraintKind, str], Any] = OrderedDict()  # -> matcher or error text
        self._cache_lock = threading.Lock()
        self._executor = None
        self.parallel = (os.cpu_count() or 1) >= PARALLEL_MIN_CPUS
        self.stats = MaskStats()

    @property
    def words(self) -> int:
        """int32 words in one row's bitmask (the grammar's vocabulary, which
        may be shorter than the model's padded one)."""
        return (self.tokenizer().vocab_size + 31) // 32

    def tokenizer(self):
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._make_tokenizer()
            return self._tokenizer

    # -- admission ---------------------------------------------------------------

    async def matcher(self, constraint: Constraint):
        """A fresh matcher for the constraint, compiled off the event loop;
        InvalidArgument when it does not compile or takes too long."""
        key = (constraint.kind, constraint.spec)
        with self._cache_lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
        if cached is None:
            loop = asyncio.get_running_loop()
            # the tokenizer is built once and is not part of a grammar's budget
            await loop.run_in_executor(_COMPILE_POOL, self.tokenizer)
            future = loop.run_in_executor(_COMPILE_POOL, self._compile, constraint)
            try:
                cached = await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
            except asyncio.TimeoutError:
                # the compile goes on in its thread and is cached when it ends
                raise InvalidArgument(f"{constraint.kind.value} constraint took longer than {self.timeout_s:g} s "
                                      "to compile; simplify it") from None
        if isinstance(cached, str):
            raise InvalidArgument(cached)
        return cached.deep_copy()

    def compile_now(self, constraint: Constraint):
        """The blocking form of `matcher` (benchmarks and tools)."""
        key = (constraint.kind, constraint.spec)
        with self._cache_lock:
            cached = self._cache.get(key)
        if cached is None:
            self.tokenizer()
            cached = self._compile(constraint)
        else:
            self.stats.cache_hits += 1
        if isinstance(cached, str):
            raise InvalidArgument(cached)
        return cached.deep_copy()

    def _compile(self, constraint: Constraint):
        """A prototype matcher, or the error text; cached either way, so a
        bad schema sent again is refused at once."""
        llg = _llg()
        started = time.perf_counter()
        try:
            grammar = _grammar(constraint)
            result = self._build(llg, grammar, constraint.kind)
        except InvalidArgument as exc:
            result = str(exc)
        except ValueError as exc:  # llguidance's own for malformed input
            result = f"{constraint.kind.value} constraint does not compile: {_short(str(exc))}"
        self.stats.compiles += 1
        self.stats.compile_s += time.perf_counter() - started
        key = (constraint.kind, constraint.spec)
        with self._cache_lock:
            self._cache[key] = result
            self._cache.move_to_end(key)
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return result

    def _build(self, llg, grammar: str, kind: ConstraintKind):
        tokenizer = self.tokenizer()
        limits = _limits()
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=limits)
        if is_error:
            return f"{kind.value} constraint does not compile: {_short(messages[0] if messages else 'invalid')}"
        matcher = llg.LLMatcher(tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            return f"{kind.value} constraint does not compile: {_short(matcher.get_error())}"
        # a grammar that allows no first token can never be satisfied (a regex that matches nothing)
        mask = np.zeros((1, self.words), dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        if matcher.is_error() or not mask.any():
            return f"{kind.value} constraint can match nothing; check it"
        return matcher

    # -- steps -------------------------------------------------------------------

    def fill_masks(self, items: list[tuple[Any, int, list[int]]], num_rows: int) -> np.ndarray:
        """Bitmasks [num_rows, words] for (matcher, first row, draft tokens):
        the row for the next token, then one after each draft token in turn
        (rows past a draft the grammar refuses are left all-allowed: the
        loop rejects that draft first and never samples them). All rows of
        the step in one call, on llguidance's threads."""
        masks = np.full((num_rows, self.words), -1, dtype=np.int32)
        started = time.perf_counter()
        if self.parallel:
            if self._executor is None:
                self._executor = _llg().LLExecutor()
            if any(drafts for _, _, drafts in items):
                self._executor.unsafe_compute_mask_ptr_with_draft_token(
                    items, masks.ctypes.data, self.words * 4, num_rows)
            else:
                self._executor.unsafe_compute_mask_ptr([(m, k) for m, k, _ in items], masks.ctypes.data,
                                                       self.words * 4, num_rows)
        else:
            for matcher, first, drafts in items:
                _fill_one(matcher, masks, first, drafts)
        self.stats.mask_s += time.perf_counter() - started
        self.stats.steps += 1
        self.stats.rows += num_rows
        return masks


def _fill_one(matcher, masks: np.ndarray, first: int, drafts: list[int]) -> None:
    """One matcher's rows: its next token's mask, then after each draft the
    grammar allows, the next; the matcher is rolled back after."""
    row_bytes = masks.shape[1] * 4
    consumed = 0
    for i in range(len(drafts) + 1):
        matcher.unsafe_compute_mask_ptr(masks[first + i].ctypes.data, row_bytes)
        if i == len(drafts):
            break
        draft = drafts[i]
        word = draft // 32
        if word >= masks.shape[1] or not (int(masks[first + i, word]) >> (draft % 32)) & 1:
            break  # refused: the loop rejects this draft and never reads the rows after it
        if not matcher.consume_token(draft):
            break
        consumed += 1
        if matcher.is_stopped():
            break
    if consumed:
        matcher.rollback(consumed)


def allowed(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """[rows, words] int32 bitmasks -> [rows, vocab] bool (bit i of word w is
    token 32w + i); logits past the grammar's vocabulary are never allowed."""
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little").view(bool)
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
