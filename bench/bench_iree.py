"""minilm compiled by IREE (backend `iree`) against onnxruntime (backend `onnx`).

One run, the peer measured in the same run, in alternating blocks so a busy
neighbour slows both alike:
  load            a cold compile into an empty cache, then a cache hit in a
                  fresh backend (hashing the graph, mapping the module)
  in-process      sentences/s with requests of 1, 8, 32 and 64 sentences,
                  each backend's model object called directly (tokenizer and
                  length buckets included, as the daemon runs them), and the
                  CPU seconds each sentence cost
                  goal: iree >= 1.0x onnx at 32 and 64
  daemon          32 concurrent clients sending one sentence each through
                  gRPC, dynamic batching on (max_batch_size 64)
  where the time goes
                  one padded batch of 32 sentences: IREE's dispatches grouped
                  by kind (iree-benchmark-module's host-execution profile)
                  beside onnxruntime's nodes grouped by operator (its profiler)

The sentences are bench_minilm's (fixed seed). The repository is a temp
folder with two models over the same files: `minilm_onnx` (backends onnx)
and `minilm_iree` (backends iree, onnx). Writes bench/results/iree.json and
iree.png.

    .venv/bin/python bench/bench_iree.py
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from bench_minilm import (  # noqa: E402
    CONCURRENCY, daemon_block, execution_counts, interleaved_throughput, make_sentences, text_inputs,
    wait_model_ready, with_load,
)
from daemon import MODELS, start_daemon  # noqa: E402

from modeld.backends.iree.backend import IreeBackend  # noqa: E402
from modeld.backends.iree.compiler import COMPILE_FLAGS, toolchain  # noqa: E402
from modeld.backends.model_config import load_model_toml  # noqa: E402
from modeld.backends.onnx.backend import OnnxBackend  # noqa: E402

BATCH_SIZES = (1, 8, 32, 64)
ROUNDS = 3
BLOCK_S = 2.0  # per variant per round and batch size; at least MIN_CALLS calls
MIN_CALLS = 2
PROFILE_BATCH = 32
PROFILE_RUNS = 3
VARIANTS = ("iree", "onnx")


# -- setup ------------------------------------------------------------------------

def make_repository(root: Path) -> Path:
    toml = (MODELS / "minilm" / "model.toml").read_text()
    for name, backends in (("minilm_onnx", '["onnx"]'), ("minilm_iree", '["iree", "onnx"]')):
        folder = root / name
        folder.mkdir()
        for file in ("model.onnx", "tokenizer.json"):
            (folder / file).symlink_to(MODELS / "minilm" / file)
        (folder / "model.toml").write_text(re.sub(r"(?m)^backends = .*$", f"backends = {backends}", toml))
    return root


def load_in_process(repo: Path) -> tuple[dict, dict]:
    """The two models, and the load figures: a cold compile, then a cache hit."""
    iree_dir, onnx_dir = repo / "minilm_iree", repo / "minilm_onnx"
    iree_config = load_model_toml("minilm_iree", iree_dir / "model.toml")
    started = time.perf_counter()
    cold = IreeBackend().load(iree_config, iree_dir)
    cold_s = time.perf_counter() - started
    cold.unload()
    started = time.perf_counter()
    warm = IreeBackend().load(iree_config, iree_dir)  # a new backend: nothing remembered but the files
    hit_s = time.perf_counter() - started
    started = time.perf_counter()
    onnx = OnnxBackend().load(load_model_toml("minilm_onnx", onnx_dir / "model.toml"), onnx_dir)
    onnx_s = time.perf_counter() - started
    figures = {
        "iree_cold_load_s": cold_s, "iree_compile_s": cold.build.compile_s, "iree_cache_hit_load_s": hit_s,
        "iree_cache_hit_is_cached": warm.build.is_cached, "onnx_load_s": onnx_s,
        "iree_module_bytes": warm.build.path.stat().st_size, "iree_module": str(warm.build.path),
        "iree_nbytes": warm.nbytes, "onnx_nbytes": onnx.nbytes,
    }
    print(f"load: iree cold {cold_s:.1f} s (compile {cold.build.compile_s:.1f} s), cache hit {hit_s:.2f} s; "
          f"onnx {onnx_s:.2f} s")
    return {"iree": warm, "onnx": onnx}, figures


# -- in-process throughput ------------------------------------------------------------

def _batches(sentences: list[str], size: int) -> list[np.ndarray]:
    """Every sentence once per pass, in requests of `size` (wrapping round)."""
    ring = sentences * (1 + size // len(sentences))
    return [np.array([s.encode() for s in (ring + ring)[i:i + size]], dtype=object)
            for i in range(0, len(sentences), size)]


def _block(model, batches: list[np.ndarray], start: int) -> tuple[int, float, float, int]:
    sentences, calls, i = 0, 0, start
    wall, cpu = time.perf_counter(), time.process_time()
    while calls < MIN_CALLS or time.perf_counter() - wall < BLOCK_S:
        texts = batches[i % len(batches)]
        model.execute({"text": texts}, ("embedding",))
        sentences, calls, i = sentences + len(texts), calls + 1, i + 1
    return sentences, time.perf_counter() - wall, time.process_time() - cpu, i


def in_process_throughput(models: dict, sentences: list[str]) -> dict:
    results = {}
    for size in BATCH_SIZES:
        batches = _batches(sentences, size)
        for model in models.values():
            model.execute({"text": batches[0]}, ("embedding",))  # warm-up
        totals = {name: [0, 0.0, 0.0] for name in models}
        position = 0
        for _ in range(ROUNDS):
            for name, model in models.items():
                done, wall, cpu, end = _block(model, batches, position)
                totals[name] = [totals[name][0] + done, totals[name][1] + wall, totals[name][2] + cpu]
            position = end  # both variants see the same inputs in each round
        row = {name: with_load({"sentences": n, "seconds": w, "sentences_per_s": n / w,
                                "cpu_ms_per_sentence": 1e3 * c / n}) for name, (n, w, c) in totals.items()}
        row["iree_over_onnx"] = row["iree"]["sentences_per_s"] / row["onnx"]["sentences_per_s"]
        results[str(size)] = row
        print(f"batch {size:>2}: iree {row['iree']['sentences_per_s']:6.1f}/s "
              f"({row['iree']['cpu_ms_per_sentence']:.1f} CPU ms each), onnx {row['onnx']['sentences_per_s']:6.1f}/s "
              f"({row['onnx']['cpu_ms_per_sentence']:.1f} CPU ms each): x{row['iree_over_onnx']:.2f} "
              f"(load {row['onnx']['load_avg_1m_after']})")
    return results


def embeddings_agree(models: dict, sentences: list[str]) -> float:
    texts = np.array([s.encode() for s in sentences], dtype=object)
    a, b = (models[n].execute({"text": texts}, ("embedding",))["embedding"] for n in VARIANTS)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


# -- where the time goes ------------------------------------------------------------------

# IREE names each dispatch after its dominant operation and shapes.
_IREE_KINDS = (
    ("dense matmul (Q/K/V/out, FFN)", re.compile(r"mmt4d|matmul_D|matmul_\d")),
    ("attention matmuls (QK^T, PV)", re.compile(r"matmul_like")),
    ("softmax", re.compile(r"softmax")),
    ("reductions (layer norm, pooling)", re.compile(r"reduction|matvec")),
    ("data-tiling pack/unpack", re.compile(r"pack")),
    ("transpose", re.compile(r"transpose")),
    ("elementwise (GELU, masks, adds)", re.compile(r"elementwise|generic")),
)


# The same four groups for both, for a side-by-side reading; onnxruntime's
# MatMul nodes include the attention products, so matmuls are compared whole.
_GROUPS = ("matmuls", "softmax", "layer norm and reductions", "the rest")
_ONNX_GROUP = {"MatMul": "matmuls", "FusedMatMul": "matmuls", "Softmax": "softmax",
               "LayerNormalization": "layer norm and reductions", "ReduceSum": "layer norm and reductions",
               "ReduceL2": "layer norm and reductions"}
_IREE_GROUP = {"dense matmul (Q/K/V/out, FFN)": "matmuls", "attention matmuls (QK^T, PV)": "matmuls",
               "softmax": "softmax", "reductions (layer norm, pooling)": "layer norm and reductions"}


def _grouped(ms_by_kind: dict[str, float], groups: dict[str, str]) -> dict[str, float]:
    out = dict.fromkeys(_GROUPS, 0.0)
    for kind, ms in ms_by_kind.items():
        out[groups.get(kind, "the rest")] += ms
    return out


def _padded_batch(sentences: list[str]) -> dict[str, np.ndarray]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(MODELS / "minilm" / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    tokenizer.no_padding()
    encodings = tokenizer.encode_batch(sentences[:PROFILE_BATCH])
    width = max(len(e.ids) for e in encodings)
    feeds = {name: np.zeros((len(encodings), width), np.int64) for name in ("input_ids", "attention_mask", "token_type_ids")}
    for row, e in enumerate(encodings):
        feeds["input_ids"][row, :len(e.ids)] = e.ids
        feeds["attention_mask"][row, :len(e.ids)] = e.attention_mask
    return feeds


def _runtime_tool(name: str) -> str:
    spec = importlib.util.find_spec("iree._runtime_libs")
    return str(Path(next(iter(spec.submodule_search_locations))) / name)


def iree_profile(module: Path, feeds: dict[str, np.ndarray], work: Path) -> dict:
    args = []
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.save(work / f"{name}.npy", feeds[name])
        args.append(f"--input=@{work / name}.npy")
    profile = work / "iree.ireeprof"
    subprocess.run([_runtime_tool("iree-benchmark-module"), f"--module={module}", "--device=local-task",
                    "--function=main_graph", *args, "--benchmark_repetitions=1",
                    f"--benchmark_min_time={PROFILE_RUNS}x", "--device_profiling_mode=host-execution",
                    f"--device_profiling_output={profile}"], check=True, capture_output=True)
    rows = subprocess.run([_runtime_tool("iree-profile"), "statistics", "--format=jsonl", str(profile)],
                          check=True, capture_output=True, text=True).stdout.splitlines()
    kinds: dict[str, float] = {}
    for row in map(json.loads, rows):
        if row.get("row_type") != "host_execution_function" or not row.get("function_name"):
            continue
        kind = next((k for k, pattern in _IREE_KINDS if pattern.search(row["function_name"])), "other")
        kinds[kind] = kinds.get(kind, 0.0) + row["total_duration_ns"] / 1e6 / PROFILE_RUNS
    return dict(sorted(kinds.items(), key=lambda kv: -kv[1]))


def onnx_profile(feeds: dict[str, np.ndarray], work: Path) -> dict:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2  # minilm's [onnx] intra_op_threads
    options.enable_profiling = True
    options.profile_file_prefix = str(work / "ort")
    session = ort.InferenceSession(str(MODELS / "minilm" / "model.onnx"), options, providers=["CPUExecutionProvider"])
    for _ in range(PROFILE_RUNS + 1):  # the first run warms up; runs differ little once the arenas exist
        session.run(None, feeds)
    events = json.loads(Path(session.end_profiling()).read_text())
    kinds: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            kinds[e["args"]["op_name"]] = kinds.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e3
    return dict(sorted(((k, v / (PROFILE_RUNS + 1)) for k, v in kinds.items()), key=lambda kv: -kv[1]))


def where_the_time_goes(module: Path, sentences: list[str]) -> dict:
    feeds = _padded_batch(sentences)
    with tempfile.TemporaryDirectory() as work:
        iree = iree_profile(module, feeds, Path(work))
        onnx = onnx_profile(feeds, Path(work))
    result = {"batch": list(feeds["input_ids"].shape), "iree_ms_by_dispatch_kind": iree,
              "onnx_ms_by_operator": onnx, "iree_total_ms": sum(iree.values()), "onnx_total_ms": sum(onnx.values()),
              "grouped_ms": {"iree": _grouped(iree, _IREE_GROUP), "onnx": _grouped(onnx, _ONNX_GROUP)}}
    print(f"one padded batch {result['batch']}: iree dispatches {result['iree_total_ms']:.0f} ms, "
          f"onnx nodes {result['onnx_total_ms']:.0f} ms")
    for kind, ms in iree.items():
        print(f"  iree {kind:<34} {ms:8.1f} ms")
    for kind, ms in list(onnx.items())[:8]:
        print(f"  onnx {kind:<34} {ms:8.1f} ms")
    for group in _GROUPS:
        a, b = result["grouped_ms"]["iree"][group], result["grouped_ms"]["onnx"][group]
        print(f"  {group:<26} iree {a:8.1f} ms, onnx {b:8.1f} ms  x{a / max(b, 1e-9):.1f}")
    return result


# -- through the daemon -------------------------------------------------------------------------

def daemon_throughput(repo: Path, sentences: list[str]) -> dict:
    import tritonclient.grpc as grpcclient

    daemon = start_daemon("--no-preload", repository=repo, timeout=900)
    client = grpcclient.InferenceServerClient(daemon.address)
    try:
        names = {"iree": "minilm_iree", "onnx": "minilm_onnx"}
        ready_s = {v: wait_model_ready(client, m, timeout=900) for v, m in names.items()}
        platforms = {v: client.get_model_metadata(m).platform for v, m in names.items()}
        requests = text_inputs(sentences)
        before = {v: execution_counts(client, m) for v, m in names.items()}
        thr = interleaved_throughput({v: daemon_block(daemon.address, m, requests) for v, m in names.items()})
        for v, m in names.items():
            rows, runs = (a - b for a, b in zip(execution_counts(client, m), before[v]))
            thr[v]["mean_batch_size"] = rows / max(runs, 1)
            thr[v]["platform"] = platforms[v]
            thr[v]["load_s"] = ready_s[v]
        thr["iree_over_onnx"] = thr["iree"]["requests_per_s"] / thr["onnx"]["requests_per_s"]
        thr["iree_module_loaded"] = daemon.events("iree_module_loaded")
        print(f"daemon, {CONCURRENCY} clients: iree {thr['iree']['requests_per_s']:.1f} req/s "
              f"(mean batch {thr['iree']['mean_batch_size']:.1f}), onnx {thr['onnx']['requests_per_s']:.1f} req/s "
              f"(mean batch {thr['onnx']['mean_batch_size']:.1f}): x{thr['iree_over_onnx']:.2f}")
        return thr
    finally:
        client.close()
        daemon.stop()


# -- report -----------------------------------------------------------------------------------

def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_thr, ax_time) = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [f"batch {b}" for b in BATCH_SIZES] + [f"daemon\n{CONCURRENCY} clients"]
    x = np.arange(len(labels))
    for offset, variant, color in ((-0.2, "iree", "tab:purple"), (0.2, "onnx", "tab:blue")):
        values = [r["in_process"][str(b)][variant]["sentences_per_s"] for b in BATCH_SIZES]
        values.append(r["daemon"][variant]["requests_per_s"])
        bars = ax_thr.bar(x + offset, values, 0.4, label=variant, color=color)
        ax_thr.bar_label(bars, fmt="%.0f", fontsize=8)
    ax_thr.set_xticks(x, labels)
    ax_thr.set_ylabel("sentences / s")
    ax_thr.set_title("minilm throughput: IREE vs onnxruntime")
    ax_thr.legend()

    prof = r["where_the_time_goes"]
    y = np.arange(len(_GROUPS))
    for offset, variant, color in ((-0.2, "iree", "tab:purple"), (0.2, "onnx", "tab:blue")):
        bars = ax_time.barh(y + offset, [prof["grouped_ms"][variant][g] for g in _GROUPS], 0.4, label=variant,
                            color=color)
        ax_time.bar_label(bars, fmt="%.0f", fontsize=8)
    ax_time.set_yticks(y, _GROUPS)
    ax_time.invert_yaxis()
    ax_time.set_xlabel("ms per run")
    ax_time.legend()
    ax_time.set_title(f"where the time goes, batch {prof['batch']}: iree {prof['iree_total_ms']:.0f} ms, "
                      f"onnx {prof['onnx_total_ms']:.0f} ms")
    fig.suptitle(f"modeld iree benchmark ({r['machine']['cpu_count']} CPUs, load {r['machine']['load_avg_at_start'][0]:.1f}, "
                 f"{r['timestamp']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    sentences = make_sentences()
    chain = toolchain()
    results: dict = {
        "command": [sys.executable, *sys.argv],
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "load_avg_at_start": list(os.getloadavg())},
        "iree": {"compiler": chain.version, "target": chain.target, "flags": list(COMPILE_FLAGS)},
        "settings": {"batch_sizes": list(BATCH_SIZES), "rounds": ROUNDS, "block_s": BLOCK_S,
                     "sentences": len(sentences), "concurrency": CONCURRENCY, "profile_batch": PROFILE_BATCH},
    }
    with tempfile.TemporaryDirectory(prefix="bench_iree_") as tmp:
        repo = make_repository(Path(tmp))
        models, results["load"] = load_in_process(repo)
        results["min_cosine_iree_vs_onnx"] = embeddings_agree(models, sentences)
        print(f"embeddings: min cosine iree vs onnx {results['min_cosine_iree_vs_onnx']:.6f}")
        results["in_process"] = in_process_throughput(models, sentences)
        for model in models.values():
            model.unload()
        results["where_the_time_goes"] = where_the_time_goes(Path(results["load"]["iree_module"]), sentences)
        results["daemon"] = daemon_throughput(repo, sentences)
    results["machine"]["load_avg_at_end"] = list(os.getloadavg())
    ratios = {b: results["in_process"][str(b)]["iree_over_onnx"] for b in BATCH_SIZES if b >= 32}
    results["goal"] = {"iree_over_onnx_at_batch_32_plus": ratios, "pass": all(v >= 1.0 for v in ratios.values())}

    print("\n== summary")
    for b in BATCH_SIZES:
        row = results["in_process"][str(b)]
        print(f"batch {b:>2}: iree {row['iree']['sentences_per_s']:6.1f}/s vs onnx "
              f"{row['onnx']['sentences_per_s']:6.1f}/s  x{row['iree_over_onnx']:.2f}")
    d = results["daemon"]
    print(f"daemon {CONCURRENCY} clients: iree {d['iree']['requests_per_s']:.1f} vs onnx "
          f"{d['onnx']['requests_per_s']:.1f} req/s  x{d['iree_over_onnx']:.2f}")
    ld = results["load"]
    print(f"load: compile {ld['iree_compile_s']:.1f} s, cache hit {ld['iree_cache_hit_load_s']:.2f} s, "
          f"onnx {ld['onnx_load_s']:.2f} s")
    print(f"goal iree >= 1.0x onnx at batch >= 32: {'PASS' if results['goal']['pass'] else 'FAIL'} "
          f"({', '.join(f'{b}: x{v:.2f}' for b, v in ratios.items())})")

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "iree.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS / "iree.png")
    print(f"wrote {RESULTS / 'iree.json'} and {RESULTS / 'iree.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
