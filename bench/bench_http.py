"""The daemon's HTTP fronts against its gRPC services, on one daemon.

Each comparison is one function taking the running daemon and returning its
figures; `COMPARISONS` lists them, so the OpenAI front's parts (embeddings,
SSE generation) join as functions of their own.

- `kserve_infer`: 2000 single-sentence `minilm` infer calls from 32
  concurrent clients (asyncio tasks), KServe v2 REST through the stock
  `tritonclient.http.aio` (binary tensor extension, its default) against
  gRPC through the stock `tritonclient.grpc.aio`. Rounds alternate which
  protocol goes first, so a neighbour that wakes up mid-run slows both
  alike; the ratio reported is the median of the rounds' HTTP/gRPC time.

- `openai_embeddings`: the same single-sentence `minilm` calls through the
  OpenAI front, `POST /v1/embeddings` (base64 vectors, what the openai SDK
  asks for by default), against gRPC ModelInfer. The HTTP client is aiohttp
  (what tritonclient.http.aio uses): httpx's async client, under the openai
  SDK, spent more CPU per call than the daemon here (GET /v1/models: 60
  calls/s through httpx, 500-600 through aiohttp), which would measure the
  client rather than the front.
- `openai_generation`: 8 concurrent `smollm2` streams of exactly 64 tokens
  (greedy, ignore_eos): `/v1/completions` server-sent events against
  `modeld.v1.Generation/Generate`; tokens/s per round, the ratio the median
  of the rounds' SSE/gRPC throughput. `--calls` does not apply.
- `embedding_request_split`: how the OpenAI front should hand a request of
  8 strings to the engine: one infer call holding all 8 (what it does) or 8
  calls of one (the batcher merges them anyway), 32 concurrent requests,
  in-process on an engine of our own so only that choice differs.

Clients and daemon share the machine's cores: the figures include each
client library's own cost, as a caller would pay it. A report, not a test:
nothing is asserted. Results: bench/results/http.json.

    .venv/bin/python bench/bench_http.py [--rounds 5] [--calls 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results" / "http.json"

CONCURRENCY = 32
WARMUP_CALLS = 200
SENTENCES = [
    "The cat sits on the mat.", "modeld serves many models from one process.", "A quick brown fox jumps.",
    "Embeddings map sentences to vectors.", "The weather is mild today.", "Python is a programming language.",
    "Two cores are shared by several engineers.", "HTTP and gRPC reach the same engine.",
]


async def _timed(call: Callable[[int], Awaitable[None]], calls: int) -> float:
    """Seconds for `calls` calls spread over CONCURRENCY workers that each
    take the next call number as soon as their last one returns."""
    numbers = iter(range(calls))

    async def worker() -> None:
        for number in numbers:
            await call(number)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    return time.perf_counter() - start


async def _interleaved(variants: dict[str, Callable[[int], Awaitable[None]]], calls: int, rounds: int) -> dict:
    """Rounds of every variant, the order rotating each round; per variant
    its throughput per round, and the median ratio of the first variant's
    time to the second's."""
    names = list(variants)
    for name in names:
        await _timed(variants[name], WARMUP_CALLS)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    load: list[float] = []
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            seconds[name].append(await _timed(variants[name], calls))
        load.append(os.getloadavg()[0])
    first, second = names[0], names[1]
    ratios = [a / b for a, b in zip(seconds[first], seconds[second])]
    return {
        "calls_per_round": calls, "concurrency": CONCURRENCY, "rounds": rounds, "load_avg_1m": load,
        **{f"{n}_rps": [round(calls / s, 1) for s in seconds[n]] for n in names},
        **{f"{n}_median_rps": round(calls / statistics.median(seconds[n]), 1) for n in names},
        f"{first}_over_{second}_time_ratio_median": round(statistics.median(ratios), 3),
        "time_ratios": [round(r, 3) for r in ratios],
    }


async def kserve_infer(daemon, calls: int, rounds: int) -> dict:
    """minilm, one sentence per call: KServe v2 REST vs gRPC, stock tritonclient."""
    import tritonclient.grpc.aio as tg
    import tritonclient.http.aio as th

    texts = [np.array([s.encode()], dtype=object) for s in SENTENCES]
    grpc_client = tg.InferenceServerClient(daemon.address)
    http_client = th.InferenceServerClient(f"127.0.0.1:{daemon.http_port}", conn_limit=CONCURRENCY)

    async def over_grpc(number: int) -> None:
        tensor = tg.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(texts[number % len(texts)])
        result = await grpc_client.infer("minilm", [tensor])
        assert result.as_numpy("embedding").shape == (1, 384)

    async def over_http(number: int) -> None:
        tensor = th.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(texts[number % len(texts)])
        result = await http_client.infer("minilm", [tensor])
        assert result.as_numpy("embedding").shape == (1, 384)

    try:
        return await _interleaved({"http": over_http, "grpc": over_grpc}, calls, rounds)
    finally:
        await http_client.close()
        await grpc_client.close()


async def openai_embeddings(daemon, calls: int, rounds: int) -> dict:
    """minilm, one sentence per call: POST /v1/embeddings vs gRPC ModelInfer."""
    import base64

    import aiohttp
    import tritonclient.grpc.aio as tg

    grpc_client = tg.InferenceServerClient(daemon.address)
    http_client = aiohttp.ClientSession(f"http://127.0.0.1:{daemon.http_port}",
                                        connector=aiohttp.TCPConnector(limit=CONCURRENCY))
    texts = [np.array([s.encode()], dtype=object) for s in SENTENCES]

    async def over_grpc(number: int) -> None:
        tensor = tg.InferInput("text", [1], "BYTES")
        tensor.set_data_from_numpy(texts[number % len(texts)])
        result = await grpc_client.infer("minilm", [tensor])
        assert result.as_numpy("embedding").shape == (1, 384)

    async def over_openai(number: int) -> None:
        async with http_client.post("/v1/embeddings", raise_for_status=True, json={
                "model": "minilm", "input": SENTENCES[number % len(SENTENCES)], "encoding_format": "base64"}) as reply:
            data = (await reply.json())["data"]
        assert np.frombuffer(base64.b64decode(data[0]["embedding"]), dtype="<f4").shape == (384,)

    try:
        return await _interleaved({"openai": over_openai, "grpc": over_grpc}, calls, rounds)
    finally:
        await http_client.close()
        await grpc_client.close()


GENERATION_STREAMS = 8
GENERATION_TOKENS = 64
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,",
    "Water boils at", "The best way to learn a language is", "In 1492,", "Python is a",
]


async def openai_generation(daemon, calls: int, rounds: int) -> dict:
    """smollm2, 8 concurrent streams of 64 tokens: SSE (/v1/completions) vs gRPC Generate."""
    import aiohttp
    import grpc
    import tritonclient.grpc as tg

    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    tg.InferenceServerClient(daemon.address).load_model("smollm2")
    http_client = aiohttp.ClientSession(f"http://127.0.0.1:{daemon.http_port}",
                                        connector=aiohttp.TCPConnector(limit=GENERATION_STREAMS))
    channel = grpc.aio.insecure_channel(daemon.address)
    stub = gg.GenerationStub(channel)

    async def sse_stream(prompt: str) -> int:
        body = {"model": "smollm2", "prompt": prompt, "max_tokens": GENERATION_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens = 0
        async with http_client.post("/v1/completions", json=body, raise_for_status=True) as reply:
            async for line in reply.content:  # one event line at a time, as it arrives
                if line.startswith(b"data: {"):
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
        return tokens

    async def grpc_stream(prompt: str) -> int:
        request = g.GenerateRequest(model="smollm2", prompt=prompt, sampling=g.SamplingParams(
            max_tokens=GENERATION_TOKENS, temperature=0.0, ignore_eos=True))
        tokens = 0
        async for response in stub.Generate(request, timeout=600):
            tokens = response.usage.completion_tokens or tokens
        return tokens

    async def timed(stream) -> float:
        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(PROMPTS[i % len(PROMPTS)]) for i in range(GENERATION_STREAMS)))
        elapsed = time.perf_counter() - start
        assert counts == [GENERATION_TOKENS] * GENERATION_STREAMS, counts
        return GENERATION_STREAMS * GENERATION_TOKENS / elapsed

    variants = {"sse": sse_stream, "grpc": grpc_stream}
    try:
        for stream in variants.values():
            await timed(stream)  # warm-up: prompts cached alike for both
        rates: dict[str, list[float]] = {n: [] for n in variants}
        load: list[float] = []
        for index in range(rounds):
            names = list(variants)
            for name in names[index % 2:] + names[:index % 2]:
                rates[name].append(await timed(variants[name]))
            load.append(os.getloadavg()[0])
        ratios = [a / b for a, b in zip(rates["sse"], rates["grpc"])]
        return {
            "streams": GENERATION_STREAMS, "tokens_per_stream": GENERATION_TOKENS, "rounds": rounds,
            "load_avg_1m": load,
            **{f"{n}_tokens_per_s": [round(r, 1) for r in rates[n]] for n in variants},
            **{f"{n}_median_tokens_per_s": round(statistics.median(rates[n]), 1) for n in variants},
            "sse_over_grpc_throughput_ratio_median": round(statistics.median(ratios), 3),
            "throughput_ratios": [round(r, 3) for r in ratios],
        }
    finally:
        await http_client.close()
        await channel.close()


async def embedding_request_split(daemon, calls: int, rounds: int) -> dict:
    """Requests of 8 strings, in-process: one infer call of 8 vs 8 calls of 1."""
    import tempfile

    from modeld.backends.registry import BackendRegistry
    from modeld.server.engine import Engine
    from modeld.server.memory import MemoryManager
    from modeld.server.metrics import Metrics
    from modeld.server.repository import ModelRepository
    from modeld.server.requests import InferRequest

    per_request = 8
    with tempfile.TemporaryDirectory() as inline:
        engine = Engine(ModelRepository(ROOT / "models", Path(inline)), BackendRegistry(), MemoryManager(2**31),
                        Metrics())
        await engine.load("minilm")

        def texts(number: int) -> list[bytes]:
            return [SENTENCES[(number + i) % len(SENTENCES)].encode() for i in range(per_request)]

        async def one_call(number: int) -> None:
            result = await engine.infer(InferRequest("minilm", {"text": np.array(texts(number), dtype=object)}))
            assert result.outputs["embedding"].shape == (per_request, 384)

        async def call_per_string(number: int) -> None:
            results = await asyncio.gather(*(
                engine.infer(InferRequest("minilm", {"text": np.array([t], dtype=object)})) for t in texts(number)))
            assert all(r.outputs["embedding"].shape == (1, 384) for r in results)

        try:
            figures = await _interleaved({"one_call": one_call, "call_per_string": call_per_string},
                                         max(calls // per_request, CONCURRENCY), rounds)
        finally:
            await engine.stop()
    return {"strings_per_request": per_request, **figures}


COMPARISONS = [kserve_infer, openai_embeddings, openai_generation, embedding_request_split]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--only", help="run only the comparison of this name")
    args = parser.parse_args()

    import tritonclient.grpc as tg

    from daemon import start_daemon

    daemon = start_daemon("--no-preload", "--metrics-port", "-1")
    results: dict = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "cpus": os.cpu_count()}
    try:
        tg.InferenceServerClient(daemon.address).load_model("minilm")
        for comparison in COMPARISONS:
            if args.only and comparison.__name__ != args.only:
                continue
            figures = asyncio.run(comparison(daemon, args.calls, args.rounds))
            results[comparison.__name__] = figures
            print(comparison.__name__, json.dumps(figures, indent=2), flush=True)
    finally:
        daemon.stop()
    RESULTS.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
