"""DynamicBatcher with a plain Python execute function."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from modeld.backends.errors import InvalidArgument, ResourceExhausted, Unavailable
from modeld.server.batcher import BatchReport, DynamicBatcher, split_outputs

TIMEOUT = 30.0  # seconds; a hang fails the test instead of stalling the suite, a busy machine never


class Recorder:
    """execute(): y = 2 * x, plus the row count; records every call's inputs."""

    def __init__(self, gate: threading.Event | None = None) -> None:
        self.calls: list[dict[str, np.ndarray]] = []
        self.gate = gate
        self.started = threading.Event()

    def __call__(self, inputs: dict[str, np.ndarray], output_names: tuple[str, ...]) -> dict[str, np.ndarray]:
        self.calls.append({k: v.copy() for k, v in inputs.items()})
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(TIMEOUT), "test gate never opened"
        x = inputs["x"]
        if np.isnan(x).any():
            raise InvalidArgument("input 'x' contains NaN")
        return {"y": x * 2, "rows": np.full((x.shape[0],), x.shape[0], dtype=np.int64)}

    def rows_per_call(self) -> list[int]:
        return [c["x"].shape[0] for c in self.calls]


def rows(start: int, n: int, width: int = 3) -> np.ndarray:
    return np.arange(start * width, (start + n) * width, dtype=np.float32).reshape(n, width)


async def wait_threading_event(event: threading.Event) -> None:
    async def poll() -> None:
        while not event.is_set():
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), TIMEOUT)


async def wait_queued(batcher: DynamicBatcher, n: int) -> None:
    async def poll() -> None:
        while batcher.num_waiting < n:
            await asyncio.sleep(0.001)
    await asyncio.wait_for(poll(), TIMEOUT)


async def test_compatible_concurrent_submits_merge_into_one_call():
    execute = Recorder()
    reports: list[BatchReport] = []
    batcher = DynamicBatcher(execute, max_batch_size=16, max_queue_delay_us=20000, on_batch=reports.append)
    batcher.start()
    try:
        xs = [rows(0, 1), rows(1, 2), rows(3, 3)]
        results = await asyncio.wait_for(asyncio.gather(*(batcher.submit({"x": x}, ("y",)) for x in xs)), TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [6]
    np.testing.assert_array_equal(execute.calls[0]["x"], np.concatenate(xs))
    for x, result in zip(xs, results):
        assert set(result) == {"y", "rows"}
        np.testing.assert_array_equal(result["y"], x * 2)
        assert result["y"].shape == x.shape
        # every request saw the merged batch of 6 rows
        np.testing.assert_array_equal(result["rows"], np.full((x.shape[0],), 6))
    assert len(reports) == 1
    assert (reports[0].batch_size, reports[0].num_requests) == (6, 3)
    assert len(reports[0].queue_ns) == 3 and all(q >= 0 for q in reports[0].queue_ns)


async def test_queue_delay_gathers_a_late_arrival():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=2, max_queue_delay_us=500_000)
    batcher.start()
    try:
        first = asyncio.create_task(batcher.submit({"x": rows(0, 1)}, ()))
        await asyncio.sleep(0.01)  # the batcher is now waiting for company
        second = asyncio.create_task(batcher.submit({"x": rows(1, 1)}, ()))
        a, b = await asyncio.wait_for(asyncio.gather(first, second), TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [2]
    np.testing.assert_array_equal(a["y"], rows(0, 1) * 2)
    np.testing.assert_array_equal(b["y"], rows(1, 1) * 2)


async def test_incompatible_trailing_shapes_are_not_merged():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=16, max_queue_delay_us=5000)
    batcher.start()
    try:
        narrow, wide, narrow2 = rows(0, 1, width=3), rows(0, 2, width=4), rows(5, 1, width=3)
        results = await asyncio.wait_for(asyncio.gather(
            batcher.submit({"x": narrow}, ()), batcher.submit({"x": wide}, ()), batcher.submit({"x": narrow2}, ()),
        ), TIMEOUT)
    finally:
        await batcher.stop()
    widths = sorted((c["x"].shape[1], c["x"].shape[0]) for c in execute.calls)
    # the two width-3 requests merge (skipping the width-4 one), width 4 runs alone
    assert widths == [(3, 2), (4, 2)]
    for x, result in zip((narrow, wide, narrow2), results):
        np.testing.assert_array_equal(result["y"], x * 2)


async def test_different_dtypes_or_output_names_are_not_merged():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=16, max_queue_delay_us=2000)
    batcher.start()
    try:
        f32 = rows(0, 1)
        f64 = rows(1, 1).astype(np.float64)
        other_outputs = rows(2, 1)
        results = await asyncio.wait_for(asyncio.gather(
            batcher.submit({"x": f32}, ("y",)), batcher.submit({"x": f64}, ("y",)),
            batcher.submit({"x": other_outputs}, ("rows",)),
        ), TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [1, 1, 1]
    assert results[1]["y"].dtype == np.float64
    np.testing.assert_array_equal(results[1]["y"], f64 * 2)


async def test_max_batch_size_is_respected():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=4, max_queue_delay_us=20000)
    batcher.start()
    try:
        xs = [rows(i, 1) for i in range(6)]
        results = await asyncio.wait_for(asyncio.gather(*(batcher.submit({"x": x}, ()) for x in xs)), TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [4, 2]
    for x, result in zip(xs, results):
        np.testing.assert_array_equal(result["y"], x * 2)


async def test_a_request_that_would_overflow_the_batch_waits_for_the_next_one():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=4, max_queue_delay_us=2000)
    batcher.start()
    try:
        a, b = rows(0, 3), rows(3, 2)
        ra, rb = await asyncio.wait_for(asyncio.gather(batcher.submit({"x": a}, ()), batcher.submit({"x": b}, ())),
                                        TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [3, 2]
    np.testing.assert_array_equal(ra["y"], a * 2)
    np.testing.assert_array_equal(rb["y"], b * 2)


async def test_a_request_larger_than_max_batch_size_is_refused():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=4)
    batcher.start()
    try:
        with pytest.raises(InvalidArgument, match="max_batch_size 4"):
            await asyncio.wait_for(batcher.submit({"x": rows(0, 5)}, ()), TIMEOUT)
        assert batcher.num_waiting == 0
    finally:
        await batcher.stop()
    assert execute.calls == []


async def test_unbatched_model_runs_each_request_alone():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=0, max_queue_delay_us=20000)
    batcher.start()
    try:
        xs = [rows(0, 2), rows(2, 7)]  # 7 rows: no max_batch_size check for unbatched models
        results = await asyncio.wait_for(asyncio.gather(*(batcher.submit({"x": x}, ()) for x in xs)), TIMEOUT)
    finally:
        await batcher.stop()
    assert execute.rows_per_call() == [2, 7]
    for x, result in zip(xs, results):
        np.testing.assert_array_equal(result["y"], x * 2)


async def test_one_bad_request_fails_alone_and_its_neighbours_succeed():
    execute = Recorder()
    reports: list[BatchReport] = []
    batcher = DynamicBatcher(execute, max_batch_size=16, max_queue_delay_us=20000, on_batch=reports.append)
    batcher.start()
    good1, good2 = rows(0, 2), rows(2, 1)
    bad = rows(3, 1)
    bad[0, 1] = np.nan
    try:
        results = await asyncio.wait_for(asyncio.gather(
            batcher.submit({"x": good1}, ()), batcher.submit({"x": bad}, ()), batcher.submit({"x": good2}, ()),
            return_exceptions=True,
        ), TIMEOUT)
    finally:
        await batcher.stop()
    assert isinstance(results[1], InvalidArgument)
    assert "NaN" in str(results[1])
    np.testing.assert_array_equal(results[0]["y"], good1 * 2)
    np.testing.assert_array_equal(results[2]["y"], good2 * 2)
    # the merged attempt, then each request alone
    assert execute.rows_per_call() == [4, 2, 1, 1]
    # each good request ran alone, so it saw only its own rows
    np.testing.assert_array_equal(results[0]["rows"], [2, 2])
    assert sorted((r.batch_size, r.num_requests) for r in reports) == [(1, 1), (2, 1)]


async def test_a_backend_bug_fails_the_whole_batch_but_the_batcher_keeps_serving():
    calls = []

    def execute(inputs, output_names):
        calls.append(inputs["x"].shape[0])
        if len(calls) == 1:
            raise RuntimeError("segfault-ish")
        return {"y": inputs["x"] + 1}

    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=20000)
    batcher.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(
            batcher.submit({"x": rows(0, 1)}, ()), batcher.submit({"x": rows(1, 1)}, ()), return_exceptions=True,
        ), TIMEOUT)
        assert all(isinstance(r, RuntimeError) for r in results)
        after = await asyncio.wait_for(batcher.submit({"x": rows(2, 1)}, ()), TIMEOUT)
    finally:
        await batcher.stop()
    assert calls == [2, 1]  # no per-request retry for a non-ModeldError
    np.testing.assert_array_equal(after["y"], rows(2, 1) + 1)


async def test_a_cancelled_request_is_never_executed():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=4, max_queue_delay_us=0)
    batcher.start()
    try:
        first = asyncio.create_task(batcher.submit({"x": rows(0, 1)}, ()))
        await wait_threading_event(execute.started)  # the first batch is running, blocked on the gate
        doomed_input = rows(40, 1)
        doomed = asyncio.create_task(batcher.submit({"x": doomed_input}, ()))
        await wait_queued(batcher, 1)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        gate.set()
        first_result = await asyncio.wait_for(first, TIMEOUT)
        later = await asyncio.wait_for(batcher.submit({"x": rows(7, 1)}, ()), TIMEOUT)
    finally:
        gate.set()
        await batcher.stop()
    np.testing.assert_array_equal(first_result["y"], rows(0, 1) * 2)
    np.testing.assert_array_equal(later["y"], rows(7, 1) * 2)
    executed = np.concatenate([c["x"] for c in execute.calls])
    assert not any((executed == doomed_input[0]).all(axis=1))
    assert execute.rows_per_call() == [1, 1]
    assert batcher.num_waiting == 0


async def test_a_cancelled_request_is_skipped_when_forming_a_merged_batch():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=0)
    batcher.start()
    try:
        first = asyncio.create_task(batcher.submit({"x": rows(0, 1)}, ()))
        await wait_threading_event(execute.started)
        keep1 = asyncio.create_task(batcher.submit({"x": rows(1, 1)}, ()))
        doomed = asyncio.create_task(batcher.submit({"x": rows(2, 1)}, ()))
        keep2 = asyncio.create_task(batcher.submit({"x": rows(3, 1)}, ()))
        await wait_queued(batcher, 3)
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        gate.set()
        r1, r2 = await asyncio.wait_for(asyncio.gather(keep1, keep2), TIMEOUT)
        await asyncio.wait_for(first, TIMEOUT)
    finally:
        gate.set()
        await batcher.stop()
    assert execute.rows_per_call() == [1, 2]
    np.testing.assert_array_equal(execute.calls[1]["x"], np.concatenate([rows(1, 1), rows(3, 1)]))
    np.testing.assert_array_equal(r1["y"], rows(1, 1) * 2)
    np.testing.assert_array_equal(r2["y"], rows(3, 1) * 2)


async def test_queue_full_raises_resource_exhausted():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=1, max_queue_delay_us=0, max_queue_size=2)
    batcher.start()
    try:
        running = asyncio.create_task(batcher.submit({"x": rows(0, 1)}, ()))
        await wait_threading_event(execute.started)  # taken off the queue, running
        queued = [asyncio.create_task(batcher.submit({"x": rows(i, 1)}, ())) for i in (1, 2)]
        await wait_queued(batcher, 2)
        with pytest.raises(ResourceExhausted, match="queue is full"):
            await batcher.submit({"x": rows(3, 1)}, ())
        assert batcher.num_waiting == 2
        gate.set()
        results = await asyncio.wait_for(asyncio.gather(running, *queued), TIMEOUT)
    finally:
        gate.set()
        await batcher.stop()
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result["y"], rows(i, 1) * 2)
    assert execute.rows_per_call() == [1, 1, 1]


async def test_stop_finishes_everything_already_queued():
    execute = Recorder()
    batcher = DynamicBatcher(execute, max_batch_size=2, max_queue_delay_us=50_000)
    batcher.start()
    tasks = [asyncio.create_task(batcher.submit({"x": rows(i, 1)}, ())) for i in range(5)]
    await asyncio.sleep(0)  # let every submit enqueue
    await asyncio.wait_for(batcher.stop(), TIMEOUT)
    results = await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    for i, result in enumerate(results):
        np.testing.assert_array_equal(result["y"], rows(i, 1) * 2)
    assert sum(execute.rows_per_call()) == 5
    assert max(execute.rows_per_call()) <= 2


async def test_submit_after_stop_does_not_hang():
    batcher = DynamicBatcher(Recorder(), max_batch_size=4)
    batcher.start()
    await batcher.stop()
    # Unavailable, not a hang or a generic error: the engine turns it into
    # gRPC UNAVAILABLE so a client retries and the model is loaded again.
    with pytest.raises(Unavailable, match="being unloaded"):
        await asyncio.wait_for(batcher.submit({"x": rows(0, 1)}, ()), TIMEOUT)


def test_split_outputs_cuts_along_dim0():
    out = {"a": np.arange(12).reshape(6, 2), "b": np.arange(6)}
    parts = split_outputs(out, [1, 2, 3])
    assert len(parts) == 3
    np.testing.assert_array_equal(parts[0]["a"], [[0, 1]])
    np.testing.assert_array_equal(parts[1]["a"], [[2, 3], [4, 5]])
    np.testing.assert_array_equal(parts[2]["a"], [[6, 7], [8, 9], [10, 11]])
    np.testing.assert_array_equal(parts[0]["b"], [0])
    np.testing.assert_array_equal(parts[1]["b"], [1, 2])
    np.testing.assert_array_equal(parts[2]["b"], [3, 4, 5])
    assert all(set(p) == {"a", "b"} for p in parts)


def test_split_outputs_single_piece_is_everything():
    out = {"a": np.arange(4)}
    (only,) = split_outputs(out, [4])
    np.testing.assert_array_equal(only["a"], np.arange(4))


def test_split_outputs_refuses_an_output_without_the_batch_dimension():
    with pytest.raises(InvalidArgument, match="'s'.*batch dimension of 3"):
        split_outputs({"a": np.zeros((3, 2)), "s": np.float32(1.0) * np.ones(())}, [1, 2])
    with pytest.raises(InvalidArgument, match="'a'.*batch dimension of 3"):
        split_outputs({"a": np.zeros((4, 2))}, [1, 2])


async def test_an_output_without_batch_dimension_fails_merged_requests_then_runs_them_alone():
    calls = []

    def execute(inputs, output_names):
        calls.append(inputs["x"].shape[0])
        return {"total": np.array(inputs["x"].sum())}  # a scalar: cannot be split

    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=20000)
    batcher.start()
    try:
        a, b = rows(0, 1), rows(1, 1)
        ra, rb = await asyncio.wait_for(asyncio.gather(batcher.submit({"x": a}, ()), batcher.submit({"x": b}, ())),
                                        TIMEOUT)
    finally:
        await batcher.stop()
    assert calls == [2, 1, 1]
    assert float(ra["total"]) == pytest.approx(a.sum())
    assert float(rb["total"]) == pytest.approx(b.sum())
