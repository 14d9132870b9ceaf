"""modeld's torch runtime vs Hugging Face transformers on the same weights
(SmolLM2-135M-Instruct dequantized from the GGUF, fp32, greedy), one run.
The peer and modeld (its defaults: fp32, torch.compile on) are measured back
to back in five rounds and each ratio is the median of the rounds' ratios;
then one round each with torch.compile off and with bf16 weights, for the
record of which is faster.

Peers, in this process: transformers `generate` one prompt at a time, and as
a padded batch of 8; transformers' continuous batching (`generate_batch`)
when it runs here. modeld: the daemon serving `smollm2-torch` over gRPC.
  single stream   tok/s, request to last token   goal >= 1.2x transformers generate
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
ROUNDS = 5
GGUF = (ROOT / "models/smollm2-torch/model.gguf").resolve()


class TransformersPeer:
    """transformers on the same GGUF, fp32, in this process."""

    def __init__(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(2)
        self.tokenizer = AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name)
        self.model = AutoModelForCausalLM.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name,
                                                          dtype=torch.float32).eval()
        self.generate_kwargs = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                    pad_token_id=self.tokenizer.eos_token_id)
        with torch.inference_mode():
            self.model.generate(**self.tokenizer("Warm up", return_tensors="pt"), max_new_tokens=4, do_sample=False)

    def single(self) -> float:
        """Median tok/s of `generate` over three prompts, prompt processing included."""
        rates = []
        with torch.inference_mode():
            for prompt in PROMPTS[:3]:
                inputs = self.tokenizer(prompt, return_tensors="pt")
                start = time.perf_counter()
                self.model.generate(**inputs, **self.generate_kwargs)
                rates.append(NEW_TOKENS / (time.perf_counter() - start))
        return statistics.median(rates)

    def padded_batch(self) -> float:
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        batch = self.tokenizer(PROMPTS, return_tensors="pt", padding=True)
        with torch.inference_mode():
            start = time.perf_counter()
            self.model.generate(**batch, **self.generate_kwargs)
        return len(PROMPTS) * NEW_TOKENS / (time.perf_counter() - start)

    def generate_batch(self) -> dict:
        try:
            from transformers import GenerationConfig

            config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1)
            ids = [self.tokenizer(p)["input_ids"] for p in PROMPTS]
            start = time.perf_counter()
            self.model.generate_batch(inputs=ids, generation_config=config)
            return {"generate_batch_tok_s": len(PROMPTS) * NEW_TOKENS / (time.perf_counter() - start)}
        except Exception as exc:  # optional peer: record why it could not run here
            return {"generate_batch_error": f"{type(exc).__name__}: {str(exc)[:200]}"}


class StaticCompiledPeer(TransformersPeer):
    """transformers' fastest generation path, on the eager peer's model and tokenizer: a static
    KV cache with its forward compiled, as transformers documents it (generate with
    cache_implementation="static" and a CompileConfig; decode steps run compiled, the prefill
    eagerly). transformers compiles automatically on CUDA only; `_compile_all_devices` opts the
    CPU in. mode "default": "reduce-overhead" means CUDA graphs, which a CPU has not. The static
    cache is sized once (max_cache_len) so every call reuses one cache. The first calls of each
    shape (1 row, 8 rows) compile: done here, untimed, and recorded as compile_s."""

    MODE = "default"

    def __init__(self, eager: TransformersPeer) -> None:
        from transformers import CompileConfig

        self.tokenizer, self.model = eager.tokenizer, eager.model
        config = CompileConfig(fullgraph=True, mode=self.MODE)  # dynamic: torch decides (the mask grows)
        config._compile_all_devices = True
        self.generate_kwargs = {**eager.generate_kwargs, "cache_implementation": "static", "compile_config": config,
                                "max_cache_len": NEW_TOKENS + 64}
        start = time.perf_counter()
        self.single()
        self.padded_batch()
        self.compile_s = time.perf_counter() - start


class ModeldTorch:
    """The daemon serving smollm2-torch with the given settings, over gRPC."""

    def __init__(self, dtype: str = "float32", compile: bool = True) -> None:
        from daemon import start_daemon

        self.repo = Path(tempfile.mkdtemp(prefix="modeld-bench-"))
        shutil.copytree(ROOT / "models/smollm2-torch", self.repo / "smollm2-torch", symlinks=True)
        toml = self.repo / "smollm2-torch/model.toml"
        lines = [line for line in toml.read_text().splitlines() if not line.startswith(("dtype", "draft_model", "compile"))]
        settings = f'[torch]\ndtype = "{dtype}"\ncompile = {str(compile).lower()}'
        toml.write_text("\n".join(lines).replace("[torch]", settings) + "\n")
        self.daemon = start_daemon("--metrics-port", "-1", repository=self.repo, timeout=600)

    def close(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.repo, ignore_errors=True)

    async def stream(self, prompt: str, max_tokens: int, **sampling) -> dict:
        import grpc

        from modeld.gen import generation_pb2 as g
        from modeld.gen import generation_pb2_grpc as gg

        params = g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        async with grpc.aio.insecure_channel(self.daemon.address) as channel:
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

    async def single(self) -> float:
        """Median tok/s over three prompts, request to last token (as the peer's is)."""
        runs = [await self.stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS[:3]]
        return statistics.median(r["tokens"] / r["total_s"] for r in runs)

    async def concurrent8(self) -> float:
        start = time.perf_counter()
        runs = await asyncio.gather(*(self.stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS))
        return sum(r["tokens"] for r in runs) / (time.perf_counter() - start)

    async def prefix(self) -> dict:
        cold = await self.stream(PREFIX + " Question: what is rule 7?", 8, cache_prompt=False)
        await self.stream(PREFIX + " Question: what is rule 3?", 8)
        warm = await self.stream(PREFIX + " Question: what is rule 7?", 8)
        return {"cold_ttft_s": cold["ttft"], "warm_ttft_s": warm["ttft"], "cached_tokens": warm["cached"],
                "ratio": warm["ttft"] / cold["ttft"]}

    async def ngram(self) -> dict:
        from modeld.gen import generation_pb2 as g

        plain = await self.stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False)
        spec = await self.stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False, speculative=g.SPECULATIVE_NGRAM,
                                 num_speculative_tokens=6)
        return {"plain_tok_s": decode_rate(plain), "spec_tok_s": decode_rate(spec), "identical": plain["ids"] == spec["ids"],
                "drafted": spec["drafted"], "accepted": spec["accepted"], "speedup": decode_rate(spec) / decode_rate(plain)}


async def rounds(peer: TransformersPeer, mine: ModeldTorch, count: int,
                 static: StaticCompiledPeer | None = None) -> list[dict]:
    """Peer and modeld back to back, `count` times: this machine's speed drifts
    by up to 2x over minutes, so each ratio compares figures taken together."""
    await mine.stream("Warm up", 4)
    out = []
    for _ in range(count):
        r = {"peer_single": peer.single(), "modeld_single": await mine.single(),
             "peer_batch8": peer.padded_batch(), "modeld_concurrent8": await mine.concurrent8()}
        r["single"] = r["modeld_single"] / r["peer_single"]
        r["concurrent8"] = r["modeld_concurrent8"] / r["peer_batch8"]
        if static is not None:  # transformers' static cache + torch.compile, in the same round
            r["static_single"], r["static_batch8"] = static.single(), static.padded_batch()
            r["single_vs_static"] = r["modeld_single"] / r["static_single"]
            r["concurrent8_vs_static"] = r["modeld_concurrent8"] / r["static_batch8"]
        out.append(r)
    return out


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def projection_matrices(model) -> list[torch.Tensor]:
    """Every weight a decode step multiplies, in order: each layer's fused
    q/k/v, output, gate/up and down projections, then the vocabulary
    projection as the forward pass runs it."""
    matrices = [w.detach() for layer in model.layers
                for w in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)]
    return [*matrices, model.head_weight().detach()]


def product_times(matrices: list[torch.Tensor], project, rows: int, repeats: int = 5) -> list[float]:
    """Seconds to multiply every matrix once by `rows` inputs, `repeats` times."""
    inputs = {m.shape[1]: torch.randn(rows, m.shape[1]) for m in matrices}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            for matrix in matrices:
                project(inputs[matrix.shape[1]], matrix)
            times.append(time.perf_counter() - start)
    return times


class DecodeFloor:
    """Only the matrix products of one decode step, through the fp32 form
    the served model uses (oneDNN on packed weights, or MKL's cpu_project
    where torch has no oneDNN), over the real weights (each layer's fused
    q/k/v, output, gate/up and down projections, and the vocabulary
    projection): what a step cannot go below with this BLAS, whatever else it
    does. The weights are loaded once; each timing multiplies every matrix
    once by `rows` inputs. Shared with bench_torch_vllm.py."""

    def __init__(self) -> None:
        from modeld.backends.model_config import ModelFormat
        from modeld.backends.torch.backend import _build_model

        model = _build_model(ModelFormat.GGUF, GGUF, GGUF.parent, torch.device("cpu"), torch.float32, 2048)
        from modeld.backends.torch.model import cpu_project, packed_project

        self.matrices = projection_matrices(model)
        self.params = sum(m.numel() for m in self.matrices)
        self.n_layers, self.n_heads, self.n_kv_heads = model.args.n_layers, model.args.n_heads, model.args.n_kv_heads
        # the product the served model runs: oneDNN's on packed weights where it packs them
        self.project = packed_project if model.packed else cpu_project
        self.kernel = "modeld.backends.torch.model." + ("packed_project" if model.packed else "cpu_project")

    def step_times(self, rows: int, repeats: int = 5) -> list[float]:
        return product_times(self.matrices, self.project, rows, repeats)


class StepOverhead:
    """What one decode step of modeld's forward pass costs apart from its
    arithmetic: a model with the served one's layer count, heads and code
    path (compiled layers, packed products, decode attention over the paged
    cache) at widths too small to cost anything (vocabulary 256, width 72,
    MLP 64), timed like DecodeFloor. What is left is torch's dispatch, each
    compiled layer's entry and wrapper, oneDNN's set-up per product and
    OpenMP's parallel regions, which a step pays once whatever the weights
    weigh. The decode floor already holds oneDNN's set-up of its products,
    so `beyond_products` leaves out this model's own products (timed as
    DecodeFloor times them): what remains adds to the decode floor, and the
    sum bounds the forward pass from below. Shared with bench_torch_vllm.py."""

    BLOCK = 16

    def __init__(self, n_layers: int, n_heads: int = 9, n_kv_heads: int = 3) -> None:
        from modeld.backends.torch.backend import _compile
        from modeld.backends.torch.model import Transformer
        from modeld.backends.torch.weights import ModelArgs

        args = ModelArgs(vocab_size=256, dim=8 * n_heads, n_layers=n_layers, n_heads=n_heads,
                         n_kv_heads=n_kv_heads, hidden_dim=64, norm_eps=1e-5, rope_theta=10000.0,
                         max_seq_len=2048, tie_embeddings=True)
        torch.manual_seed(0)
        self.model = Transformer(args, max_positions=2048)
        for parameter in self.model.parameters():
            torch.nn.init.normal_(parameter, std=0.02)
        self.model.eval().pack_weights()
        self.k_caches, self.v_caches = self.model.new_kv_caches(64 * self.BLOCK * 8)
        self.compiled = _compile(self.model, self.k_caches, self.v_caches, self.BLOCK, torch.device("cpu"))
        self.matrices = projection_matrices(self.model)

    def beyond_products(self, rows: int, repeats: int = 5) -> float:
        """Seconds a step spends outside its matrix products, best of `repeats`."""
        from modeld.backends.torch.model import cpu_project, packed_project

        project = packed_project if self.model.packed else cpu_project
        products = product_times(self.matrices, project, rows, repeats)
        return max(0.0, min(self.step_times(rows, repeats=repeats)) - min(products))

    def step_times(self, rows: int, context: int = 64, repeats: int = 5) -> list[float]:
        from modeld.backends.generation.interface import PagedWork, StepPlan
        from modeld.backends.torch.step import build_step

        blocks = -(-(context + 1) // self.BLOCK)
        plan = StepPlan((), tuple(PagedWork(s, context, (1,), 1, 0, tuple(range(s * blocks, (s + 1) * blocks)))
                                  for s in range(rows)))
        batch = build_step(plan, self.BLOCK, torch.device("cpu"))
        self.model(batch, self.k_caches, self.v_caches)  # a shape compiled at load; this call only warms
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            self.model(batch, self.k_caches, self.v_caches)
            times.append(time.perf_counter() - start)
        return times


def projection_floor(floor: DecodeFloor, rows: int) -> dict:
    """The floor for `rows` sequences as tokens/s (rows per step / seconds per step)."""
    step = statistics.median(floor.step_times(rows))
    return {"rows": rows, "step_ms": step * 1000, "tok_s": rows / step}


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, p = record["modeld"], record["transformers"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    axes[0].bar(["modeld torch", "transformers generate"], [m["single_tok_s"], p["generate_tok_s"]], color=["#2a7", "#888"])
    axes[0].set_title("1 stream tok/s")
    axes[1].bar(["modeld torch (8 streams)", "transformers padded batch 8"], [m["concurrent8_tok_s"], p["padded_batch8_tok_s"]],
                color=["#2a7", "#888"])
    axes[1].set_title("8 sequences, total tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import argparse

    parser = argparse.ArgumentParser(description="modeld torch runtime vs transformers")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    count = parser.parse_args().rounds
    peer = TransformersPeer()
    static = StaticCompiledPeer(peer)
    # right next to the peer's figures: this machine's memory bandwidth drifts
    torch.set_num_threads(2)
    decode = DecodeFloor()
    floor = {"batch8": projection_floor(decode, 8), "single": projection_floor(decode, 1)}

    async def measure() -> dict:
        result = {}
        mine = ModeldTorch()
        try:
            result["default"] = await rounds(peer, mine, count, static)
            result["prefix"], result["ngram"] = await mine.prefix(), await mine.ngram()
        finally:
            mine.close()
        for name, settings in (("eager", {"compile": False}), ("bfloat16", {"dtype": "bfloat16"})):
            mine = ModeldTorch(**settings)
            try:
                result[name] = await rounds(peer, mine, 1)
            finally:
                mine.close()
        return result

    measured = asyncio.run(measure())
    default = measured["default"]
    peer_figures = {"generate_tok_s": median_of(default, "peer_single"),
                    "padded_batch8_tok_s": median_of(default, "peer_batch8"), **peer.generate_batch(),
                    "static_compiled": {"generate_tok_s": median_of(default, "static_single"),
                                        "padded_batch8_tok_s": median_of(default, "static_batch8"),
                                        "compile_s": static.compile_s, "mode": static.MODE,
                                        "max_cache_len": static.generate_kwargs["max_cache_len"]}}
    mine = {"single_tok_s": median_of(default, "modeld_single"), "concurrent8_tok_s": median_of(default, "modeld_concurrent8"),
            "prefix": measured["prefix"], "ngram": measured["ngram"], "rounds": default,
            "eager": measured["eager"][0], "bfloat16": measured["bfloat16"][0]}
    ratios = {
        "single": median_of(default, "single"),
        "concurrent8": median_of(default, "concurrent8"),
        "prefix_ttft": mine["prefix"]["ratio"],
        "ngram_speedup": mine["ngram"]["speedup"],
        # against transformers' static cache + torch.compile (no goal of its own; recorded)
        "single_vs_static_compiled": median_of(default, "single_vs_static"),
        "concurrent8_vs_static_compiled": median_of(default, "concurrent8_vs_static"),
    }
    goals = {"single": ratios["single"] >= 1.2, "concurrent8": ratios["concurrent8"] >= 2.0,
             "prefix_ttft": ratios["prefix_ttft"] <= 0.25,
             "ngram_speedup": ratios["ngram_speedup"] >= 1.5 and mine["ngram"]["identical"]}
    record = {"command": "make bench (bench/bench_torch.py)", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpu_count": os.cpu_count(), "new_tokens": NEW_TOKENS, "rounds": count, "transformers": peer_figures,
              "modeld": mine, "ratios": ratios, "goals_met": goals, "projection_floor": floor}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "torch.json").write_text(json.dumps(record, indent=2))
    chart(record, RESULTS / "torch.png")
    for i, r in enumerate(default, 1):
        print(f"round {i}: 1 stream {r['modeld_single']:.1f} vs {r['peer_single']:.1f} tok/s ({r['single']:.2f}x), "
              f"8 streams {r['modeld_concurrent8']:.1f} vs padded batch {r['peer_batch8']:.1f} tok/s ({r['concurrent8']:.2f}x)")
    sc = peer_figures["static_compiled"]
    print(f"transformers static cache + torch.compile (compiled in {sc['compile_s']:.0f} s, untimed): 1 stream "
          f"{sc['generate_tok_s']:.1f} tok/s, padded batch 8 {sc['padded_batch8_tok_s']:.1f} tok/s; modeld "
          f"{ratios['single_vs_static_compiled']:.2f}x and {ratios['concurrent8_vs_static_compiled']:.2f}x")
    print(f"transformers generate_batch: {peer_figures.get('generate_batch_tok_s', peer_figures.get('generate_batch_error'))}")
    print(f"modeld torch: prefix ttft {mine['prefix']['cold_ttft_s']:.2f} s cold -> {mine['prefix']['warm_ttft_s']:.2f} s warm "
          f"({mine['prefix']['cached_tokens']} cached); n-gram {mine['ngram']['plain_tok_s']:.1f} -> {mine['ngram']['spec_tok_s']:.1f} tok/s "
          f"identical={mine['ngram']['identical']} ({mine['ngram']['accepted']}/{mine['ngram']['drafted']} accepted)")
    for variant in ("eager", "bfloat16"):
        v = mine[variant]
        print(f"modeld torch, {variant}: 1 stream {v['modeld_single']:.1f} tok/s ({v['single']:.2f}x), "
              f"8 streams {v['modeld_concurrent8']:.1f} tok/s ({v['concurrent8']:.2f}x)")
    print(f"matrix products alone (MKL, fp32): 8 rows {floor['batch8']['step_ms']:.1f} ms/step = "
          f"{floor['batch8']['tok_s']:.0f} tok/s, 1 row {floor['single']['step_ms']:.1f} ms/step = "
          f"{floor['single']['tok_s']:.0f} tok/s; 2x the padded batch needs {2 * peer_figures['padded_batch8_tok_s']:.0f} tok/s")
    print("ratios (median of rounds): " + ", ".join(
        f"{k} {v:.2f}x" + (f" ({'met' if goals[k] else 'missed'})" if k in goals else "") for k, v in ratios.items()))


if __name__ == "__main__":
    main()
