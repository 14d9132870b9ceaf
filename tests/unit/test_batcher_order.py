"""DynamicBatcher: which requests form the next batch, and when.

Triton's rules: more urgent priority levels first; the queue delay is
counted from the oldest request in the forming batch; a batch of a
preferred size runs as soon as one can be formed.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from modeld.server.batcher import DynamicBatcher
from test_batcher import TIMEOUT, Recorder, rows, wait_queued, wait_threading_event


async def _occupy(batcher: DynamicBatcher, execute: Recorder) -> asyncio.Task:
    """Start a request that holds the batcher's one runner until the gate opens."""
    task = asyncio.create_task(batcher.submit({"x": rows(100, 1)}, ()))
    await wait_threading_event(execute.started)
    return task


async def test_more_urgent_requests_run_first_and_levels_keep_arrival_order():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=1)
    batcher.start()
    busy = await _occupy(batcher, execute)
    # 0 is the default level, after every explicit one; 1 is the most urgent
    order = [(0, 0), (1, 5), (2, 3), (3, 1), (4, 0), (5, 1)]
    tasks = []
    for index, priority in order:
        tasks.append(asyncio.create_task(batcher.submit({"x": rows(index, 1)}, (), priority)))
        await wait_queued(batcher, len(tasks))
    gate.set()
    await asyncio.wait_for(asyncio.gather(busy, *tasks), TIMEOUT)
    ran = [int(call["x"][0, 0]) // 3 for call in execute.calls[1:]]
    assert ran == [3, 5, 2, 1, 0, 4]
    await batcher.stop()


async def test_queue_delay_counts_from_the_oldest_request_not_from_when_the_runner_freed():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=1_000_000)
    batcher.start()
    busy = asyncio.create_task(batcher.submit({"x": rows(100, 1)}, ()))
    await wait_threading_event(execute.started)
    first = asyncio.create_task(batcher.submit({"x": rows(0, 1)}, ()))
    await wait_queued(batcher, 1)
    # The runner frees 0.5 s after `first` arrived. Counted from `first`,
    # its batch closes at 1.0 s; counted from the moment the runner freed
    # (the old rule) it would close at 1.5 s and take `late` along.
    await asyncio.sleep(0.5)
    gate.set()
    await asyncio.sleep(0.75)
    late = asyncio.create_task(batcher.submit({"x": rows(1, 1)}, ()))
    await asyncio.wait_for(asyncio.gather(busy, first, late), TIMEOUT)
    assert execute.rows_per_call() == [1, 1, 1]
    await batcher.stop()


async def test_the_largest_preferred_batch_is_formed_and_the_rest_waits_its_turn():
    gate = threading.Event()
    execute = Recorder(gate)
    batcher = DynamicBatcher(execute, max_batch_size=8, preferred_batch_sizes=(2, 4))
    batcher.start()
    busy = await _occupy(batcher, execute)
    tasks = []
    for i in range(7):
        tasks.append(asyncio.create_task(batcher.submit({"x": rows(i, 1)}, ())))
    await wait_queued(batcher, 7)
    gate.set()
    results = await asyncio.wait_for(asyncio.gather(busy, *tasks), TIMEOUT)
    # 7 waiting: 4 (largest preferred), then 2 (preferred), then the 1 left
    assert execute.rows_per_call() == [1, 4, 2, 1]
    for i, result in enumerate(results[1:]):
        np.testing.assert_array_equal(result["y"], rows(i, 1) * 2)
    await batcher.stop()


async def test_a_preferred_batch_does_not_wait_out_the_queue_delay():
    execute = Recorder()
    # a delay far longer than the test's timeout: only the preferred size can release the batch
    batcher = DynamicBatcher(execute, max_batch_size=8, max_queue_delay_us=60_000_000, preferred_batch_sizes=(2,))
    batcher.start()
    tasks = [asyncio.create_task(batcher.submit({"x": rows(i, 1)}, ())) for i in range(2)]
    await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)
    assert execute.rows_per_call() == [2]
    await batcher.stop()


def test_preferred_batch_sizes_are_read_from_toml_and_triton_json_and_checked():
    import json

    import pytest

    from modeld.backends.errors import InvalidArgument
    from modeld.backends.model_config import config_from_dict, config_from_json

    toml = config_from_dict("m", {"batching": {"max_batch_size": 8, "preferred_batch_sizes": [8, 4]}})
    assert toml.preferred_batch_sizes == (4, 8)
    triton = config_from_json("m", json.dumps({"max_batch_size": 8, "dynamic_batching": {
        "preferred_batch_size": [2, 4], "max_queue_delay_microseconds": "100"}}))
    assert triton.preferred_batch_sizes == (2, 4) and triton.max_queue_delay_us == 100
    with pytest.raises(InvalidArgument, match="preferred_batch_sizes"):
        config_from_dict("m", {"batching": {"max_batch_size": 4, "preferred_batch_sizes": [8]}})
    with pytest.raises(InvalidArgument, match="batching.max_queue_delay"):
        config_from_dict("m", {"batching": {"max_batch_size": 4, "max_queue_delay": 100}})
