"""The gateway's file discovery: a list of daemon addresses re-read on a timer."""

from __future__ import annotations

import asyncio

from modeld.server.gateway.discovery import MAX_FILE_BYTES, read_nodes_file, watch_file


async def test_a_nodes_file_lists_addresses_and_skips_comments(tmp_path):
    path = tmp_path / "nodes"
    path.write_text("# the fleet\n10.0.0.1:8001\n\n[::1]:8001  # v6\n10.0.0.1:8001\n")
    assert await read_nodes_file(path) == {"10.0.0.1:8001", "[::1]:8001"}


async def test_a_file_that_is_no_list_of_addresses_keeps_the_nodes_known(tmp_path):
    path = tmp_path / "nodes"
    assert await read_nodes_file(path) is None  # missing
    path.write_text("10.0.0.1:8001\nnot-an-address\n")
    assert await read_nodes_file(path) is None
    path.write_text("10.0.0.1:0\n")
    assert await read_nodes_file(path) is None
    path.write_bytes(b"10.0.0.1:8001\n" + b"#" * MAX_FILE_BYTES)
    assert await read_nodes_file(path) is None


async def test_the_watch_applies_each_change_and_ignores_a_broken_file(tmp_path):
    path = tmp_path / "nodes"
    path.write_text("127.0.0.1:1\n")
    seen: list[set[str]] = []
    task = asyncio.create_task(watch_file(path, 0.01, seen.append))
    try:
        for _ in range(500):
            if seen:
                break
            await asyncio.sleep(0.01)
        path.write_text("127.0.0.1:1\n127.0.0.1:2\n")
        for _ in range(500):
            if len(seen) == 2:
                break
            await asyncio.sleep(0.01)
        path.write_text("garbage\n")
        await asyncio.sleep(0.1)
    finally:
        task.cancel()
    assert seen == [{"127.0.0.1:1"}, {"127.0.0.1:1", "127.0.0.1:2"}]
