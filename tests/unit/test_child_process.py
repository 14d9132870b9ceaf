"""The daemon's handle on a worker process (stand_in.ChildProcess): started
by subprocess.Popen, its exit awaited on either event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import pytest

from modeld.server.event_loop import run
from modeld.server.workers.stand_in import ChildProcess

LOOPS = ["asyncio", "uvloop"]


def _child(code: str) -> ChildProcess:
    return ChildProcess(subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL))


def _on(loop: str, main, monkeypatch) -> object:
    monkeypatch.setenv("MODELD_EVENT_LOOP", loop)
    return run(main())


@pytest.mark.parametrize("loop", LOOPS)
def test_every_waiter_sees_the_exit_status(loop, monkeypatch):
    async def main():
        child = _child("import sys, time; time.sleep(0.3); sys.exit(7)")
        assert child.returncode is None
        # two waiters at once: each must wake (the pidfd has one reader)
        codes = await asyncio.wait_for(asyncio.gather(child.wait(), child.wait()), 60)
        return codes, child.returncode, await child.wait()
    assert _on(loop, main, monkeypatch) == ([7, 7], 7, 7)


@pytest.mark.parametrize("loop", LOOPS)
def test_a_killed_child_reports_the_signal_and_a_later_kill_is_harmless(loop, monkeypatch):
    async def main():
        child = _child("import time; time.sleep(600)")
        waiting = asyncio.ensure_future(child.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done()  # it is still running
        child.kill()
        code = await asyncio.wait_for(waiting, 60)
        child.kill()  # collected already: nothing to signal
        return code
    assert _on(loop, main, monkeypatch) == -signal.SIGKILL


def test_without_pidfds_the_exit_is_polled(monkeypatch):
    def no_pidfd(pid):
        raise OSError("no pidfd here")
    monkeypatch.setattr(os, "pidfd_open", no_pidfd)

    async def main():
        child = _child("import sys, time; time.sleep(0.2); sys.exit(3)")
        return await asyncio.wait_for(child.wait(), 60)
    assert _on("asyncio", main, monkeypatch) == 3


@pytest.mark.parametrize("loop", LOOPS)
def test_a_child_that_ended_before_the_wait_is_collected_at_once(loop, monkeypatch):
    async def main():
        child = _child("pass")
        child._popen.wait(60)  # already reaped: no pidfd can be opened for it
        return await asyncio.wait_for(child.wait(), 5)
    assert _on(loop, main, monkeypatch) == 0
