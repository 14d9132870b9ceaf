"""The serving-engine table (issue 14): time to first token, throughput and
memory for every language-model backend modeld runs, on SmolLM2-135M-Instruct
here, at 1 and 8 streams; a memory projection for a 7B model of the same
architecture; and the batching strategies on one backend under one
staggered arrival pattern.

Rows (same weights; each in a daemon of its own, so a row's resident
growth is its backend's alone; all daemons up, one working at a time, the
order rotating per round):
  llamacpp      models/smollm2 (Q4_1 GGUF)
  torch fp32    models/smollm2-torch (dequantized, torch.compile)
  torch bf16    the same with [torch] dtype = "bfloat16"
  onnx-genai    models/smollm2-onnx (its model.toml's precision)
  vllm          a `format = "remote"` model on vLLM CPU (fp32), when
                .venv-vllm and var/hf/smollm2 exist (make vllm-env)
Per row and round: 1 stream (time to first token, decode tok/s), 8 streams
(aggregate tok/s, median time to first token), and the resident memory of
the daemon with its worker processes (language models run in a worker by
default) before loading, after loading, and at its peak over the 8 streams
(for vllm: the vLLM server's, the daemon only relays).

7B projection, per row: weights scale with parameters, KV with
layers x KV width. bytes/param = (resident growth at load - the KV the
backend reserved at load) / 134.5M parameters; KV bytes/token from the
architecture and the backend's KV dtype; a Llama-2-7B-shaped model (32
layers, KV width 4,096, 6.74B parameters) then needs
bytes/param x 6.74e9 + KV bytes/token x (32 x 4096) / (30 x 192) x 8
streams x 2,048 tokens.

Strategies: llamacpp with [llamacpp] admission = continuous, dynamic (50 ms
window, batches of 8) and static (batches of 8, 10 s window); 16 requests
of 64 tokens arriving one every 250 ms. Per strategy: median and p90
request latency, median time to first token, aggregate tok/s.

    .venv/bin/python bench/bench_backends.py [--rounds 2] [--only table,strategies] [--no-vllm]

Writes bench/results/backends.json and backends.png.
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
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests/remote"), str(ROOT / "bench")]
from bench_llamacpp import PROMPTS  # noqa: E402
from bench_onnx_genai import RssPeak, _stream  # noqa: E402
from daemon import start_daemon  # noqa: E402
from racing import machine, round_order  # noqa: E402

RESULTS = ROOT / "bench/results"
NEW_TOKENS = 64
PARAMS_135M = 134.5e6
ARCH = {"layers": 30, "kv_width": 3 * 64}  # SmolLM2-135M: 30 layers, 3 KV heads of 64
ARCH_7B = {"layers": 32, "kv_width": 4096, "params": 6.74e9}  # Llama-2-7B's shape
STREAMS_7B, CONTEXT_7B = 8, 2048


def _model_dir(repo: Path, name: str, source: str, edits: dict[str, dict]) -> None:
    """A copy of models/<source> under repo/name: links to its files, its
    model.toml without a draft model and with `edits` applied."""
    src, dst = ROOT / "models" / source, repo / name
    dst.mkdir(parents=True)
    for entry in src.iterdir():
        if entry.name != "model.toml" and not entry.name.startswith("."):
            (dst / entry.name).symlink_to(entry.resolve())
    config = tomllib.loads((src / "model.toml").read_text())
    config.pop("draft_model", None)
    for table in config.values():
        if isinstance(table, dict):
            table.pop("draft_model", None)
    for table, values in edits.items():
        config.setdefault(table, {}).update(values)
    from remote_setup import toml_text

    (dst / "model.toml").write_text(toml_text(config))


def _kv_dtype_bytes(row: str) -> int:
    return {"llamacpp": 2, "torch bf16": 2}.get(row, 4)  # llama.cpp keeps f16 KV; the others fp32


def _reserved_kv_bytes(row: str, config: dict) -> int:
    """KV the backend allocates at load, from its model.toml."""
    per_token = 2 * ARCH["layers"] * ARCH["kv_width"] * _kv_dtype_bytes(row)
    if row == "llamacpp":
        return config["llamacpp"]["n_ctx"] * per_token
    if row.startswith("torch"):
        return config["torch"]["num_blocks"] * config["torch"]["block_size"] * per_token
    if row == "onnx-genai":
        og = config.get("onnx_genai", {})
        return og.get("max_running", 8) * og.get("context_length", 2048) * per_token
    return 0


def projection(row: str, loaded_bytes: float, kv_reserved: int) -> dict:
    per_param = max(loaded_bytes - kv_reserved, 0) / PARAMS_135M
    kv_token = 2 * ARCH["layers"] * ARCH["kv_width"] * _kv_dtype_bytes(row)
    kv_token_7b = kv_token * (ARCH_7B["layers"] * ARCH_7B["kv_width"]) / (ARCH["layers"] * ARCH["kv_width"])
    weights = per_param * ARCH_7B["params"]
    kv = kv_token_7b * STREAMS_7B * CONTEXT_7B
    return {"bytes_per_param": per_param, "kv_bytes_per_token": kv_token, "kv_bytes_per_token_7b": kv_token_7b,
            "weights_7b_gb": weights / 1e9, "kv_7b_gb": kv / 1e9, "total_7b_gb": (weights + kv) / 1e9}


class Row:
    """One backend in a daemon of its own."""

    def __init__(self, row: str, model: str, source: str | None, edits: dict, repo: Path, config: dict | None = None):
        self.row, self.model = row, model
        folder = repo / row.replace(" ", "-")
        if source is not None:
            _model_dir(folder, model, source, edits)
        else:
            from remote_setup import toml_text

            (folder / model).mkdir(parents=True)
            (folder / model / "model.toml").write_text(toml_text(config))
        self.config = tomllib.loads((folder / model / "model.toml").read_text())
        self.daemon = start_daemon("--metrics-port", "-1", "--http-port", "-1", "--no-preload", repository=folder,
                                   timeout=300)
        self.rounds: list[dict] = []
        self.memory: dict = {}
        self.vllm = None

    def rss(self) -> int:
        return self.vllm.rss() if self.vllm is not None else self.daemon.tree_rss()

    def load(self) -> None:
        import tritonclient.grpc as tc

        before = self.rss()
        started = time.perf_counter()
        client = tc.InferenceServerClient(self.daemon.address)
        client.load_model(self.model, client_timeout=1800)
        client.close()
        asyncio.run(_stream(self.daemon.address, self.model, "Warm up.", 8))
        loaded = self.rss()
        self.memory = {"rss_before_mb": before / 1e6, "rss_loaded_mb": loaded / 1e6,
                       "load_growth_mb": (loaded - before) / 1e6, "peak_8_streams_mb": loaded / 1e6,
                       "load_s": time.perf_counter() - started}

    async def one_round(self, prompt: str) -> dict:
        single = await _stream(self.daemon.address, self.model, prompt, NEW_TOKENS)
        with RssPeak(self.rss) as peak:
            start = time.perf_counter()
            many = await asyncio.gather(*(_stream(self.daemon.address, self.model, p, NEW_TOKENS) for p in PROMPTS))
            wall = time.perf_counter() - start
        self.memory["peak_8_streams_mb"] = max(self.memory["peak_8_streams_mb"], peak.peak / 1e6)
        return {"ttft_1_s": single["ttft"], "tok_s_1": (single["tokens"] - 1) / single["decode_s"],
                "tok_s_8": sum(r["tokens"] for r in many) / wall,
                "ttft_8_median_s": statistics.median(r["ttft"] for r in many)}

    def close(self) -> None:
        self.daemon.stop()


def _rows(repo: Path, with_vllm: bool):
    specs = [("llamacpp", "smollm2", "smollm2", {}),
             ("torch fp32", "smollm2-torch", "smollm2-torch", {}),
             ("torch bf16", "smollm2-torch", "smollm2-torch", {"torch": {"dtype": "bfloat16"}}),
             ("onnx-genai", "smollm2-onnx", "smollm2-onnx", {})]
    for row, model, source, edits in specs:
        yield lambda row=row, model=model, source=source, edits=edits: Row(row, model, source, edits, repo)
    if with_vllm:
        from vllm_server import VllmServer, missing

        reason = missing()
        if reason:
            print(f"vllm row skipped: {reason}", flush=True)
            return

        def vllm_row():
            from remote_setup import remote_config

            server = VllmServer()
            server.start()
            config = remote_config(server.url, fallback=False)
            config["remote"] = {k: v for k, v in config["remote"].items() if "probe" not in k}
            row = Row("vllm", "smollm2-vllm", None, {}, repo, config=config)
            row.vllm = server
            close = row.close

            def close_both():
                close()
                server.stop()

            row.close = close_both
            return row

        yield vllm_row


async def _table_rounds(rows: list[Row], rounds: int) -> None:
    for r in range(rounds):
        for name in round_order([row.row for row in rows], r):
            row = next(x for x in rows if x.row == name)
            row.rounds.append(await row.one_round(PROMPTS[r % len(PROMPTS)]))
        print(f"table round {r + 1}/{rounds} done", flush=True)


def table(rounds: int, with_vllm: bool) -> dict:
    repo = Path(tempfile.mkdtemp(prefix="modeld-backends-"))
    rows: list[Row] = []
    try:
        for make in _rows(repo, with_vllm):
            row = make()
            rows.append(row)
            row.load()
            print(f"{row.row}: loaded in {row.memory['load_s']:.0f} s, +{row.memory['load_growth_mb']:.0f} MB resident",
                  flush=True)
        asyncio.run(_table_rounds(rows, rounds))
    finally:
        for row in rows:
            row.close()
        shutil.rmtree(repo, ignore_errors=True)
    out = {}
    for row in rows:
        medians = {k: statistics.median(r[k] for r in row.rounds) for k in row.rounds[0]}
        kv = _reserved_kv_bytes(row.row, row.config)
        out[row.row] = {"model": row.model, "medians": medians, "memory": row.memory, "kv_reserved_mb": kv / 1e6,
                        "projection_7b": projection(row.row, row.memory["load_growth_mb"] * 1e6, kv)
                        if row.vllm is None else None, "rounds": row.rounds}
    return out


# -- batching strategies ----------------------------------------------------------

STRATEGIES = {"continuous": {"admission": "continuous"},
              "dynamic": {"admission": "dynamic", "admission_batch": 8, "admission_window_ms": 50},
              "static": {"admission": "static", "admission_batch": 8, "admission_window_ms": 10_000}}
ARRIVALS, GAP_S, STRATEGY_TOKENS = 16, 0.25, 64


async def _staggered(address: str, model: str) -> dict:
    async def one(i: int) -> dict:
        await asyncio.sleep(i * GAP_S)
        sent = time.perf_counter()
        r = await _stream(address, model, PROMPTS[i % len(PROMPTS)], STRATEGY_TOKENS)
        return {"sent": sent, "latency": r["total_s"], "ttft": r["ttft"], "tokens": r["tokens"]}

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(ARRIVALS)))
    wall = time.perf_counter() - start
    latencies = sorted(r["latency"] for r in results)
    return {"latency_median_s": statistics.median(latencies),
            "latency_p90_s": latencies[int(0.9 * (len(latencies) - 1))],
            "ttft_median_s": statistics.median(r["ttft"] for r in results),
            "tok_s": sum(r["tokens"] for r in results) / wall}


def strategies(rounds: int) -> dict:
    repo = Path(tempfile.mkdtemp(prefix="modeld-strategies-"))
    daemon = None
    try:
        for name, values in STRATEGIES.items():
            _model_dir(repo, f"smollm2-{name}", "smollm2", {"llamacpp": {**values, "n_ctx": 16384}})
        daemon = start_daemon("--metrics-port", "-1", "--http-port", "-1", repository=repo, timeout=300)
        runs = {name: [] for name in STRATEGIES}
        for r in range(rounds):
            for name in round_order(list(STRATEGIES), r):
                runs[name].append(asyncio.run(_staggered(daemon.address, f"smollm2-{name}")))
            print(f"strategies round {r + 1}/{rounds}: " + ", ".join(
                f"{n} p50 {runs[n][-1]['latency_median_s']:.2f} s" for n in STRATEGIES), flush=True)
    finally:
        if daemon is not None:
            daemon.stop()
        shutil.rmtree(repo, ignore_errors=True)
    return {"arrivals": ARRIVALS, "gap_s": GAP_S, "tokens": STRATEGY_TOKENS, "settings": STRATEGIES,
            "medians": {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()},
            "rounds": runs}


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    if "table" in record:
        rows = record["table"]
        names = list(rows)
        panels += [("1 stream decode tok/s", names, [rows[n]["medians"]["tok_s_1"] for n in names]),
                   ("8 streams tok/s", names, [rows[n]["medians"]["tok_s_8"] for n in names]),
                   ("median TTFT at 8 streams (s)", names, [rows[n]["medians"]["ttft_8_median_s"] for n in names]),
                   ("resident MB at load", names, [rows[n]["memory"]["load_growth_mb"] for n in names])]
    if "strategies" in record:
        med = record["strategies"]["medians"]
        names = list(med)
        panels += [("strategies: p50 latency (s)", names, [med[n]["latency_median_s"] for n in names]),
                   ("strategies: tok/s", names, [med[n]["tok_s"] for n in names])]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.3 * len(panels), 4))
    for ax, (title, names, values) in zip(axes if len(panels) > 1 else [axes], panels):
        ax.bar(names, values, color="#2a7")
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", default="table,strategies")
    parser.add_argument("--no-vllm", action="store_true")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    record = {"command": " ".join([".venv/bin/python bench/bench_backends.py", *sys.argv[1:]]), "machine": machine(),
              "new_tokens": NEW_TOKENS, "rounds": args.rounds,
              "projection_method": "bytes/param = (resident growth at load - reserved KV) / 134.5M; KV bytes/token "
                                   "= 2 x layers x KV width x KV dtype bytes, scaled by (32 x 4096)/(30 x 192); "
                                   "7B = bytes/param x 6.74e9 + KV/token x 8 streams x 2048 tokens"}
    if "table" in parts:
        record["table"] = table(args.rounds, not args.no_vllm)
    if "strategies" in parts:
        record["strategies"] = strategies(args.rounds)
    record["load_average_after"] = list(os.getloadavg())
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "backends.json").write_text(json.dumps(record, indent=2))
    chart(record, RESULTS / "backends.png")
    for name, row in record.get("table", {}).items():
        m, mem, proj = row["medians"], row["memory"], row["projection_7b"]
        print(f"{name:<11} 1 stream {m['tok_s_1']:6.1f} tok/s ttft {m['ttft_1_s'] * 1000:5.0f} ms | 8 streams "
              f"{m['tok_s_8']:6.1f} tok/s ttft {m['ttft_8_median_s']:5.2f} s | +{mem['load_growth_mb']:.0f} MB at load, "
              f"peak {mem['peak_8_streams_mb']:.0f} MB" + (f" | 7B: {proj['total_7b_gb']:.1f} GB" if proj else ""))
    for name, m in record.get("strategies", {}).get("medians", {}).items():
        print(f"{name:<11} p50 {m['latency_median_s']:.2f} s p90 {m['latency_p90_s']:.2f} s ttft "
              f"{m['ttft_median_s']:.2f} s {m['tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
