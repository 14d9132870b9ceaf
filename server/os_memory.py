"""Give memory freed by an unload back to the operating system.

glibc keeps freed heap pages for reuse, so without a trim the process's RSS
stays high after a model is unloaded and the memory budget (which already
counts it as free) disagrees with what the machine sees.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc


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
