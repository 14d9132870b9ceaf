"""What a worker process costs: the same model in-process and in a worker.

One daemon serves four models from a temporary repository: minilm twice
(isolation = "in-process" and "process") and smollm2 (llama.cpp) twice,
from the same files. Measured, in alternating rounds (in-process block,
worker block, ...) so a neighbour that wakes up mid-run slows both alike:

1. minilm single-request latency, one client, one sentence per request
   (tritonclient.grpc, the stock KServe client): p50 and p99.
2. smollm2 generation throughput: 8 concurrent streams of 64 tokens each
   (ignore_eos) over modeld.v1.Generation; tok/s = tokens / wall time.

Wall-clock figures on a shared machine move with its load, so each block
also records the CPU time the daemon and the model's worker spent on it
(utime + stime from /proc): CPU ms per request and per token compare the two
placements even when neighbours make the wall clock useless.

Goals (issue 11): p50 in a worker at most 0.3 ms above in-process, and
generation in a worker at least 0.97x in-process. Reported, not asserted.
Writes bench/results/workers.json; `--only latency` measures minilm alone
(no smollm2 models, a quick check) and writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from daemon import MODELS, start_daemon  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "workers.json"
# smaller runs on a busy machine: BENCH_WORKERS_ROUNDS=2 BENCH_WORKERS_TOKENS=32
ROUNDS = int(os.environ.get("BENCH_WORKERS_ROUNDS", 4))
LATENCY_BLOCK = 150  # requests per variant per round
STREAMS = 8
NEW_TOKENS = int(os.environ.get("BENCH_WORKERS_TOKENS", 64))
SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."

LLM_TOML = """
format = "gguf"
backends = ["llamacpp"]
artifact = "model.gguf"
isolation = "{isolation}"

[llamacpp]
n_ctx = 8192
n_slots = 8
context_length = 1024
n_threads = 2
"""


def _repository(root: Path, generation: bool = True) -> None:
    minilm = (MODELS / "minilm" / "model.toml").read_text()
    for suffix, isolation in (("", "in-process"), ("-worker", "process")):
        folder = root / f"minilm{suffix}"
        folder.mkdir()
        (folder / "model.toml").write_text(
            minilm.replace('format = "onnx"', f'format = "onnx"\nisolation = "{isolation}"', 1))
        for artifact in ("model.onnx", "tokenizer.json"):
            (folder / artifact).symlink_to((MODELS / "minilm" / artifact).resolve())
        if not generation:
            continue
        folder = root / f"smollm2{suffix}"
        folder.mkdir()
        (folder / "model.toml").write_text(LLM_TOML.format(isolation=isolation))
        (folder / "model.gguf").symlink_to((MODELS / "smollm2" / "model.gguf").resolve())


_TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) * _TICK_S  # utime, stime
    return total


def _pids(daemon, model: str) -> list[int]:
    """The daemon, and the model's worker if it has one."""
    pids = [daemon.proc.pid]
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "cmdline").read_bytes().rstrip(b"\0 ").replace(b"\0", b" ") == f"modeld-worker {model}".encode():
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def _latencies(client, model: str, n: int) -> list[float]:
    import tritonclient.grpc as tc

    text = tc.InferInput("text", [1], "BYTES")
    text.set_data_from_numpy(np.array([SENTENCE.encode()], dtype=object))
    out = []
    for _ in range(n):
        start = time.perf_counter()
        client.infer(model, [text])
        out.append(time.perf_counter() - start)
    return out


async def _generation_tok_s(address: str, model: str) -> float:
    import grpc

    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gg.GenerationStub(channel)

        async def one(i: int) -> int:
            request = g.GenerateRequest(model=model, prompt=f"Story number {i}: once upon a time",
                                        sampling=g.SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True,
                                                                  cache_prompt=False))
            return sum([len(r.token_ids) async for r in stub.Generate(request, timeout=600)])

        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(i) for i in range(STREAMS)))
        return sum(tokens) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> dict:
    import tritonclient.grpc as tc

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["latency"], help="measure minilm's latency alone (writes no results)")
    only_latency = parser.parse_args(argv).only == "latency"
    with tempfile.TemporaryDirectory(prefix="bench-workers-") as tmp:
        _repository(Path(tmp), generation=not only_latency)
        daemon = start_daemon("--http-port", "-1", "--metrics-port", "-1", "--memory-budget", "8GiB",
                              repository=Path(tmp))
        try:
            client = tc.InferenceServerClient(daemon.address)
            for model in ("minilm", "minilm-worker"):
                _latencies(client, model, 30)  # warm-up
            for model in () if only_latency else ("smollm2", "smollm2-worker"):
                asyncio.run(_generation_tok_s(daemon.address, model))
            lat = {"in-process": [], "process": []}
            gen = {"in-process": [], "process": []}
            cpu_lat = {"in-process": 0.0, "process": 0.0}
            cpu_gen = {"in-process": 0.0, "process": 0.0}
            loads = []
            for round_ in range(ROUNDS):
                order = (("minilm", "in-process"), ("minilm-worker", "process"))
                for model, key in order if round_ % 2 == 0 else reversed(order):
                    pids = _pids(daemon, model)
                    before = _cpu_s(pids)
                    lat[key] += _latencies(client, model, LATENCY_BLOCK)
                    cpu_lat[key] += _cpu_s(pids) - before
                order = (("smollm2", "in-process"), ("smollm2-worker", "process"))
                for model, key in () if only_latency else order if round_ % 2 == 0 else reversed(order):
                    pids = _pids(daemon, model)
                    before = _cpu_s(pids)
                    gen[key].append(asyncio.run(_generation_tok_s(daemon.address, model)))
                    cpu_gen[key] += _cpu_s(pids) - before
                loads.append(os.getloadavg()[0])
                tok_s = "" if only_latency else (f"; tok/s in-process {gen['in-process'][-1]:.1f} "
                                                 f"worker {gen['process'][-1]:.1f}")
                print(f"round {round_ + 1}/{ROUNDS}: p50 ms in-process {np.median(lat['in-process']) * 1e3:.3f} "
                      f"worker {np.median(lat['process']) * 1e3:.3f}{tok_s}; load {loads[-1]:.1f}",
                      file=sys.stderr, flush=True)
            client.close()
        finally:
            daemon.stop()

    if only_latency:
        p50 = {k: float(np.median(v) * 1e3) for k, v in lat.items()}
        result = {"minilm_p50_ms": p50, "minilm_p50_delta_ms": p50["process"] - p50["in-process"],
                  "cpu_ms_per_request": {k: v * 1e3 / len(lat[k]) for k, v in cpu_lat.items()},
                  "load_average_during": loads}
        print(json.dumps(result, indent=2))
        return result

    def q(values, p):
        return float(np.percentile(np.array(values) * 1e3, p))

    result = {
        "command": "python bench/bench_workers.py",
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S%z"),
        "cpu_count": os.cpu_count(),
        "load_average_during": loads,
        "minilm_latency_ms": {k: {"p50": q(v, 50), "p99": q(v, 99), "n": len(v)} for k, v in lat.items()},
        "generation_tok_s": {k: {"median": statistics.median(v), "rounds": v} for k, v in gen.items()},
        # CPU of the daemon plus the model's worker (if any), per unit of work
        "cpu_ms_per_request": {k: v * 1e3 / len(lat[k]) for k, v in cpu_lat.items()},
        "cpu_ms_per_token": {k: v * 1e3 / (ROUNDS * STREAMS * NEW_TOKENS) for k, v in cpu_gen.items()},
        "streams": STREAMS,
        "new_tokens": NEW_TOKENS,
    }
    p50_delta = result["minilm_latency_ms"]["process"]["p50"] - result["minilm_latency_ms"]["in-process"]["p50"]
    ratio = result["generation_tok_s"]["process"]["median"] / result["generation_tok_s"]["in-process"]["median"]
    result["goals"] = {
        "minilm_p50_delta_ms": p50_delta, "minilm_p50_delta_ok": p50_delta <= 0.3,
        "generation_ratio": ratio, "generation_ratio_ok": ratio >= 0.97,
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
