"""The gateway against the issue's goals, each section with its own fleet.

- `overhead`: minilm unary calls from one client, one at a time, straight to
  a replica and through a gateway in front of three daemons, in interleaved
  rounds; p50 and p99 of each and the difference (goal: p50 +1 ms, p99 +3 ms).
- `ring`: the ring on its own, 100 nodes x 10,000 models x 150 virtual
  nodes: the busiest node against the mean (goal 1.1x) with plain consistent
  hashing and with bounded loads, and the models a joining node moves (goal
  1/n + 5%).
- `kill`: minilm traffic at about 40 calls/s through the gateway; SIGKILL of
  the model's busiest replica; failed calls (goal 0) and the time until the
  gateway's breaker for that node reads open (goal 1 s).
- `frozen`: the same traffic while a replica is frozen (SIGSTOP) for 2 s at a
  time, calls marked urgent (hedged) and unmarked in alternating phases;
  p99 of each (goal: hedged <= 0.5x) and the hedges sent per call (goal 5%).
- `residency`: 8 models of 40 MB on three daemons that hold 4 each, calls
  spread over the models at random; the share of calls that found their
  model loaded (goal 95%), through the gateway and, for contrast, round robin
  straight to the daemons.
- `prefix`: 12 conversations (three long system prompts, four conversations
  each, three turns) on smollm2: prompt tokens served from the prefix cache
  against the ideal (every token some earlier prompt or answer shared),
  through the gateway's prefix affinity and round robin over the daemons,
  interleaved (goal 0.7 of the ideal).

A report, not a test: nothing is asserted. Results: bench/results/gateway.json
and gateway.png.

    .venv/bin/python bench/bench_gateway.py [--only overhead,kill,...] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import signal
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
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results" / "gateway.json"
CHART = ROOT / "bench" / "results" / "gateway.png"

from daemon import MODELS, start_daemon, start_gateway  # noqa: E402

from modeld.clients.client import build_infer_request  # noqa: E402
from modeld.gen import generation_pb2 as gen  # noqa: E402
from modeld.gen import generation_pb2_grpc as gen_grpc  # noqa: E402
from modeld.gen import inference_pb2 as pb  # noqa: E402
from modeld.server.gateway.ring import HashRing  # noqa: E402

INFER = "/inference.GRPCInferenceService/ModelInfer"
URGENT = (("x-modeld-urgency", "high"),)


# -- fleets ---------------------------------------------------------------------

def _repository(tmp: Path, names=("minilm", "smollm2", "smollm2-draft")) -> Path:
    for name in names:
        (tmp / name).symlink_to(MODELS / name)
    return tmp


class Fleet:
    def __init__(self, repo: Path, n: int = 3, daemon_args=(), gateway_args=()) -> None:
        with ThreadPoolExecutor(n) as pool:
            self.daemons = list(pool.map(lambda _: start_daemon("--no-preload", *daemon_args, repository=repo),
                                         range(n)))
        self.gateway = start_gateway(*(d.address for d in self.daemons), args=tuple(gateway_args))
        self.ring = HashRing(150)
        for d in self.daemons:
            self.ring.add(d.address)
        channel = grpc.insecure_channel(self.gateway.address)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if pb.ServerReadyResponse.FromString(channel.unary_unary("/inference.GRPCInferenceService/ServerReady")(
                    pb.ServerReadyRequest().SerializeToString())).ready and _gauge(
                    self.gateway, "modeld_gateway_node_serving") == n:
                break
            time.sleep(0.1)
        channel.close()

    def daemon(self, address: str):
        return next(d for d in self.daemons if d.address == address)

    def close(self) -> None:
        for process in [self.gateway, *self.daemons]:
            if process.proc.poll() is None:
                os.kill(process.proc.pid, signal.SIGCONT)
                process.stop()


def _metrics(process) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{process.metrics_port}/metrics", timeout=10).read().decode()


def _gauge(process, name: str, **labels) -> float:
    total = 0.0
    for line in _metrics(process).splitlines():
        match = re.match(rf"{re.escape(name)}(?:\{{(.*)\}})? ([0-9.e+-]+)$", line)
        if match:
            have = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1) or ""))
            if all(have.get(k) == v for k, v in labels.items()):
                total += float(match.group(2))
    return total


def _minilm_request(text: str = "The gateway forwards bytes.") -> bytes:
    return build_infer_request("minilm", {"text": np.array([text], dtype=object)}).SerializeToString()


def _percentile(values, q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if len(values) else float("nan")


# -- overhead -------------------------------------------------------------------

def overhead(rounds: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(_repository(Path(tmp), ("minilm",)))
        try:
            request = _minilm_request()
            replica = fleet.ring.replicas("minilm", 2)[0]
            targets = {"direct": replica, "gateway": fleet.gateway.address}
            channels = {k: grpc.insecure_channel(v) for k, v in targets.items()}
            calls_of = {k: c.unary_unary(INFER) for k, c in channels.items()}
            for call in calls_of.values():
                for _ in range(200):
                    call(request)
            samples = {k: [] for k in targets}
            for index in range(rounds):
                for name in (("direct", "gateway") if index % 2 == 0 else ("gateway", "direct")):
                    call = calls_of[name]
                    for _ in range(calls):
                        started = time.perf_counter()
                        call(request)
                        samples[name].append((time.perf_counter() - started) * 1000)
            for c in channels.values():
                c.close()
        finally:
            fleet.close()
    p50 = {k: round(_percentile(v, 50), 3) for k, v in samples.items()}
    p99 = {k: round(_percentile(v, 99), 3) for k, v in samples.items()}
    return {
        "calls_per_round": calls, "rounds": rounds, "p50_ms": p50, "p99_ms": p99,
        "p50_added_ms": round(p50["gateway"] - p50["direct"], 3),
        "p99_added_ms": round(p99["gateway"] - p99["direct"], 3),
        "goal": "p50 <= direct + 1 ms, p99 <= direct + 3 ms",
    }


# -- ring -----------------------------------------------------------------------

def ring(rounds: int, calls: int) -> dict:
    from ring_sim import ring_simulation

    result = ring_simulation(nodes=100, models=10_000, vnodes=150)
    result["goal"] = "busiest <= 1.1x mean; a join moves <= 1/n + 5% of models"
    return result


# -- traffic helpers --------------------------------------------------------------

class Traffic:
    """`workers` threads each sending minilm calls through the gateway, one
    every `period_s`; latencies and failures with their wall time."""

    def __init__(self, address: str, workers: int, period_s: float, metadata=()) -> None:
        self.address, self.period_s, self.metadata = address, period_s, metadata
        self.samples: list[tuple[float, float]] = []
        self.failures: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)]

    def _run(self, index: int) -> None:
        channel = grpc.insecure_channel(self.address)
        call = channel.unary_unary(INFER)
        request = _minilm_request(f"traffic {index}")
        next_at = time.monotonic()
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                call(request, metadata=self.metadata, timeout=30)
                self.samples.append((time.monotonic(), time.perf_counter() - started))
            except grpc.RpcError as exc:
                self.failures.append((time.monotonic(), f"{exc.code().name}: {exc.details()}"))
            next_at += self.period_s
            time.sleep(max(0.0, next_at - time.monotonic()))
        channel.close()

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()


def _busiest_replica(fleet: Fleet) -> str:
    """The replica of minilm that took the most calls so far."""
    counts = {a: _gauge(fleet.daemon(a), "modeld_requests_total", model="minilm")
              for a in fleet.ring.replicas("minilm", 2)}
    return max(counts, key=counts.get)


# -- kill -----------------------------------------------------------------------

def kill(rounds: int, calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(_repository(Path(tmp), ("minilm",)))
        try:
            with Traffic(fleet.gateway.address, workers=4, period_s=0.1) as traffic:
                time.sleep(3)
                victim = fleet.daemon(_busiest_replica(fleet))
                victim.proc.send_signal(signal.SIGKILL)
                killed = time.monotonic()
                opened_after = None
                while time.monotonic() - killed < 5:
                    if _gauge(fleet.gateway, "modeld_gateway_breaker_state", node=victim.address) == 2:
                        opened_after = time.monotonic() - killed
                        break
                    time.sleep(0.01)
                time.sleep(3)
            duration = traffic.samples[-1][0] - traffic.samples[0][0]
            retries = _gauge(fleet.gateway, "modeld_gateway_retries_total")
        finally:
            fleet.close()
    return {
        "calls": len(traffic.samples) + len(traffic.failures), "calls_per_s": round(len(traffic.samples) / duration, 1),
        "failed_calls": len(traffic.failures), "failures": traffic.failures[:5],
        "breaker_open_after_s": None if opened_after is None else round(opened_after, 3),
        "retried_calls": retries, "goal": "0 failed calls at >= 20/s; breaker open within 1 s",
    }


# -- frozen ---------------------------------------------------------------------

def frozen(rounds: int, calls: int) -> dict:
    """Phases of 6 s (2 s calm, 2 s frozen, 2 s calm) alternate hedged and
    plain traffic; a phase waits for the breaker to close before it starts."""
    rounds = max(2, min(rounds, 4))
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(_repository(Path(tmp), ("minilm",)))
        try:
            with Traffic(fleet.gateway.address, workers=4, period_s=0.05, metadata=URGENT):
                time.sleep(4)  # the p95 each (node, model) pair needs before hedging starts
            victim = fleet.daemon(_busiest_replica(fleet))
            latencies = {"hedged": [], "plain": []}
            hedges = {"hedged": 0.0, "plain": 0.0}
            counts = {"hedged": 0, "plain": 0}
            failures = {"hedged": 0, "plain": 0}
            for index in range(rounds):
                for mode in (("hedged", "plain") if index % 2 == 0 else ("plain", "hedged")):
                    deadline = time.monotonic() + 30
                    while _gauge(fleet.gateway, "modeld_gateway_breaker_state", node=victim.address) != 0 \
                            and time.monotonic() < deadline:
                        time.sleep(0.1)
                    fired = _gauge(fleet.gateway, "modeld_gateway_hedges_fired_total")
                    with Traffic(fleet.gateway.address, workers=4, period_s=0.05,
                                 metadata=URGENT if mode == "hedged" else ()) as traffic:
                        time.sleep(2)
                        os.kill(victim.proc.pid, signal.SIGSTOP)
                        time.sleep(2)
                        os.kill(victim.proc.pid, signal.SIGCONT)
                        time.sleep(2)
                    latencies[mode] += [s for _, s in traffic.samples]
                    counts[mode] += len(traffic.samples) + len(traffic.failures)
                    failures[mode] += len(traffic.failures)
                    hedges[mode] += _gauge(fleet.gateway, "modeld_gateway_hedges_fired_total") - fired
        finally:
            fleet.close()
    p99 = {m: round(_percentile(v, 99) * 1000, 2) for m, v in latencies.items()}
    p50 = {m: round(_percentile(v, 50) * 1000, 2) for m, v in latencies.items()}
    return {
        "rounds": rounds, "calls": counts, "failed_calls": failures, "p50_ms": p50, "p99_ms": p99,
        "p99_hedged_over_plain": round(p99["hedged"] / p99["plain"], 3) if p99["plain"] else None,
        "extra_requests_hedged": round(hedges["hedged"] / max(1, counts["hedged"]), 4),
        "goal": "p99 hedged <= 0.5x plain; extra requests <= 5%",
    }


# -- residency ------------------------------------------------------------------

def residency(rounds: int, calls: int) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    import onnx_fixtures

    names = [f"m{i}" for i in range(8)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp)
        model = onnx_fixtures.add_fp32(10_000_000)  # 40 MB of weights
        for name in names:
            (repo / name).mkdir()
            (repo / name / "model.toml").write_text('format = "onnx"\n')
            (repo / name / "model.onnx").write_bytes(model)
        # the budget covers the whole daemon process (its own share, then the
        # models), so each node gets an idle daemon's share plus room for four
        # 40 MB models (each reported at about 44 MB loaded), as the tests size it
        from daemon import daemon_share

        budget = daemon_share() + 180_000_000
        fleet = Fleet(repo, daemon_args=("--memory-budget", str(budget)))
        try:
            request = {n: build_infer_request(n, {"x": np.zeros((1, 4), np.float32)}).SerializeToString()
                       for n in names}
            rng = random.Random(7)
            sequence = [rng.choice(names) for _ in range(calls)]

            def loads() -> float:
                return sum(_gauge(d, "modeld_model_loads_total", outcome="ok") for d in fleet.daemons)

            def run(addresses: list[str], label: str) -> dict:
                channels = [grpc.insecure_channel(a) for a in addresses]
                stubs = [c.unary_unary(INFER) for c in channels]
                before = loads()
                failed = 0

                def one(i: int) -> None:
                    nonlocal failed
                    try:
                        stubs[i % len(stubs)](request[sequence[i]], timeout=60)
                    except grpc.RpcError:
                        failed += 1

                with ThreadPoolExecutor(4) as pool:
                    list(pool.map(one, range(len(sequence))))
                for c in channels:
                    c.close()
                cold = loads() - before
                return {"calls": len(sequence), "loads": cold, "failed": failed,
                        "resident_share": round(1 - cold / len(sequence), 4)}

            warm = run([fleet.gateway.address], "warm-up")  # first loads, placement settles
            through = run([fleet.gateway.address], "gateway")
            direct = run([d.address for d in fleet.daemons], "round robin")
        finally:
            fleet.close()
    return {"models": len(names), "model_mb": 40, "node_budget_mb": round(budget / 1e6), "warm_up": warm,
            "gateway": through, "round_robin_direct": direct, "goal": ">= 95% of calls find their model loaded"}


# -- prefix ---------------------------------------------------------------------

def _lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def prefix(rounds: int, calls: int) -> dict:
    rounds = max(2, min(rounds, 4))
    with tempfile.TemporaryDirectory() as tmp:
        fleet = Fleet(_repository(Path(tmp), ("smollm2", "smollm2-draft")))
        try:
            results = {"gateway": [], "round_robin": []}
            for index in range(rounds):
                for mode in (("gateway", "round_robin") if index % 2 == 0 else ("round_robin", "gateway")):
                    results[mode].append(_conversations(fleet, mode, salt=f"{index}-{mode}"))
        finally:
            fleet.close()
    summary = {}
    for mode, runs in results.items():
        cached = sum(r["cached"] for r in runs)
        ideal = sum(r["ideal"] for r in runs)
        summary[mode] = {"cached_tokens": cached, "ideal_tokens": ideal, "share_of_ideal": round(cached / ideal, 3),
                         "per_round": [round(r["cached"] / r["ideal"], 3) for r in runs]}
    return {"rounds": rounds, "conversations": 12, "turns": 3, **summary,
            "goal": "cached prompt tokens >= 0.7 of the ideal, through the gateway"}


_SYSTEMS = [
    "You are the support assistant of a bicycle shop. You answer in two sentences, you never invent prices, "
    "and you always suggest visiting the workshop for anything involving brakes or gears. ",
    "You are a patient maths tutor for secondary school pupils. You explain each step, you check the pupil's "
    "arithmetic, and you end every answer with one short practice question. ",
    "You are a travel planner for rail journeys across Europe. You give times in the 24-hour clock, mention "
    "seat reservations where trains need them, and keep answers brief. ",
]
_QUESTIONS = ["What should I do first?", "Can you say more about that?", "Thanks. Anything else?"]


def _conversations(fleet: Fleet, mode: str, salt: str) -> dict:
    """12 conversations, turns interleaved across them, three at a time."""
    gateway = gen_grpc.GenerationStub(grpc.insecure_channel(fleet.gateway.address))
    nodes = [gen_grpc.GenerationStub(grpc.insecure_channel(d.address)) for d in fleet.daemons]
    tokenizer = nodes[0]
    convs = [{"prompt": f"[{salt}] " * 8 + _SYSTEMS[c % 3] * 6 + f"\nUser {c}: {_QUESTIONS[0]}\nAssistant:",
              "node": c % 3} for c in range(12)]
    seen: list[list[int]] = []
    cached = ideal = 0
    counter = 0
    lock = threading.Lock()
    for turn in range(3):
        def one(c: int) -> tuple[int, int]:
            nonlocal counter
            conv = convs[c]
            with lock:
                stub = gateway if mode == "gateway" else nodes[counter % 3]
                counter += 1
            replies = list(stub.Generate(gen.GenerateRequest(
                model="smollm2", prompt=conv["prompt"],
                sampling=gen.SamplingParams(max_tokens=16, temperature=0.0)), timeout=300))
            completion = "".join(r.text for r in replies)
            ids = list(tokenizer.Tokenize(gen.TokenizeRequest(model="smollm2", text=conv["prompt"])).token_ids)
            answer = [i for r in replies for i in r.token_ids]
            with lock:
                best = max((_lcp(ids, s) for s in seen), default=0)
                seen.append(ids + answer)
            # the last prompt token is always computed (its logits start the answer)
            conv["prompt"] += completion + f"\nUser {c}: {_QUESTIONS[(turn + 1) % 3]}\nAssistant:"
            return replies[-1].usage.cached_prompt_tokens, min(best, len(ids) - 1)

        with ThreadPoolExecutor(3) as pool:
            for got, best in pool.map(one, range(12)):
                cached += got
                ideal += best
    return {"cached": cached, "ideal": ideal}


# -- main -----------------------------------------------------------------------

SECTIONS = {"overhead": overhead, "ring": ring, "kill": kill, "frozen": frozen, "residency": residency,
            "prefix": prefix}


def _chart(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    if "overhead" in results:
        o = results["overhead"]
        axes[0].bar(["direct p50", "gateway p50", "direct p99", "gateway p99"],
                    [o["p50_ms"]["direct"], o["p50_ms"]["gateway"], o["p99_ms"]["direct"], o["p99_ms"]["gateway"]],
                    color=["#888", "#2a7", "#888", "#2a7"])
        axes[0].set_ylabel("ms per minilm call")
        axes[0].set_title("gateway overhead, one client")
    if "frozen" in results:
        f = results["frozen"]
        axes[1].bar(["plain p99", "hedged p99"], [f["p99_ms"]["plain"], f["p99_ms"]["hedged"]], color=["#888", "#2a7"])
        axes[1].set_ylabel("ms")
        axes[1].set_title("one replica frozen 2 s at a time")
    shares = {}
    if "residency" in results:
        shares["resident (gw)"] = results["residency"]["gateway"]["resident_share"]
        shares["resident (rr)"] = results["residency"]["round_robin_direct"]["resident_share"]
    if "prefix" in results:
        shares["prefix (gw)"] = results["prefix"]["gateway"]["share_of_ideal"]
        shares["prefix (rr)"] = results["prefix"]["round_robin"]["share_of_ideal"]
    if shares:
        axes[2].bar(list(shares), list(shares.values()), color=["#2a7" if "gw" in k else "#888" for k in shares])
        axes[2].set_ylim(0, 1.05)
        axes[2].set_title("residency and prefix-cache share")
    fig.tight_layout()
    fig.savefig(CHART, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated sections: " + ", ".join(SECTIONS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400, help="calls per round (overhead) or in all (residency)")
    args = parser.parse_args()
    chosen = args.only.split(",") if args.only else list(SECTIONS)
    previous = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results = dict(previous.get("results", {}))
    for name in chosen:
        started = time.monotonic()
        print(f"== {name}", flush=True)
        results[name] = SECTIONS[name](args.rounds, args.calls)
        results[name]["seconds"] = round(time.monotonic() - started, 1)
        results[name]["command"] = f"python bench/bench_gateway.py --only {name} --rounds {args.rounds} " \
                                   f"--calls {args.calls}"
        results[name]["date"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        results[name]["load_avg_1m"] = os.getloadavg()[0]
        print(json.dumps(results[name], indent=1), flush=True)
        record = {  # written after each section: a long run stopped midway keeps what it measured
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
            "results": results,
        }
        RESULTS.write_text(json.dumps(record, indent=1) + "\n")
    _chart(results)
    print(f"wrote {RESULTS} and {CHART}")


if __name__ == "__main__":
    main()
