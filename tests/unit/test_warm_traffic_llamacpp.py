"""Issue 14 on the real llama.cpp backend (in process, smollm2): a model that
has served unrelated requests must decode a burst of streams in as few
forward passes as a fresh one, and give the same tokens.

llama.cpp is asked how many forward passes it ran: a graph callback counts
the first layer's attention norm, computed once per pass (per ubatch).
Nothing here is timed.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
from pathlib import Path

import pytest

from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams, TokenEvent

ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = ROOT / "models/smollm2"
llama_cpp = pytest.importorskip("llama_cpp")
pytestmark = pytest.mark.skipif(not (MODEL_DIR / "model.gguf").exists(), reason="run `modeld prepare` first")

UNRELATED = ["Tell me a joke about cats.", "What is the capital of Peru?", "Name three primary colours.",
             "How do airplanes fly?", "Translate 'good morning' into French.", "Write a haiku about rain."]
STREAMS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
           "List ten uses for a paperclip.", "Describe the water cycle to a child.",
           "What makes a good cup of coffee?", "Summarise the history of the printing press.",
           "Give advice to a new gardener.", "Why is the sky blue?"]


class PassCounter:
    """Counts llama.cpp forward passes through the context's eval callback."""

    def __init__(self) -> None:
        base = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib/libggml-base.so"))
        base.ggml_get_name.restype = ctypes.c_char_p
        base.ggml_get_name.argtypes = [ctypes.c_void_p]
        self.passes = 0

        @llama_cpp.ggml_backend_sched_eval_callback
        def observe(tensor, ask, user_data):
            if base.ggml_get_name(tensor) != b"attn_norm-0":
                return False
            if not ask:
                self.passes += 1
            return True

        self.callback = observe  # kept alive as long as the context


def _load(monkeypatch, counter: PassCounter, **overrides):
    from modeld.backends.llamacpp.backend import LlamaCppBackend
    from modeld.backends.model_config import load_model_toml

    config = load_model_toml("smollm2", MODEL_DIR / "model.toml")
    # 8 slots as shipped, smaller streams: the prompts here are short
    options = dataclasses.replace(config.backend_options.llamacpp, n_ctx=4096, n_slots=8, draft_path="", **overrides)
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, llamacpp=options))
    defaults = llama_cpp.llama_context_default_params

    def with_callback():
        params = defaults()
        params.cb_eval = counter.callback
        return params

    monkeypatch.setattr(llama_cpp, "llama_context_default_params", with_callback)
    try:
        return LlamaCppBackend().load(config, MODEL_DIR)
    finally:
        monkeypatch.setattr(llama_cpp, "llama_context_default_params", defaults)


async def _generate(model, prompt: str, max_tokens: int, **params) -> list[int]:
    request = GenerateRequest("smollm2", prompt=prompt, params=SamplingParams(max_tokens=max_tokens, **params))
    tokens = []
    async for event in model.generate(request):
        if isinstance(event, TokenEvent):
            tokens.extend(event.token_ids)
        elif isinstance(event, FinalEvent):
            assert not event.error, event.error
    return tokens


def _burst(monkeypatch, warm: bool, new_tokens: int = 12):
    """8 concurrent greedy streams, after 6 unrelated requests when warm.
    Returns their tokens and, per step that decoded all 8, the passes it took."""
    counter = PassCounter()
    model = _load(monkeypatch, counter)
    steps: list[tuple[int, int]] = []  # (sequences decoding one token, forward passes)
    run = model.context.run

    def counted(plan, **how):  # how: argmax_only, for plain greedy steps
        before = counter.passes
        logits = run(plan, **how)
        steps.append((sum(1 for w in plan.work if len(w.token_ids) == 1), counter.passes - before))
        return logits

    model.context.run = counted

    async def go():
        await model.start()
        try:
            if warm:
                for prompt in UNRELATED:  # one at a time, prefixes kept (the default)
                    await _generate(model, prompt, 8)
                assert len(model.scheduler.slots.cached) == 6
            del steps[:]
            return await asyncio.gather(*(_generate(model, p, new_tokens, ignore_eos=True) for p in STREAMS))
        finally:
            await model.stop()

    try:
        tokens = asyncio.run(go())
    finally:
        model.unload()
    return tokens, [passes for decoding, passes in steps if decoding == len(STREAMS)]


def test_after_unrelated_requests_a_burst_decodes_in_one_pass_per_step_like_a_fresh_model(monkeypatch):
    fresh_tokens, fresh = _burst(monkeypatch, warm=False)
    warm_tokens, warm = _burst(monkeypatch, warm=True)
    assert fresh and warm
    # before the fix: slots granted 6, 7, 0..5 and fed in that order, 2 passes every step
    assert set(fresh) == {1}
    assert set(warm) == {1}, f"forward passes per 8-stream decode step after unrelated traffic: {warm}"
    # the batch runs in slot order; each stream still gets its own logits
    assert warm_tokens == fresh_tokens


def test_a_cached_prefix_away_from_the_running_block_is_copied_next_to_it_and_matches_a_cold_run(monkeypatch):
    model = _load(monkeypatch, PassCounter())
    ops = []
    run = model.context.run

    def recorded(plan, **how):
        ops.extend(plan.kv_ops)
        return run(plan, **how)

    model.context.run = recorded
    shared = "You are a careful assistant who answers briefly. " * 4
    question = shared + "Question: why do leaves fall?"

    async def go():
        await model.start()
        try:
            cold = await _generate(model, question, 16, cache_prompt=False)
            await _generate(model, shared + "Question: what is rain?", 4)  # slot 0 keeps the shared prefix
            for prompt in UNRELATED[:5]:
                await _generate(model, prompt, 4)  # slots 1..5
            slots = model.scheduler.slots
            assert list(slots.cached) == [0, 1, 2, 3, 4, 5]
            # two long streams take the free slots 6 and 7; slot 0 is away from them
            streams = [asyncio.ensure_future(_generate(model, p, 48, ignore_eos=True)) for p in STREAMS[:2]]
            while not all(s.num_output for s in model.scheduler.running) or len(model.scheduler.running) < 2:
                await asyncio.sleep(0.01)
            assert sorted(slots.active) == [6, 7]
            del ops[:]
            request = GenerateRequest("smollm2", prompt=question, params=SamplingParams(max_tokens=16))
            warm, usage = [], None
            async for event in model.generate(request):
                if isinstance(event, TokenEvent):
                    warm.extend(event.token_ids)
                else:
                    usage = event.usage
            await asyncio.gather(*streams)
            return cold, warm, usage
        finally:
            await model.stop()

    try:
        cold, warm, usage = asyncio.run(go())
    finally:
        model.unload()
    copies = [op for op in ops if op.kind.value == "copy"]
    assert [(op.src, op.slot) for op in copies] == [(0, 5)]
    assert usage.cached_prompt_tokens == copies[0].pos >= 16
    assert warm == cold


def _prompt_steps(monkeypatch, prompts: list[str], new_tokens: int, **overrides
                  ) -> tuple[list[list[int]], list[tuple[int, int, int]]]:
    """Prompts sent together: their greedy tokens and, per step with work, (prompt
    tokens, those in chunks, sequences decoding). A sequence with one
    prompt token left feeds it beside the decodes, outside the cap."""
    model = _load(monkeypatch, PassCounter(), **overrides)
    for key, value in overrides.items():
        assert getattr(model.scheduler.config, key) == value
    steps = []
    run = model.context.run

    def recorded(plan, **how):
        running = {seq.seq_id: seq for seq in model.scheduler.running}
        prompt = chunks = decoding = 0
        for w in plan.work:
            seq = running[w.seq_id]
            n = max(0, min(w.start_pos + len(w.token_ids), seq.num_prompt) - w.start_pos)
            prompt += n
            chunks += n if seq.is_prefilling else 0
            decoding += n == 0
        if plan.work:  # not a step that only frees slots
            steps.append((prompt, chunks, decoding))
        return run(plan, **how)

    model.context.run = recorded

    async def go():
        await model.start()
        try:
            return await asyncio.gather(*(_generate(model, p, new_tokens, ignore_eos=True) for p in prompts))
        finally:
            await model.stop()

    try:
        return asyncio.run(go()), steps
    finally:
        model.unload()


def test_prompts_arriving_together_are_fed_a_few_tokens_per_step_with_the_same_tokens_out(monkeypatch):
    whole_tokens, whole = _prompt_steps(monkeypatch, STREAMS[:3], 6, max_prefill_tokens=512)
    capped_tokens, capped = _prompt_steps(monkeypatch, STREAMS[:3], 6, max_prefill_tokens=8)
    whole, capped = [s for s in whole if s[0]], [s for s in capped if s[0]]
    assert sum(p for p, _, _ in capped) == sum(p for p, _, _ in whole)  # every prompt token fed once
    assert max(c for _, c, _ in capped) <= 8 < max(c for _, c, _ in whole)
    assert len(capped) > len(whole)
    assert capped_tokens == whole_tokens


def test_a_burst_of_long_prompts_prefills_in_one_step_and_its_streams_decode_together(monkeypatch):
    """As shipped, 8 prompts of ~150 tokens sent together (aiperf's shape)
    fill one step, run by llama.cpp as micro-batches of 512; then all 8
    decode in every step and finish in the same one. Split over steps
    (512 prompt tokens a step), streams that started a step apart kept
    decoding through each other's prompt chunks."""
    model = _load(monkeypatch, PassCounter())
    try:
        assert (llama_cpp.llama_n_batch(model.context.ctx), llama_cpp.llama_n_ubatch(model.context.ctx)) == (2048, 512)
    finally:
        model.unload()
    prompts = [f"{topic} " + "Answer in plain words, one short sentence at a time. " * 12 for topic in STREAMS]
    tokens, steps = _prompt_steps(monkeypatch, prompts, 5)
    prompt_steps = [s for s in steps if s[0]]
    assert len(prompt_steps) == 1 and prompt_steps[0][0] > 8 * 128 and prompt_steps[0][2] == 0
    assert steps[steps.index(prompt_steps[0]) + 1:] == [(0, 0, 8)] * 4
    assert [len(t) for t in tokens] == [5] * 8
