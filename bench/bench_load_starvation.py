"""Loading must not starve serving: minilm's throughput at 32 clients with
nothing loading, against the same while other models load, in one run.

Two daemons on one temporary repository, told apart only by
MODELD_LOAD_NICENESS: `plain` (0: loads at the daemon's own priority) and
`lowered` (the default, server/load_priority.py: loads at nice +10, the
threads they start put back afterwards). Each round, for each daemon in
turn (alternating which goes first, so a busy neighbour slows both alike):

  quiet  32 gRPC clients (tritonclient.grpc.aio) call minilm for --quiet-s
  busy   the same clients while the daemon loads, one after another,
         smollm2-torch (the torch runtime: GGUF dequantisation and
         torch.compile of each layer, in its worker process) and --onnx
         generated ONNX graphs (onnxruntime's session build and graph
         optimisation, in the daemon), each unloaded again first, and
         meanwhile pulls and loads a model of --pull-mib MiB from a local
         registry (Debian's docker-registry on loopback; a fresh artifact
         each window, so every byte is fetched and hashed); the window lasts
         as long as the loads and the pull do

and reports each window's requests per second and busy/quiet per daemon
(goal: lowered >= 0.8). The machine is shared: the load average is
recorded, and the ratios of one round against another say how noisy it is.
Writes bench/results/load_starvation.json.

    .venv/bin/python bench/bench_load_starvation.py [--rounds 2] [--quiet-s 15] [--onnx 4] [--pull-mib 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
RESULTS = ROOT / "bench" / "results"

from daemon import start_daemon  # noqa: E402
from store_servers import start_registry  # noqa: E402

CLIENTS = 32
MAX_BUSY_S = 600.0
TORCH_MODEL = "smollm2-torch"


def matmul_chain(seed: int, width: int = 512, depth: int = 24) -> bytes:
    """A graph onnxruntime spends CPU optimising at load: `depth` MatMul+Relu
    layers of width x width float weights (about 1 MiB each)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits, prev = [], [], "x"
    for i in range(depth):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, width)).astype(np.float32) * 0.01, f"w{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        prev = f"r{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def make_repository(root: Path, num_onnx: int) -> list[str]:
    """minilm and smollm2-torch from models/ (links to their files), and the generated graphs."""
    minilm = root / "minilm"
    minilm.mkdir()
    for name in ("model.onnx", "tokenizer.json", "model.toml"):
        (minilm / name).symlink_to(ROOT / "models" / "minilm" / name)
    torch_dir = root / TORCH_MODEL
    torch_dir.mkdir()
    (torch_dir / "model.gguf").symlink_to((ROOT / "models" / "smollm2" / "model.gguf").resolve())
    # models/smollm2-torch's own settings, without its draft model
    toml = (ROOT / "models" / TORCH_MODEL / "model.toml").read_text()
    (torch_dir / "model.toml").write_text("\n".join(line for line in toml.splitlines()
                                                    if not line.startswith("draft_model")) + "\n")
    loads = [TORCH_MODEL]
    for i in range(num_onnx):
        folder = root / f"chain{i}"
        folder.mkdir()
        (folder / "model.onnx").write_bytes(matmul_chain(i))
        (folder / "model.toml").write_text('format = "onnx"\nbackends = ["onnx"]\n')
        loads.append(folder.name)
    return loads


def sentence_requests() -> list:
    import tritonclient.grpc as grpcclient

    words = "the quick brown fox jumps over a lazy dog while models load beside it".split()
    rng = np.random.default_rng(7)
    requests = []
    for _ in range(256):
        text = " ".join(rng.choice(words, size=12))
        inp = grpcclient.InferInput("text", [1], "BYTES")
        inp.set_data_from_numpy(np.array([text.encode()], dtype=np.object_))
        requests.append([inp])
    return requests


async def _drive(address: str, requests: list, until) -> tuple[int, float, int]:
    """32 clients calling minilm until `until()` is true: (calls, seconds, errors)."""
    from tritonclient.grpc.aio import InferenceServerClient

    client = InferenceServerClient(address)
    done, errors = [0], [0]

    async def one(first: int) -> None:
        i = first
        while not until():
            try:
                await client.infer("minilm", requests[i % len(requests)])
                done[0] += 1
            except Exception:  # noqa: BLE001 - counted; a failing daemon must not spin
                errors[0] += 1
                await asyncio.sleep(0.05)
            i += CLIENTS

    try:
        start = time.perf_counter()
        await asyncio.gather(*(one(w) for w in range(CLIENTS)))
        return done[0], time.perf_counter() - start, errors[0]
    finally:
        await client.close()


def drive_for(address: str, requests: list, seconds: float) -> tuple[int, float, int]:
    stop_at = time.perf_counter() + seconds
    return asyncio.run(_drive(address, requests, lambda: time.perf_counter() >= stop_at))


def push_pulled(root: Path, registry, tag: str, mib: int) -> str:
    """A fresh artifact to pull: a small ONNX graph and --pull-mib MiB of
    random weights beside it, pushed by modeld push's code; its URI."""
    from modeld.server.store import ModelStore, OciSettings, StoreSettings

    folder = root / "pulled" / tag
    folder.mkdir(parents=True)
    (folder / "model.onnx").write_bytes(matmul_chain(1000, width=64, depth=2))
    with (folder / "weights.bin").open("wb") as out:
        rng = np.random.default_rng()
        for _ in range(mib):
            out.write(rng.bytes(1024 * 1024))
    uri = registry.uri("starve/pulled", tag)
    store = ModelStore(StoreSettings(root / "push-cache", 1 << 40, OciSettings(plain_http=(registry.host,))))
    try:
        store.push(folder, uri, "onnx")
    finally:
        store.close()
    shutil.rmtree(folder)
    return uri


def busy_window(address: str, requests: list, loads: list[str], pull_uri: str = "") -> dict:
    """minilm driven while `loads` load one after another (each unloaded
    first) and, beside them, a model is pulled from `pull_uri` and loaded."""
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(address) as client:
        for name in loads:
            client.unload_model(name)
    finished = threading.Event()
    pulled = threading.Event()
    timings: dict[str, float] = {}
    failure: list[str] = []

    def pull() -> None:
        try:
            with grpcclient.InferenceServerClient(address) as client:
                began = time.perf_counter()
                client.load_model("pulled", config=json.dumps({"source": pull_uri}), client_timeout=MAX_BUSY_S)
                timings["pulled"] = round(time.perf_counter() - began, 2)
                client.unload_model("pulled")
        except Exception as exc:  # noqa: BLE001 - reported with the round
            failure.append(f"pull: {type(exc).__name__}: {str(exc)[:200]}")
        finally:
            pulled.set()

    if pull_uri:
        threading.Thread(target=pull, daemon=True).start()
    else:
        pulled.set()

    def load_all() -> None:
        try:
            with grpcclient.InferenceServerClient(address) as client:
                for name in loads:
                    began = time.perf_counter()
                    client.load_model(name, client_timeout=MAX_BUSY_S)
                    timings[name] = round(time.perf_counter() - began, 2)
        except Exception as exc:  # noqa: BLE001 - reported with the round
            failure.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        finally:
            finished.set()

    loader = threading.Thread(target=load_all, daemon=True)
    loader.start()
    calls, seconds, errors = asyncio.run(_drive(address, requests, lambda: finished.is_set() and pulled.is_set()))
    loader.join()
    return {"calls": calls, "seconds": round(seconds, 2), "rps": calls / seconds, "errors": errors,
            "load_seconds": timings, "load_failure": failure[0] if failure else ""}


def start(mode: str, root: Path, niceness: int, registry):
    settings = root / f"{mode}.toml"
    # a torch compile at nice +10 on a busy shared machine takes minutes: past the 300 s default
    settings.write_text(f'store_cache_dir = "{root / ("cache-" + mode)}"\nworker_load_timeout_s = {MAX_BUSY_S}\n'
                        f'store_oci_plain_http = ["{registry.host}"]\n')
    env = {**os.environ, "MODELD_LOAD_NICENESS": str(niceness)}
    daemon = start_daemon("--config", str(settings), "--no-preload", repository=root / "repo", env=env, timeout=600)
    import tritonclient.grpc as grpcclient

    with grpcclient.InferenceServerClient(daemon.address) as client:
        client.load_model("minilm")
    return daemon


def hooks_in_place() -> dict[str, bool]:
    """Whether the loaders call run_lowered (in-process: loading.py; workers: workers/main.py)."""
    return {path: "run_lowered" in (ROOT / path).read_text()
            for path in ("server/engine/loading.py", "server/workers/main.py")}


def write_record(started: datetime, args, loads: list[str], rounds: list[dict]) -> dict:
    summary = {mode: {"median_ratio": statistics.median(r["ratio"] for r in rounds if r["mode"] == mode),
                      "ratios": [round(r["ratio"], 3) for r in rounds if r["mode"] == mode],
                      "median_quiet_rps": statistics.median(r["quiet_rps"] for r in rounds if r["mode"] == mode)}
               for mode in ("plain", "lowered") if any(r["mode"] == mode for r in rounds)}
    record = {
        "started": started.isoformat(timespec="seconds"), "machine": platform.platform(), "cpus": os.cpu_count(),
        "command": "flock /tmp/coord/bench.lock .venv/bin/python bench/bench_load_starvation.py " + " ".join(sys.argv[1:]),
        "clients": CLIENTS, "loads": loads, "pull_mib": args.pull_mib, "quiet_s": args.quiet_s, "rounds": rounds,
        "rounds_asked": args.rounds, "summary": summary, "hooks_in_place": hooks_in_place(),
        "goal": "lowered median_ratio >= 0.8",
        "goal_met": "lowered" in summary and summary["lowered"]["median_ratio"] >= 0.8,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "load_starvation.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quiet-s", type=float, default=15.0)
    parser.add_argument("--onnx", type=int, default=4, help="generated ONNX graphs loaded after smollm2-torch")
    parser.add_argument("--no-torch", action="store_true", help="ONNX loads only")
    parser.add_argument("--pull-mib", type=int, default=256, help="MiB pulled from a registry in each busy window "
                                                                   "(0: no pull)")
    args = parser.parse_args()
    started = datetime.now(timezone.utc)
    requests = sentence_requests()
    rounds: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench-starve-") as tmp:
        root = Path(tmp)
        (root / "repo").mkdir()
        loads = make_repository(root / "repo", args.onnx)
        if args.no_torch:
            loads = loads[1:]
        registry = start_registry(root / "registry")
        daemons = {}
        try:
            daemons = {"plain": start("plain", root, 0, registry), "lowered": start("lowered", root, 10, registry)}
            for r in range(args.rounds):
                order = list(daemons) if r % 2 == 0 else list(reversed(daemons))
                for mode in order:
                    address = daemons[mode].address
                    pull_uri = push_pulled(root, registry, f"{mode}-{r}", args.pull_mib) if args.pull_mib else ""
                    drive_for(address, requests, 3.0)  # warm: connections up, batches formed
                    calls, seconds, errors = drive_for(address, requests, args.quiet_s)
                    busy = busy_window(address, requests, loads, pull_uri)
                    row = {"round": r, "mode": mode, "quiet_rps": calls / seconds, "quiet_errors": errors,
                           "busy": busy, "ratio": busy["rps"] / (calls / seconds), "load_average": os.getloadavg()}
                    rounds.append(row)
                    write_record(started, args, loads, rounds)  # after every window: a stopped run keeps its rounds
                    print(f"round {r} {mode:8s} quiet {row['quiet_rps']:6.1f} req/s  busy {busy['rps']:6.1f} req/s "
                          f"over {busy['seconds']:5.1f} s  ratio {row['ratio']:.2f}  loads {busy['load_seconds']} "
                          f"{busy['load_failure']}", flush=True)
        finally:
            for daemon in daemons.values():
                daemon.stop()
            registry.stop()
    record = write_record(started, args, loads, rounds)
    summary = record["summary"]
    print(f"plain busy/quiet {summary['plain']['median_ratio']:.2f}  lowered {summary['lowered']['median_ratio']:.2f}"
          f"  (goal lowered >= 0.8: {'met' if record['goal_met'] else 'NOT met'}); hooks {record['hooks_in_place']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
