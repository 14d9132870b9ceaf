"""The process's memory as the operating system sees it: resident bytes
(the daemon's and each worker's, read the same way), and freed memory given
back.

glibc keeps freed heap pages for reuse, so without a trim the process's RSS
stays high after a model is unloaded and the memory budget (which already
counts it as free) disagrees with what the machine sees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import os


@functools.cache
def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> bool:
    # an unloaded model's objects may sit in reference cycles (onnx.reference's
    # graphs do): only the cycle collector frees them, so collect before trimming
    gc.collect()
    libc = _libc()
    if libc is None:  # not glibc: nothing to trim
        return False
    return bool(libc.malloc_trim(0))


def process_rss(pid: int) -> int:
    """Resident bytes of process `pid` (VmRSS), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def own_rss() -> int:
    """This process's resident bytes (the daemon's baseline, logged at start)."""
    return process_rss(os.getpid())
