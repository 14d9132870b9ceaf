"""Dynamic batching for tensor models, with Triton's semantics.

Requests whose inputs agree in names, datatypes and every dimension but the
first are concatenated along dimension 0 (up to `max_batch_size` rows), run
as one backend call, and split back. While one batch runs, the next one
forms, so a busy model batches without any added delay; `max_queue_delay_us`
lets an idle model wait a little for company, counted from the oldest request
in the forming batch. A batch of a preferred size runs as soon as it can be
formed (the largest such); otherwise the batcher waits out the delay and runs
the largest batch it has. More urgent requests (Triton's priority levels) are
taken first. A request whose client has gone is dropped before it runs.
"""

from __future__ import annotations

import asyncio
import bisect
import inspect
import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

import anyio
import numpy as np
import structlog

from modeld.backends.errors import DeadlineExceeded, InvalidArgument, ModeldError, ResourceExhausted, Unavailable
from modeld.backends.generation.params import queue_rank

log = structlog.get_logger("modeld.batcher")

Execute = Callable[[dict[str, np.ndarray], tuple[str, ...]], dict[str, np.ndarray]]


_arrivals = itertools.count()


@dataclass(eq=False)  # identity: queue removal must not compare numpy inputs
class _Pending:
    inputs: dict[str, np.ndarray]
    output_names: tuple[str, ...]
    future: asyncio.Future
    priority: int = 0
    deadline: float | None = None  # time.monotonic(); past it the request is dropped unrun
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    arrival: int = field(default_factory=lambda: next(_arrivals))

    @property
    def order(self) -> tuple[int, int]:
        """Queue position: most urgent level first, then first come."""
        return queue_rank(self.priority), self.arrival

    @property
    def num_rows(self) -> int:
        first = next(iter(self.inputs.values()))
        return first.shape[0] if first.ndim else 1

    @cached_property
    def merge_key(self) -> tuple:
        """Requests merge only when this matches; computed once, compared on every scan."""
        return (self.output_names,) + tuple(
            (name, arr.dtype.str, arr.shape[1:]) for name, arr in self.inputs.items()
        )


@dataclass(frozen=True)
class BatchReport:
    batch_size: int  # rows
    num_requests: int
    compute_ns: int
    queue_ns: tuple[int, ...]  # per request


class DynamicBatcher:
    def __init__(self, execute: Execute, max_batch_size: int, max_queue_delay_us: int = 0,
                 max_queue_size: int = 1024, on_batch: Callable[[BatchReport], None] | None = None,
                 preferred_batch_sizes: tuple[int, ...] = ()) -> None:
        self._execute = execute
        # a coroutine (a worker process's model): awaited on the loop, no thread
        self._is_async = inspect.iscoroutinefunction(execute)
        self.max_batch_size = max_batch_size
        self.max_queue_delay_s = max_queue_delay_us / 1e6
        self.max_queue_size = max_queue_size
        self.preferred_batch_sizes = frozenset(preferred_batch_sizes)
        self._on_batch = on_batch
        self._queue: list[_Pending] = []  # kept in `order`
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._busy = False  # a batch is running (one at a time per model)
        # One thread per model: batches run one at a time, and a dedicated
        # executor skips the hand-offs of a shared pool.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="modeld-batch")

    @property
    def num_waiting(self) -> int:
        return len(self._queue)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Finish everything already queued, then end the loop."""
        self._stopping = True
        self._wakeup.set()
        if self._task is not None:
            await self._task
        self._executor.shutdown(wait=False)

    async def submit(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...],
                     priority: int = 0, deadline: float | None = None) -> dict[str, np.ndarray]:
        if self._stopping or (self._task is not None and self._task.done()):
            raise Unavailable("the model is being unloaded; retry and it will be loaded again")
        if not inputs:
            raise InvalidArgument("the request has no inputs")
        if len(self._queue) >= self.max_queue_size:
            raise ResourceExhausted(
                f"the model's queue is full ({self.max_queue_size} requests waiting); retry later"
            )
        pending = _Pending(inputs, output_names, asyncio.get_running_loop().create_future(), priority, deadline)
        if self.max_batch_size and pending.num_rows > self.max_batch_size:
            raise InvalidArgument(
                f"batch of {pending.num_rows} exceeds the model's max_batch_size {self.max_batch_size}"
            )
        if not self._busy and not self._queue and not self.max_queue_delay_s:
            # Idle model, nothing to wait for: run in the caller's task and
            # save the hop through the batching loop. Requests arriving
            # meanwhile queue up and form the next batch.
            self._busy = True
            try:
                await self._run([pending])
            finally:
                self._busy = False
                self._wakeup.set()
            return pending.future.result()
        self._enqueue(pending)
        self._wakeup.set()
        return await pending.future

    def _enqueue(self, pending: _Pending) -> None:
        bisect.insort(self._queue, pending, key=lambda p: p.order)

    async def _loop(self) -> None:
        while True:
            if not self._queue or self._busy:
                if self._stopping:
                    return
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            batch = await self._form_batch()
            if batch:
                self._busy = True
                try:
                    await self._run(batch)
                finally:
                    self._busy = False

    async def _form_batch(self) -> list[_Pending]:
        first = self._queue.pop(0)
        if first.future.done():  # cancelled by its client while waiting
            return []
        batch, rows = [first], first.num_rows
        if not self.max_batch_size:
            return batch
        key = first.merge_key
        while True:
            while rows < self.max_batch_size:
                taken = self._take_compatible(key, self.max_batch_size - rows)
                if taken is None:
                    break
                batch.append(taken)
                rows += taken.num_rows
            cut = self._preferred_cut(batch)
            if cut:
                for item in batch[cut:]:
                    self._enqueue(item)  # back in their places, for the next batch
                return batch[:cut]
            if rows >= self.max_batch_size:
                return batch
            # Triton's delay: counted from the oldest request in the batch,
            # so a request never waits longer than max_queue_delay_us for company
            oldest_ns = min(item.enqueued_ns for item in batch)
            remaining = oldest_ns / 1e9 + self.max_queue_delay_s - time.perf_counter()
            if remaining <= 0 or self._stopping:
                return batch
            self._wakeup.clear()
            with anyio.move_on_after(remaining):
                await self._wakeup.wait()

    def _preferred_cut(self, batch: list[_Pending]) -> int:
        """How many requests make the largest preferred batch, 0 if none can."""
        cut, rows = 0, 0
        for index, item in enumerate(batch, 1):
            rows += item.num_rows
            if rows in self.preferred_batch_sizes:
                cut = index
        return cut

    def _take_compatible(self, key: tuple, room: int) -> _Pending | None:
        for item in list(self._queue):
            if item.future.done():  # its client left; drop it while passing by
                self._queue.remove(item)
            elif item.merge_key == key and item.num_rows <= room:
                self._queue.remove(item)
                return item
        return None

    async def _run(self, batch: list[_Pending]) -> None:
        batch = _still_wanted(batch)
        if not batch:
            return
        start = time.perf_counter_ns()
        try:
            results = await self._execute_merged(batch)
        except ModeldError as exc:
            if len(batch) == 1:
                _settle(batch[0], exc)
                return
            # One bad request must not fail its neighbours: run each alone.
            for item in batch:
                await self._run([item])
            return
        except Exception as exc:  # a bug in a backend: fail these requests, keep serving
            for item in batch:
                _settle(item, exc)
            return
        compute_ns = time.perf_counter_ns() - start
        for item, result in zip(batch, results):
            _settle(item, result)
        if self._on_batch is not None:
            try:
                self._on_batch(BatchReport(
                    sum(i.num_rows for i in batch), len(batch), compute_ns,
                    tuple(start - i.enqueued_ns for i in batch),
                ))
            except Exception:  # statistics must never stop the serving loop
                log.exception("batch_report_failed")

    async def _execute_merged(self, batch: list[_Pending]) -> list[dict[str, np.ndarray]]:
        names = batch[0].output_names
        loop = asyncio.get_running_loop()
        if len(batch) == 1:
            if self._is_async:
                return [await self._execute(batch[0].inputs, names)]
            return [await loop.run_in_executor(self._executor, self._execute, batch[0].inputs, names)]
        merged = {name: np.concatenate([b.inputs[name] for b in batch]) for name in batch[0].inputs}
        if self._is_async:
            outputs = await self._execute(merged, names)
        else:
            outputs = await loop.run_in_executor(self._executor, self._execute, merged, names)
        return split_outputs(outputs, [b.num_rows for b in batch])


def split_outputs(outputs: dict[str, np.ndarray], rows: list[int]) -> list[dict[str, np.ndarray]]:
    """Cut a merged batch's outputs back into per-request pieces along dim 0."""
    total = sum(rows)
    for name, array in outputs.items():
        if array.ndim == 0 or array.shape[0] != total:
            raise InvalidArgument(f"output {name!r} has no batch dimension of {total}; cannot split the batch")
    bounds = np.cumsum([0] + rows)
    return [{name: arr[bounds[i]:bounds[i + 1]] for name, arr in outputs.items()} for i in range(len(rows))]


def _still_wanted(batch: list[_Pending]) -> list[_Pending]:
    """The requests worth running: a client that left while its batch
    formed, or a deadline that passed meanwhile, would throw the work away."""
    now = time.monotonic()
    wanted = []
    for item in batch:
        if item.future.done():
            continue
        if item.deadline is not None and now >= item.deadline:
            _settle(item, DeadlineExceeded("the request's deadline passed while it waited in the model's queue; "
                                           "it was not run"))
            continue
        wanted.append(item)
    return wanted


def _settle(item: _Pending, outcome: object) -> None:
    if item.future.done():
        return
    if isinstance(outcome, BaseException):
        item.future.set_exception(outcome)
    else:
        item.future.set_result(outcome)
