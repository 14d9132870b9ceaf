"""modeld's torch runtime (`smollm2-torch`) against vLLM on CPU, the torch-runtime
peer, on the same weights and dtype.

Sides, both servers up for the whole run, one working at a time:
  modeld  `smollm2-torch` (models/smollm2-torch: the GGUF dequantized to fp32,
          torch.compile on, its defaults) from a temporary repository whose
          model.toml has no draft model, over gRPC Generate (--protocol
          http: over its OpenAI /v1/completions, the prefix cache off by
          the request's cache_prompt, streamed by vLLM's client code)
  vllm    vLLM (CPU build, .venv-vllm) serving var/hf/smollm2 (the same weights
          in Hugging Face format, bench/peers/hf_weights.py), --dtype float32,
          over its OpenAI /v1/completions (server-sent events), given both
          cores as bench/peers notes say is fair: VLLM_CPU_NUM_OF_RESERVED_CPU=0
          VLLM_CPU_OMP_THREADS_BIND=0-1 OMP_NUM_THREADS=2 (by default it keeps
          one of the two cores for itself); eager unless --compile
Every stream is greedy and asks for exactly --tokens tokens with EOS
suppressed (ignore_eos on both sides); prompt caching is off on both
(cache_prompt false; vLLM --no-enable-prefix-caching), so every round
prefills. Each round runs, in racing.round_order, 8 concurrent streams and
then 1 stream on each side (aggregate tokens / wall time, request to last
token; and the p50 time to first token). Before each block both servers are
let go idle (racing.settle): vLLM keeps a core busy for about a second after
its last reply, which otherwise lands on whoever runs next.

Goals (issue 14): 8 streams >= 1.25x vLLM, 1 stream >= 1.25x, each the median
over rounds of the per-round ratio; (issue 30) the time to first token at
one stream <= 1.0x vLLM's, the median of the rounds' ratios of p50s. Reported, never asserted. Each round also
times the machine's ceiling for a decode step (bench_torch.DecodeFloor: the bare weight
products, in this process while both servers idle), and both servers' rates
are reported as a share of it; and what modeld's forward pass spends beyond
its products (bench_torch.StepOverhead: the served layer count and code
path at no width), which with the floor bounds modeld's forward pass.

    .venv/bin/python bench/bench_torch_vllm.py [--rounds 5] [--tokens 64] [--protocol grpc|http] [--compile]

Writes bench/results/torch_vllm.json and torch_vllm.png (--output: elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT / "tests"), str(ROOT / "tests/remote")]
RESULTS = ROOT / "bench" / "results"

from racing import goal, machine, median_ratio, round_order, settle  # noqa: E402
from vllm_server import SERVED_NAME, VENV, VllmServer, missing  # noqa: E402

from bench_torch import DecodeFloor, StepOverhead  # noqa: E402

MODEL = "smollm2-torch"
SIDES = ("modeld", "vllm")
PROMPTS = [
    "Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
    "List ten uses for a paperclip.", "Describe the water cycle to a child.",
    "What makes a good cup of coffee?", "Summarise the history of the printing press.",
    "Give advice to a new gardener.", "Why is the sky blue?",
]
GOALS = {"streams8": 1.25, "streams1": 1.25}
TTFT_GOAL = 1.0  # issue 30: modeld's time to first token at one stream, over vLLM's
FAIR_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2"}


class FairVllm(VllmServer):
    """VllmServer with both cores for its compute and no prefix cache."""

    def command(self) -> list[str]:
        return [*super().command(), "--no-enable-prefix-caching"]

    def environment(self) -> dict[str, str]:
        return {**super().environment(), **FAIR_ENV}


def repository() -> Path:
    """smollm2-torch alone: links to its files, its model.toml without the draft model."""
    repo = Path(tempfile.mkdtemp(prefix="modeld-bench-"))
    source, target = ROOT / "models" / MODEL, repo / MODEL
    target.mkdir()
    for entry in source.iterdir():
        if entry.name != "model.toml":
            (target / entry.name).symlink_to(entry.resolve())
    lines = (source / "model.toml").read_text().splitlines()
    (target / "model.toml").write_text("\n".join(l for l in lines if not l.startswith("draft_model")) + "\n")
    return repo


def floor_block(floor: DecodeFloor, overhead: StepOverhead, streams: int) -> dict:
    """bench_torch's decode floor (every weight product of one fp32 decode
    step, modeld's kernel, nothing else) as tokens/s, best of five: a decode
    step streams every weight from memory, so this bare loop is the machine's
    ceiling for either server. It leaves out prefill, attention and sampling,
    so no server can reach it. With it, what modeld's forward pass spends
    beyond its products on a model of no width (StepOverhead): the floor
    plus that is the most modeld's own forward pass could reach here, its
    arithmetic outside the products aside."""
    best = min(floor.step_times(streams))
    beyond = overhead.beyond_products(streams)
    return {"tokens_per_s": round(streams / best, 2), "step_ms": round(best * 1e3, 2),
            "overhead_ms": round(beyond * 1e3, 2), "forward_bound_tokens_per_s": round(streams / (best + beyond), 2),
            "load_avg_1m": round(os.getloadavg()[0], 2)}


class Sides:
    def __init__(self, vllm: VllmServer, daemon, tokens: int, protocol: str = "grpc") -> None:
        import aiohttp
        import grpc

        from modeld.gen import generation_pb2_grpc as gg

        self.tokens, self.protocol = tokens, protocol
        self.pids = [vllm.proc.pid, daemon.proc.pid]
        self.http = aiohttp.ClientSession(vllm.url, connector=aiohttp.TCPConnector(limit=8))
        self.channel = grpc.aio.insecure_channel(daemon.address)
        self.stub = gg.GenerationStub(self.channel)
        self.modeld_http = (aiohttp.ClientSession(daemon.http_url, connector=aiohttp.TCPConnector(limit=8))
                            if protocol == "http" else None)

    async def close(self) -> None:
        await self.http.close()
        await self.channel.close()
        if self.modeld_http is not None:
            await self.modeld_http.close()

    async def vllm(self, prompt: str) -> dict:
        """vLLM's stream, its first token at its first chunk (gRPC races)."""
        return await self.completion(self.http, {"model": SERVED_NAME, "prompt": prompt}, first_at_text=False)

    async def modeld(self, prompt: str) -> dict:
        from modeld.gen import generation_pb2 as g

        request = g.GenerateRequest(model=MODEL, prompt=prompt, sampling=g.SamplingParams(
            max_tokens=self.tokens, temperature=0.0, ignore_eos=True, cache_prompt=False))
        started, first, tokens, text = time.perf_counter(), None, 0, []
        async for response in self.stub.Generate(request, timeout=900):
            if response.token_ids:
                first = first or time.perf_counter()
            text.append(response.text)
            tokens = response.usage.completion_tokens or tokens
        return {"ttft_s": first - started, "tokens": tokens, "end": time.perf_counter(), "text": "".join(text)}

    async def completion(self, session, body: dict, first_at_text: bool = True) -> dict:
        """One streamed OpenAI completion, the same client code for either
        server: with first_at_text (--protocol http) the time to first token
        is to the first chunk with text (a token whose text is empty, such as
        a special one, opens vLLM's stream but not modeld's, so the first
        text is the event both streams share; greedy, both write the same
        text), else to the first chunk with a choice."""
        body = {**body, "max_tokens": self.tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        started, first, tokens, text = time.perf_counter(), None, 0, []
        async with session.post("/v1/completions", json=body, raise_for_status=True) as reply:
            async for line in reply.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                piece = "".join(c.get("text", "") for c in event.get("choices") or ())
                if piece or (event.get("choices") and not first_at_text):
                    first = first or time.perf_counter()
                    text.append(piece)
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        if first is None:
            raise RuntimeError(f"{body['model']}: the stream held no text")
        return {"ttft_s": first - started, "tokens": tokens, "end": time.perf_counter(), "text": "".join(text)}

    async def block(self, side: str, prompts: list[str]) -> dict:
        if self.protocol == "http":
            call = ((lambda p: self.completion(self.modeld_http, {"model": MODEL, "prompt": p, "cache_prompt": False}))
                    if side == "modeld" else (lambda p: self.completion(self.http, {"model": SERVED_NAME, "prompt": p})))
        else:
            call = self.modeld if side == "modeld" else self.vllm
        settled_s = await asyncio.to_thread(settle, self.pids)
        started = time.perf_counter()
        results = await asyncio.gather(*(call(p) for p in prompts))
        counts = [r["tokens"] for r in results]
        if counts != [self.tokens] * len(prompts):
            raise RuntimeError(f"{side}: streams ended early: {counts}")
        wall = max(r["end"] for r in results) - started
        return {"tokens_per_s": round(len(prompts) * self.tokens / wall, 2),
                "ttft_p50_ms": round(statistics.median(r["ttft_s"] for r in results) * 1e3, 1),
                "load_avg_1m": round(os.getloadavg()[0], 2), "settled_s": round(settled_s, 2), "texts": [r["text"] for r in results]}


async def race(sides: Sides, floor: DecodeFloor, overhead: StepOverhead, rounds: int) -> list[dict]:
    for side in SIDES:  # warm-up, unrecorded
        await sides.block(side, PROMPTS)
        await sides.block(side, PROMPTS[:1])
    out = []
    for index in range(rounds):
        order = round_order(SIDES, index)
        row: dict = {"order": order, "streams8": {}, "streams1": {}}
        for side in order:
            row["streams8"][side] = await sides.block(side, PROMPTS)
        one = [PROMPTS[index % len(PROMPTS)]]
        for side in order:
            row["streams1"][side] = await sides.block(side, one)
        # the ceiling in the same round, with both servers idle
        await asyncio.to_thread(settle, sides.pids)
        row["ceiling"] = {"streams8": floor_block(floor, overhead, len(PROMPTS)),
                          "streams1": floor_block(floor, overhead, 1)}
        out.append(row)
        print(f"round {index + 1}/{rounds} ({' then '.join(order)}): 8 streams " + ", ".join(
            f"{s} {row['streams8'][s]['tokens_per_s']:.1f}" for s in SIDES) + " tok/s; 1 stream " + ", ".join(
            f"{s} {row['streams1'][s]['tokens_per_s']:.1f}" for s in SIDES) + " tok/s; decode floor "
            f"{row['ceiling']['streams8']['tokens_per_s']:.1f} / {row['ceiling']['streams1']['tokens_per_s']:.1f} tok/s, "
            f"step overhead {row['ceiling']['streams8']['overhead_ms']:.1f} / {row['ceiling']['streams1']['overhead_ms']:.1f} ms "
            f"(load {os.getloadavg()[0]:.2f})",
            flush=True)
    return out


def summarise(rounds: list[dict]) -> tuple[dict, dict, dict, dict]:
    medians, ratios, agreement, ceiling = {}, {}, {}, {}
    for scenario in ("streams8", "streams1"):
        rate = {s: [r[scenario][s]["tokens_per_s"] for r in rounds] for s in SIDES}
        floor = [r["ceiling"][scenario]["tokens_per_s"] for r in rounds]
        bound = [r["ceiling"][scenario]["forward_bound_tokens_per_s"] for r in rounds]
        ceiling[scenario] = {"decode_floor_tokens_per_s": statistics.median(floor),
                             **{f"{s}_over_floor": round(median_ratio(rate[s], floor), 3) for s in SIDES},
                             "step_overhead_ms": statistics.median(r["ceiling"][scenario]["overhead_ms"] for r in rounds),
                             "forward_bound_tokens_per_s": statistics.median(bound),
                             "modeld_over_forward_bound": round(median_ratio(rate["modeld"], bound), 3)}
        # where the goal sits against the machine: the fraction of the floor
        # modeld must reach to beat vLLM by the goal at vLLM's own fraction
        # (above about 1.0 no server could, the floor leaving out attention,
        # prefill and sampling)
        ceiling[scenario]["goal_needs_modeld_over_floor"] = round(
            GOALS[scenario] * ceiling[scenario]["vllm_over_floor"], 3)
        medians[scenario] = {s: {"tokens_per_s": statistics.median(rate[s]),
                                 "ttft_p50_ms": statistics.median(r[scenario][s]["ttft_p50_ms"] for r in rounds)}
                             for s in SIDES}
        ratios[scenario] = {**goal(median_ratio(rate["modeld"], rate["vllm"]), GOALS[scenario]),
                            "rounds": [round(m / v, 3) for m, v in zip(rate["modeld"], rate["vllm"])]}
        ttft = {s: [r[scenario][s]["ttft_p50_ms"] for r in rounds] for s in SIDES}
        ratios[scenario]["ttft"] = {**goal(median_ratio(ttft["modeld"], ttft["vllm"]), TTFT_GOAL, False),
                                    "rounds": [round(m / v, 3) for m, v in zip(ttft["modeld"], ttft["vllm"])]}
        # fp32 greedy on both: the texts should mostly agree (not required: kernels differ in rounding)
        pairs = [(a, b) for r in rounds for a, b in zip(r[scenario]["modeld"]["texts"], r[scenario]["vllm"]["texts"])]
        agreement[scenario] = {"identical_texts": sum(a == b for a, b in pairs), "of": len(pairs)}
    return medians, ratios, agreement, ceiling


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    colours = {"modeld": "#2a7", "vllm": "#888"}
    labels = {"modeld": "modeld torch\n(smollm2-torch)", "vllm": "vLLM CPU\n(both cores)"}
    for ax, scenario, title in ((axes[0], "streams8", "8 streams"), (axes[1], "streams1", "1 stream")):
        for x, side in enumerate(SIDES):
            values = [r[scenario][side]["tokens_per_s"] for r in record["rounds"]]
            bar = ax.bar(x, statistics.median(values), color=colours[side], alpha=0.6)
            ax.bar_label(bar, fmt="%.1f")
            ax.scatter([x] * len(values), values, color=colours[side], edgecolor="black", zorder=3)
        floor = record["ceiling"][scenario]["decode_floor_tokens_per_s"]
        ax.axhline(floor, color="#c33", linestyle="--", linewidth=1)
        ax.annotate(f"decode floor {floor:.0f} tok/s", (0.02, floor), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=8, color="#c33")
        ax.set_xticks(range(len(SIDES)), [labels[s] for s in SIDES])
        g = record["ratios"][scenario]
        ax.set_title(f"{title} x {record['tokens_per_stream']} tokens: {g['ratio']:.2f}x (goal {g['goal']})", fontsize=10)
        ax.set_ylabel("tokens / s (median of rounds; dots: rounds)")
    fig.suptitle(f"SmolLM2-135M fp32, greedy: modeld torch runtime vs vLLM CPU "
                 f"(load average {record['machine']['load_average'][0]:.1f} at start)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run(vllm: VllmServer, daemon, floor: DecodeFloor, overhead: StepOverhead, rounds: int,
              tokens: int, protocol: str = "grpc") -> list[dict]:
    sides = Sides(vllm, daemon, tokens, protocol)
    try:
        return await race(sides, floor, overhead, rounds)
    finally:
        await sides.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="modeld torch runtime vs vLLM CPU")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64, help="completion tokens per stream")
    parser.add_argument("--output", type=Path, default=RESULTS / "torch_vllm.json",
                        help="the record; its chart goes beside it as .png")
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                        help="grpc: modeld's Generate against vLLM's /v1/completions; http: both servers' "
                             "/v1/completions, streamed by the same client")
    parser.add_argument("--compile", action="store_true",
                        help="let vLLM torch.compile (minutes at every start with vllm-cpu 0.32; eager otherwise)")
    args = parser.parse_args()
    reason = missing()
    if reason:
        sys.exit(f"bench_torch_vllm: {reason}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from daemon import start_daemon

    record: dict = {"command": " ".join([".venv/bin/python bench/bench_torch_vllm.py", *sys.argv[1:]]),
                    "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine(),
                    "protocol": args.protocol, "streams": [8, 1], "tokens_per_stream": args.tokens, "rounds_run": args.rounds, "goals": GOALS}
    vllm = FairVllm(eager=not args.compile)
    print(f"starting vLLM on {vllm.url} ({'compiled' if args.compile else 'eager'}, {FAIR_ENV})", flush=True)
    vllm.start()
    stamps = sorted(p.name for p in VENV.glob(".modeld-vllm-*"))
    record["vllm"] = {"version": stamps[-1].removeprefix(".modeld-vllm-") if stamps else "unknown",
                      "start_s": round(vllm.start_s, 1), "command": vllm.command(), "environment": FAIR_ENV,
                      "dtype": "float32", "enforce_eager": vllm.eager}
    print(f"vLLM ready in {vllm.start_s:.0f} s; starting modeld ({MODEL}, torch.compile at load)", flush=True)
    repo, daemon = repository(), None
    try:
        started = time.monotonic()
        ports = [] if args.protocol == "http" else ["--http-port", "-1"]
        daemon = start_daemon(*ports, "--metrics-port", "-1", repository=repo, timeout=1200)
        record["modeld"] = {"model": MODEL, "start_and_load_s": round(time.monotonic() - started, 1),
                            "model_toml": (repo / MODEL / "model.toml").read_text()}
        print(f"modeld ready in {record['modeld']['start_and_load_s']:.0f} s", flush=True)
        floor = DecodeFloor()
        record["decode_floor"] = {"matrices": len(floor.matrices), "parameters": floor.params,
                                  "kernel": floor.kernel, "dtype": "float32"}
        overhead = StepOverhead(floor.n_layers, floor.n_heads, floor.n_kv_heads)
        record["step_overhead"] = {"model": "the served layer count and heads, width 72, MLP 64, vocabulary 256",
                                   "compiled": overhead.compiled}
        record["rounds"] = asyncio.run(run(vllm, daemon, floor, overhead, args.rounds, args.tokens, args.protocol))
    finally:
        if daemon is not None:
            daemon.stop()
        vllm.stop()
        shutil.rmtree(repo, ignore_errors=True)
    record["machine"]["load_avg_at_end"] = list(os.getloadavg())
    record["medians"], record["ratios"], record["greedy_text_agreement"], record["ceiling"] = summarise(record["rounds"])
    for row in record["rounds"]:  # the texts served the agreement count; keep the record small
        for scenario in ("streams8", "streams1"):
            for side in SIDES:
                row[scenario][side].pop("texts")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(record, indent=2) + "\n")
    chart(record, args.output.with_suffix(".png"))
    for scenario, label in (("streams8", "8 streams"), ("streams1", "1 stream")):
        m, g = record["medians"][scenario], record["ratios"][scenario]
        print(f"{label}: modeld {m['modeld']['tokens_per_s']:.1f} tok/s (TTFT p50 {m['modeld']['ttft_p50_ms']:.0f} ms), "
              f"vLLM {m['vllm']['tokens_per_s']:.1f} tok/s (TTFT p50 {m['vllm']['ttft_p50_ms']:.0f} ms): "
              f"{g['ratio']:.2f}x, goal {g['goal']}: {'met' if g['met'] else 'missed'}; decode floor "
              f"{record['ceiling'][scenario]['decode_floor_tokens_per_s']:.1f} tok/s (modeld "
              f"{record['ceiling'][scenario]['modeld_over_floor']:.2f}x of it, vLLM "
              f"{record['ceiling'][scenario]['vllm_over_floor']:.2f}x; the goal needs modeld at "
              f"{record['ceiling'][scenario]['goal_needs_modeld_over_floor']:.2f}x); step overhead "
              f"{record['ceiling'][scenario]['step_overhead_ms']:.1f} ms, forward bound "
              f"{record['ceiling'][scenario]['forward_bound_tokens_per_s']:.1f} tok/s (modeld "
              f"{record['ceiling'][scenario]['modeld_over_forward_bound']:.2f}x of it); TTFT "
              f"{g['ttft']['ratio']:.2f}x vLLM's")
    print(f"greedy texts identical: {record['greedy_text_agreement']}; load average "
          f"{record['machine']['load_average'][0]:.2f} at start, {record['machine']['load_avg_at_end'][0]:.2f} at end")
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


if __name__ == "__main__":
    main()
