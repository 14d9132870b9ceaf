"""bench_token_cpu's clock of llama.cpp's compute in a worker process.

With MODELD_BENCH_COMPUTE_CLOCK=<folder> in its environment (and this
folder first on PYTHONPATH), a process that imports llama_cpp gets
llama_decode and llama_sampler_sample wrapped: the CPU time the calling
thread spends inside them (CLOCK_THREAD_CPUTIME_ID, the scheduler's own
count, as /proc/<pid>/task/<tid>/schedstat) is summed into an 8-byte
counter, <folder>/<pid>, that the benchmark reads before and after each
phase. The step thread's CPU less that sum is its Python, to the
nanosecond, where a sampling profiler gives a share of a few thousand
samples. The wrapping waits for llama_cpp's own import, so libgomp loads
when modeld lets it (after setting its wait policy), not at start-up.
"""

from __future__ import annotations

import os
import sys

_FOLDER = os.environ.get("MODELD_BENCH_COMPUTE_CLOCK")


def _clock(module) -> None:
    import mmap
    import struct
    import time

    fd = os.open(os.path.join(_FOLDER, str(os.getpid())), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 8)
    counter = mmap.mmap(fd, 8)
    os.close(fd)
    total = [0]
    now = time.thread_time_ns

    def timed(call):
        def run(*args):
            start = now()
            try:
                return call(*args)
            finally:
                total[0] += now() - start
                struct.pack_into("<q", counter, 0, total[0])
        return run

    for name in ("llama_decode", "llama_sampler_sample"):
        setattr(module, name, timed(getattr(module, name)))


if _FOLDER:
    import importlib.abc
    import importlib.machinery

    class _AfterImport(importlib.abc.MetaPathFinder):
        """Wraps llama_cpp.llama_cpp's functions once it has run, before the
        package's `from .llama_cpp import *` copies them."""

        def find_spec(self, name, path, target=None):
            if name != "llama_cpp.llama_cpp":
                return None
            sys.meta_path.remove(self)
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _clock(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _AfterImport())
