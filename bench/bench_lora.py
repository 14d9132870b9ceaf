"""LoRA adapters mixed in one batch vs the base alone, on modeld's torch
runtime (SmolLM2-135M): 8 streams x 128 tokens spread over 4 adapters
(2 streams each, every step mixing all four) against 8 streams on the base,
in interleaved rounds of the same run so drift in the machine's load hits
both sides alike; plus each adapter's cold load time and bytes.

The adapters are PEFT-layout folders (adapter_config.json +
adapter_model.safetensors) of random rank-16 A and B on all seven
projections, written here with safetensors: the runtime reads them as it
reads peft's own (tests/integration/test_lora_torch.py checks the outputs
against peft). The model runs in process through its own generate(), so
the figures are the engine's.

With --vllm, vLLM's CPU build serves the same four adapter folders
(--enable-lora --max-loras 4 --max-lora-rank R --lora-modules adapter-i=DIR,
both cores, eager: vLLM turns compilation off with LoRA on CPU anyway, no
prefix cache) and runs the same two sides over /v1/completions in the same
rounds, one server working at a time: the figure is modeld's adapters'
tok/s over vLLM's adapters' tok/s (goal >= 1.0).

    .venv/bin/python bench/bench_lora.py [--rounds 3] [--rank 16] [--eager] [--vllm]

Writes bench/results/lora.json.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "models"
RESULTS = ROOT / "bench/results"
NEW_TOKENS = 128
STREAMS = 8
NUM_ADAPTERS = 4
BASE = "smollm2-torch"
SERVED_NAME = ""  # vLLM's name for the base (tests/remote/vllm_server.py)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was", "1, 2, 3, 4,",
           "Water boils at a temperature of", "SELECT name FROM users WHERE", "The best way to learn is",
           "In 1492,"]


def write_adapter(folder: Path, args, rank: int, seed: int) -> None:
    import torch
    from safetensors.torch import save_file

    from modeld.backends.torch.lora import _shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(args.n_layers):
        for module, (d_in, d_out) in _shapes(args).items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=generator) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
        "lora_dropout": 0.0, "bias": "none"}))
    (folder / "model.toml").write_text(f'format = "lora"\nbase = "{BASE}"\n')


def load_runtime(eager: bool):
    from modeld.backends.model_config import load_model_toml
    from modeld.backends.torch.backend import TorchBackend

    config = load_model_toml(BASE, MODELS / BASE / "model.toml")
    options = dataclasses.replace(config.backend_options.torch, draft_model="", compile=not eager)
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, torch=options))
    return TorchBackend().load(config, MODELS / BASE)


async def _stream(model, prompt: str) -> int:
    from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams

    request = GenerateRequest("bench", prompt=prompt,
                              params=SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, cache_prompt=False))
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            if event.error:
                raise RuntimeError(event.error)
            return event.usage.completion_tokens
    return 0


async def _tok_s(models: list) -> float:
    started = time.perf_counter()
    tokens = await asyncio.gather(*(_stream(m, p) for m, p in zip(models, PROMPTS)))
    return sum(tokens) / (time.perf_counter() - started)


FAIR_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}


def lora_vllm(folders: list[Path], rank: int):
    """vLLM CPU serving the adapters from the start (--lora-modules), both cores, no prefix cache."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/remote")]
    from vllm_server import VllmServer

    class LoraVllm(VllmServer):
        def command(self) -> list[str]:
            return [*super().command(), "--no-enable-prefix-caching", "--enable-lora", "--max-loras",
                    str(len(folders)), "--max-lora-rank", str(rank), "--max-num-seqs", str(STREAMS),
                    "--lora-modules", *(f"{f.name}={f}" for f in folders)]

        def environment(self) -> dict[str, str]:
            return {**super().environment(), **FAIR_ENV}

    return LoraVllm()


async def _vllm_stream(client, model: str, prompt: str) -> int:
    response = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0.0})
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"]


async def _vllm_tok_s(client, models: list[str]) -> float:
    started = time.perf_counter()
    tokens = await asyncio.gather(*(_vllm_stream(client, m, p) for m, p in zip(models, PROMPTS)))
    return sum(tokens) / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--eager", action="store_true", help="no torch.compile (the model's default is compiled)")
    parser.add_argument("--vllm", action="store_true", help="also vLLM CPU --enable-lora on the same adapters")
    opts = parser.parse_args()
    from modeld.backends.model_config import load_model_toml

    runtime = load_runtime(opts.eager)
    loads = []
    tmp = tempfile.TemporaryDirectory()  # the folders stay while vLLM reads them
    adapters, folders = [], []
    for i in range(NUM_ADAPTERS):
        folder = Path(tmp.name) / f"adapter-{i}"
        write_adapter(folder, runtime.model.args, opts.rank, seed=i)
        folders.append(folder)
        started = time.perf_counter()
        adapters.append(runtime.load_adapter(load_model_toml(folder.name, folder / "model.toml"), folder))
        loads.append({"seconds": round(time.perf_counter() - started, 3), "nbytes": adapters[-1].nbytes,
                      "file_bytes": (folder / "adapter_model.safetensors").stat().st_size})
    vllm = lora_vllm(folders, opts.rank).start() if opts.vllm else None

    async def run() -> list[dict]:
        import httpx

        await runtime.start()
        client = httpx.AsyncClient(base_url=vllm.url, timeout=900) if vllm else None
        vllm_base = [SERVED_NAME] * STREAMS if vllm else []
        vllm_mixed = [folders[i % NUM_ADAPTERS].name for i in range(STREAMS)]
        try:
            # warm-up: both sides once (compiles the LoRA graph variants where compiled)
            await _tok_s([runtime] * STREAMS)
            await _tok_s([adapters[i % NUM_ADAPTERS] for i in range(STREAMS)])
            if client:
                await _vllm_tok_s(client, vllm_base)
                await _vllm_tok_s(client, vllm_mixed)
            rounds = []
            for _ in range(opts.rounds):
                base = await _tok_s([runtime] * STREAMS)
                mixed = await _tok_s([adapters[i % NUM_ADAPTERS] for i in range(STREAMS)])
                row = {"base_tok_s": round(base, 1), "adapters_tok_s": round(mixed, 1),
                       "ratio": round(mixed / base, 3)}
                if client:
                    v_base = await _vllm_tok_s(client, vllm_base)
                    v_mixed = await _vllm_tok_s(client, vllm_mixed)
                    row.update(vllm_base_tok_s=round(v_base, 1), vllm_adapters_tok_s=round(v_mixed, 1),
                               vllm_ratio=round(v_mixed / v_base, 3), vs_vllm=round(mixed / v_mixed, 3))
                rounds.append(row)
                print(json.dumps(rounds[-1]), file=sys.stderr)
            return rounds
        finally:
            if client:
                await client.aclose()
            await runtime.stop()

    global SERVED_NAME
    if vllm:
        from vllm_server import SERVED_NAME
    try:
        rounds = asyncio.run(run())
    finally:
        if vllm:
            vllm.stop()
        tmp.cleanup()
    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "what": f"torch runtime, SmolLM2-135M, {STREAMS} streams x {NEW_TOKENS} tokens: {NUM_ADAPTERS} rank-"
                f"{opts.rank} adapters on all 7 projections (2 streams each, mixed in every step) vs the base alone",
        "command": "flock /tmp/coord/bench.lock .venv/bin/python bench/bench_lora.py " + " ".join(sys.argv[1:]),
        "compiled": not opts.eager, "rounds": rounds, "median_ratio": ratio, "goal": 0.8,
        "adapter_cold_load": loads,
    }
    if vllm:
        result["vllm"] = {
            "what": f"vLLM CPU (vllm-cpu, fp32, eager, both cores) serving the same {NUM_ADAPTERS} adapter "
                    "folders, same streams and tokens, same rounds (one server working at a time)",
            "command": vllm.command(), "environment": FAIR_ENV, "start_s": round(vllm.start_s, 1),
            "median_vllm_ratio": statistics.median(r["vllm_ratio"] for r in rounds),
            "median_modeld_adapters_over_vllm_adapters": statistics.median(r["vs_vllm"] for r in rounds),
            "goal": 1.0,
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(result, indent=2) + "\n")
    if vllm:
        print(f"lora vs vLLM: modeld adapters / vLLM adapters tok/s median "
              f"{result['vllm']['median_modeld_adapters_over_vllm_adapters']:.2f}x (goal >= 1.0)")
    print(f"lora: adapters/base tok/s median {ratio:.2f}x over {opts.rounds} rounds "
          f"(goal >= 0.8x); cold load {statistics.median(l['seconds'] for l in loads):.2f} s, "
          f"{loads[0]['nbytes'] / 2**20:.1f} MiB per adapter")


if __name__ == "__main__":
    main()
