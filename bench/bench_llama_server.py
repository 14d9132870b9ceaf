"""Issue 14: modeld's llamacpp backend against llama.cpp's own C++ server,
fresh and after warm traffic, with llama-batched-bench's decode as the
ceiling of this hardware. Same GGUF (SmolLM2-135M-Instruct Q4_1), same
llama.cpp (both built from the llama-cpp-python version our venv runs:
bench/peers/llama_server.sh), same threads, 8 slots of 2,048 cells each,
greedy, generation forced to NEW_TOKENS on both sides (ignore_eos).

Each round starts a fresh modeld and a fresh llama-server (both up, only
one working at a time) and runs, per side, in an order that alternates
between rounds:
  fresh   1 stream x 3 prompts (decode tok/s, time to first token), then
          8 streams (aggregate tok/s, median time to first token)
  warm    6 unrelated single greedy requests (32 tokens each, the same to
          both), then the same 8 streams again
The one-stream phase also records CPU ms per token by process
(racing.CpuPerToken): where modeld's time goes beside llama-server's.
The ceiling's turn runs llama-batched-bench (1 and 8 sequences), then its
one-sequence decode again beside a bare gRPC token stream at that rate, and
its 8-sequence decode beside 8 such streams (grpc_load.py): the best a
server that streams over gRPC in Python can do on the same two cores.
Ratios are per round (modeld / llama-server), reported as medians. Each
side starts once both servers are idle (racing.settle), so no side pays for
the other's threads still polling for work.

--protocol http races the two servers' OpenAI `/v1/completions` instead,
streamed by the same blocking client code (requests, one thread a stream):
the comparison a user of either's OpenAI API makes; its rounds also time
the one-stream phase and the 8 fresh streams through the pipeline floor
(pipeline_floor.py: a Python worker and front that do nothing but decode
and stream), what a server of modeld's shape reaches whatever its own
work. The default (grpc)
streams modeld's Generate and llama-server's native /completion. The
ceiling's gRPC rows are timed either way.

--threads N gives both servers and batched-bench N compute threads (2,
every core here, by default); with 1, a core is left to each server's own
work (its HTTP front, modeld's daemon and step loop, the client): how the
race runs on a machine with a core to spare beside the decode.

    .venv/bin/python bench/bench_llama_server.py [--rounds 5] [--protocol grpc|http] [--threads 2]

Writes bench/results/llama_server.json and llama_server.png (--output: elsewhere).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench_llamacpp import GGUF, PROMPTS, UNRELATED, Modeld, concurrent_threads, free_port  # noqa: E402
from grpc_load import GrpcStreamLoad  # noqa: E402
from racing import CpuPerToken, goal, machine, median_ratio, round_order, settle  # noqa: E402

PEER_BIN = ROOT / "var/peers/llama.cpp/bin"
RESULTS = ROOT / "bench/results"
NEW_TOKENS = 128
THREADS = 2


class LlamaServer:
    """llama.cpp's llama-server: 8 slots, continuous batching (its default)."""

    def __init__(self, threads: int = THREADS) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [str(PEER_BIN / "llama-server"), "-m", str(GGUF), "-t", str(threads), "-tb", str(threads),
             "-np", "8", "-c", "16384", "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.3)
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def stream(self, prompt: str, max_tokens: int) -> dict:
        # native endpoint: its last event carries the count of tokens predicted
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "stream": True,
                "ignore_eos": True, "cache_prompt": True}
        start, first, tokens = time.perf_counter(), None, 0
        with requests.post(f"{self.url}/completion", json=body, stream=True, timeout=600) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith(b"data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("content") and first is None:
                    first = time.perf_counter()
                if event.get("stop"):
                    tokens = event.get("tokens_predicted") or event["timings"]["predicted_n"]
        end = time.perf_counter()
        return {"ttft": first - start, "tokens": tokens, "decode_s": end - first, "total_s": end - start}

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def openai_stream(url: str, prompt: str, max_tokens: int) -> dict:
    """One streamed OpenAI completion (`/v1/completions`), the same client
    code for both servers: greedy, `max_tokens` forced by ignore_eos, the
    count of tokens from the usage chunk."""
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, first, tokens = time.perf_counter(), None, 0
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("text") for c in event.get("choices") or ()):
                first = time.perf_counter()
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    end = time.perf_counter()
    if first is None or tokens != max_tokens:
        raise RuntimeError(f"{url}: {tokens} tokens streamed, {max_tokens} asked for")
    return {"ttft": first - start, "tokens": tokens, "decode_s": end - first, "total_s": end - start}


def _rate(r: dict) -> float:
    return (r["tokens"] - 1) / r["decode_s"]


def _burst(results: list[dict], wall: float) -> dict:
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "median_ttft_s": statistics.median(r["ttft"] for r in results)}


def _single(results: list[dict]) -> dict:
    return {"tok_s": statistics.median(_rate(r) for r in results),
            "ttft_s": statistics.median(r["ttft"] for r in results)}


def run_blocking(stream, pid: int) -> dict:
    """The phases with a blocking client (`stream(prompt, max_tokens)`), 8
    streams on 8 threads; CPU of the process tree `pid`."""
    stream("Warm up.", 8)
    with CpuPerToken(pid) as cpu:
        single = _single(cpu.count([stream(p, NEW_TOKENS) for p in PROMPTS[:3]]))
    single["cpu_ms_per_token"] = cpu.figures
    fresh = _burst(*concurrent_threads(lambda p: stream(p, NEW_TOKENS), PROMPTS))
    for prompt in UNRELATED:
        stream(prompt, 32)
    warm = _burst(*concurrent_threads(lambda p: stream(p, NEW_TOKENS), PROMPTS))
    return {"single": single, "fresh": fresh, "warm": warm}


async def run_modeld(node: Modeld) -> dict:
    await node.stream("Warm up.", 8)
    # prefixes kept, as by default and as llama-server does (cache_prompt)
    with CpuPerToken(node.daemon.proc.pid) as cpu:
        single = _single(cpu.count([await node.stream(p, NEW_TOKENS) for p in PROMPTS[:3]]))
    single["cpu_ms_per_token"] = cpu.figures

    async def burst() -> dict:
        start = time.perf_counter()
        results = await asyncio.gather(*(node.stream(p, NEW_TOKENS) for p in PROMPTS))
        return _burst(results, time.perf_counter() - start)

    fresh = await burst()
    for prompt in UNRELATED:
        await node.stream(prompt, 32)
    warm = await burst()
    return {"single": single, "fresh": fresh, "warm": warm}


def batched_bench(sequences: str = "1,8", threads: int = THREADS) -> dict:
    """llama-batched-bench's decode speed at 1 and 8 sequences: what this
    hardware does on the same work with no server around it. A count given
    more than once runs that many times: its figures are the medians."""
    out = subprocess.run(
        [str(PEER_BIN / "llama-batched-bench"), "-m", str(GGUF), "-c", "4096", "-b", "512", "-ub", "512",
         "-npp", "32", "-ntg", str(NEW_TOKENS), "-npl", sequences, "-t", str(threads)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True, timeout=600).stdout
    # table rows: |  PP |  TG |  B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
    runs: dict[int, list[tuple[float, float]]] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and re.fullmatch(r"\d+", cells[0] or "x"):
            runs.setdefault(int(cells[2]), []).append((float(cells[7]), float(cells[5])))
    wanted = [int(n) for n in sequences.split(",")]
    if any(len(runs.get(n, ())) != wanted.count(n) for n in wanted):
        raise RuntimeError(f"could not read llama-batched-bench's table:\n{out}")
    return {n: {"decode_tok_s": statistics.median(d for d, _ in got), "prompt_tok_s": statistics.median(p for _, p in got)}
            for n, got in runs.items()}


def grpc_ceiling(rate: float, sequences: int = 1, threads: int = THREADS) -> dict:
    """batched-bench's decode of `sequences` sequences (median of three)
    while as many bare gRPC streams, `rate` tokens a second in all, run from
    a Python server to a Python client (grpc_load.py), and right before
    without them: the best a server streaming over gRPC in Python can do on
    these two cores, whatever else it does. One 128-token decode of one
    sequence lasts about a second and a half here, too short to stand alone
    on this machine."""
    runs = ",".join([str(sequences)] * 3)
    plain = batched_bench(runs, threads)[sequences]["decode_tok_s"]
    with GrpcStreamLoad(rate, streams=sequences) as load:
        loaded = batched_bench(runs, threads)[sequences]["decode_tok_s"]
    return {"decode_tok_s": loaded, "plain_decode_tok_s": plain, "load": load.figures}


SIDES = ["modeld", "llama-server", "ceiling"]


def repository_with_threads(threads: int, into: Path) -> Path:
    """models/smollm2 (and the draft its config names) in a repository of
    their own under `into`, the llamacpp backend's n_threads set to
    `threads`; the weights are links to the prepared ones."""
    for name in ("smollm2", "smollm2-draft"):
        source, target = ROOT / "models" / name, into / name
        target.mkdir(parents=True)
        config = (source / "model.toml").read_text()
        if name == "smollm2":
            config, count = re.subn(r"(?m)^n_threads = \d+", f"n_threads = {threads}", config)
            if count != 1:
                raise RuntimeError("models/smollm2/model.toml has no single `n_threads = N` line to change")
        (target / "model.toml").write_text(config)
        (target / "model.gguf").symlink_to((source / "model.gguf").resolve())
    return into


async def race(rounds: int, protocol: str, threads: int = THREADS) -> dict:
    runs = []
    repository = ROOT / "models"
    scratch = None
    if threads != THREADS:
        scratch = Path(tempfile.mkdtemp(prefix="modeld-threads-"))
        repository = repository_with_threads(threads, scratch / "models")
    try:
        for r in range(rounds):
            runs.append(await race_round(r, protocol, threads, repository))
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return {"protocol": protocol, "rounds": runs}


def run_pipeline(pipeline) -> dict:
    """The pipeline floor (bench/pipeline_floor.py: a worker and a front
    that do nothing else) through run_blocking's one stream and its 8 fresh
    streams; it keeps no prefix, so it has no warm phase."""
    def stream(prompt: str, max_tokens: int) -> dict:
        return openai_stream(pipeline.http_url, prompt, max_tokens)

    stream("Warm up.", 8)
    with CpuPerToken(pipeline.pid) as cpu:
        single = _single(cpu.count([stream(p, NEW_TOKENS) for p in PROMPTS[:3]]))
    single["cpu_ms_per_token"] = cpu.figures
    return {"single": single, "fresh": _burst(*concurrent_threads(lambda p: stream(p, NEW_TOKENS), PROMPTS))}


async def race_round(r: int, protocol: str, threads: int, repository: Path) -> dict:
    from pipeline_floor import PipelineFloor

    node, peer = Modeld("--no-preload", repository=repository), LlamaServer(threads)
    # over HTTP, the streams of a server of modeld's shape that does nothing else
    pipeline = PipelineFloor(threads=threads).__enter__() if protocol == "http" else None
    sides = SIDES + (["pipeline"] if pipeline is not None else [])
    try:
        node.load()
        got = {}
        # the ceiling is measured in every round too: a figure taken once,
        # minutes away from the race, compares two different machines
        settled = {}
        for side in round_order(sides, r):
            # llama.cpp's threads poll for work a while after their last step, on both sides
            settled[side] = round(settle([node.daemon.proc.pid, peer.proc.pid]
                                         + ([pipeline.pid, pipeline.worker] if pipeline is not None else [])), 2)
            if side == "pipeline":
                got[side] = run_pipeline(pipeline)
                continue
            if side == "modeld" and protocol == "grpc":
                got[side] = await run_modeld(node)
            elif side == "modeld":
                got[side] = run_blocking(lambda p, n: openai_stream(node.daemon.http_url, p, n),
                                         node.daemon.proc.pid)
            elif side == "llama-server":
                got[side] = run_blocking(peer.stream if protocol == "grpc" else
                                         lambda p, n: openai_stream(peer.url, p, n), peer.proc.pid)
            else:
                got[side] = batched_bench(threads=threads)
                got["ceiling_grpc"] = grpc_ceiling(got[side][1]["decode_tok_s"], threads=threads)
                got["ceiling_grpc8"] = grpc_ceiling(got[side][8]["decode_tok_s"], 8, threads)
    finally:
        node.stop()
        peer.stop()
        if pipeline is not None:
            pipeline.__exit__()
    got["first"] = round_order(sides, r)[0]
    got["settled_s"] = settled
    m, p = got["modeld"], got["llama-server"]
    print(f"round {r} ({got['first']} first): 8 streams fresh {m['fresh']['tok_s']:.1f} vs {p['fresh']['tok_s']:.1f} "
          f"tok/s, warm {m['warm']['tok_s']:.1f} vs {p['warm']['tok_s']:.1f}; 1 stream {m['single']['tok_s']:.1f} "
          f"vs {p['single']['tok_s']:.1f}; ttft@8 {m['fresh']['median_ttft_s']:.2f} vs {p['fresh']['median_ttft_s']:.2f} s; "
          f"batched-bench 8 seq {got['ceiling'][8]['decode_tok_s']:.1f}, 1 seq {got['ceiling'][1]['decode_tok_s']:.1f}, "
          f"1 seq beside a gRPC stream {got['ceiling_grpc']['decode_tok_s']:.1f}, "
          f"8 seq beside 8 {got['ceiling_grpc8']['decode_tok_s']:.1f}"
          + (f"; the pipeline floor's 1 stream {got['pipeline']['single']['tok_s']:.1f}, 8 fresh "
             f"{got['pipeline']['fresh']['tok_s']:.1f}" if "pipeline" in got else ""),
          flush=True)
    return got


def summarise(runs: list[dict]) -> dict:
    def series(side: str, phase: str, key: str) -> list[float]:
        return [g[side][phase][key] for g in runs]

    def ceiling(sequences: int) -> list[float]:
        return [g["ceiling"][sequences]["decode_tok_s"] for g in runs]

    def beside_grpc(key: str, field: str = "decode_tok_s") -> list[float]:
        return [g[key][field] for g in runs]

    def load_cost(key: str) -> dict[str, float]:
        return {part: statistics.median(g[key]["load"][f"{part}_cpu_ms_per_message"] for g in runs)
                for part in ("server", "client")}

    fresh = median_ratio(series("modeld", "fresh", "tok_s"), series("llama-server", "fresh", "tok_s"))
    warm = median_ratio(series("modeld", "warm", "tok_s"), series("llama-server", "warm", "tok_s"))
    single = median_ratio(series("modeld", "single", "tok_s"), series("llama-server", "single", "tok_s"))
    ttft = median_ratio(series("modeld", "fresh", "median_ttft_s"), series("llama-server", "fresh", "median_ttft_s"))
    ttft_warm = median_ratio(series("modeld", "warm", "median_ttft_s"), series("llama-server", "warm", "median_ttft_s"))
    best8 = max(series("modeld", "fresh", "tok_s") + series("modeld", "warm", "tok_s"))
    medians = {f"{side} {phase} {key}": statistics.median(series(side, phase, key))
               for side in ("modeld", "llama-server") for phase in ("single", "fresh", "warm")
               for key in (("tok_s", "ttft_s") if phase == "single" else ("tok_s", "median_ttft_s"))}
    ceiling8 = statistics.median(ceiling(8))
    medians["ceiling 1 sequence decode tok_s"] = statistics.median(ceiling(1))
    medians["ceiling 8 sequences decode tok_s"] = ceiling8
    ceiling_ratio = median_ratio(series("modeld", "fresh", "tok_s"), ceiling(8))
    pipeline = {}
    if all("pipeline" in g for g in runs):
        # one stream of a worker and a front that do nothing else: what a
        # server of modeld's shape reaches, against the peer and the machine
        pipeline = {"pipeline_floor": {
            "single_tok_s": statistics.median(series("pipeline", "single", "tok_s")),
            "over_llama_server": median_ratio(series("pipeline", "single", "tok_s"),
                                              series("llama-server", "single", "tok_s")),
            "over_ceiling": median_ratio(series("pipeline", "single", "tok_s"), ceiling(1)),
            "modeld_over_it": median_ratio(series("modeld", "single", "tok_s"), series("pipeline", "single", "tok_s")),
            "cpu_ms_per_token": {part: statistics.median(g["pipeline"]["single"]["cpu_ms_per_token"][part]
                                                         for g in runs) for part in ("front", "children", "client")},
        }}
        if all("fresh" in g["pipeline"] for g in runs):
            pipeline["pipeline_floor"]["streams8"] = {
                "tok_s": statistics.median(series("pipeline", "fresh", "tok_s")),
                "over_llama_server": median_ratio(series("pipeline", "fresh", "tok_s"),
                                                  series("llama-server", "fresh", "tok_s")),
                "over_ceiling": median_ratio(series("pipeline", "fresh", "tok_s"), ceiling(8)),
                "modeld_over_it": median_ratio(series("modeld", "fresh", "tok_s"), series("pipeline", "fresh", "tok_s")),
            }
    return {
        **pipeline,
        "medians": medians,
        "goals": {
            "8 streams fresh vs llama-server": goal(fresh, 1.0),
            "8 streams warm vs llama-server": goal(warm, 1.0),
            "8 streams vs llama-batched-bench decode": goal(ceiling_ratio, 0.95),
            "1 stream vs llama-server": goal(single, 1.0),
            "median ttft at 8 streams vs llama-server": goal(ttft, 1.0, higher_is_better=False),
        },
        "ttft_warm_ratio": ttft_warm,
        "modeld_warm_over_fresh": median_ratio(series("modeld", "warm", "tok_s"), series("modeld", "fresh", "tok_s")),
        "peer_warm_over_fresh": median_ratio(series("llama-server", "warm", "tok_s"), series("llama-server", "fresh", "tok_s")),
        "best_modeld_8_streams_over_ceiling": best8 / ceiling8,
        # the peer against the same ceiling: what a server with its clients on
        # the same two cores reaches (no goal; it bounds ours)
        "peer_8_streams_over_ceiling": median_ratio(series("llama-server", "fresh", "tok_s"), ceiling(8)),
        # one stream against batched-bench's one-sequence decode (the bare
        # loop on the same cores): how near each server comes to the machine
        "single_over_ceiling": {side: median_ratio(series(side, "single", "tok_s"), ceiling(1))
                                for side in ("modeld", "llama-server")},
        # the same decode beside a bare gRPC token stream (grpc_ceiling): what
        # streaming in Python costs the decode, and modeld against that ceiling
        "grpc_ceiling_over_ceiling": median_ratio(beside_grpc("ceiling_grpc"),
                                                  beside_grpc("ceiling_grpc", "plain_decode_tok_s")),
        "single_over_grpc_ceiling": median_ratio(series("modeld", "single", "tok_s"), beside_grpc("ceiling_grpc")),
        "grpc_stream_cpu_ms_per_message": load_cost("ceiling_grpc"),
        # the same at 8: batched-bench's 8-sequence decode beside 8 bare gRPC
        # streams; against llama-server's 8 streams it is the most a Python
        # gRPC server could reach in the race, were its own work free
        "grpc8_ceiling_over_ceiling": median_ratio(beside_grpc("ceiling_grpc8"),
                                                   beside_grpc("ceiling_grpc8", "plain_decode_tok_s")),
        "fresh_over_grpc8_ceiling": median_ratio(series("modeld", "fresh", "tok_s"), beside_grpc("ceiling_grpc8")),
        "grpc8_ceiling_over_peer_fresh": median_ratio(beside_grpc("ceiling_grpc8"), series("llama-server", "fresh", "tok_s")),
        "grpc8_stream_cpu_ms_per_message": load_cost("ceiling_grpc8"),
        # one stream: CPU ms per token by process (CpuPerToken), medians of rounds
        "single_cpu_ms_per_token": {side: {part: statistics.median(g[side]["single"]["cpu_ms_per_token"][part] for g in runs)
                                           for part in ("front", "children", "client")}
                                    for side in ("modeld", "llama-server")},
    }


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = record["summary"]["medians"]
    med_ceiling = {1: med["ceiling 1 sequence decode tok_s"], 8: med["ceiling 8 sequences decode tok_s"]}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = ["1 stream", "8 fresh", "8 warm"]
    keys = ["single tok_s", "fresh tok_s", "warm tok_s"]
    x = range(len(labels))
    for i, (side, color) in enumerate((("modeld", "#2a7"), ("llama-server", "#888"))):
        axes[0].bar([v + i * 0.4 for v in x], [med[f"{side} {k}"] for k in keys], 0.4, label=side, color=color)
    axes[0].axhline(med_ceiling[8], color="#c33", ls="--", label="batched-bench 8 seq")
    axes[0].axhline(med_ceiling[1], color="#c93", ls=":", label="batched-bench 1 seq")
    axes[0].set_xticks([v + 0.2 for v in x], labels)
    axes[0].set_title("tok/s (medians of rounds)")
    axes[0].legend(fontsize=7)
    goals = record["summary"]["goals"]
    axes[1].barh(list(goals), [g["ratio"] for g in goals.values()],
                 color=["#2a7" if g["met"] else "#c33" for g in goals.values()])
    axes[1].axvline(1.0, color="k", lw=0.5)
    axes[1].set_title("ratios (green: goal met)")
    axes[1].tick_params(axis="y", labelsize=7)
    rounds = record["race"]["rounds"]
    axes[2].plot([g["modeld"]["fresh"]["tok_s"] for g in rounds], "o-", color="#2a7", label="modeld fresh")
    axes[2].plot([g["modeld"]["warm"]["tok_s"] for g in rounds], "s--", color="#2a7", label="modeld warm")
    axes[2].plot([g["llama-server"]["fresh"]["tok_s"] for g in rounds], "o-", color="#888", label="llama-server fresh")
    axes[2].plot([g["llama-server"]["warm"]["tok_s"] for g in rounds], "s--", color="#888", label="llama-server warm")
    axes[2].set_title("8 streams tok/s per round")
    axes[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--protocol", choices=["grpc", "http"], default="grpc",
                        help="grpc: modeld's Generate against llama-server's /completion (each its native "
                             "stream); http: both servers' OpenAI /v1/completions, streamed by the same client")
    parser.add_argument("--threads", type=int, default=THREADS,
                        help="compute threads of both servers and of batched-bench (1: a core to spare beside them)")
    parser.add_argument("--output", default=str(RESULTS / "llama_server.json"),
                        help="the record; its chart goes beside it as .png")
    args = parser.parse_args()
    if not (PEER_BIN / "llama-server").exists():
        sys.exit("llama-server is not built: run `bash bench/peers/llama_server.sh` (or `make bench`)")
    before = machine()
    race_record = asyncio.run(race(args.rounds, args.protocol, args.threads))
    summary = summarise(race_record["rounds"])
    record = {"command": "python bench/bench_llama_server.py " + " ".join(sys.argv[1:]), "machine": before,
              "load_average_after": list(os.getloadavg()), "new_tokens": NEW_TOKENS, "threads": args.threads,
              "race": race_record, "summary": summary}
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(record, indent=2))
    chart(record, output.with_suffix(".png"))
    for name, g in summary["goals"].items():
        print(f"{name}: {g['ratio']:.2f}x (goal {g['goal']}: {'met' if g['met'] else 'missed'})")
    for side, parts in summary["single_cpu_ms_per_token"].items():
        print(f"1 stream, CPU ms per token, {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    print(f"llama-server's own 8 streams: {summary['peer_8_streams_over_ceiling']:.2f}x of batched-bench's decode")
    print("1 stream against batched-bench's 1-sequence decode: " + ", ".join(
        f"{side} {ratio:.2f}x" for side, ratio in summary["single_over_ceiling"].items()))
    if "pipeline_floor" in summary:
        floor = summary["pipeline_floor"]
        print(f"1 stream, the pipeline floor (a worker and a front that do nothing else): {floor['single_tok_s']:.1f} "
              f"tok/s, {floor['over_llama_server']:.2f}x llama-server's, {floor['over_ceiling']:.2f}x batched-bench's "
              f"decode; modeld {floor['modeld_over_it']:.2f}x of it")
        if "streams8" in floor:
            eight = floor["streams8"]
            print(f"8 fresh streams, the pipeline floor: {eight['tok_s']:.1f} tok/s, {eight['over_llama_server']:.2f}x "
                  f"llama-server's, {eight['over_ceiling']:.2f}x batched-bench's decode; modeld "
                  f"{eight['modeld_over_it']:.2f}x of it")
    cost = summary["grpc_stream_cpu_ms_per_message"]
    print(f"the same decode beside a bare gRPC stream (server {cost['server']:.2f} + client {cost['client']:.2f} CPU ms "
          f"a token): {summary['grpc_ceiling_over_ceiling']:.2f}x of it; modeld's 1 stream "
          f"{summary['single_over_grpc_ceiling']:.2f}x of that")
    cost8 = summary["grpc8_stream_cpu_ms_per_message"]
    print(f"the 8-sequence decode beside 8 bare gRPC streams (server {cost8['server']:.2f} + client "
          f"{cost8['client']:.2f} CPU ms a token): {summary['grpc8_ceiling_over_ceiling']:.2f}x of it, "
          f"{summary['grpc8_ceiling_over_peer_fresh']:.2f}x of llama-server's 8 streams; modeld's 8 fresh "
          f"streams {summary['fresh_over_grpc8_ceiling']:.2f}x of that")
    print(f"modeld warm/fresh {summary['modeld_warm_over_fresh']:.2f}x, llama-server warm/fresh "
          f"{summary['peer_warm_over_fresh']:.2f}x")


if __name__ == "__main__":
    main()
