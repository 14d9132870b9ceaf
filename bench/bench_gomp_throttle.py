"""libgomp's spin while a second OpenMP team is alive: a setting one process
can change while it runs.

libgomp reads OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when it loads, but
it spins for a short "throttled" count instead whenever it manages more
OpenMP threads than the process has CPUs (libgomp's manual, GOMP_SPINCOUNT).
One idle team started on a thread of its own (GOMP_PARALLEL with two
threads, then parked) takes the count past the CPUs; ending that thread
releases its team and the configured spin is back.

This times llama.cpp's bare decode of smollm2 in this process (1 sequence,
or --sequences N, 64 tokens a round) with and without such a team,
alternating, on an idle machine and with --hog 1 beside one busy process.
It runs under the libgomp settings it is started with (with neither
variable set, modeld's llama.cpp module sets the shipped ones; an empty
OMP_WAIT_POLICY leaves libgomp's own):

    OMP_WAIT_POLICY=PASSIVE GOMP_SPINCOUNT=300 .venv/bin/python bench/bench_gomp_throttle.py [--hog 1]
    OMP_WAIT_POLICY= .venv/bin/python bench/bench_gomp_throttle.py [--hog 1]   # libgomp's own default

Writes bench/results/gomp_throttle.json (one entry per run, appended).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

_CALLBACK = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@_CALLBACK
def _nothing(_data) -> None:
    pass


class ExtraTeam:
    """An idle OpenMP team of two threads on a thread of its own while on."""

    def __init__(self) -> None:
        self._gomp = ctypes.CDLL("libgomp.so.1")  # the one ggml's OpenMP already loaded
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def on(self) -> None:
        started = threading.Event()

        def hold() -> None:
            self._gomp.GOMP_parallel(_nothing, None, 2, 0)
            started.set()
            self._stop.wait()  # the thread's end frees its team (libgomp's thread destructor)

        self._stop.clear()
        self._thread = threading.Thread(target=hold, daemon=True)
        self._thread.start()
        started.wait(10)

    def off(self) -> None:
        self._stop.set()
        self._thread.join(10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hog", type=int, default=0, help="busy processes beside the decode")
    parser.add_argument("--sequences", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", default=str(RESULTS / "gomp_throttle.json"))
    args = parser.parse_args()

    from modeld.backends.llamacpp.context import LlamaContext, LlamaModel, _llama

    model = LlamaModel((ROOT / "models" / "smollm2" / "model.gguf").resolve())
    context = LlamaContext(model, 4096, max(2, args.sequences), 512, 2)
    llama = _llama()
    n = args.sequences

    def decode_rate(tokens: int = 64) -> float:
        for s in range(n):
            llama.llama_memory_seq_rm(context.memory, s, -1, -1)
        context.decode([(10 + i, i, s, i == 19) for s in range(n) for i in range(20)], argmax_only=True)
        start = time.perf_counter()
        for i in range(tokens):
            context.decode([(100 + i, 20 + i, s, True) for s in range(n)], argmax_only=True)
        return tokens * n / (time.perf_counter() - start)

    team = ExtraTeam()
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    try:
        decode_rate(16)
        rates: dict[str, list[float]] = {"configured spin": [], "throttled (extra team)": []}
        for _ in range(args.rounds):
            rates["configured spin"].append(decode_rate())
            team.on()
            rates["throttled (extra team)"].append(decode_rate())
            team.off()
    finally:
        for hog in hogs:
            hog.kill()
    medians = {side: statistics.median(values) for side, values in rates.items()}
    entry = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "env": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "hog": args.hog, "sequences": n, "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "tok_s": {side: [round(v, 1) for v in values] for side, values in rates.items()},
        "median_tok_s": {side: round(v, 1) for side, v in medians.items()},
        "throttled_over_configured": round(medians["throttled (extra team)"] / medians["configured spin"], 3),
    }
    print(json.dumps(entry))
    out = Path(args.output)
    runs = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps(runs + [entry], indent=1) + "\n")


if __name__ == "__main__":
    main()
