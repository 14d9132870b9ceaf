"""modeld's torch runtime against Hugging Face transformers on the same
weights (SmolLM2 dequantized from the GGUF), greedy, token for token."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from daemon import MODELS
from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams, SpeculativeMode
from modeld.backends.model_config import load_model_toml
from modeld.backends.errors import InvalidArgument
from modeld.backends.torch.backend import TorchBackend
from polling import wait_until_async

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was",
           "1, 2, 3, 4,", "Water boils at a temperature of"]
LONG = "Please answer briefly and politely. " * 8 + "The capital of France is"
NEW_TOKENS = 32


def _config(**options):
    config = load_model_toml("smollm2-torch", MODELS / "smollm2-torch/model.toml")
    # the engine resolves draft_model to a path; here we do it by hand
    torch_options = dataclasses.replace(config.backend_options.torch,
                                        draft_path=str(MODELS / "smollm2-draft/model.gguf"), **options)
    return dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, torch=torch_options))


def _load(**options):
    return TorchBackend().load(_config(**options), MODELS / "smollm2-torch")


@pytest.fixture(scope="module")
def runtime():
    return _load()  # torch.compile on: the default


@pytest.fixture(scope="module")
def reference(runtime):
    """transformers' LlamaForCausalLM on the same GGUF: greedy continuations."""
    from hf_reference import reference_model

    model = reference_model(MODELS / "smollm2-torch/model.gguf")
    out = {}
    for prompt in PROMPTS + [LONG]:
        ids = runtime.tokenize(prompt)
        with torch.inference_mode():
            generated = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                       attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        # transformers stops at end-of-sequence; the runtime runs on (ignore_eos), so
        # the comparison covers transformers' tokens, EOS included
        out[prompt] = generated[0, len(ids):].tolist()
    return out


def _same(tokens: list[int], expected: list[int]) -> bool:
    return len(expected) >= 4 and tokens[:len(expected)] == expected[:len(tokens)]


def _run(runtime, coro_factory):
    async def main():
        await runtime.start()
        try:
            return await coro_factory()
        finally:
            await runtime.stop()
    return asyncio.run(main())


async def _generate(runtime, prompt, **params):
    tokens = []
    request = GenerateRequest("smollm2-torch", prompt=prompt,
                              params=SamplingParams(**{"max_tokens": NEW_TOKENS, "ignore_eos": True, **params}))
    async for event in runtime.generate(request):
        if isinstance(event, FinalEvent):
            return tokens, event.usage
        tokens.extend(event.token_ids)


def test_the_default_runtime_is_compiled(runtime):
    # a silent fallback to eager would leave every test below passing on the slower path
    assert runtime.model.compiled and runtime.draft.model.compiled


def test_fp32_weights_on_the_cpu_are_packed_for_onednn(runtime):
    # every test below then runs the packed products; a model that silently kept
    # plain weights would pass them on the slower path
    for model in (runtime.model, runtime.draft.model):
        assert model.packed
        layer = model.layers[0]
        assert all(w.is_mkldnn for w in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13,
                                         layer.feed_forward.w2))
        # SmolLM2 ties its vocabulary projection: the lookup keeps the plain
        # matrix, the projection reads a packed copy of it
        assert model.output is None and not model.tok_embeddings.weight.is_mkldnn
        assert model.packed_output.is_mkldnn and model.packed_output.shape == model.tok_embeddings.weight.shape


def test_the_packed_product_is_the_plain_one():
    from modeld.backends.torch.model import cpu_project, pack_weight, packed_project

    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    packed = pack_weight(weight)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 64)
        assert torch.allclose(packed_project(x, packed), x @ weight.t(), atol=1e-4)
        assert torch.allclose(packed_project(x, packed), cpu_project(x, weight), atol=1e-4)


@pytest.mark.parametrize("masked", [False, True])
def test_compiled_decode_attention_is_the_gathered_one(masked):
    """The decode step's attention as the compiled layer runs it (reductions
    reading the cache through the block index) against the eager form
    (gather, then scaled_dot_product_attention), grouped-query heads."""
    import torch.nn.functional as F

    from modeld.backends.torch.model import decode_attention

    torch.manual_seed(0)
    seqs, heads, kv_heads, head_dim, cells = 4, 6, 2, 16, 256
    lengths = torch.tensor([5, 17, 9, 32]) if masked else torch.full((seqs,), 32)
    context = int(lengths.max())
    k_cache, v_cache = torch.randn(cells, kv_heads, head_dim), torch.randn(cells, kv_heads, head_dim)
    kv_index = torch.stack([torch.randperm(cells)[:context] for _ in range(seqs)])
    mask = (torch.arange(context)[None, :] < lengths[:, None])[:, None, None, :] if masked else None
    q = torch.randn(seqs, heads, head_dim)

    keys = k_cache[kv_index].transpose(1, 2)  # [S, kv_heads, C, head_dim]
    values = v_cache[kv_index].transpose(1, 2)
    expected = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=mask, enable_gqa=True)
    expected = expected.reshape(seqs, heads * head_dim)
    compiled = torch.compile(decode_attention, dynamic=True)
    got = compiled(q, k_cache, v_cache, kv_index, mask, kv_heads)
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def test_the_memory_estimate_is_what_the_load_reports(runtime):
    # weights (the packed copy of a tied projection included) and KV pools of
    # target and draft, read from the GGUF headers before loading
    expected = TorchBackend().estimate_bytes(_config(), MODELS / "smollm2-torch")
    assert expected == runtime.nbytes
    vocab, dim = runtime.model.tok_embeddings.weight.shape
    assert runtime.model.weight_bytes() == 4 * (sum(p.numel() for p in runtime.model.parameters()) + vocab * dim)


def test_alone_matches_transformers(runtime, reference):
    async def go():
        return [await _generate(runtime, p, cache_prompt=False) for p in PROMPTS]
    for prompt, (tokens, _) in zip(PROMPTS, _run(runtime, go)):
        assert _same(tokens, reference[prompt]), prompt


def test_batch_of_eight_with_mixed_lengths_matches_transformers(runtime, reference):
    batch = PROMPTS + PROMPTS[:3]

    async def go():
        return await asyncio.gather(*(_generate(runtime, p, cache_prompt=False, max_tokens=NEW_TOKENS - 4 * (i % 3))
                                      for i, p in enumerate(batch)))
    for i, (prompt, (tokens, _)) in enumerate(zip(batch, _run(runtime, go))):
        assert _same(tokens, reference[prompt]), prompt


def test_prefix_cache_hits_match_transformers(runtime, reference):
    async def go():
        return await _generate(runtime, LONG), await _generate(runtime, LONG)
    (cold, usage_cold), (warm, usage_warm) = _run(runtime, go)
    assert _same(cold, reference[LONG]) and _same(warm, reference[LONG])
    assert usage_cold.cached_prompt_tokens == 0
    assert usage_warm.cached_prompt_tokens >= 48  # whole 16-token blocks of the prompt


def test_speculation_matches_transformers(runtime, reference):
    async def go():
        return [await _generate(runtime, p, cache_prompt=False, speculative=SpeculativeMode.NGRAM,
                                num_speculative_tokens=4) for p in PROMPTS]
    results = _run(runtime, go)
    for prompt, (tokens, usage) in zip(PROMPTS, results):
        assert _same(tokens, reference[prompt]), prompt
    assert sum(u.drafted_tokens for _, u in results) > 0


def test_draft_model_speculation_matches_transformers(runtime, reference):
    async def go():
        return [await _generate(runtime, p, cache_prompt=False, speculative=SpeculativeMode.DRAFT,
                                num_speculative_tokens=3) for p in PROMPTS[:3]]
    results = _run(runtime, go)
    for prompt, (tokens, usage) in zip(PROMPTS, results):
        assert _same(tokens, reference[prompt]), prompt
        assert usage.drafted_tokens > 0 and usage.accepted_tokens > 0


def test_blocks_all_return_after_the_runs(runtime):
    blocks = runtime.scheduler.blocks
    assert not runtime.scheduler.running and not runtime.scheduler.waiting
    assert all(b.ref_count == 0 for b in blocks.blocks) and blocks.num_free == len(blocks.blocks)


def test_eager_runtime_matches_transformers(reference):
    """compile = false: the same tokens without inductor, alone and batched."""
    eager = _load(compile=False)
    assert not eager.model.compiled

    async def go():
        alone = [await _generate(eager, p, cache_prompt=False) for p in PROMPTS[:2]]
        together = await asyncio.gather(*(_generate(eager, p, cache_prompt=False) for p in PROMPTS))
        return alone, together
    alone, together = _run(eager, go)
    for prompt, (tokens, _) in zip(PROMPTS[:2], alone):
        assert _same(tokens, reference[prompt]), prompt
    for prompt, (tokens, _) in zip(PROMPTS, together):
        assert _same(tokens, reference[prompt]), prompt
    eager.unload()


def test_a_compile_setting_that_is_not_a_bool_is_refused():
    # refused as the options are built, before any weights are read
    with pytest.raises(InvalidArgument, match="torch.compile must be true or false"):
        _load(compile="yes")


def test_cancelling_a_draft_stream_releases_the_draft_blocks(runtime):
    """A speculative stream cancelled mid-generation gives the draft model's
    KV blocks back, as it does the target's."""
    draft_blocks = runtime.draft.blocks
    free_before = draft_blocks.num_free

    async def go():
        request = GenerateRequest("smollm2-torch", prompt=LONG, params=SamplingParams(
            max_tokens=200, ignore_eos=True, speculative=SpeculativeMode.DRAFT, num_speculative_tokens=3))
        stream = runtime.generate(request)
        got = 0
        while got < 6:
            got += len((await stream.__anext__()).token_ids)
        held = draft_blocks.num_free
        await stream.aclose()  # the client went away
        await wait_until_async(lambda: not runtime.scheduler.has_work(), what="the sequence to leave the batch")
        return held
    held = _run(runtime, go)
    assert held < free_before  # the draft was in use when the stream was cancelled
    assert not runtime.scheduler.running
    assert draft_blocks.num_free == free_before and not draft_blocks.tables
