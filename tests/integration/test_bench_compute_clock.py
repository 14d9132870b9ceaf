"""bench/compute_clock: bench_token_cpu's clock of the CPU a thread spends
inside llama.cpp's decode, in a process that gets it as a worker does (on
PYTHONPATH, with MODELD_BENCH_COMPUTE_CLOCK naming its folder). SmolLM2
decodes a few tokens in a fresh interpreter; the counter must hold the
decodes' thread CPU, no more than the thread's whole CPU and most of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from daemon import MODELS

pytest.importorskip("llama_cpp")

ROOT = Path(__file__).resolve().parents[2]

_DECODE = """
import sys, time
from pathlib import Path
from modeld.backends.llamacpp.context import LlamaContext, LlamaModel
model = LlamaModel(Path(sys.argv[1]).resolve())
context = LlamaContext(model, 512, 1, 64, 1)
start = time.thread_time_ns()
context.decode([(10 + i, i, 0, i == 15) for i in range(16)], argmax_only=True)
for i in range(8):
    context.decode([(100 + i, 16 + i, 0, True)], argmax_only=True)
print(time.thread_time_ns() - start)
"""


def _counter(folder: Path, pid: int) -> int:
    return int.from_bytes((folder / str(pid)).read_bytes()[:8], "little", signed=True)


def test_clock_sums_the_decodes_thread_cpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench/compute_clock"),
           "MODELD_BENCH_COMPUTE_CLOCK": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _DECODE, str(MODELS / "smollm2/model.gguf")], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    thread_ns = int(proc.stdout.strip().splitlines()[-1])
    (counter,) = list(tmp_path.iterdir())
    inside = _counter(tmp_path, int(counter.name))
    # nine decodes of SmolLM2 on one thread: nearly all of that thread's CPU
    assert 0.5 * thread_ns < inside <= thread_ns


def test_without_the_variable_nothing_is_wrapped(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench/compute_clock")}
    env.pop("MODELD_BENCH_COMPUTE_CLOCK", None)
    code = "import llama_cpp; print(type(llama_cpp.llama_decode).__name__)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # the ctypes function itself, not the clock's wrapper
    assert proc.stdout.strip() != "function"
