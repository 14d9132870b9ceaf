"""Constrained decoding and the sampling surface on the real LLM backends
(llama.cpp and modeld's torch runtime, SmolLM2-135M), driven through the
models' own generate(): JSON schema, regex and choice constraints hold,
a constraint the greedy output already meets changes nothing, n-gram
speculation under a constraint gives the same output, penalties and
logit_bias pick what the formula says from the backend's own logits, and
one prompt sent n times is computed once."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re

import jsonschema
import numpy as np
import pytest

from daemon import MODELS
from modeld.backends.errors import InvalidArgument
from modeld.backends.generation.params import (
    ChatMessage, Constraint, ConstraintKind, FinalEvent, FinishReason, GenerateRequest, SamplingParams,
    SpeculativeMode,
)
from modeld.backends.model_config import load_model_toml

BACKENDS = ["llamacpp", "torch"]

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "role": {"enum": ["engineer", "teacher", "doctor", "artist"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "skills", "address"],
    "additionalProperties": False,
}
ASK = (ChatMessage("user", "Describe a fictional person as JSON: name, age, role, skills and address."),)


def _load(name: str):
    if name == "llamacpp":
        from modeld.backends.llamacpp.backend import LlamaCppBackend

        config = load_model_toml("smollm2", MODELS / "smollm2/model.toml")
        options = dataclasses.replace(config.backend_options.llamacpp, n_ctx=8192, n_slots=8)
        config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options,
                                                                                 llamacpp=options))
        return LlamaCppBackend().load(config, MODELS / "smollm2")
    from modeld.backends.torch.backend import TorchBackend

    config = load_model_toml("smollm2-torch", MODELS / "smollm2-torch/model.toml")
    # eager: the same arithmetic as compiled (test_torch_runtime covers both) without the compile wait
    options = dataclasses.replace(config.backend_options.torch, compile=False)
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, torch=options))
    return TorchBackend().load(config, MODELS / "smollm2-torch")


@pytest.fixture(scope="module", params=BACKENDS)
def model(request):
    loaded = _load(request.param)
    loaded.backend_name = request.param
    yield loaded
    loaded.unload()


def _run(model, coro_factory):
    async def main():
        await model.start()
        try:
            return await coro_factory()
        finally:
            await model.stop()
    return asyncio.run(main())


async def _generate(model, messages=ASK, prompt="", token_ids=(), **params):
    request = GenerateRequest("m", prompt=prompt, messages=() if (prompt or token_ids) else messages,
                              token_ids=tuple(token_ids), params=SamplingParams(**params))
    tokens, text = [], ""
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            return tokens, text, event
        tokens.extend(event.token_ids)
        text += event.text
    raise AssertionError("no final event")


def _schema(schema: dict) -> Constraint:
    return Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))


def _check_json_generations(model, count: int) -> None:
    async def go():
        runs = [_generate(model, max_tokens=160, temperature=0.9, seed=seed, constraint=_schema(PERSON))
                for seed in range(count)]
        return await asyncio.gather(*runs)
    for tokens, text, final in _run(model, go):
        assert final.finish_reason is FinishReason.STOP, (final, text)
        jsonschema.validate(json.loads(text), PERSON)


def test_json_schema_generations_validate(model):
    _check_json_generations(model, 5)


@pytest.mark.slow
def test_fifty_json_schema_generations_validate(model):
    _check_json_generations(model, 50)


def test_regex_and_choice_hold(model):
    async def go():
        phone = _generate(model, messages=(ChatMessage("user", "Give me a phone number."),), max_tokens=24,
                          temperature=1.0, seed=1, constraint=Constraint(ConstraintKind.REGEX, r"\(\d{3}\) \d{3}-\d{4}"))
        pick = _generate(model, messages=(ChatMessage("user", "What color is the sky?"),), max_tokens=8,
                         temperature=1.0, seed=2,
                         constraint=Constraint(ConstraintKind.CHOICE, json.dumps(["red", "blue sky", "green"])))
        lark = _generate(model, messages=(ChatMessage("user", "Count."),), max_tokens=24,
                         constraint=Constraint(ConstraintKind.LARK, 'start: NUM ("," NUM)~2\nNUM: /[0-9]{1,3}/'))
        return await asyncio.gather(phone, pick, lark)
    (_, phone, f1), (_, pick, f2), (_, lark, f3) = _run(model, go)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone) and f1.finish_reason is FinishReason.STOP
    assert pick in ("red", "blue sky", "green") and f2.finish_reason is FinishReason.STOP
    assert re.fullmatch(r"[0-9]{1,3}(,[0-9]{1,3}){2}", lark) and f3.finish_reason is FinishReason.STOP


def test_a_constraint_the_greedy_output_meets_changes_nothing(model):
    async def go():
        free = await _generate(model, prompt="1, 2, 3, 4,", max_tokens=16, ignore_eos=True)
        held = await _generate(model, prompt="1, 2, 3, 4,", max_tokens=16, ignore_eos=True,
                               constraint=Constraint(ConstraintKind.REGEX, r"[0-9, ]*"))
        return free, held
    (free_tokens, free_text, _), (held_tokens, held_text, _) = _run(model, go)
    assert re.fullmatch(r"[0-9, ]*", free_text), free_text  # the premise: greedy already meets it
    assert held_tokens == free_tokens and held_text == free_text


def test_ngram_speculation_under_a_constraint_gives_the_same_output(model):
    copy = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string"}}},
            "required": ["items"]}
    ask = (ChatMessage("user", 'Repeat exactly: {"items": ["apple", "banana", "cherry", "apple", "banana", '
                               '"cherry"]}'),)

    async def go():
        plain = await _generate(model, messages=ask, max_tokens=48, constraint=_schema(copy))
        spec = await _generate(model, messages=ask, max_tokens=48, constraint=_schema(copy),
                               speculative=SpeculativeMode.NGRAM, num_speculative_tokens=4)
        return plain, spec
    (plain_tokens, plain_text, _), (spec_tokens, spec_text, final) = _run(model, go)
    assert final.usage.drafted_tokens > 0 and final.usage.accepted_tokens > 0
    assert spec_text == plain_text
    if model.backend_name == "llamacpp":
        # llama.cpp's flash attention gives a token the same logits whatever shares its batch
        assert spec_tokens == plain_tokens
    assert isinstance(json.loads(plain_text)["items"], list)


def test_bad_constraints_are_refused_before_any_token_and_the_model_keeps_serving(model):
    async def go():
        steps = model.loop.step_counts.steps
        for bad in (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "object", "properties": {"a": {"type": "x"}}}'),
                    Constraint(ConstraintKind.REGEX, "(unclosed"),
                    Constraint(ConstraintKind.GBNF, "root ::= missing")):
            with pytest.raises(InvalidArgument, match=bad.kind.value):
                await _generate(model, max_tokens=4, constraint=bad)
        assert model.loop.step_counts.steps == steps  # nothing ran
        return await _generate(model, prompt="The capital of France is", max_tokens=4)
    tokens, _, final = _run(model, go)
    assert len(tokens) == 4 and final.finish_reason is FinishReason.LENGTH


def test_json_object_mode_gives_an_object(model):
    async def go():
        ask = (ChatMessage("user", 'Reply with a JSON object like {"fruit": "apple"} naming one fruit.'),)
        return await _generate(model, messages=ask, max_tokens=64, constraint=Constraint(ConstraintKind.JSON_OBJECT))
    _, text, final = _run(model, go)
    assert final.finish_reason is FinishReason.STOP, text
    assert isinstance(json.loads(text), dict)


def test_special_tokens_and_stop_text_when_asked(model):
    ask = (ChatMessage("user", "Say hello."),)

    async def go():
        plain = await _generate(model, messages=ask, max_tokens=48)
        spelled = await _generate(model, messages=ask, max_tokens=48, skip_special_tokens=False,
                                  include_stop_str_in_output=True)
        return plain, spelled
    (plain_tokens, plain, final), (tokens, spelled, _) = _run(model, go)
    assert tokens == plain_tokens and final.finish_reason is FinishReason.STOP  # ended on its end-of-turn token
    assert "<|im_end|>" not in plain and spelled == plain + "<|im_end|>"


def test_min_tokens_holds_back_a_stop_string_that_comes_too_early(model):
    ask = (ChatMessage("user", "Count from one to twenty, one number per line."),)

    async def go():
        free = await _generate(model, messages=ask, max_tokens=24, ignore_eos=True)
        # a stop string the greedy answer writes within its first tokens
        first = model.detokenize(free[0][:3])
        stop = first.strip()[:4] or first
        early, held = await asyncio.gather(
            _generate(model, messages=ask, max_tokens=24, stop=(stop,), ignore_eos=True),
            _generate(model, messages=ask, max_tokens=24, stop=(stop,), min_tokens=12, ignore_eos=True))
        return free, stop, early, held
    (free_tokens, free_text, _), stop, (early_tokens, early_text, early_final), (tokens, text, final) = _run(model, go)
    assert stop in free_text[:free_text.index(stop) + len(stop)]
    assert early_final.finish_reason is FinishReason.STOP and len(early_tokens) < 12
    assert stop not in early_text and free_text.startswith(early_text)
    # with min_tokens the early stop is text like any other: greedy decoding goes on as without the stop
    assert len(tokens) >= 12 and tokens == free_tokens[:len(tokens)]
    assert stop in text and free_text.startswith(text)
    if final.finish_reason is FinishReason.STOP:  # a later occurrence, past min_tokens, ends it before itself
        assert free_text[len(text):].startswith(stop)


def test_n_identical_prompts_compute_the_prompt_once(model):
    # a prompt no other test sends: nothing of it is cached before
    system = f"Session {model.backend_name}-n4. You are a careful assistant. Answer in one short sentence. " * 3
    messages = (ChatMessage("system", system), ChatMessage("user", "Name a fruit."))

    async def go():
        before = model.loop.step_counts.prompt_tokens
        runs = [_generate(model, messages=messages, max_tokens=8, temperature=0.8, seed=100 + i) for i in range(4)]
        results = await asyncio.gather(*runs)
        computed = model.loop.step_counts.prompt_tokens - before
        again = [await _generate(model, messages=messages, max_tokens=8, temperature=0.8, seed=100 + i)
                 for i in (1, 2)]
        return computed, results, again
    computed, results, again = _run(model, go)
    prompt = results[0][2].usage.prompt_tokens
    assert prompt > 48
    # the first computes it whole; the other three only what the cache cannot share (less than a block)
    assert prompt <= computed < prompt + 3 * 16, (computed, prompt)
    assert sum(r[2].usage.cached_prompt_tokens for r in results) >= 3 * (prompt - 16)
    # seeded choices that took the prompt from the cache repeat, alone or
    # together. (The one that computed it is left out: llama.cpp's kernels
    # for a step of many tokens round differently from a step of a few, so
    # its first logits differ in the last bits from a cache hit's.)
    assert [r[0] for r in results[1:3]] == [a[0] for a in again]


def _raw_logits(model, ids: list[int]) -> np.ndarray:
    """The backend's own logits for the token after ids: one step of its
    runner on KV the schedulers are not using (a free slot / fresh blocks),
    left free again. Only while the model's loop is stopped."""
    from modeld.backends.compute_thread import COMPUTE_THREAD
    from modeld.backends.generation.interface import PagedWork, SlotWork, StepPlan
    from modeld.backends.generation.slots import KvOp, KvOpKind

    def run() -> np.ndarray:
        scheduler, runner = model.scheduler, model.runner
        if model.backend_name == "llamacpp":
            pool = scheduler.slots
            if not pool.free:
                runner.run(StepPlan(pool.evict_lru(), ()))
            slot = pool.free[-1]
            clear = (KvOp(KvOpKind.CLEAR, slot),)
            logits = runner.run(StepPlan(clear, (SlotWork(-1, 0, tuple(ids), 1, 0, slot),)))
            runner.run(StepPlan(clear, ()))
            return logits[0].copy()
        blocks = scheduler.blocks
        blocks.start_sequence(-1)
        assert blocks.grow(-1, len(ids))
        try:
            logits = runner.run(StepPlan((), (PagedWork(-1, 0, tuple(ids), 1, 0, tuple(blocks.tables[-1])),)))
        finally:
            blocks.free_sequence(-1)
        return np.array(logits[0], copy=True)
    return COMPUTE_THREAD.submit(run).result()


@pytest.mark.parametrize("params", [
    dict(frequency_penalty=2.0, presence_penalty=2.0),
    dict(repetition_penalty=1.9),
    dict(logit_bias=((11, 9.0), (28, 7.0)), frequency_penalty=0.5),
    dict(min_tokens=6),  # with the end tokens pushed up by logit_bias, and still held back
])
def test_penalties_pick_what_the_formula_says_from_the_backends_logits(model, params):
    """Greedy under the processors equals, token by token, the argmax of the
    formula applied to the logits the same backend gives unprocessed; and
    the engine's processor gives the formula's logits from them."""
    from modeld.backends.generation.sampling import adjust_logits
    from sampling_reference import reference

    prompt = "1 1 1 1 1 1 1 1"  # the model repeats it unless penalised
    end_ids = model.runner.end_of_generation_ids()
    if "min_tokens" in params:
        params = {**params, "logit_bias": tuple((int(t), 100.0) for t in end_ids)}
    sampling = SamplingParams(max_tokens=6, **params)

    async def go():
        return await _generate(model, prompt=prompt, cache_prompt=False, max_tokens=6, **params)
    got, _, _ = _run(model, go)
    ids = model.tokenize(prompt)
    assert len(got) == 6 if "min_tokens" in params else got  # without it the model may end early
    changed = 0
    for i, token in enumerate(got):
        raw = _raw_logits(model, ids + got[:i])
        expected = reference(raw, sampling, ids, got[:i], list(end_ids))
        assert token == int(np.argmax(expected)), (i, params)
        rows = raw[None].copy()
        adjust_logits(rows, sampling, ids, got[:i], [], end_ids)
        np.testing.assert_allclose(rows[0], expected, rtol=1e-5, atol=1e-4)
        # what the pick would be without the processor under test (min_tokens: with the bias alone)
        without = dataclasses.replace(sampling, min_tokens=0) if sampling.min_tokens else SamplingParams()
        changed += int(np.argmax(reference(raw, without, ids, got[:i], list(end_ids)))) != token
    assert changed, "the processors never changed a choice: the case tests nothing"
