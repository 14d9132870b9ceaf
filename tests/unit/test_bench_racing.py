"""The race arithmetic the benchmarks report (bench/racing.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from racing import decode_rate, goal, median_ratio, ratios, round_order  # noqa: E402


def test_round_order_rotates_so_no_side_always_runs_first():
    sides = ["modeld", "peer", "ceiling"]
    firsts = [round_order(sides, r)[0] for r in range(6)]
    assert firsts == ["modeld", "peer", "ceiling", "modeld", "peer", "ceiling"]
    assert sorted(round_order(sides, 4)) == sorted(sides)


def test_ratios_pair_rounds_and_the_median_is_of_the_ratios():
    mine, theirs = [100, 50, 90], [100, 100, 60]
    assert ratios(mine, theirs) == [1.0, 0.5, 1.5]
    # the median of per-round ratios, not the ratio of medians (90/100)
    assert median_ratio(mine, theirs) == 1.0
    with pytest.raises(ValueError, match="pair rounds"):
        ratios([1, 2], [1])


def test_goal_direction():
    assert goal(1.02, 1.0)["met"] and not goal(0.98, 1.0)["met"]
    assert goal(0.9, 1.0, higher_is_better=False)["met"]
    assert goal(1.1, 1.0, higher_is_better=False) == {"ratio": 1.1, "goal": "<= 1.0", "met": False}


def test_decode_rate_leaves_out_the_first_token():
    assert decode_rate(11, first_token_at=2.0, end=3.0) == 10.0
    assert decode_rate(1, 2.0, 3.0) == 0.0


def test_settle_waits_out_a_server_that_keeps_spinning_after_its_last_reply():
    from racing import settle

    # CPU seconds the servers have used, read before and after each 0.25 s window:
    # busy for three windows (a full core), then idle
    readings = iter([0.0, 0.25, 0.25, 0.5, 0.5, 0.75, 0.75, 0.751])
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    waited = settle([1], cpu_seconds=lambda pids: next(readings), sleep=sleep, clock=lambda: now[0])
    assert waited == pytest.approx(1.0)  # three busy windows and one idle one


def test_settle_gives_up_at_its_limit_on_a_server_that_never_idles():
    from racing import settle

    used, now = [0.0], [0.0]

    def cpu_seconds(pids) -> float:
        used[0] += 0.2
        return used[0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    assert settle([1], limit_s=2.0, cpu_seconds=cpu_seconds, sleep=sleep, clock=lambda: now[0]) == pytest.approx(2.0)


def test_tree_cpu_seconds_counts_children_and_skips_ended_processes():
    import os
    import subprocess

    from racing import tree_cpu_seconds

    child = subprocess.Popen([sys.executable, "-c", "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ntime.sleep(30)"])
    try:
        import time

        deadline = time.monotonic() + 20
        while tree_cpu_seconds([child.pid]) < 0.25:
            assert time.monotonic() < deadline, "the child never used its 0.3 CPU seconds"
            time.sleep(0.05)
        # the child's spin shows up when counted through its parent's tree too
        assert tree_cpu_seconds([os.getpid()]) >= tree_cpu_seconds([child.pid]) >= 0.25
    finally:
        child.kill()
        child.wait()
    assert tree_cpu_seconds([child.pid]) == 0.0  # gone: counted as nothing, no error


def test_cpu_per_token_splits_the_front_its_children_and_the_client():
    import subprocess
    import time

    from racing import CpuPerToken, tree_cpu_seconds

    # a "server" whose child spins 0.4 CPU seconds while the server itself sleeps;
    # the child spins when told to (a byte on the stdin it shares with the
    # server), so its spin falls inside the counted block however slow the start
    spin = ("import sys, time\nprint('child ready', flush=True)\nsys.stdin.read(1)\n"
            "t = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)")
    front = subprocess.Popen([sys.executable, "-c",
                              f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {spin!r}])\n"
                              "print('front ready', flush=True)\ntime.sleep(30)"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        # both have started (start-up CPU is not counted)
        assert sorted(front.stdout.readline().strip() for _ in range(2)) == ["child ready", "front ready"]
        with CpuPerToken(front.pid) as cpu:
            t = time.process_time()
            while time.process_time() - t < 0.2:  # the client's own work
                pass
            front.stdin.write("x")
            front.stdin.flush()
            deadline = time.monotonic() + 20
            while tree_cpu_seconds([front.pid]) - cpu.start[1] < 0.35:
                assert time.monotonic() < deadline, "the child never spun"
                time.sleep(0.05)
            cpu.count([{"tokens": 60}, {"tokens": 40}])
        parts = cpu.figures
        assert parts["client"] >= 2.0  # 0.2 s over 100 tokens, at least
        assert parts["children"] >= 3.0  # the child's 0.4 s, less clock-tick rounding
        assert parts["front"] < 1.0  # the front only slept
    finally:
        subprocess.run(["pkill", "-P", str(front.pid)], check=False)
        front.kill()
        front.wait()
