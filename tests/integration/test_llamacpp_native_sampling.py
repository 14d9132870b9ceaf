"""Sampled requests on the llama.cpp backend draw their tokens on llama.cpp's
own sampler chain, in its logits buffer (backends/llamacpp/native_sampling.py),
with the semantics modeld documents: SmolLM2-135M through the model's own
generate(). The context's PickCounts tell how each logit row left it: a
sampled request must have its rows drawn there and none copied out."""

from __future__ import annotations

import asyncio
import dataclasses

import numpy as np
import pytest

from daemon import MODELS
from modeld.backends.generation.params import (
    Constraint, ConstraintKind, FinalEvent, GenerateRequest, SamplingParams,
)
from modeld.backends.generation.sampling import probabilities
from modeld.backends.model_config import load_model_toml

pytest.importorskip("llama_cpp")

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List ten uses for a paperclip.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def model():
    from modeld.backends.llamacpp.backend import LlamaCppBackend

    config = load_model_toml("smollm2", MODELS / "smollm2/model.toml")
    options = dataclasses.replace(config.backend_options.llamacpp, n_ctx=8192, n_slots=8)
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, llamacpp=options))
    loaded = LlamaCppBackend().load(config, MODELS / "smollm2")
    yield loaded
    loaded.unload()


def _run(model, factory):
    async def main():
        await model.start()
        try:
            return await factory()
        finally:
            await model.stop()
    return asyncio.run(main())


async def _generate(model, prompt: str, **params) -> list[int]:
    request = GenerateRequest("m", prompt=prompt, params=SamplingParams(**{"max_tokens": 24, "ignore_eos": True,
                                                                             **params}))
    tokens = []
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            assert not event.error, event.error
            return tokens
        tokens.extend(event.token_ids)
    raise AssertionError("no final event")


def _counted(model, factory):
    """factory's results, and how the context's rows left it meanwhile."""
    picks = model.context.picks
    before = dataclasses.replace(picks)
    got = _run(model, factory)
    return got, {name: getattr(picks, name) - getattr(before, name) for name in ("rows_sampled", "rows_argmax",
                                                                                  "rows_copied", "rows_drawn")}


def _raw_logits(model, ids: list[int]) -> np.ndarray:
    """The model's own logits for the token after ids, from one step of its
    runner on a slot no sequence holds (left empty again); loop stopped."""
    from modeld.backends.compute_thread import COMPUTE_THREAD
    from modeld.backends.generation.interface import SlotWork, StepPlan
    from modeld.backends.generation.slots import KvOp, KvOpKind

    def run() -> np.ndarray:
        pool = model.scheduler.slots
        if not pool.free:
            model.runner.run(StepPlan(pool.evict_lru(), ()))
        slot = pool.free[-1]
        clear = (KvOp(KvOpKind.CLEAR, slot),)
        logits = model.runner.run(StepPlan(clear, (SlotWork(-1, 0, tuple(ids), 1, 0, slot),)))
        model.runner.run(StepPlan(clear, ()))
        return logits[0].copy()
    return COMPUTE_THREAD.submit(run).result()


def test_seeded_sampling_repeats_alone_and_beside_other_requests(model):
    """A seeded request at temperature 1 with top-p 0.95: the same tokens
    alone, again, and sharing its steps with other sampled streams; another
    seed, other tokens. Every row drawn in llama.cpp's buffer, none copied."""
    prompt = PROMPTS[0]
    sampled = dict(temperature=1.0, top_p=0.95)

    async def go():
        alone = await _generate(model, prompt, seed=11, **sampled)
        again = await _generate(model, prompt, seed=11, cache_prompt=False, **sampled)
        together = await asyncio.gather(_generate(model, prompt, seed=11, **sampled),
                                        *(_generate(model, p, seed=i, **sampled) for i, p in enumerate(PROMPTS)))
        other = await _generate(model, prompt, seed=12, **sampled)
        return alone, again, together, other
    (alone, again, together, other), counts = _counted(model, go)
    assert len(alone) == 24 and alone == again == together[0]
    assert other != alone
    assert counts["rows_copied"] == 0, counts
    assert counts["rows_sampled"] == 24 * 8, counts
    assert not model.loop._native, "a finished sequence's sampler chain was not freed"


def test_top_k_1_is_greedy(model):
    async def go():
        greedy = await _generate(model, PROMPTS[1], temperature=0.0)
        sampled = [await _generate(model, PROMPTS[1], temperature=t, top_k=1, seed=s) for t, s in ((1.0, 1), (0.6, 2))]
        return greedy, sampled
    (greedy, sampled), counts = _counted(model, go)
    assert sampled == [greedy, greedy]
    assert counts["rows_sampled"] == 48 and counts["rows_copied"] == 0, counts


def test_a_whole_vocabulary_row_is_drawn_in_the_buffer_as_numpy_draws_it(model):
    """OpenAI's default request (temperature 1, nothing truncated) is drawn
    by draw_whole from llama.cpp's buffer, read in place: none of its rows
    is copied out, and the tokens are those the copied-out numpy path
    draws from the same seed (logprobs make a row be copied). Both compute
    their prompts whole: a prefix-cache hit may round the logits otherwise."""
    def go(**extra):
        async def run():
            return [await _generate(model, p, seed=21 + i, temperature=t, cache_prompt=False, **extra)
                    for i, (p, t) in enumerate(zip(PROMPTS, (1.0, 1.0, 0.7, 1.3)))]
        return run
    in_buffer, counts = _counted(model, go())
    copied, copied_counts = _counted(model, go(logprobs=1))
    assert in_buffer == copied
    assert len({tuple(t) for t in in_buffer}) == len(PROMPTS)
    assert counts["rows_drawn"] == 4 * 24 and counts["rows_copied"] == 0 and counts["rows_sampled"] == 0, counts
    assert copied_counts["rows_copied"] == 4 * 24 and copied_counts["rows_drawn"] == 0, copied_counts


@pytest.mark.parametrize("params", [dict(top_p=0.5), dict(min_p=0.3), dict(top_k=3, temperature=1.5),
                                    dict(temperature=0.8, top_p=0.8, min_p=0.1)])
def test_every_sampled_token_lies_in_the_set_the_reference_logits_allow(model, params):
    """Each token is allowed by sampling.probabilities (numpy's semantics)
    on the model's own logits at its position, recomputed afterwards; the
    thresholds are widened a little, since a recomputed prompt is one batch
    where generation decoded token by token."""
    prompt = PROMPTS[2]
    params = {"temperature": 1.0, **params}

    async def go():
        return await _generate(model, prompt, max_tokens=16, seed=5, **params)
    got, counts = _counted(model, go)
    assert counts["rows_sampled"] == 16 and counts["rows_copied"] == 0, counts
    ids = model.tokenize(prompt)
    strict = SamplingParams(**params)
    loose = dataclasses.replace(strict, top_p=min(1.0, strict.top_p + 0.02), min_p=strict.min_p * 0.9)
    sizes = []
    for i, token in enumerate(got):
        raw = _raw_logits(model, ids + got[:i])
        assert probabilities(raw, loose)[token] > 0, (i, token, params)
        sizes.append(int((probabilities(raw, strict) > 0).sum()))
    assert np.median(sizes) < 50, "the filter allowed most of the vocabulary: the check says little"


@pytest.mark.parametrize("params", [
    dict(frequency_penalty=2.0, presence_penalty=2.0),
    dict(repetition_penalty=1.9),
    dict(logit_bias=((11, 9.0), (28, 7.0)), frequency_penalty=0.5),
    dict(min_tokens=6, max_tokens=8),
])
def test_penalties_on_the_chain_pick_what_numpy_picks(model, params):
    """top_k=1 on the chain draws the argmax of the processed logits: the
    same tokens as greedy decoding through numpy's processors
    (sampling.adjust_logits), and not the unprocessed greedy ones."""
    prompt = "1 1 1 1 1 1 1 1"  # the model repeats it unless penalised
    if "min_tokens" in params:  # the end pushed to the top, and still held back until min_tokens
        params = {**params, "logit_bias": tuple((int(t), 100.0) for t in model.runner.end_of_generation_ids())}

    async def go():
        native = await _generate(model, prompt, temperature=1.0, top_k=1, seed=1, ignore_eos=False, **params)
        numpy_side = await _generate(model, prompt, temperature=0.0, ignore_eos=False, **params)
        plain = await _generate(model, prompt, temperature=0.0, ignore_eos=False,
                                **({"max_tokens": params["max_tokens"]} if "max_tokens" in params else {}))
        return native, numpy_side, plain
    (native, numpy_side, plain), counts = _counted(model, go)
    assert native == numpy_side and native != plain, (native, numpy_side, plain)
    assert counts["rows_sampled"] == len(native), counts
    if "min_tokens" in params:
        assert len(native) == 7 and model.runner.is_end_of_generation(native[-1])


def test_a_step_of_native_numpy_and_greedy_rows(model):
    """Sequences on the three paths share steps: a native sampled one, a
    sampled one with logprobs and a constrained one (numpy: their rows are
    copied out), a greedy one (argmax in the buffer). Each gives the tokens
    it gives alone."""
    requests = [dict(temperature=1.0, top_k=40, seed=3), dict(temperature=1.0, seed=4, logprobs=1),
                dict(temperature=0.9, seed=5, constraint=Constraint(ConstraintKind.REGEX, "[a-z ]{1,80}")),
                dict(temperature=0.0)]
    prompts = PROMPTS

    async def alone():
        return [await _generate(model, p, max_tokens=16, **r) for p, r in zip(prompts, requests)]

    async def together():
        return await asyncio.gather(*(_generate(model, p, max_tokens=16, **r) for p, r in zip(prompts, requests)))
    solo, _ = _counted(model, alone)
    mixed, counts = _counted(model, together)
    assert mixed == solo
    assert counts["rows_sampled"] == 16 and counts["rows_copied"] >= 32, counts
    assert counts["rows_argmax"] >= 16, counts
