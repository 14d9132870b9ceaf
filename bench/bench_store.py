"""Pull throughput of the model store against `oras pull` of the same artifact.

One local docker-registry (Debian's CNCF distribution registry) on loopback
holds one artifact pushed by `modeld push`: a folder with one weight file of
--size MiB (random bytes, named model.onnx) and a model.toml. Each round, in
alternating order so a busy neighbour slows both alike, pulls it into an
empty folder:

  modeld   ModelStore.pull_sync into an empty cache: digest-checked, written
           to a partial file and renamed, then hard-linked into the model folder
  oras     the oras Python library's pull of the same tag into an empty folder
           (it writes what arrives and checks no digest)

and reports MB/s of each (median over --rounds) and their ratio
(goal: modeld >= 0.9x oras). The pull threads run at --nice (default 0,
oras's own priority; the daemon runs them at 10, which on a busy machine
yields the CPU to serving). Each side keeps one client for every round, and
each round ends by deleting what it pulled (the store's evict, oras's
folder), inside the time. Writes bench/results/store.json.

    .venv/bin/python bench/bench_store.py [--size 256] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
RESULTS = ROOT / "bench" / "results"

from store_servers import start_registry  # noqa: E402

from modeld.server.store import ModelStore, OciSettings, StoreSettings  # noqa: E402
from modeld.server.store import cache as store_cache  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=256, help="MiB of the weight file")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--nice", type=int, default=0,
                        help="the pull threads' nice (the daemon's is 10, so serving goes first; 0 here races "
                             "oras at the same priority)")
    args = parser.parse_args()
    store_cache.PULL_NICE = args.nice
    started = datetime.now(timezone.utc)
    with tempfile.TemporaryDirectory(prefix="bench-store-") as tmp:
        root = Path(tmp)
        registry = start_registry(root / "registry")
        try:
            folder = root / "model"
            folder.mkdir()
            with (folder / "model.onnx").open("wb") as out:
                for _ in range(args.size):
                    out.write(os.urandom(1024 * 1024))
            (folder / "model.toml").write_text('format = "onnx"\n')
            uri = registry.uri("bench/model", "v1")
            settings = OciSettings(plain_http=(registry.host,))
            ModelStore(StoreSettings(root / "push-cache", 1 << 40, settings)).push(folder, uri)
            nbytes = sum(p.stat().st_size for p in folder.iterdir())
            import oras.client

            oras_client = oras.client.OrasClient(hostname=registry.host, insecure=True)
            times: dict[str, list[float]] = {"modeld": [], "oras": []}

            # one store, as one oras client: a new one a round would pay for a new HTTP client and pool
            store = ModelStore(StoreSettings(root / "cache", 1 << 40, settings))

            def pull_modeld(i: int) -> None:
                pulled = store.pull_sync(uri)
                assert (pulled.folder / "model.onnx").stat().st_size == args.size * 1024 * 1024
                assert store.cache.evict(uri) == 1 and store.cache.used_bytes() == 0

            def pull_oras(i: int) -> None:
                out = root / f"oras-{i}"
                oras_client.pull(target=f"{registry.host}/bench/model:v1", outdir=str(out))
                assert (out / "model.onnx").stat().st_size == args.size * 1024 * 1024
                shutil.rmtree(out)

            pull_modeld(-1)  # warm-up: the registry's own caches, imports
            pull_oras(-1)
            for i in range(args.rounds):
                order = (("modeld", pull_modeld), ("oras", pull_oras))
                for name, pull in (order if i % 2 == 0 else order[::-1]):
                    t0 = time.perf_counter()
                    pull(i)
                    times[name].append(time.perf_counter() - t0)
            store.close()
        finally:
            registry.stop()
    mbps = {name: nbytes / 1e6 / statistics.median(ts) for name, ts in times.items()}
    ratio = mbps["modeld"] / mbps["oras"]
    print(f"pull of {nbytes / 1e6:.0f} MB from a local docker-registry, median of {args.rounds} rounds:")
    for name in ("modeld", "oras"):
        print(f"  {name:7s} {mbps[name]:8.1f} MB/s  (rounds: {', '.join(f'{t:.2f}s' for t in times[name])})")
    print(f"  ratio modeld/oras = {ratio:.2f} (goal >= 0.9)")
    RESULTS.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([".venv/bin/python", "bench/bench_store.py", *sys.argv[1:]]),
              "started": started.isoformat(timespec="seconds"), "machine": platform.platform(),
              "load_average": os.getloadavg(), "pull_nice": args.nice,
              "cpus": os.cpu_count(), "bytes": nbytes, "rounds": args.rounds, "seconds": times,
              "mb_per_s": mbps, "ratio_modeld_over_oras": ratio}
    (RESULTS / "store.json").write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
