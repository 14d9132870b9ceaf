"""A fleet serving more models than it holds: --models small ONNX models in a
local registry (Debian's docker-registry on loopback), --nodes daemons each
with memory for --memory-models of them and disk for --disk-models, behind
`modeld gateway`, under a Zipf request mix.

Each model is y = x * w with its own weights plus a padding initializer of
--model-kib KiB (so no two share a blob), pushed by `modeld push`'s code as a
ModelPack artifact; each daemon's repository names all of them by
`source = "oci://..."`. Every model has one fixed memory figure: the budget
counts a model at the larger of its artifact's size and its measured growth,
and onnxruntime drops the unused padding at load, so each counts exactly its
artifact's bytes (the calibration checks this, and the run records every
load's figure). A daemon's memory budget is its own share (measured on a
throwaway daemon) plus --memory-models + 0.5 artifacts, so exactly
--memory-models fit; its store_cache_budget is --disk-models + 0.5 artifacts.
--clients clients send --requests calls through the gateway, each to a model
drawn from Zipf(--zipf) over the models in a fixed shuffled order.

From the clients' timings and the daemons' own log events (model_loaded,
store_pulled with its outcome, both stamped by the same clock) it reports:
  residency       models READY on each node and models on its disk, at the end
  memory tier     calls answered without waiting for a load (hit rate)
  disk tier       of the loads, those whose files were all on disk already
  cold starts     per load, the first call that waited for it, split into
                  pull (store_pulled's seconds; ~0 for a disk hit), load (the
                  rest until model_loaded: placement, eviction, onnxruntime's
                  session) and first inference (model_loaded to the answer),
                  p50 and p99 of each
Rates are given over all calls and over the second half (the tiers warm).
Writes bench/results/store_fleet.json.

    .venv/bin/python bench/bench_store_fleet.py [--models 200] [--nodes 3] [--requests 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results"

from daemon import metric_sum, start_daemon, start_gateway  # noqa: E402
from store_servers import start_registry  # noqa: E402

SEED = 31
FAILURES: list[str] = []  # the first failed calls' reasons
X = np.ones((1, 4), dtype=np.float32)


def model_bytes(index: int, pad_kib: int) -> bytes:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(index)
    w = numpy_helper.from_array(np.full(4, float(index + 1), dtype=np.float32), "w")
    pad = numpy_helper.from_array(rng.standard_normal(pad_kib * 256).astype(np.float32), "pad")
    graph = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["y"])], "scale",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
                              initializer=[w, pad])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def name_of(index: int) -> str:
    return f"m{index:03d}"


def push_models(root: Path, registry, count: int, pad_kib: int) -> tuple[dict[str, str], int]:
    """Every model pushed as a ModelPack artifact: their URIs, and one artifact's bytes."""
    from modeld.server.store import ModelStore, OciSettings, StoreSettings

    store = ModelStore(StoreSettings(root / "push-cache", 1 << 40, OciSettings(plain_http=(registry.host,))))
    uris, size = {}, 0
    try:
        for i in range(count):
            folder = root / "src" / name_of(i)
            folder.mkdir(parents=True)
            data = model_bytes(i, pad_kib)
            (folder / "model.onnx").write_bytes(data)
            size = max(size, len(data))
            uris[name_of(i)] = registry.uri(f"fleet/{name_of(i)}", "v1")
            store.push(folder, uris[name_of(i)], "onnx")
    finally:
        store.close()
    return uris, size


def make_repository(folder: Path, uris: dict[str, str]) -> None:
    for name, uri in uris.items():
        (folder / name).mkdir(parents=True)
        (folder / name / "model.toml").write_text(f'source = "{uri}"\nformat = "onnx"\nbackends = ["onnx"]\n')


def settings_file(path: Path, cache: Path, registry, disk_budget: int, memory_budget: int | None) -> Path:
    lines = [f'store_cache_dir = "{cache}"', f"store_cache_budget = {disk_budget}",
             f'store_oci_plain_http = ["{registry.host}"]']
    if memory_budget is not None:
        lines.append(f"memory_budget = {memory_budget}")
    path.write_text("\n".join(lines) + "\n")
    return path


def infer_sync(address: str, model: str) -> None:
    import tritonclient.grpc as tc

    with tc.InferenceServerClient(address) as client:
        inp = tc.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(X)
        client.infer(model, [inp])


def calibrate(root: Path, repo: Path, registry, disk_budget: int, names: list[str]) -> dict:
    """The daemon's own share once onnxruntime is in, and the bytes the books
    hold for each model (modeld_loaded_bytes, its load's figure), on a
    throwaway daemon after 8 loads."""
    settings = settings_file(root / "calibrate.toml", root / "cache-calibrate", registry, disk_budget, None)
    daemon = start_daemon("--config", str(settings), "--no-preload", repository=repo)
    try:
        for name in names[:8]:
            infer_sync(daemon.address, name)
        time.sleep(6)  # the daemon's share is the least of its last readings: let them follow the loads
        daemon_bytes = metric_sum(daemon, "modeld_memory_daemon_bytes")
        per_model = [int(metric_sum(daemon, "modeld_loaded_bytes", model=name)) for name in names[:8]]
    finally:
        daemon.stop()
    return {"daemon_bytes": int(daemon_bytes), "model_bytes": int(statistics.median(per_model)), "per_model_bytes": per_model}


def books_figures(nodes: list) -> dict:
    """What the books counted for each load in the run (model_loaded's nbytes)."""
    figures = [int(e["nbytes"]) for node in nodes for e in node.events("model_loaded") if "nbytes" in e]
    if not figures:
        return {"loads": 0}
    return {"loads": len(figures), "min": min(figures), "max": max(figures),
            "distinct": len(set(figures)), "median": int(statistics.median(figures))}


async def drive(address: str, plan: list[str], clients: int) -> list[tuple[str, float, float, bool]]:
    """Each call: (model, sent at, answered at, ok), wall-clock seconds."""
    from tritonclient.grpc.aio import InferInput, InferenceServerClient

    client = InferenceServerClient(address)
    inp = InferInput("x", [1, 4], "FP32")
    inp.set_data_from_numpy(X)
    calls: list[tuple[str, float, float, bool]] = []
    queue = iter(plan)
    failures = FAILURES

    async def one() -> None:
        for model in queue:
            sent = time.time()
            try:
                await client.infer(model, [inp], client_timeout=300)
                ok = True
            except Exception as exc:  # noqa: BLE001 - counted, the first reasons kept
                ok = False
                if len(failures) < 20:
                    failures.append(str(exc)[:300])
            calls.append((model, sent, time.time(), ok))

    try:
        await asyncio.gather(*(one() for _ in range(clients)))
    finally:
        await client.close()
    return calls


def zipf_plan(names: list[str], count: int, s: float) -> list[str]:
    rng = np.random.default_rng(SEED)
    order = list(rng.permutation(names))
    weights = 1.0 / np.arange(1, len(order) + 1) ** s
    return [order[i] for i in rng.choice(len(order), size=count, p=weights / weights.sum())]


def _ts(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def cold_starts(nodes: list, calls: list, uris: dict[str, str]) -> tuple[list[dict], set[int]]:
    """Each load with the first call that waited for it; and the indices of every call that waited for one."""
    by_model: dict[str, list[int]] = {}
    for i, (model, _, _, _) in enumerate(calls):
        by_model.setdefault(model, []).append(i)
    waited: set[int] = set()
    starts = []
    for n, node in enumerate(nodes):
        pulls = {}
        for event in node.events("store_pulled"):
            pulls.setdefault(event["uri"], []).append(event)
        for event in node.events("model_loaded"):
            model, loaded_at = event.get("model"), _ts(event)
            overlapping = [i for i in by_model.get(model, []) if calls[i][1] <= loaded_at <= calls[i][2]]
            if not overlapping:
                continue  # not a call's load (calibration, a retry)
            waited.update(overlapping)
            first = min(overlapping, key=lambda i: calls[i][1])
            sent, answered = calls[first][1], calls[first][2]
            pull = next((p for p in pulls.get(uris[model], []) if sent - 0.05 <= _ts(p) <= loaded_at + 0.05), None)
            pull_s = float(pull["seconds"]) if pull else 0.0
            starts.append({"node": n, "model": model, "pull_s": pull_s, "pull_outcome": pull["outcome"] if pull else "",
                           "load_s": max(0.0, loaded_at - sent - pull_s), "first_inference_s": answered - loaded_at,
                           "total_s": answered - sent, "at": sent})
    return starts, waited


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "n": 0}
    return {"p50": round(float(np.percentile(values, 50)), 4), "p99": round(float(np.percentile(values, 99)), 4),
            "n": len(values)}


def tiers(calls: list, starts: list[dict], waited: set[int], since: float) -> dict:
    chosen = [i for i, c in enumerate(calls) if c[1] >= since]
    loads = [s for s in starts if s["at"] >= since]
    disk_hits = sum(1 for s in loads if s["pull_outcome"] == "cached")
    return {"calls": len(chosen), "memory_hit_rate": round(1 - sum(1 for i in chosen if i in waited) / max(1, len(chosen)), 4),
            "loads": len(loads), "disk_hit_rate": round(disk_hits / max(1, len(loads)), 4)}


def residency(nodes: list, caches: list[Path]) -> list[dict]:
    import tritonclient.grpc as tc

    out = []
    for node, cache in zip(nodes, caches):
        with tc.InferenceServerClient(node.address) as client:
            ready = [m.name for m in client.get_model_repository_index().models if m.state == "READY"]
        on_disk = len(list((cache / "models").glob("*.json"))) if (cache / "models").is_dir() else 0
        out.append({"ready_in_memory": len(ready), "on_disk": on_disk,
                    "memory_used_bytes": int(metric_sum(node, "modeld_memory_used_bytes")),
                    "memory_budget_bytes": int(metric_sum(node, "modeld_memory_budget_bytes")),
                    "evictions": int(metric_sum(node, "modeld_evictions_total")),
                    "disk_evictions": len(node.events("store_evicted"))})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--memory-models", type=int, default=20)
    parser.add_argument("--disk-models", type=int, default=60)
    parser.add_argument("--model-kib", type=int, default=8192)
    parser.add_argument("--requests", type=int, default=4000)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--zipf", type=float, default=1.0)
    parser.add_argument("--stats-timeout-s", type=float, default=3.0, help="the gateway's stats_timeout_s")
    args = parser.parse_args()
    started = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        registry = start_registry(root / "registry")
        nodes, gateway = [], None
        try:
            began = time.monotonic()
            uris, artifact_bytes = push_models(root, registry, args.models, args.model_kib)
            push_s = time.monotonic() - began
            repo = root / "repo"
            make_repository(repo, uris)
            names = sorted(uris)
            disk_budget = int((args.disk_models + 0.5) * artifact_bytes)
            measured = calibrate(root, repo, registry, disk_budget, names)
            if measured["model_bytes"] != artifact_bytes:
                print(f"note: a model counts {measured['per_model_bytes']} bytes, not its artifact's "
                      f"{artifact_bytes}: residency will not be exactly --memory-models", flush=True)
            # the daemon's share moves by a few MB from one daemon to the next: half a model of slack
            memory_budget = int(measured["daemon_bytes"] + (args.memory_models + 0.5) * measured["model_bytes"])
            caches = [root / f"cache-{n}" for n in range(args.nodes)]
            from concurrent.futures import ThreadPoolExecutor

            def start_node(n: int):
                settings = settings_file(root / f"node{n}.toml", caches[n], registry, disk_budget, memory_budget)
                return start_daemon("--config", str(settings), "--no-preload", repository=repo, timeout=600)

            with ThreadPoolExecutor(args.nodes) as pool:  # a daemon's start is mostly imports: side by side
                nodes.extend(pool.map(start_node, range(args.nodes)))
            # a Stats poll slower than stats_timeout_s marks a node frozen; on a shared 2-core machine at a
            # load average of 15 a poll takes longer than the 0.5 s default while the node is fine
            gateway_config = root / "gateway.toml"
            gateway_config.write_text(f"[gateway]\nstats_timeout_s = {args.stats_timeout_s}\n")
            gateway = start_gateway(*(node.address for node in nodes), args=("--config", str(gateway_config)))
            # calls start once the gateway has seen every node's health say
            # SERVING: before that it rightly refuses them (UNAVAILABLE), which
            # would count the gateway's start-up against the store
            deadline = time.monotonic() + 120
            while metric_sum(gateway, "modeld_gateway_node_serving") < len(nodes):
                if time.monotonic() > deadline:
                    raise SystemExit("the gateway did not see every node serving within 120 s")
                time.sleep(0.2)
            plan = zipf_plan(names, args.requests, args.zipf)
            began = time.time()
            calls = asyncio.run(drive(gateway.address, plan, args.clients))
            elapsed = time.time() - began
            time.sleep(1.0)  # the last log lines reach the pumps
            starts, waited = cold_starts(nodes, calls, uris)
            calls.sort(key=lambda c: c[1])
            half = calls[len(calls) // 2][1]
            record = {
                "started": started.isoformat(timespec="seconds"), "machine": platform.platform(),
                "cpus": os.cpu_count(), "load_average": os.getloadavg(),
                "config": {**vars(args), "artifact_bytes": artifact_bytes, "disk_budget_bytes": disk_budget,
                           "memory_budget_bytes": memory_budget, "calibration": measured},
                "push_seconds": round(push_s, 1), "drive_seconds": round(elapsed, 1),
                "calls_per_s": round(len(calls) / elapsed, 1), "failed_calls": sum(1 for c in calls if not c[3]), "failure_samples": FAILURES[:5],
                "distinct_models_called": len(set(plan)),
                "tiers_all": tiers(calls, starts, waited, 0.0), "tiers_second_half": tiers(calls, starts, waited, half),
                "cold_start": {part: percentiles([s[part] for s in starts])
                               for part in ("pull_s", "load_s", "first_inference_s", "total_s")},
                "cold_start_disk_miss": {part: percentiles([s[part] for s in starts if s["pull_outcome"] == "pulled"])
                                         for part in ("pull_s", "load_s", "first_inference_s", "total_s")},
                "cold_start_disk_hit": {part: percentiles([s[part] for s in starts if s["pull_outcome"] == "cached"])
                                        for part in ("pull_s", "load_s", "first_inference_s", "total_s")},
                "warm_call_s": percentiles([c[2] - c[1] for i, c in enumerate(calls) if i not in waited]),
                "residency": residency(nodes, caches),
                "books_bytes_per_load": books_figures(nodes),
                "command": "flock /tmp/coord/bench.lock .venv/bin/python bench/bench_store_fleet.py "
                           + " ".join(sys.argv[1:]),
            }
        finally:
            if gateway is not None:
                gateway.stop()
            for node in nodes:
                node.stop()
            registry.stop()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "store_fleet.json").write_text(json.dumps(record, indent=2) + "\n")
    a, h = record["tiers_all"], record["tiers_second_half"]
    cold = record["cold_start"]
    print(f"{len(calls)} calls over {args.models} models, {args.nodes} nodes: memory hit {a['memory_hit_rate']:.2f} "
          f"(2nd half {h['memory_hit_rate']:.2f}), disk hit {a['disk_hit_rate']:.2f} (2nd half {h['disk_hit_rate']:.2f}), "
          f"{a['loads']} loads; cold start p50/p99 pull {cold['pull_s']['p50']}/{cold['pull_s']['p99']} s, "
          f"load {cold['load_s']['p50']}/{cold['load_s']['p99']} s, first inference "
          f"{cold['first_inference_s']['p50']}/{cold['first_inference_s']['p99']} s; residency "
          f"{[(r['ready_in_memory'], r['on_disk']) for r in record['residency']]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
