"""The one thread that runs every language-model computation in the daemon.

llama.cpp (ggml) and torch share one OpenMP runtime in this process (torch's
libgomp is loaded first and ggml binds to it), and OpenMP keeps a thread team
per calling thread. Measured here: with torch loaded on one thread and
llama.cpp decoding on another, llama.cpp ran at a third to half of its speed;
stepping on a thread other than the one that loaded the model cost 1.5-2x too.
So loading and every step of both LLM backends run on this thread. On two
cores the steps of different models would compete for the CPU anyway.
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor


class ComputeThread(ThreadPoolExecutor):
    """A one-thread executor that can tell whether a job waits behind the
    running one: a generation loop then holds the thread for as long as its
    model has work and nobody else needs it (generation/loop.py, _burst)."""

    def __init__(self, thread_name_prefix: str) -> None:
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._waiting = 0
        self._count_lock = threading.Lock()

    def has_waiting(self) -> bool:
        """Whether a submitted job has neither started nor been cancelled."""
        return self._waiting > 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        settled = False

        def settle(_future=None) -> None:  # once: when the job starts, or when it is cancelled unstarted
            nonlocal settled
            with self._count_lock:
                if not settled:
                    settled = True
                    self._waiting -= 1

        def run():
            settle()
            return fn(*args, **kwargs)

        with self._count_lock:
            self._waiting += 1
        try:
            future = super().submit(run)
        except BaseException:
            settle()
            raise
        future.add_done_callback(settle)
        return future


COMPUTE_THREAD = ComputeThread(thread_name_prefix="modeld-compute")
