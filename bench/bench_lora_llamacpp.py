"""What mixing LoRA adapters costs on the llama.cpp backend (SmolLM2-135M,
Q4_1): 8 streams x 96 tokens all on the base, all on one adapter, spread
over 2 adapters and over 4, in interleaved rounds of the same run so drift
in the machine's load hits every side alike; plus each adapter's cold
load time and bytes.

llama.cpp applies adapters per context, so a step carries one adapter set
and sets take turns (backends/llamacpp/lora.py): with k sets in play each
step runs 8/k streams, and each change of set makes llama.cpp reserve its
compute graph again. one_adapter/base is what the adapter's own matrices
cost; mixed_k/one_adapter is what mixing k adapters costs on top.

The adapters are GGUF LoRA files of random rank-R lora_a / lora_b on all
seven projections of every layer, written here with the gguf package in
the layout convert_lora_to_gguf.py writes (tests/integration/
test_lora_llamacpp.py checks converted adapters against llama-cpp-python's
own Llama(lora_path=...)). The model runs in process through its own
generate(), so the figures are the engine's.

    flock /tmp/coord/bench.lock .venv/bin/python bench/bench_lora_llamacpp.py [--rounds 3] [--rank 16] [--tokens 96]

Writes bench/results/lora_llamacpp.json.
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
STREAMS = 8
BASE = "smollm2"
WEIGHTS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time there was", "1, 2, 3, 4,",
           "Water boils at a temperature of", "SELECT name FROM users WHERE", "The best way to learn is",
           "In 1492,"]


def write_adapter(folder: Path, shapes: dict[str, tuple[int, ...]], rank: int, seed: int) -> None:
    import gguf
    import numpy as np

    folder.mkdir(parents=True)
    writer = gguf.GGUFWriter(str(folder / "adapter.gguf"), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 2.0 * rank)
    rng = np.random.default_rng(seed)
    for name, (d_in, d_out) in shapes.items():
        if not name.startswith("blk.") or name.split(".")[-2] not in WEIGHTS:
            continue  # blk.<i>.<weight>.weight: the seven projections of each layer
        # numpy shapes: ggml's ne reversed (lora_a ne [in, r], lora_b ne [r, out])
        writer.add_tensor(f"{name}.lora_a", (rng.standard_normal((rank, d_in)) * 0.02).astype(np.float32))
        writer.add_tensor(f"{name}.lora_b", (rng.standard_normal((d_out, rank)) * 0.02).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (folder / "model.toml").write_text(f'format = "lora"\nbase = "{BASE}"\nartifact = "adapter.gguf"\n')


def load_runtime():
    from modeld.backends.llamacpp.backend import LlamaCppBackend
    from modeld.backends.model_config import load_model_toml

    config = load_model_toml(BASE, MODELS / BASE / "model.toml")
    options = dataclasses.replace(config.backend_options.llamacpp, draft_model="", draft_path="")
    config = dataclasses.replace(config, backend_options=dataclasses.replace(config.backend_options, llamacpp=options))
    return LlamaCppBackend().load(config, MODELS / BASE)


async def _stream(model, prompt: str, tokens: int) -> int:
    from modeld.backends.generation.params import FinalEvent, GenerateRequest, SamplingParams

    request = GenerateRequest("bench", prompt=prompt,
                              params=SamplingParams(max_tokens=tokens, ignore_eos=True, cache_prompt=False))
    async for event in model.generate(request):
        if isinstance(event, FinalEvent):
            if event.error:
                raise RuntimeError(event.error)
            return event.usage.completion_tokens
    return 0


async def _side(runtime, models: list, tokens: int) -> dict:
    switches, steps = runtime.adapters.num_switches, runtime.loop.step_counts.steps
    started = time.perf_counter()
    done = await asyncio.gather(*(_stream(m, p, tokens) for m, p in zip(models, PROMPTS)))
    seconds = time.perf_counter() - started
    return {"tok_s": round(sum(done) / seconds, 1), "steps": runtime.loop.step_counts.steps - steps,
            "adapter_switches": runtime.adapters.num_switches - switches}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    opts = parser.parse_args()
    from modeld.backends.llamacpp.lora import base_shapes
    from modeld.backends.model_config import load_model_toml

    runtime = load_runtime()
    shapes = {name: shape for name, shape in base_shapes(runtime.llama_model.path).shapes.items() if len(shape) == 2}
    tmp = tempfile.TemporaryDirectory()
    adapters, loads = [], []
    for i in range(4):
        folder = Path(tmp.name) / f"adapter-{i}"
        write_adapter(folder, shapes, opts.rank, seed=i)
        started = time.perf_counter()
        adapters.append(runtime.load_adapter(load_model_toml(folder.name, folder / "model.toml"), folder))
        loads.append({"seconds": round(time.perf_counter() - started, 3), "nbytes": adapters[-1].nbytes,
                      "file_bytes": (folder / "adapter.gguf").stat().st_size})
    sides = {
        "base": [runtime] * STREAMS,
        "one_adapter": [adapters[0]] * STREAMS,
        "mixed_2": [adapters[i % 2] for i in range(STREAMS)],
        "mixed_4": [adapters[i % 4] for i in range(STREAMS)],
    }

    async def run() -> list[dict]:
        await runtime.start()
        try:
            for models in sides.values():  # warm-up: each side once
                await _side(runtime, models, 16)
            rounds = []
            for _ in range(opts.rounds):
                row = {name: await _side(runtime, models, opts.tokens) for name, models in sides.items()}
                base, one = row["base"]["tok_s"], row["one_adapter"]["tok_s"]
                row["ratios"] = {"one_adapter/base": round(one / base, 3),
                                 "mixed_2/base": round(row["mixed_2"]["tok_s"] / base, 3),
                                 "mixed_4/base": round(row["mixed_4"]["tok_s"] / base, 3),
                                 "mixed_2/one_adapter": round(row["mixed_2"]["tok_s"] / one, 3),
                                 "mixed_4/one_adapter": round(row["mixed_4"]["tok_s"] / one, 3)}
                rounds.append(row)
                print(json.dumps(row), file=sys.stderr)
            return rounds
        finally:
            await runtime.stop()

    try:
        rounds = asyncio.run(run())
    finally:
        for adapter in adapters:
            adapter.unload()
        runtime.unload()
        tmp.cleanup()
    medians = {key: statistics.median(r["ratios"][key] for r in rounds) for key in rounds[0]["ratios"]}
    result = {
        "what": f"llamacpp backend, SmolLM2-135M Q4_1, {STREAMS} streams x {opts.tokens} tokens, greedy: all on the "
                f"base, all on one rank-{opts.rank} adapter (all 7 projections), spread over 2 and over 4 such "
                "adapters (one adapter set per step, sets in turn); interleaved rounds",
        "command": "flock /tmp/coord/bench.lock .venv/bin/python bench/bench_lora_llamacpp.py " + " ".join(sys.argv[1:]),
        "rounds": rounds, "median_ratios": medians, "adapter_cold_load": loads,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "lora_llamacpp.json").write_text(json.dumps(result, indent=2) + "\n")
    print("lora_llamacpp: median " + ", ".join(f"{k} {v:.2f}x" for k, v in medians.items()))


if __name__ == "__main__":
    main()
