"""The gateway's HTTP front against the issue's overhead goals: three daemons
(minilm, smollm2 on llama.cpp) and a gateway on loopback, one client calling
one request at a time, straight to a daemon that holds the model and through
the gateway, in interleaved rounds (the order flips each round).

- `embeddings`: POST /v1/embeddings (minilm, one sentence); p50 and p99 of
  each and the difference (goal: p50 <= direct + 1 ms).
- `ttft`: a streamed /v1/chat/completions (smollm2, 4 tokens): the time from
  sending the request to the first content event (goal: p50 <= direct + 2 ms).

The client is one keep-alive connection per target (http.client: the
cheapest client, so its own cost does not hide the gateway's). A report, not
a test: nothing is asserted. On a shared machine expect noise of the order of
the differences measured; each round's p50 is recorded so it can be judged.
Results: bench/results/gateway_http.json.

    flock /tmp/coord/bench.lock .venv/bin/python bench/bench_gateway_http.py [--rounds 6] [--calls 200]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import grpc
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results" / "gateway_http.json"

from daemon import MODELS, add_small_smollm2, metric_sum, start_daemon, start_gateway  # noqa: E402

from modeld.gen import node_pb2, node_pb2_grpc  # noqa: E402

EMBEDDING = json.dumps({"model": "minilm", "input": ["The gateway forwards bytes."]}).encode()
CHAT = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
                   "temperature": 0, "stream": True}).encode()
HEADERS = {"content-type": "application/json"}


class Fleet:
    def __init__(self, repo: Path, n: int = 3) -> None:
        with ThreadPoolExecutor(n) as pool:
            self.daemons = list(pool.map(lambda _: start_daemon("--no-preload", repository=repo), range(n)))
        args = ["--http-port", "0"]
        for d in self.daemons:
            args += ["--node-http", f"{d.address}=127.0.0.1:{d.http_port}"]
        self.gateway = start_gateway(*(d.address for d in self.daemons), args=tuple(args))
        deadline = time.monotonic() + 60
        while metric_sum(self.gateway, "modeld_gateway_node_serving") < n:
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway did not see its nodes serving")
            time.sleep(0.1)

    def holder(self, model: str):
        """A daemon holding `model` ready: the direct target."""
        for d in self.daemons:
            with grpc.insecure_channel(d.address) as channel:
                stats = node_pb2_grpc.NodeStub(channel).Stats(node_pb2.NodeStatsRequest(), timeout=5)
            if any(m.name == model and m.state == "READY" for m in stats.models):
                return d
        raise RuntimeError(f"no daemon holds {model}")

    def close(self) -> None:
        for process in (self.gateway, *self.daemons):
            if process.proc.poll() is None:
                process.stop()


def _unary(connection: http.client.HTTPConnection, path: str, body: bytes) -> float:
    started = time.perf_counter()
    connection.request("POST", path, body=body, headers=HEADERS)
    response = connection.getresponse()
    data = response.read()
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"{path}: {response.status} {data[:200]!r}")
    return elapsed * 1000


def _ttft(connection: http.client.HTTPConnection) -> float:
    """Milliseconds to the first event that carries content; the rest is read off."""
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=CHAT, headers=HEADERS)
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"chat: {response.status} {response.read()[:200]!r}")
    first = None
    while True:
        line = response.readline()
        if not line:
            break
        if first is None and line.startswith(b"data: {") and b'"content"' in line:
            first = (time.perf_counter() - started) * 1000
    if first is None:
        raise RuntimeError("the stream carried no content event")
    return first


def _cpu_s(pid: int) -> float:
    """A process's CPU seconds so far (user + system)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _interleaved(targets: dict, rounds: int, calls: int, one, gateway_pid: int) -> dict:
    connections = {name: http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                   for name, port in targets.items()}
    try:
        for connection in connections.values():  # warm-up: loads, caches, keep-alive connections
            for _ in range(max(20, calls // 10)):
                one(connection)
        samples = {name: [] for name in targets}
        per_round = []
        gateway_cpu_s = 0.0
        for index in range(rounds):
            order = list(targets) if index % 2 == 0 else list(reversed(targets))
            this_round = {}
            for name in order:
                cpu = _cpu_s(gateway_pid)
                values = [one(connections[name]) for _ in range(calls)]
                if name == "gateway":
                    gateway_cpu_s += _cpu_s(gateway_pid) - cpu
                samples[name] += values
                this_round[name] = round(float(np.percentile(values, 50)), 3)
            per_round.append(this_round)
    finally:
        for connection in connections.values():
            connection.close()
    p50 = {k: round(float(np.percentile(v, 50)), 3) for k, v in samples.items()}
    p99 = {k: round(float(np.percentile(v, 99)), 3) for k, v in samples.items()}
    return {"calls_per_round": calls, "rounds": rounds, "p50_ms": p50, "p99_ms": p99,
            "p50_added_ms": round(p50["gateway"] - p50["direct"], 3),
            "p99_added_ms": round(p99["gateway"] - p99["direct"], 3),
            "p50_ratio": round(p50["gateway"] / p50["direct"], 3),
            # the gateway's own CPU per call: what the hop costs, read where
            # wall times are noisy (a shared machine); clock ticks of 10 ms
            "gateway_cpu_ms_per_call": round(gateway_cpu_s * 1000 / (rounds * calls), 3),
            "round_p50_added_ms": [round(r["gateway"] - r["direct"], 3) for r in per_round],
            "round_p50_ms": per_round}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--calls", type=int, default=200, help="embedding calls per round and target")
    parser.add_argument("--streams", type=int, default=40, help="chat streams per round and target")
    args = parser.parse_args()
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        (repo / "minilm").symlink_to(MODELS / "minilm")
        add_small_smollm2(repo)
        fleet = Fleet(repo)
        try:
            gateway_port = fleet.gateway.http_port
            first = http.client.HTTPConnection("127.0.0.1", gateway_port, timeout=120)
            _unary(first, "/v1/embeddings", EMBEDDING)  # load on the gateway's pick first
            _ttft(first)
            first.close()
            results = {}
            for name, model, one, calls, goal in (
                    ("embeddings", "minilm", lambda c: _unary(c, "/v1/embeddings", EMBEDDING), args.calls,
                     "p50 <= direct + 1 ms"),
                    ("ttft", "smollm2", _ttft, args.streams, "p50 <= direct + 2 ms")):
                print(f"== {name}", flush=True)
                direct = fleet.holder(model)
                results[name] = _interleaved({"direct": direct.http_port, "gateway": gateway_port},
                                             args.rounds, calls, one, fleet.gateway.proc.pid)
                results[name]["goal"] = goal
                print(json.dumps(results[name], indent=1), flush=True)
        finally:
            fleet.close()
    record = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_1m_before": load_before, "load_avg_1m_after": os.getloadavg()[0]},
        "command": f"flock /tmp/coord/bench.lock .venv/bin/python bench/bench_gateway_http.py --rounds {args.rounds} "
                   f"--calls {args.calls} --streams {args.streams}",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
        "results": results,
        "note": "one client, one request at a time, keep-alive; direct = a daemon holding the model; shared "
                "machine: the per-round differences show the noise",
    }
    RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
