"""Loads yield the CPU to serving: a model's load (an ONNX session's graph
optimisation, a GGUF dequantisation, torch.compile's tracing and inductor's
compile workers) runs at a lower CPU priority than the models already
serving, so a resident model keeps its throughput while another loads.

Linux schedules threads, and a thread's nice value is its own: the loading
thread is lowered, every thread and process it starts meanwhile (onnxruntime's
and torch's pools, inductor's compile workers) inherits the lowered value,
and when the load ends every thread of this process the load lowered is put
back, so the new model then serves at the daemon's priority. Putting a value
back needs CAP_SYS_NICE (or an RLIMIT_NICE that allows it): without either,
threads the load started stay lowered and `load_priority_not_restored` is
logged once; `load_niceness = 0` turns all of this off.

Measured in bench/bench_load_starvation.py (bench/results/load_starvation.json).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Callable, TypeVar

import structlog

from modeld.backends.digits import ascii_digits

log = structlog.get_logger("modeld.load_priority")

T = TypeVar("T")

# nice 10 weighs 110 against a serving thread's 1024 (the kernel's
# sched_prio_to_weight): a load gets about a tenth of a contended core
DEFAULT_NICENESS = 10
_TASKS = Path("/proc/self/task")
_warned = False
_lock = threading.Lock()  # one lowered load at a time sees a clean "lowered by us" set


def niceness() -> int:
    """The daemon's setting, passed to its worker processes in the environment."""
    raw = os.environ.get("MODELD_LOAD_NICENESS", "")
    return int(raw) if ascii_digits(raw.lstrip("-")) else DEFAULT_NICENESS


def run_lowered(fn: Callable[..., T], *args, nice: int | None = None) -> T:
    """fn(*args) in this thread at `nice` (default: niceness()) above the
    thread's own value; every thread of this process it lowered goes back
    afterwards, however fn ends."""
    step = niceness() if nice is None else nice
    if step <= 0 or not hasattr(os, "setpriority"):
        return fn(*args)
    with _lock:
        tid = threading.get_native_id()
        base = _nice_of(tid)
        if base is None:
            return fn(*args)
        before = _thread_ids()
        lowered = min(19, base + step)
        try:
            os.setpriority(os.PRIO_PROCESS, tid, lowered)
        except OSError:
            return fn(*args)
        try:
            return fn(*args)
        finally:
            _restore(tid, base, lowered, before)


def _restore(tid: int, base: int, lowered: int, before: set[int]) -> None:
    """Put back this thread and each one the load started at `lowered`."""
    global _warned
    failed = 0
    for other in {tid} | (_thread_ids() - before):
        if _nice_of(other) != lowered:
            continue  # changed by someone else since: theirs to keep
        try:
            os.setpriority(os.PRIO_PROCESS, other, base)
        except OSError:
            failed += 1
    if failed and not _warned:
        _warned = True
        log.warning("load_priority_not_restored", threads=failed, niceness=lowered,
                    hint="give the daemon CAP_SYS_NICE, or set load_niceness = 0")


def _thread_ids() -> set[int]:
    try:
        return {int(p.name) for p in _TASKS.iterdir()}
    except OSError:
        return set()


def _nice_of(tid: int) -> int | None:
    try:
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None


def place_compile_caches(cache_dir: Path) -> dict[str, str]:
    """torch.compile's caches (inductor's FX graph and generated code, the
    autograd cache) under the store's disk cache folder, so a model compiled
    once on a node compiles from its cache on every later load, there and
    in its worker processes (which inherit the environment); and inductor's
    compile workers bounded to one process, so a compile never takes every
    core. An operator's own settings of these variables win."""
    wanted = {
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir / "compile" / "inductor"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        "TORCHINDUCTOR_COMPILE_THREADS": "1",
    }
    placed = {}
    for key, value in wanted.items():
        if key not in os.environ:
            os.environ[key] = placed[key] = value
    return placed
