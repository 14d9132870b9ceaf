"""smollm2-onnx (onnxruntime-genai) beside modeld's other language-model
backends on the same SmolLM2-135M-Instruct weights, greedy, in one run:
smollm2 (llamacpp, Q4_1 GGUF), smollm2-torch (torch, fp32) and smollm2-onnx
(onnx-genai, the precision its model.toml names). The peer: onnxruntime-genai's
own Engine in a process of its own on the same model folder, no daemon.

One daemon holds the three models (no draft models); they are measured in
interleaved rounds (the order rotating), the peer's process once per round
too, so a busy machine slows every side alike; figures are round medians:
  1 stream    decode tok/s after the first token, and time to first token
  8 streams   aggregate tok/s and median time to first token
  memory      the bytes the model holds in the memory budget, the daemon's
              resident memory added by loading it (its runtime library
              included), and the most added while serving the 8 streams
Generation is forced to NEW_TOKENS (ignore_eos). Writes
bench/results/onnx_genai.json and a PNG chart.

    .venv/bin/python bench/bench_onnx_genai.py
"""

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from bench_llamacpp import PROMPTS, decode_rate  # noqa: E402

RESULTS = ROOT / "bench/results"
NEW_TOKENS = 64
ROUNDS = 3
MODELS = {"smollm2": "llamacpp", "smollm2-torch": "torch", "smollm2-onnx": "onnx-genai"}
OG_ARTIFACT = tomllib.loads((ROOT / "models/smollm2-onnx/model.toml").read_text())["artifact"]


def round_figures(single: dict, many: list[dict], wall: float) -> dict:
    return {
        "single_decode_tok_s": decode_rate(single),
        "single_ttft_s": single["ttft"],
        "concurrent_tok_s": sum(r["tokens"] for r in many) / wall,
        "concurrent_median_ttft_s": statistics.median(r["ttft"] for r in many),
    }


def medians(rounds: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


class RssPeak:
    """The highest resident memory of a process while it runs, sampled every 50 ms."""

    def __init__(self, read) -> None:
        self.read, self.peak, self._stop = read, 0, threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self.read())

    def __enter__(self):
        self.peak = self.read()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- modeld: one daemon, the three models ---------------------------------------------

def _repository() -> Path:
    """The three models: links to their files, each model.toml without a draft model."""
    repo = Path(tempfile.mkdtemp(prefix="modeld-bench-"))
    for model in MODELS:
        source, target = ROOT / "models" / model, repo / model
        target.mkdir()
        for entry in source.iterdir():
            if entry.name != "model.toml":
                (target / entry.name).symlink_to(entry.resolve())
        lines = (source / "model.toml").read_text().splitlines()
        (target / "model.toml").write_text("\n".join(l for l in lines if not l.startswith("draft_model")) + "\n")
    return repo


def _loaded_bytes(daemon, model: str) -> int:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read().decode()
    for line in text.splitlines():
        if line.startswith("modeld_loaded_bytes{") and f'model="{model}"' in line:
            return int(float(line.rsplit(" ", 1)[1]))
    return 0


async def _stream(address: str, model: str, prompt: str, max_tokens: int) -> dict:
    import grpc

    from modeld.gen import generation_pb2 as g
    from modeld.gen import generation_pb2_grpc as gg

    params = g.SamplingParams(max_tokens=max_tokens, ignore_eos=True, cache_prompt=False)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gg.GenerationStub(channel)
        start, first, count = time.perf_counter(), None, 0
        async for r in stub.Generate(g.GenerateRequest(model=model, prompt=prompt, sampling=params), timeout=900):
            if r.token_ids:
                first = first or time.perf_counter()
                count += len(r.token_ids)
    end = time.perf_counter()
    return {"ttft": first - start, "tokens": count, "decode_s": end - first, "total_s": end - start}


class Modeld:
    def __init__(self) -> None:
        from daemon import start_daemon

        self.repo = _repository()
        self.daemon = start_daemon("--http-port", "-1", "--no-preload", repository=self.repo, timeout=120)
        self.memory: dict[str, dict] = {}

    def load(self, model: str) -> None:
        """Load one model, measuring what it adds to the resident memory of
        the daemon and its workers (a language model's worker included)."""
        import tritonclient.grpc as tc

        before = self.daemon.tree_rss()
        client = tc.InferenceServerClient(self.daemon.address)
        client.load_model(model, client_timeout=900)
        client.close()
        asyncio.run(_stream(self.daemon.address, model, "Warm up.", 8))
        self.memory[model] = {"reported_mb": _loaded_bytes(self.daemon, model) / 1e6,
                              "rss_loaded_mb": (self.daemon.tree_rss() - before) / 1e6, "rss_peak_8_streams_mb": 0.0}

    async def round(self, model: str, prompt: str) -> dict:
        single = await _stream(self.daemon.address, model, prompt, NEW_TOKENS)
        base = self.daemon.tree_rss()
        with RssPeak(self.daemon.tree_rss) as peak:
            start = time.perf_counter()
            many = await asyncio.gather(*(_stream(self.daemon.address, model, p, NEW_TOKENS) for p in PROMPTS))
            wall = time.perf_counter() - start
        memory = self.memory[model]
        memory["rss_peak_8_streams_mb"] = max(memory["rss_peak_8_streams_mb"],
                                              memory["rss_loaded_mb"] + (peak.peak - base) / 1e6)
        return round_figures(single, many, wall)

    def close(self) -> None:
        self.daemon.stop()
        shutil.rmtree(self.repo, ignore_errors=True)


# -- the peer: onnxruntime-genai's Engine alone, in a process of its own ---------------

def peer_main(prompt: str) -> None:
    """Run as `bench_onnx_genai.py --peer PROMPT`: one round, one JSON line."""
    import numpy as np
    import onnxruntime_genai as og
    import psutil

    process = psutil.Process()
    folder = ROOT / "models/smollm2-onnx" / Path(OG_ARTIFACT).parent
    before = process.memory_info().rss
    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    engine = og.Engine(model)
    buffer = engine.create_event_buffer(64)

    def run(prompts: list[str], max_tokens: int) -> tuple[list[dict], float]:
        started, state = time.perf_counter(), {}
        for p in prompts:
            request = engine.create_request()
            options = og.TurnOptions(request)
            options.set_max_generated_tokens(max_tokens)
            options.set_min_generated_tokens(max_tokens)  # ignore_eos
            options.set_do_sample(False)
            request.begin_turn(np.asarray(tokenizer.encode(p), dtype=np.int32), options)
            state[id(request)] = {"request": request, "first": None, "tokens": 0}
        while engine.has_pending_requests():
            for event in engine.run(buffer):
                s = state[id(event.request)]
                if event.token is not None:
                    s["first"] = s["first"] or time.perf_counter()
                    s["tokens"] += 1
                if int(event.flags) & int(og.EngineEventFlags.TURN_FINISHED):
                    s["end"] = time.perf_counter()
        for s in state.values():
            s["request"].close()
        runs = [{"ttft": s["first"] - started, "tokens": s["tokens"], "decode_s": s["end"] - s["first"]}
                for s in state.values()]
        return runs, time.perf_counter() - started

    run(["Warm up."], 8)
    loaded = process.memory_info().rss
    single = run([prompt], NEW_TOKENS)[0][0]
    with RssPeak(lambda: process.memory_info().rss) as peak:
        many, wall = run(PROMPTS, NEW_TOKENS)
    result = round_figures(single, many, wall)
    result["memory"] = {"rss_loaded_mb": (loaded - before) / 1e6, "rss_peak_8_streams_mb": (peak.peak - before) / 1e6}
    print(json.dumps(result))


def bench_peer(prompt: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--peer", prompt], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {f"{m}\n({b})": record["modeld"][m] for m, b in MODELS.items()}
    rows["og Engine\nalone"] = record["peer"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    panels = ((lambda r: r["single_decode_tok_s"], "1 stream decode tok/s"),
              (lambda r: r["concurrent_tok_s"], "8 streams total tok/s"),
              (lambda r: r["concurrent_median_ttft_s"], "8 streams median TTFT (s)"),
              (lambda r: r["memory"]["rss_peak_8_streams_mb"], "resident MB, peak over 8 streams"))
    colors = ["#888", "#888", "#2a7", "#bbb"]
    for ax, (value, title) in zip(axes, panels):
        ax.bar(list(rows), [value(r) for r in rows.values()], color=colors)
        ax.set_title(title)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    node = Modeld()
    rounds: dict[str, list[dict]] = {name: [] for name in (*MODELS, "peer")}
    peer_memory = []
    try:
        for model in MODELS:
            node.load(model)
        for i in range(ROUNDS):
            order = list(MODELS)[i % 3:] + list(MODELS)[:i % 3]
            for model in order:
                rounds[model].append(asyncio.run(node.round(model, PROMPTS[i])))
            peer = bench_peer(PROMPTS[i])
            peer_memory.append(peer.pop("memory"))
            rounds["peer"].append(peer)
            print(f"round {i + 1}/{ROUNDS} done", flush=True)
    finally:
        node.close()
    mine = {model: medians(rounds[model]) | {"memory": node.memory[model]} for model in MODELS}
    peer = medians(rounds["peer"]) | {"memory": {k: max(m[k] for m in peer_memory) for k in peer_memory[0]}}
    og = mine["smollm2-onnx"]
    ratios = {
        "onnx_vs_peer_single_decode": og["single_decode_tok_s"] / peer["single_decode_tok_s"],
        "onnx_vs_peer_concurrent": og["concurrent_tok_s"] / peer["concurrent_tok_s"],
        "onnx_vs_peer_concurrent_ttft": og["concurrent_median_ttft_s"] / peer["concurrent_median_ttft_s"],
        "onnx_vs_llamacpp_concurrent": og["concurrent_tok_s"] / mine["smollm2"]["concurrent_tok_s"],
        "onnx_vs_torch_concurrent": og["concurrent_tok_s"] / mine["smollm2-torch"]["concurrent_tok_s"],
    }
    record = {"command": "bench/bench_onnx_genai.py", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "cpu_count": os.cpu_count(), "load_average": os.getloadavg(), "new_tokens": NEW_TOKENS,
              "rounds": ROUNDS, "onnx_genai_artifact": OG_ARTIFACT, "peer": peer, "modeld": mine,
              "ratios": ratios, "per_round": rounds}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "onnx_genai.json").write_text(json.dumps(record, indent=2))
    chart(record, RESULTS / "onnx_genai.png")
    for name, r in [*((f"{m} ({b})", mine[m]) for m, b in MODELS.items()), ("og Engine alone", peer)]:
        memory = r["memory"]
        print(f"{name:<28} 1 stream {r['single_decode_tok_s']:6.1f} tok/s ttft {r['single_ttft_s'] * 1000:5.0f} ms | "
              f"8 streams {r['concurrent_tok_s']:6.1f} tok/s median ttft {r['concurrent_median_ttft_s']:5.2f} s | "
              f"memory: {memory.get('reported_mb', 0):5.0f} MB reported, {memory['rss_loaded_mb']:5.0f} MB resident "
              f"loaded, {memory['rss_peak_8_streams_mb']:5.0f} MB peak")
    print("ratios: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--peer"]:
        peer_main(sys.argv[2])
    else:
        main()
