"""Scale-in under load: one of three daemons drained (SIGTERM, as the kubelet
sends it after the preStop hook) while generation streams and unary calls
run through the gateway.

Per round, a fresh fleet: three daemons (smollm2 on llama.cpp, minilm on
onnxruntime) with the drain settings deploy/k8s/nodes.yaml ships
(MODELD_DRAIN_DELAY_S=2, MODELD_SHUTDOWN_GRACE_S=300) behind one gateway;
8 streams that each start a new Generate (48 tokens, ignore_eos) as soon as
the last one ended, and minilm unary calls at 20/s, open loop. After a
warm-up the daemon with the most of the gateway's calls in flight gets
SIGTERM; the load runs on until it has exited and a few seconds more.

Measured, from a poll of the gateway's metrics every POLL_S and the
daemon's process:
- failed calls (goal 0) and truncated streams: a stream that raised, or
  ended without its final message saying LENGTH after 48 tokens (goal 0);
- `not_serving_s`: SIGTERM to the gateway's modeld_gateway_node_serving
  for the node reading 0 (its health Watch saw NOT_SERVING; from then the
  node is not routable: the gateway places nothing there);
- `last_pick_s`: SIGTERM to the last rise of the gateway's
  modeld_gateway_picks_total for the node (the last call placed on it),
  and `picks_after_not_serving` (goal 0);
- `idle_s`: SIGTERM to the gateway's in-flight count for the node reading 0
  (its streams finished); `exit_s`: SIGTERM to the process's exit, and its
  exit status (goal 0).
Times are at the poll's resolution (POLL_S).

A report, not a test: nothing is asserted (tests/integration/
test_gateway_drain.py is the test). Results: bench/results/drain.json.

    flock /tmp/coord/bench.lock .venv/bin/python bench/bench_drain.py [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = Path(os.environ.get("DRAIN_BENCH_RESULTS", ROOT / "bench" / "results" / "drain.json"))

from daemon import MODELS, add_small_smollm2, start_daemon, start_gateway  # noqa: E402

from modeld.clients.client import build_infer_request  # noqa: E402
from modeld.gen import generation_pb2 as gen  # noqa: E402
from modeld.gen import generation_pb2_grpc as gen_grpc  # noqa: E402

LLM, EMBEDDER = "smollm2", "minilm"
NUM_STREAMS, STREAM_TOKENS, UNARY_PER_S = 8, 48, 20.0
WARM_S, AFTER_EXIT_S, POLL_S = 6.0, 4.0, 0.02
DRAIN_ENV = {"MODELD_DRAIN_DELAY_S": "2", "MODELD_SHUTDOWN_GRACE_S": "300"}  # deploy/k8s/nodes.yaml's
INFER = "/inference.GRPCInferenceService/ModelInfer"


def _series(text: str, name: str) -> dict[str, float]:
    """node label -> value of the metric `name` (summed over its other labels)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = re.match(rf"{re.escape(name)}\{{(.*)\}} ([0-9.e+-]+)$", line)
        if match:
            node = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))).get("node", "")
            found[node] = found.get(node, 0.0) + float(match.group(2))
    return found


def _metrics(process) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=5).read().decode()


class Load:
    """The streams and the unary calls, until stop()."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.generate = gen_grpc.GenerationStub(self.channel)
        self.infer = self.channel.unary_unary(INFER)
        self.request = build_infer_request(EMBEDDER, {"text": np.array(["draining under load"], dtype=object)}
                                           ).SerializeToString()
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.failures: list[str] = []
        self.truncated: list[str] = []
        self.streams_ok = self.unary_ok = 0
        self.unary_late = 0  # calls the pacer could not start on time (the pool was busy)
        self._threads = [threading.Thread(target=self._stream_loop, args=(i,), daemon=True)
                         for i in range(NUM_STREAMS)]
        self._threads.append(threading.Thread(target=self._pacer, daemon=True))
        self._pool = ThreadPoolExecutor(16)

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(300)
        self._pool.shutdown(wait=True)
        self.channel.close()

    def _stream_loop(self, i: int) -> None:
        n = 0
        while not self.stopping.is_set():
            n += 1
            try:
                replies = list(self.generate.Generate(gen.GenerateRequest(
                    model=LLM, prompt=f"Stream {i}, call {n}: count slowly from {n}:",
                    sampling=gen.SamplingParams(max_tokens=STREAM_TOKENS, temperature=0.0, ignore_eos=True)),
                    timeout=300))
            except grpc.RpcError as exc:
                with self.lock:
                    self.failures.append(f"stream: {exc.code().name}: {exc.details()}")
                    self.truncated.append(f"stream {i}/{n} raised {exc.code().name}")
                continue
            tokens = sum(len(r.token_ids) for r in replies)
            reason = gen.FinishReason.Name(replies[-1].finish_reason) if replies else "no reply"
            with self.lock:
                if reason == "FINISH_REASON_LENGTH" and tokens == STREAM_TOKENS:
                    self.streams_ok += 1
                else:
                    self.truncated.append(f"stream {i}/{n}: {reason} after {tokens} tokens")

    def _unary(self) -> None:
        try:
            self.infer(self.request, timeout=60)
        except grpc.RpcError as exc:
            with self.lock:
                self.failures.append(f"unary: {exc.code().name}: {exc.details()}")
            return
        with self.lock:
            self.unary_ok += 1

    def _pacer(self) -> None:
        due = time.monotonic()
        while not self.stopping.is_set():
            self._pool.submit(self._unary)
            due += 1.0 / UNARY_PER_S
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            else:
                self.unary_late += 1


def _round(index: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        repo.mkdir()
        add_small_smollm2(repo)
        (repo / EMBEDDER).symlink_to(MODELS / EMBEDDER)
        with ThreadPoolExecutor(3) as pool:
            daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo, env=DRAIN_ENV),
                                    range(3)))
        gateway = start_gateway(*(d.address for d in daemons), args=("--http-port", "-1"))
        load = None
        try:
            deadline = time.monotonic() + 60
            while sum(_series(_metrics(gateway), "modeld_gateway_node_serving").values()) < 3:
                if time.monotonic() > deadline:
                    raise RuntimeError("the gateway did not see three serving nodes")
                time.sleep(0.1)
            import tritonclient.grpc as tc

            loader = tc.InferenceServerClient(gateway.address)
            for model in (LLM, EMBEDDER):  # on every home, before the clock starts: a load is no drain
                loader.load_model(model)
            load = Load(gateway.address)
            load.start()
            time.sleep(WARM_S)  # the models load on their homes, the load settles
            text = _metrics(gateway)
            in_flight = _series(text, "modeld_gateway_node_in_flight")
            leaving = max(daemons, key=lambda d: in_flight.get(d.address, 0.0))
            picks_before = _series(text, "modeld_gateway_picks_total").get(leaving.address, 0.0)
            counts_before = (load.streams_ok, load.unary_ok)
            print(f"round {index}: draining {leaving.address} with {in_flight.get(leaving.address, 0):.0f} "
                  f"calls in flight", flush=True)
            leaving.proc.send_signal(15)
            started = time.monotonic()
            not_serving_at = idle_at = exit_at = None
            last_pick_at, last_picks, picks_after_not_serving = None, picks_before, 0
            while True:
                now = time.monotonic()
                text = _metrics(gateway)
                picks = _series(text, "modeld_gateway_picks_total").get(leaving.address, 0.0)
                if picks > last_picks:
                    last_pick_at, last_picks = now, picks
                    if not_serving_at is not None:
                        picks_after_not_serving += 1
                if not_serving_at is None and _series(text, "modeld_gateway_node_serving").get(
                        leaving.address, 1.0) == 0:
                    not_serving_at = now
                if idle_at is None and _series(text, "modeld_gateway_node_in_flight").get(leaving.address, 0) == 0:
                    idle_at = now
                if exit_at is None and leaving.proc.poll() is not None:
                    exit_at = now
                if exit_at is not None and now - exit_at > AFTER_EXIT_S:
                    break
                if now - started > 330:
                    break  # past terminationGracePeriodSeconds: the kubelet would have killed it
                time.sleep(POLL_S)
            load.stop()
            during = (load.streams_ok - counts_before[0], load.unary_ok - counts_before[1])

            def since(t):
                return round(t - started, 3) if t is not None else None

            return {
                "left_in_flight": in_flight.get(leaving.address, 0.0),
                "failed_calls": len(load.failures), "failures": load.failures[:5],
                "truncated_streams": len(load.truncated), "truncated": load.truncated[:5],
                "streams_ok": load.streams_ok, "unary_ok": load.unary_ok,
                "streams_ok_from_sigterm": during[0], "unary_ok_from_sigterm": during[1],
                "unary_late": load.unary_late,
                "not_serving_s": since(not_serving_at), "last_pick_s": since(last_pick_at),
                "picks_after_sigterm": last_picks - picks_before,
                "picks_after_not_serving": picks_after_not_serving,
                "idle_s": since(idle_at), "exit_s": since(exit_at), "exit_status": leaving.proc.returncode,
            }
        finally:
            if load is not None and not load.stopping.is_set():
                load.stop()
            for process in [gateway, *daemons]:
                if process.proc.poll() is None:
                    process.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    started = time.monotonic()
    rounds = [_round(i) for i in range(args.rounds)]

    def median(key):
        values = [r[key] for r in rounds if r[key] is not None]
        return round(statistics.median(values), 3) if values else None

    record = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "results": {
            "failed_calls": sum(r["failed_calls"] for r in rounds),
            "truncated_streams": sum(r["truncated_streams"] for r in rounds),
            "picks_after_not_serving": sum(r["picks_after_not_serving"] for r in rounds),
            "not_serving_s_median": median("not_serving_s"), "last_pick_s_median": median("last_pick_s"),
            "idle_s_median": median("idle_s"), "exit_s_median": median("exit_s"),
            "rounds": rounds,
            "streams": NUM_STREAMS, "stream_tokens": STREAM_TOKENS, "unary_per_s": UNARY_PER_S,
            "drain_env": DRAIN_ENV, "poll_s": POLL_S,
            "goal": "0 failed calls, 0 truncated streams; the gateway stops placing on the node within one "
                    "Stats interval (0.25 s)",
            "seconds": round(time.monotonic() - started, 1),
            "command": f"flock /tmp/coord/bench.lock .venv/bin/python bench/bench_drain.py --rounds {args.rounds}",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_avg_1m": os.getloadavg()[0],
        },
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record["results"], indent=1))
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
