"""The logit processors (sampling.adjust_logits) against the formulas written
out token by token, the limits on every new SamplingParams field, stop
strings kept with include_stop_str_in_output, and the constraint compiler's
refusals."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.detokenize import IncrementalText
from modeld.backends.generation.params import (
    MAX_CONSTRAINT_BYTES, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOPS, Constraint, ConstraintKind, SamplingParams,
)
from modeld.backends.generation.sampling import adjust_logits, needs_adjusting
from sampling_reference import reference

VOCAB = 257


def _case(seed: int):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, size=VOCAB).astype(np.float32)
    prompt = rng.integers(0, VOCAB, size=12).tolist()
    output = rng.integers(0, 40, size=20).tolist()  # repeats, so counts above 1
    return logits, prompt, output


@pytest.mark.parametrize("params", [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=1.5),
    SamplingParams(frequency_penalty=-0.4, presence_penalty=0.9),
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.8),
    SamplingParams(logit_bias=((5, 100.0), (7, -100.0), (3, 2.5))),
    SamplingParams(max_tokens=64, min_tokens=30, stop_token_ids=(9,)),
    SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.5, logit_bias=((1, 3.0),),
                   min_tokens=25, max_tokens=64),
])
def test_processors_follow_the_formula(params):
    for seed in range(3):
        logits, prompt, output = _case(seed)
        rows = logits[None].copy()
        assert needs_adjusting(params, len(output))
        adjust_logits(rows, params, prompt, output, [], np.array([0, 2]))
        np.testing.assert_allclose(rows[0], reference(logits, params, prompt, output, [0, 2]), rtol=1e-5, atol=1e-4)


def test_draft_rows_count_the_drafts_before_them():
    logits, prompt, output = _case(7)
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=1.4)
    drafts = [3, 3, 200]
    rows = np.stack([logits] * 4)
    adjust_logits(rows, params, prompt, output, drafts, np.array([0]))
    for i in range(4):
        expected = reference(logits, params, prompt, output + drafts[:i], [0])
        np.testing.assert_allclose(rows[i], expected, rtol=1e-5, atol=1e-4)


def test_defaults_leave_the_fast_path_alone():
    assert not needs_adjusting(SamplingParams(), 0)
    assert needs_adjusting(SamplingParams(max_tokens=8, min_tokens=2), 1)
    assert not needs_adjusting(SamplingParams(max_tokens=8, min_tokens=2), 2)


@pytest.mark.parametrize("params, named", [
    (SamplingParams(presence_penalty=2.5), "presence_penalty"),
    (SamplingParams(frequency_penalty=-3), "frequency_penalty"),
    (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
    (SamplingParams(repetition_penalty=2.5), "repetition_penalty"),
    (SamplingParams(logit_bias=tuple((i, 1.0) for i in range(MAX_LOGIT_BIAS + 1))), str(MAX_LOGIT_BIAS)),
    (SamplingParams(logit_bias=((1, 101.0),)), "logit_bias"),
    (SamplingParams(max_tokens=4, min_tokens=5), "min_tokens"),
    (SamplingParams(stop=tuple(f"s{i}" for i in range(MAX_STOPS + 1))), str(MAX_STOPS)),
    (SamplingParams(stop=("x" * (MAX_STOP_CHARS + 1),)), str(MAX_STOP_CHARS)),
    (SamplingParams(stop_token_ids=tuple(range(65))), "stop_token_ids"),
    (SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "a" * (MAX_CONSTRAINT_BYTES + 1))),
     str(MAX_CONSTRAINT_BYTES)),
    (SamplingParams(constraint=Constraint(ConstraintKind.REGEX, "")), "regex"),
])
def test_limits_name_the_field(params, named):
    with pytest.raises(InvalidArgument, match=named):
        params.validate()


def test_a_stop_string_is_kept_when_asked():
    text = IncrementalText(("END",), include_stop=True)
    assert text.push(b"abc EN") == "abc "
    assert text.push(b"D more") == "END"
    assert text.stopped
    plain = IncrementalText(("END",))
    assert plain.push(b"abc END more") == "abc "


@pytest.fixture(scope="module")
def compiler():
    """A compiler over a real vocabulary: SmolLM2's GGUF through llama.cpp."""
    from daemon import MODELS
    from modeld.backends.generation.constraints import ConstraintCompiler
    from modeld.backends.llamacpp.context import LlamaModel

    model = LlamaModel(MODELS / "smollm2/model.gguf")
    yield ConstraintCompiler(model.constraint_tokenizer, model.vocab_size)
    model.close()


@pytest.mark.parametrize("constraint, says", [
    (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "not valid JSON"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "nope"}}}'), "nope"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string", "format": "made-up"}'), "made-up"),
    (Constraint(ConstraintKind.REGEX, "a("), "unclosed group"),
    (Constraint(ConstraintKind.REGEX, "[a&&b]"), "can match nothing"),
    (Constraint(ConstraintKind.CHOICE, '["a", 3]'), "array of non-empty strings"),
    (Constraint(ConstraintKind.LARK, "start: missing_rule"), "missing_rule"),
    (Constraint(ConstraintKind.GBNF, 'root ::= "unterminated'), "gbnf"),
])
def test_bad_constraints_are_refused_with_the_reason(compiler, constraint, says):
    with pytest.raises(InvalidArgument, match=says):
        asyncio.run(compiler.matcher(constraint))
    with pytest.raises(InvalidArgument, match=says):  # from the cache, the same answer
        asyncio.run(compiler.matcher(constraint))


def test_constraints_compile_once_and_openai_wrapper_is_unwrapped(compiler):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    wrapped = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps({"name": "thing", "strict": True, "schema": schema}))
    compiles = compiler.stats.compiles
    first = asyncio.run(compiler.matcher(wrapped))
    second = asyncio.run(compiler.matcher(wrapped))
    assert compiler.stats.compiles == compiles + 1
    tokenizer = compiler.tokenizer()
    ids = tokenizer.tokenize_str('{"a": 12}')
    assert first.consume_tokens(ids) and first.is_accepting()
    assert second.try_consume_tokens(tokenizer.tokenize_str('{"b"')) < 2  # its own state, and the schema holds


def test_every_new_field_crosses_the_worker_boundary():
    """A request reaches a worker process as a frame (server/workers/frames.py)."""
    from modeld.backends.generation.params import GenerateRequest
    from modeld.server.workers.frames import decode_bytes, encode_bytes

    params = SamplingParams(max_tokens=40, presence_penalty=0.5, frequency_penalty=-0.25, repetition_penalty=1.1,
                            logit_bias=((3, -2.0), (9, 1.5)), min_tokens=4, skip_special_tokens=False,
                            include_stop_str_in_output=True, stop_token_ids=(7,),
                            constraint=Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object"}'))
    request = GenerateRequest("m", prompt="hi", params=params)
    message, used = decode_bytes(encode_bytes(("generate", request)))
    assert message == ("generate", request) and message[1].params.constraint.kind is ConstraintKind.JSON_SCHEMA
