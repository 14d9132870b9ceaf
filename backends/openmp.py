"""libgomp's wait settings for a runtime's compute threads, unless the user gave some.

llama.cpp (ggml) and torch both run their compute on GNU OpenMP thread
teams. At each wait (a barrier inside a step, the pause between steps)
libgomp spins GOMP_SPINCOUNT turns before it sleeps; unset, about 300,000
(~3 ms). On a machine the decode shares, a spinning team holds the cores
the rest of the work needs: Python sampling and sending between steps, and
whatever else runs there (a benchmark harness). A short spin covers a wait
whose partner is running and still sleeps at once when it is not.

Each runtime gets its own count, measured with bench/ab_env.py on two
cores, 8 streams, idle and beside one busy process (`--hog 1`):

- llama.cpp, 300 turns: ggml ends every graph node at an OpenMP barrier,
  hundreds a decode, each a few microseconds apart. Against pure PASSIVE
  1.33x idle and 0.92x beside a busy process; libgomp's own spin ran 0.96x
  of it at 8 streams idle and fell to 15 tok/s under a harness.
- torch, 3,000 turns: every op of a step is a parallel region with Python
  dispatch between them, tens of microseconds apart, so 300 turns let the
  team sleep and wake once per op (0.69x of libgomp's own spin idle).
  Against libgomp's own spin: 3,000 turns 0.97x idle and 1.46x beside a
  busy process; 1,000 turns 0.86x and 1.94x; 10,000 1.02x and 0.86x.

libgomp reads both variables once, when it loads, so they must be set
before the runtime's first import in a process; in a process that runs
both runtimes (in-process isolation) the first to load sets them for
both. A value the user set for either variable is kept (OMP_WAIT_POLICY=
ACTIVE for a machine the daemon has to itself; GOMP_SPINCOUNT=0 for pure
PASSIVE), and GOMP_SPINCOUNT overrides the policy's spin. Values this
module set are marked (MODELD_OMP_DEFAULTS), so that a worker process,
which inherits the daemon's environment, takes its own runtime's count
rather than keeping another's as if the user had set it.
"""

from __future__ import annotations

import os

LLAMACPP_SPIN_COUNT = 300
TORCH_SPIN_COUNT = 3000
_MARK = "MODELD_OMP_DEFAULTS"


def wait_defaults(environ, spin_count: int) -> None:
    """Set OMP_WAIT_POLICY=PASSIVE and GOMP_SPINCOUNT=spin_count in environ
    where the user set neither (or only this module did)."""
    ours = environ.get(_MARK) == "1"
    if ours or ("OMP_WAIT_POLICY" not in environ and "GOMP_SPINCOUNT" not in environ):
        environ["GOMP_SPINCOUNT"] = str(spin_count)
        environ["OMP_WAIT_POLICY"] = "PASSIVE"
        environ[_MARK] = "1"
        return
    environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def apply(spin_count: int) -> None:
    """wait_defaults on this process's environment, before a runtime's
    first import. Both runtimes load `libgomp.so.1` (torch's copy or the
    system's, whichever comes first serves both in one process), so a call
    after the other runtime loaded changes only what child processes inherit."""
    wait_defaults(os.environ, spin_count)
