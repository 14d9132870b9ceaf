"""modeld's llama.cpp backend vs llama-cpp-python's own OpenAI-compatible
server, on the same GGUF (SmolLM2-135M-Instruct Q4_1), greedy, in one run.

Measured, each side alone on the machine (the other server is stopped):
  1 stream      decode tok/s (after the first token) and time to first token
  8 streams     aggregate completion tok/s and median time to first token
  prefix cache  (modeld) time to first token with a 1,000-token prefix
                shared with an earlier request vs the same request cold
  n-gram spec.  (modeld) single-stream decode tok/s on a copy-heavy prompt, with
                and without n-gram speculation, and whether outputs match
  warm          (modeld) 8 streams on a daemon that first served 6 unrelated
                single requests, beside a fresh daemon, in interleaved rounds
                (issue 14: a daemon that had served traffic ran 0.7x as fast)
Generation is forced to max_tokens: modeld with ignore_eos, the peer with a
logit bias against end-of-sequence. Writes bench/results/llamacpp.json and
a PNG chart. `--warm-only [--rounds N]` runs the warm section alone and
updates that section of the JSON, keeping the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
GGUF = ROOT / "models/smollm2/model.gguf"
RESULTS = ROOT / "bench/results"
NEW_TOKENS = 128
PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "List ten uses for a paperclip.", "Describe the water cycle to a child.",
    "What makes a good cup of coffee?", "Summarise the history of the printing press.",
    "Give advice to a new gardener.", "Why is the sky blue?",
]
CODE = "\n".join(f"def handler_{i}(request):\n    value = request.get('field_{i}')\n    if value is None:\n"
                 f"        return error_response('missing field_{i}')\n    return ok_response(value * {i})\n"
                 for i in range(6))
COPY_PROMPT = ("Rewrite the following code exactly, but rename ok_response to success_response:\n\n"
               f"{CODE}\nRewritten code:\n")
UNRELATED = [  # issue 14's earlier traffic: single greedy requests, 32 tokens, prompts unlike PROMPTS
    "Tell me a joke about cats.", "What is the capital of Peru?", "Name three primary colours.",
    "How do airplanes fly?", "Translate 'good morning' into French.", "Write a haiku about rain.",
]
PREFIX = " ".join(f"Rule {i}: every answer must be polite, short and correct." for i in range(110))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the peer: llama-cpp-python's server over HTTP + SSE ----------------------------

class Peer:
    def __init__(self) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llama_cpp.server", "--model", str(GGUF), "--n_threads", "2",
             "--n_threads_batch", "2", "--n_ctx", "4096", "--port", str(self.port),
             "--interrupt_requests", "False", "--verbose", "False"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                requests.get(f"http://127.0.0.1:{self.port}/v1/models", timeout=1)
                break
            except requests.ConnectionError:
                time.sleep(0.3)
        from llama_cpp import Llama

        vocab_only = Llama(str(GGUF), vocab_only=True, verbose=False)
        self.eos = vocab_only.token_eos()

    def stream(self, prompt: str, max_tokens: int) -> dict:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "logit_bias": {str(self.eos): -100.0}}
        start, first, count, text = time.perf_counter(), None, 0, []
        with requests.post(self.url, json=body, stream=True, timeout=600) as response:
            for line in response.iter_lines():
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])["choices"][0]["text"]
                if chunk:
                    first = first or time.perf_counter()
                    count += 1
                    text.append(chunk)
        end = time.perf_counter()
        return {"ttft": first - start, "tokens": count, "decode_s": end - first, "total_s": end - start, "text": "".join(text)}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


# -- modeld over gRPC ----------------------------------------------------------------

class Modeld:
    def __init__(self, *args: str, repository: Path = ROOT / "models") -> None:
        from daemon import start_daemon

        self.daemon = start_daemon("--metrics-port", "-1", *args, repository=repository)

    def load(self, model: str = "smollm2") -> None:
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(self.daemon.address)
        client.load_model(model)
        client.close()

    async def stream(self, prompt: str, max_tokens: int, **sampling) -> dict:
        import grpc

        from modeld.gen import generation_pb2 as g
        from modeld.gen import generation_pb2_grpc as gg

        params = g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)
        async with grpc.aio.insecure_channel(self.daemon.address) as channel:
            stub = gg.GenerationStub(channel)
            start, first, count, ids, usage = time.perf_counter(), None, 0, [], None
            async for r in stub.Generate(g.GenerateRequest(model="smollm2", prompt=prompt, sampling=params), timeout=600):
                if r.token_ids:
                    first = first or time.perf_counter()
                    count += len(r.token_ids)
                    ids.extend(r.token_ids)
                if r.HasField("usage") and r.finish_reason:
                    usage = r.usage
        end = time.perf_counter()
        return {"ttft": first - start, "tokens": count, "decode_s": end - first, "total_s": end - start,
                "ids": ids, "cached": usage.cached_prompt_tokens if usage else 0,
                "drafted": usage.drafted_tokens if usage else 0, "accepted": usage.accepted_tokens if usage else 0}

    def stop(self) -> None:
        self.daemon.stop()


def decode_rate(r: dict) -> float:
    return (r["tokens"] - 1) / r["decode_s"]


def concurrent_threads(fn, prompts) -> tuple[list[dict], float]:
    results: list[dict] = [None] * len(prompts)

    def run(i, p):
        results[i] = fn(p)

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results, time.perf_counter() - start


def summarise(single: list[dict], many: list[dict], wall: float) -> dict:
    return {
        "single_decode_tok_s": statistics.median(decode_rate(r) for r in single),
        "single_ttft_s": statistics.median(r["ttft"] for r in single),
        "concurrent_tok_s": sum(r["tokens"] for r in many) / wall,
        "concurrent_median_ttft_s": statistics.median(r["ttft"] for r in many),
    }


def bench_peer() -> dict:
    peer = Peer()
    try:
        peer.stream("Warm up.", 8)
        single = [peer.stream(p, NEW_TOKENS) for p in PROMPTS[:3]]
        many, wall = concurrent_threads(lambda p: peer.stream(p, NEW_TOKENS), PROMPTS)
    finally:
        peer.stop()
    return summarise(single, many, wall)


async def bench_modeld() -> dict:
    node = Modeld()
    try:
        await node.stream("Warm up.", 8)
        single = [await node.stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS[:3]]
        start = time.perf_counter()
        many = await asyncio.gather(*(node.stream(p, NEW_TOKENS, cache_prompt=False) for p in PROMPTS))
        wall = time.perf_counter() - start
        result = summarise(single, many, wall)
        cold = await node.stream(PREFIX + " Question: what is rule 7?", 16, cache_prompt=False)
        await node.stream(PREFIX + " Question: what is rule 3?", 16)
        warm = await node.stream(PREFIX + " Question: what is rule 7?", 16)
        result["prefix"] = {"cold_ttft_s": cold["ttft"], "warm_ttft_s": warm["ttft"], "cached_tokens": warm["cached"],
                            "ratio": warm["ttft"] / cold["ttft"]}
        plain = await node.stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False)
        spec = await node.stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False, speculative=1, num_speculative_tokens=6)
        result["ngram"] = {"plain_tok_s": decode_rate(plain), "spec_tok_s": decode_rate(spec),
                           "identical": plain["ids"] == spec["ids"], "drafted": spec["drafted"], "accepted": spec["accepted"]}
        result["ngram"]["speedup"] = result["ngram"]["spec_tok_s"] / result["ngram"]["plain_tok_s"]
        draft = await node.stream(COPY_PROMPT, NEW_TOKENS, cache_prompt=False, speculative=2, num_speculative_tokens=4)
        result["draft"] = {"tok_s": decode_rate(draft), "identical": draft["ids"] == plain["ids"],
                           "acceptance": draft["accepted"] / max(draft["drafted"], 1)}
    finally:
        node.stop()
    return result


async def eight_streams(node: Modeld) -> dict:
    start = time.perf_counter()
    many = await asyncio.gather(*(node.stream(p, NEW_TOKENS) for p in PROMPTS))
    wall = time.perf_counter() - start
    return {"tok_s": sum(r["tokens"] for r in many) / wall, "median_ttft_s": statistics.median(r["ttft"] for r in many)}


async def bench_warm(rounds: int) -> dict:
    """Issue 14: the same 8 streams on a fresh daemon and on one that first
    served 6 unrelated single requests (prefixes cached, as by default).
    Each round starts both daemons (smollm2 only), then runs the two in
    alternating order; only the measured daemon works meanwhile."""
    runs = []
    for r in range(rounds):
        fresh, warm = Modeld("--no-preload"), Modeld("--no-preload")
        try:
            fresh.load()
            warm.load()
            for prompt in UNRELATED:
                await warm.stream(prompt, 32)
            order = [("fresh", fresh), ("warm", warm)]
            if r % 2:
                order.reverse()
            got = {name: await eight_streams(node) for name, node in order}
            # the "again on the next try": the same daemon, a second burst
            got["warm_again"] = await eight_streams(warm)
        finally:
            fresh.stop()
            warm.stop()
        got["first"] = order[0][0]
        runs.append(got)
        print(f"round {r}: fresh {got['fresh']['tok_s']:.1f} tok/s, after 6 unrelated requests "
              f"{got['warm']['tok_s']:.1f} (again {got['warm_again']['tok_s']:.1f}); {got['first']} ran first")
    ratios = [g["warm"]["tok_s"] / g["fresh"]["tok_s"] for g in runs]
    return {
        "command": f"python bench/bench_llamacpp.py --warm-only --rounds {rounds}",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "streams": len(PROMPTS), "new_tokens": NEW_TOKENS, "unrelated_requests": len(UNRELATED),
        "rounds": runs,
        "fresh_median_tok_s": statistics.median(g["fresh"]["tok_s"] for g in runs),
        "warm_median_tok_s": statistics.median(g["warm"]["tok_s"] for g in runs),
        "warm_over_fresh_median": statistics.median(ratios),
        "warm_over_fresh_rounds": ratios,
    }


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    m, p = record["modeld"], record["peer"]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    for ax, key, title in ((axes[0], "single_decode_tok_s", "1 stream decode tok/s"),
                           (axes[1], "concurrent_tok_s", "8 streams total tok/s"),
                           (axes[2], "concurrent_median_ttft_s", "8 streams median TTFT (s)")):
        ax.bar(["modeld", "llama-cpp-python server"], [m[key], p[key]], color=["#2a7", "#888"])
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm-only", action="store_true", help="only the fresh-vs-warm section; keep the rest")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the warm section")
    args = parser.parse_args()
    if args.warm_only:
        path = RESULTS / "llamacpp.json"
        record = json.loads(path.read_text()) if path.exists() else {}
        record["warm"] = asyncio.run(bench_warm(args.rounds))
        RESULTS.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2))
        print_warm(record["warm"])
        return
    peer = bench_peer()
    mine = asyncio.run(bench_modeld())
    ratios = {
        "single_decode": mine["single_decode_tok_s"] / peer["single_decode_tok_s"],
        "single_ttft": mine["single_ttft_s"] / peer["single_ttft_s"],
        "concurrent_throughput": mine["concurrent_tok_s"] / peer["concurrent_tok_s"],
        "concurrent_ttft": mine["concurrent_median_ttft_s"] / peer["concurrent_median_ttft_s"],
        "prefix_ttft": mine["prefix"]["ratio"],
        "ngram_speedup": mine["ngram"]["speedup"],
    }
    goals = {"single_decode": ratios["single_decode"] >= 1.0, "single_ttft": ratios["single_ttft"] <= 1.0,
             "concurrent_throughput": ratios["concurrent_throughput"] >= 3.0,
             "concurrent_ttft": ratios["concurrent_ttft"] <= 0.1, "prefix_ttft": ratios["prefix_ttft"] <= 0.25,
             "ngram_speedup": ratios["ngram_speedup"] >= 1.5 and mine["ngram"]["identical"]}
    warm = asyncio.run(bench_warm(args.rounds))
    record = {"command": "make bench (bench/bench_llamacpp.py)", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpu_count": os.cpu_count(), "new_tokens": NEW_TOKENS, "peer": peer, "modeld": mine,
              "ratios": ratios, "goals_met": goals, "warm": warm}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "llamacpp.json").write_text(json.dumps(record, indent=2))
    chart(record, RESULTS / "llamacpp.png")
    print(f"peer   1 stream {peer['single_decode_tok_s']:.1f} tok/s ttft {peer['single_ttft_s'] * 1000:.0f} ms | "
          f"8 streams {peer['concurrent_tok_s']:.1f} tok/s median ttft {peer['concurrent_median_ttft_s']:.2f} s")
    print(f"modeld 1 stream {mine['single_decode_tok_s']:.1f} tok/s ttft {mine['single_ttft_s'] * 1000:.0f} ms | "
          f"8 streams {mine['concurrent_tok_s']:.1f} tok/s median ttft {mine['concurrent_median_ttft_s']:.2f} s")
    print(f"modeld prefix cache: cold ttft {mine['prefix']['cold_ttft_s'] * 1000:.0f} ms, warm "
          f"{mine['prefix']['warm_ttft_s'] * 1000:.0f} ms ({mine['prefix']['cached_tokens']} cached tokens)")
    print(f"modeld n-gram: {mine['ngram']['plain_tok_s']:.1f} -> {mine['ngram']['spec_tok_s']:.1f} tok/s, identical="
          f"{mine['ngram']['identical']}, accepted {mine['ngram']['accepted']}/{mine['ngram']['drafted']}; draft model: "
          f"{mine['draft']['tok_s']:.1f} tok/s, acceptance {mine['draft']['acceptance']:.2f}, identical={mine['draft']['identical']}")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x ({'met' if goals[k] else 'missed'})" for k, v in ratios.items()))
    print_warm(warm)


def print_warm(warm: dict) -> None:
    print(f"modeld 8 streams fresh {warm['fresh_median_tok_s']:.1f} tok/s, after {warm['unrelated_requests']} unrelated "
          f"requests {warm['warm_median_tok_s']:.1f} tok/s: median ratio {warm['warm_over_fresh_median']:.2f}x "
          f"(rounds {', '.join(f'{r:.2f}' for r in warm['warm_over_fresh_rounds'])})")


if __name__ == "__main__":
    main()
