"""modeld's torch runtime vs Hugging Face transformers on the same weights
(SmolLM2-135M-Instruct dequantized from the GGUF, fp32, greedy), one run.
modeld runs with its defaults (fp32, torch.compile on), then with
torch.compile off and with bf16 weights, for the record of which is faster.

Peers, in this process: transformers `generate` one prompt at a time, and as
a padded batch of 8; transformers' continuous batching (`generate_batch`)
when it runs here. modeld: the daemon serving `smollm2-torch` over gRPC.
  single stream   decode tok/s               goal >= 1.2x transformers generate
  8 streams       aggregate tok/s            goal >= 2x transformers padded batch
  prefix cache    TTFT with a shared 1,000-token prefix vs cold   goal <= 0.25x
  speculation     n-gram decode tok/s on a copy-heavy prompt      goal >= 1.5x, identical
Writes bench/results/torch.json and torch.png.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_llamacpp import COPY_PROMPT, PREFIX, PROMPTS, decode_rate  # noqa: E402

RESULTS = ROOT / "bench/results"
NEW_TOKENS = 64
GGUF = (ROOT / "models/smollm2-torch/model.gguf").resolve()


def transformers_peer() -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    tokenizer = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
    model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name, dtype=torch.float32).eval()
    generate = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                    pad_token_id=tokenizer.eos_token_id)
    with torch.inference_mode():
        model.generate(**tokenizer("Warm up", return_tensors="pt"), max_new_tokens=4, do_sample=False)
        rates = []
        for prompt in PROMPTS[:3]:
            inputs = tokenizer(prompt, return_tensors="pt")
            start = time.perf_counter()
            model.generate(**inputs, **generate)
            rates.append(NEW_TOKENS / (time.perf_counter() - start))
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
        start = time.perf_counter()
        model.generate(**batch, **generate)
        padded = len(PROMPTS) * NEW_TOKENS / (time.perf_counter() - start)
    result = {"generate_tok_s": statistics.median(rates), "padded_batch8_tok_s": padded}
    try:
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
        ids = [tokenizer(p)["input_ids"] for p in PROMPTS]
        start = time.perf_counter()
        model.generate_batch(inputs=ids, generation_config=config)
        result["generate_batch_tok_s"] = len(PROMPTS) * NEW_TOKENS / (time.perf_counter() - start)
    except Exception as exc:  # optional peer: record why it could not run here
        result["generate_batch_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return result


async def modeld_side(dtype: str = "float32", full: bool = True, compile: bool = True) -> dict:
    import grpc

    from daemon import start_daemon
    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    repo = Path(tempfile.mkdtemp(prefix="modeld-bench-"))
    shutil.copytree(ROOT / "models/smollm2-torch", repo / "smollm2-torch", symlinks=True)
    toml = repo / "smollm2-torch/model.toml"
    lines = [line for line in toml.read_text().splitlines() if not line.startswith(("dtype", "draft_model", "compile"))]
    settings = f'[torch]\ndtype = "{dtype}"\ncompile = {str(compile).lower()}'
    toml.write_text("\n".join(lines).replace("[torch]", settings) + "\n")
    daemon = start_daemon("--metrics-port", "-1", repository=repo)

    async def stream(prompt: str, max_tokens: int, **sampling) -> dict:
        params = g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        async with grpc.aio.insecure_channel(daemon.address) as channel:
            stub = gg.GenerationStub(channel)
            start, first, ids, usage = time.perf_counter(), None, [], None
            async for r in stub.Generate(g.GenerateRequest(model="smollm2-torch", prompt=prompt, sampling=params), timeout=900):
                if r.token_ids:
                    first = first or time.perf_counter()
                    ids.extend(r.token_ids)
                if r.finish_reason:
                    usage = r.usage
        end = time.perf_counter()
        return {"ttft": first - start, "tokens": len(ids), "decode_s": end - first, "total_s": end - start,
                "ids": ids, "cached": usage.cached_prompt_tokens, "drafted": usage.drafted_tokens,
                "accepted": usage.accepted_tokens}

    try:
        await stream("Warm up", 4)
        single = [await stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS[:3]]
        start = time.perf_counter()
        many = await asyncio.gather(*(stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS))
        wall = time.perf_counter() - start
        if not full:
            return {"single_decode_tok_s": statistics.median(decode_rate(r) for r in single),
                    "concurrent8_tok_s": sum(r["tokens"] for r in many) / wall}
        cold = await stream(PREFIX + " Question: what is rule 7?", 8, cache_prompt=False)
        await stream(PREFIX + " Question: what is rule 3?", 8)
        warm = await stream(PREFIX + " Question: what is rule 7?", 8)
        plain = await stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False)
        spec = await stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False, speculative=g.SPECULATIVE_NGRAM,
                            num_speculative_tokens=6)
    finally:
        daemon.stop()
        shutil.rmtree(repo, ignore_errors=True)
    return {
        "single_decode_tok_s": statistics.median(decode_rate(r) for r in single),
        "concurrent8_tok_s": sum(r["tokens"] for r in many) / wall,
        "prefix": {"cold_ttft_s": cold["ttft"], "warm_ttft_s": warm["ttft"], "cached_tokens": warm["cached"],
                   "ratio": warm["ttft"] / cold["ttft"]},
        "ngram": {"plain_tok_s": decode_rate(plain), "spec_tok_s": decode_rate(spec), "identical": plain["ids"] == spec["ids"],
                  "drafted": spec["drafted"], "accepted": spec["accepted"], "speedup": decode_rate(spec) / decode_rate(plain)},
    }


def projection_floor(rows: int = 8, repeats: int = 5) -> dict:
    """Only the matrix products of one decode step for `rows` sequences,
    through modeld's fastest fp32 form on MKL, over the real weights: what a
    step cannot go below with this BLAS, whatever else it does. Reported as
    tokens/s (rows per step / seconds per step)."""
    from modeld.backends.model_config import ModelFormat
    from modeld.backends.torch.backend import _build_model
    from modeld.backends.torch.model import cpu_project

    torch.set_num_threads(2)
    model = _build_model(ModelFormat.GGUF, GGUF, GGUF.parent, torch.device("cpu"), torch.float32, 2048)
    weights = [w for layer in model.layers for w in (layer.attention.wqkv, layer.attention.wo,
                                                     layer.feed_forward.w13, layer.feed_forward.w2)]
    weights.append(model.output_weight())
    inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for w in weights:
                cpu_project(inputs[w.shape[1]], w)
            times.append(time.perf_counter() - start)
    step = statistics.median(times)
    return {"rows": rows, "step_ms": step * 1000, "tok_s": rows / step}


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, p = record["modeld"], record["transformers"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    axes[0].bar(["modeld torch", "transformers generate"], [m["single_decode_tok_s"], p["generate_tok_s"]], color=["#2a7", "#888"])
    axes[0].set_title("1 stream tok/s")
    axes[1].bar(["modeld torch (8 streams)", "transformers padded batch 8"], [m["concurrent8_tok_s"], p["padded_batch8_tok_s"]],
                color=["#2a7", "#888"])
    axes[1].set_title("8 sequences, total tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    peer = transformers_peer()
    # right after the peer, in the same minute: this machine's memory bandwidth drifts
    floor = {"batch8": projection_floor(8), "single": projection_floor(1)}
    mine = asyncio.run(modeld_side())
    mine["eager"] = asyncio.run(modeld_side(compile=False, full=False))  # torch.compile off
    mine["bfloat16"] = asyncio.run(modeld_side("bfloat16", full=False))
    ratios = {
        "single": mine["single_decode_tok_s"] / peer["generate_tok_s"],
        "concurrent8": mine["concurrent8_tok_s"] / peer["padded_batch8_tok_s"],
        "prefix_ttft": mine["prefix"]["ratio"],
        "ngram_speedup": mine["ngram"]["speedup"],
    }
    goals = {"single": ratios["single"] >= 1.2, "concurrent8": ratios["concurrent8"] >= 2.0,
             "prefix_ttft": ratios["prefix_ttft"] <= 0.25,
             "ngram_speedup": ratios["ngram_speedup"] >= 1.5 and mine["ngram"]["identical"]}
    record = {"command": "make bench (bench/bench_torch.py)", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpu_count": os.cpu_count(), "new_tokens": NEW_TOKENS, "transformers": peer, "modeld": mine,
              "ratios": ratios, "goals_met": goals, "projection_floor": floor}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torch.json").write_text(json.dumps(record, indent=2))
    chart(record, RESULTS / "torch.png")
    print(f"transformers: generate {peer['generate_tok_s']:.1f} tok/s, padded batch of 8 {peer['padded_batch8_tok_s']:.1f} tok/s, "
          f"generate_batch {peer.get('generate_batch_tok_s', peer.get('generate_batch_error'))}")
    print(f"modeld torch: 1 stream {mine['single_decode_tok_s']:.1f} tok/s, 8 streams {mine['concurrent8_tok_s']:.1f} tok/s; "
          f"prefix ttft {mine['prefix']['cold_ttft_s']:.2f} s cold -> {mine['prefix']['warm_ttft_s']:.2f} s warm "
          f"({mine['prefix']['cached_tokens']} cached); n-gram {mine['ngram']['plain_tok_s']:.1f} -> {mine['ngram']['spec_tok_s']:.1f} tok/s "
          f"identical={mine['ngram']['identical']} ({mine['ngram']['accepted']}/{mine['ngram']['drafted']} accepted)")
    for variant in ("eager", "bfloat16"):
        v = mine[variant]
        print(f"modeld torch, {variant}: 1 stream {v['single_decode_tok_s']:.1f} tok/s "
              f"({v['single_decode_tok_s'] / peer['generate_tok_s']:.2f}x), 8 streams {v['concurrent8_tok_s']:.1f} tok/s "
              f"({v['concurrent8_tok_s'] / peer['padded_batch8_tok_s']:.2f}x)")
    print(f"matrix products alone (MKL, fp32): 8 rows {floor['batch8']['step_ms']:.1f} ms/step = "
          f"{floor['batch8']['tok_s']:.0f} tok/s, 1 row {floor['single']['step_ms']:.1f} ms/step = "
          f"{floor['single']['tok_s']:.0f} tok/s; 2x the padded batch needs {2 * peer['padded_batch8_tok_s']:.0f} tok/s")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x ({'met' if goals[k] else 'missed'})" for k, v in ratios.items()))


if __name__ == "__main__":
    main()
