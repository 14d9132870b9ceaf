"""GGUF LoRA adapters on the llama.cpp backend against llama-cpp-python's
own `Llama(model_path=base, lora_path=adapter)`: each adapter alone, the
base and both adapters interleaved, the prefix cache per adapter, and bad
adapters refused at load (6 prompts x 32 tokens, greedy, token for token).

In-process, on the backend's model object, for speed; the engine's part
(budget, base first, refusals over gRPC) is test_lora_llamacpp_daemon.py.

Each comparison runs one sequence per adapter set at a time, as the
reference does: llama.cpp multiplies an adapter's f32 matrices with
tinyBLAS for two or more rows and with a plain dot product for one, which
round differently, so two sequences of one adapter decoded together can
part from a lone run's greedy text after a near tie. Sets never share a
llama_decode, so a base and an adapter sequence running together each
decode as alone.
"""

from __future__ import annotations

import asyncio
import dataclasses
import shutil

import pytest

from daemon import MODELS
from lora_gguf_fixtures import ADAPTER_FILE, RECIPES, cached_gguf_suite, write_adapter_toml, write_lora_gguf
from modeld.backends.errors import FailedPrecondition, InvalidArgument
from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams
from modeld.backends.llamacpp.backend import LlamaCppBackend
from modeld.backends.model_config import load_model_toml

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "1, 2, 3, 4,", "Water boils at a temperature of", "SELECT name FROM users WHERE"]
NEW_TOKENS = 32
BASE = "smollm2"
NAMES = [r.name for r in RECIPES]


def _base_config():
    config = load_model_toml(BASE, MODELS / BASE / "model.toml")
    options = dataclasses.replace(config.backend_options.llamacpp, draft_model="", draft_path="", n_ctx=8192,
                                  n_slots=4)
    return dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, llamacpp=options))


@pytest.fixture(scope="module")
def suite():
    return cached_gguf_suite(PROMPTS, NEW_TOKENS, BASE)


@pytest.fixture(scope="module")
def runtime():
    model = LlamaCppBackend().load(_base_config(), MODELS / BASE)
    yield model
    model.unload()


def _load(runtime, name: str, folder):
    return runtime.load_adapter(load_model_toml(name, folder / "model.toml"), folder)


@pytest.fixture(scope="module")
def adapters(runtime, suite):
    loaded = {name: _load(runtime, name, suite.root / name) for name in NAMES}
    yield loaded
    for adapter in loaded.values():
        adapter.unload()


@pytest.fixture(scope="module")
def models(runtime, adapters):
    return {"": runtime, **adapters}


def _run(runtime, coro_factory):
    async def main():
        await runtime.start()
        try:
            return await coro_factory()
        finally:
            await runtime.stop()
    return asyncio.run(main())


async def _generate(model, prompt: str, cache_prompt: bool = False, new_tokens: int = NEW_TOKENS):
    tokens: list[int] = []
    request = GenerateRequest("any", prompt=prompt,
                              params=SamplingParams(max_tokens=new_tokens, ignore_eos=True, cache_prompt=cache_prompt))
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            assert not event.error, event.error
            return tokens, event.usage
        tokens.extend(event.token_ids)
    raise AssertionError("no final event")


def test_the_adapters_change_the_text(suite):
    # an adapter that changed nothing would make every comparison below vacuous
    for name in NAMES:
        differs = [p for p in PROMPTS if suite.references[name][p][:8] != suite.references[""][p][:8]]
        assert len(differs) >= 3, name
        assert all(len(suite.references[name][p]) == NEW_TOKENS for p in PROMPTS)


@pytest.mark.parametrize("name", NAMES)
def test_each_adapter_matches_llama_cpp_python_with_lora_path(runtime, models, suite, name):
    async def go():
        return [(await _generate(models[name], p))[0] for p in PROMPTS]
    for prompt, tokens in zip(PROMPTS, _run(runtime, go)):
        assert tokens == suite.references[name][prompt], (name, prompt)


def test_base_and_adapters_interleaved_each_get_their_own_tokens(runtime, models, suite):
    switches = runtime.adapters.num_switches
    steps = runtime.loop.step_counts.steps

    async def go():
        out = []
        for prompt in PROMPTS:  # the base and both adapters at once, one prompt each
            out.append(await asyncio.gather(*(_generate(models[name], prompt) for name in ("", *NAMES))))
        return out
    for prompt, results in zip(PROMPTS, _run(runtime, go)):
        for name, (tokens, _) in zip(("", *NAMES), results):
            assert tokens == suite.references[name][prompt], (name or "base", prompt)
    # the three sets took turns, step by step, on the one context
    assert runtime.adapters.num_switches - switches >= 2 * len(PROMPTS) * NEW_TOKENS
    assert runtime.loop.step_counts.steps - steps >= 3 * len(PROMPTS) * NEW_TOKENS


def test_a_prompt_cached_under_one_adapter_serves_that_adapter_only(runtime, models, suite):
    shared = "You are a careful assistant who answers in full sentences. " * 6
    prompt = shared + PROMPTS[0]
    first, other = NAMES

    async def go():
        cold = {name: await _generate(models[name], prompt) for name in ("", *NAMES)}
        await _generate(models[first], prompt, cache_prompt=True)  # leaves the prompt cached under `first`
        base = await _generate(models[""], prompt, cache_prompt=True)
        second = await _generate(models[other], prompt, cache_prompt=True)
        again = await _generate(models[first], prompt, cache_prompt=True)
        return cold, base, second, again
    cold, base, second, again = _run(runtime, go)
    assert base[1].cached_prompt_tokens == 0 and base[0] == cold[""][0]
    assert second[1].cached_prompt_tokens == 0 and second[0] == cold[other][0]
    assert again[1].cached_prompt_tokens >= 60 and again[0] == cold[first][0]
    assert cold[first][0] != cold[""][0]


def test_an_adapters_bytes_are_its_matrices(adapters):
    # f32 lora_a [576, r] and lora_b [r, out] per adapted weight, 30 layers
    widths = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
              "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
    for recipe in RECIPES:
        per_layer = sum(recipe.rank * (d_in + d_out) for m, (d_in, d_out) in widths.items() if m in recipe.targets)
        assert adapters[recipe.name].nbytes == 30 * per_layer * 4, recipe.name


# -- bad adapters --------------------------------------------------------------------


def _bad_folder(tmp_path, suite, case: str):
    folder = tmp_path / case.replace(" ", "-")
    folder.mkdir()
    write_adapter_toml(folder, BASE)
    good = suite.adapter_file(NAMES[0]).read_bytes()
    target = folder / ADAPTER_FILE
    if case == "corrupt":
        target.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    elif case == "truncated":
        target.write_bytes(good[:len(good) // 2])
    elif case == "another architecture":
        write_lora_gguf(target, "qwen2", {"blk.0.attn_q.weight": (576, 8, 576)})
    elif case == "another hidden size":
        write_lora_gguf(target, "llama", {"blk.0.attn_q.weight": (640, 8, 640)})
    elif case == "a layer the base lacks":
        write_lora_gguf(target, "llama", {"blk.30.attn_q.weight": (576, 8, 576)})
    elif case == "rank above the limit":
        write_lora_gguf(target, "llama", {"blk.0.attn_q.weight": (576, 80, 576)})  # max_lora_rank: 64
    elif case == "a full model":
        target.symlink_to((MODELS / BASE / "model.gguf").resolve())
    elif case == "a PEFT adapter":
        shutil.copytree(suite.root / "peft" / NAMES[0], folder, dirs_exist_ok=True)
        (folder / "model.toml").write_text(f'format = "lora"\nbase = "{BASE}"\n')  # adapter_model.safetensors
        target.unlink(missing_ok=True)
    return folder


@pytest.mark.parametrize("case, error, reason", [
    ("corrupt", InvalidArgument, "corrupt or truncated"),
    ("truncated", InvalidArgument, "truncated"),
    ("another architecture", InvalidArgument, "architecture 'qwen2'"),
    ("another hidden size", InvalidArgument, "another hidden size"),
    ("a layer the base lacks", InvalidArgument, "blk.30.attn_q.weight"),
    ("rank above the limit", InvalidArgument, "max_lora_rank"),
    ("a full model", InvalidArgument, "not a LoRA adapter"),
    ("a PEFT adapter", FailedPrecondition, "llamacpp backend applies GGUF LoRA adapters"),
])
def test_bad_adapters_are_refused_naming_the_adapter_and_the_base_keeps_serving(runtime, models, suite, tmp_path,
                                                                                 case, error, reason):
    folder = _bad_folder(tmp_path, suite, case)
    handles = dict(runtime.adapters.handles)
    with pytest.raises(error) as info:
        _load(runtime, "bad-adapter", folder)
    message = str(info.value)
    assert "bad-adapter" in message and reason in message, message
    assert str(tmp_path) not in message  # a file's name, never the machine's path to it
    assert runtime.adapters.handles == handles

    async def go():
        return [(await _generate(models[name], PROMPTS[2], new_tokens=8))[0] for name in ("", NAMES[0])]
    base, adapter = _run(runtime, go)
    assert base == suite.references[""][PROMPTS[2]][:8] and adapter == suite.references[NAMES[0]][PROMPTS[2]][:8]
