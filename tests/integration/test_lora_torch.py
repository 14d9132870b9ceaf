"""LoRA adapters on the torch runtime against transformers + peft on the
same weights: each adapter alone, and the base with three adapters mixed
in one batch, greedy, token for token (6 prompts x 32 tokens)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from daemon import MODELS
from lora_fixtures import RECIPES, cached_suite
from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams
from modeld.backends.model_config import load_model_toml
from modeld.backends.torch.backend import TorchBackend

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "1, 2, 3, 4,", "Water boils at a temperature of", "SELECT name FROM users WHERE"]
NEW_TOKENS = 32
BASE = "smollm2-torch"


def _base_config(**options):
    config = load_model_toml(BASE, MODELS / BASE / "model.toml")
    # eager: the compiled path is the same code under inductor, and compiling
    # it for every LoRA mix would take most of this module's time here
    torch_options = dataclasses.replace(config.backend_options.torch, compile=False, draft_model="",
                                        **options)
    return dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, torch=torch_options))


@pytest.fixture(scope="module")
def runtime():
    model = TorchBackend().load(_base_config(), MODELS / BASE)
    yield model
    model.unload()


@pytest.fixture(scope="module")
def suite(runtime):
    return cached_suite(PROMPTS, runtime.tokenize, NEW_TOKENS, BASE)


@pytest.fixture(scope="module")
def adapters(runtime, suite):
    loaded = {}
    for recipe in RECIPES:
        config = load_model_toml(recipe.name, suite.root / recipe.name / "model.toml")
        loaded[recipe.name] = runtime.load_adapter(config, suite.root / recipe.name)
    yield loaded
    for adapter in loaded.values():
        adapter.unload()


def _same(tokens: list[int], expected: list[int]) -> bool:
    return len(expected) == NEW_TOKENS and tokens == expected


def _run(runtime, coro_factory):
    async def main():
        await runtime.start()
        try:
            return await coro_factory()
        finally:
            await runtime.stop()
    return asyncio.run(main())


async def _generate(model, prompt: str) -> list[int]:
    tokens: list[int] = []
    request = GenerateRequest("any", prompt=prompt,
                              params=SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, cache_prompt=False))
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            assert not event.error, event.error
            return tokens
        tokens.extend(event.token_ids)
    raise AssertionError("no final event")


def test_the_adapters_change_the_text(suite):
    # a no-op adapter (peft's default B = 0) would make every comparison below vacuous
    for recipe in RECIPES:
        differs = [p for p in PROMPTS if suite.references[recipe.name][p][:8] != suite.references[""][p][:8]]
        assert len(differs) >= 3, recipe.name


# slow: the mixed batch below checks every adapter against peft too, in one run
@pytest.mark.slow
@pytest.mark.parametrize("name", [r.name for r in RECIPES])
def test_each_adapter_alone_matches_peft(runtime, adapters, suite, name):
    async def go():
        return await asyncio.gather(*(_generate(adapters[name], p) for p in PROMPTS))
    for prompt, tokens in zip(PROMPTS, _run(runtime, go)):
        assert _same(tokens, suite.references[name][prompt]), (name, prompt)


def test_base_and_three_adapters_share_each_step(runtime, adapters, suite):
    jobs = [("", runtime)] + [(name, adapter) for name, adapter in adapters.items()]
    before = dataclasses.replace(runtime.loop.step_counts)

    async def go():
        return await asyncio.gather(*(_generate(model, p) for _, model in jobs for p in PROMPTS))
    results = iter(_run(runtime, go))
    for name, _ in jobs:
        for prompt in PROMPTS:
            assert _same(next(results), suite.references[name][prompt]), (name or "base", prompt)
    counts = runtime.loop.step_counts
    # 24 sequences of 4 models: steps carried several models' sequences at once
    assert counts.most_sequences >= 16
    assert counts.shared_steps - before.shared_steps >= NEW_TOKENS - 1
    assert counts.steps - before.steps < 4 * NEW_TOKENS  # not one model's steps after another's


def test_adapter_bytes_are_its_matrices(adapters):
    # A [r, in] and B [out, r] per target module per layer, in float32
    args_dims = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
                 "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
    for recipe in RECIPES:
        per_layer = sum(recipe.rank * (d_in + d_out) for m, (d_in, d_out) in args_dims.items() if m in recipe.targets)
        assert adapters[recipe.name].nbytes == 30 * per_layer * 4, recipe.name
