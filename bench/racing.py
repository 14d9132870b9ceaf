"""Arithmetic shared by the races against peers: interleaved round order,
per-round ratios and their medians, and the record every result carries.
Kept apart from the benchmarks so unit tests can check it without a server."""

from __future__ import annotations

import os
import platform
import statistics
import sys
import time
from typing import Iterable, Sequence


def round_order(sides: Sequence[str], round_index: int) -> list[str]:
    """Who runs first in round `round_index`: the sides rotate, so on a
    machine whose speed drifts over minutes no side always gets the same
    slot in the round."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])


def ratios(mine: Iterable[float], theirs: Iterable[float]) -> list[float]:
    """Per-round ratios, mine / theirs; rounds are paired, never pooled."""
    mine, theirs = list(mine), list(theirs)
    if len(mine) != len(theirs):
        raise ValueError(f"{len(mine)} rounds against {len(theirs)}: ratios pair rounds")
    return [m / t for m, t in zip(mine, theirs)]


def median_ratio(mine: Iterable[float], theirs: Iterable[float]) -> float:
    return statistics.median(ratios(mine, theirs))


def goal(value: float, target: float, higher_is_better: bool = True) -> dict:
    met = value >= target if higher_is_better else value <= target
    return {"ratio": value, "goal": f"{'>=' if higher_is_better else '<='} {target}", "met": met}


def machine() -> dict:
    """What the result was measured on; figures from a busy machine say so."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": sys.version.split()[0],
            "load_average": list(os.getloadavg()), "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def decode_rate(tokens: int, first_token_at: float, end: float) -> float:
    """Tokens per second after the first (the first is the prompt's cost)."""
    if tokens < 2 or end <= first_token_at:
        return 0.0
    return (tokens - 1) / (end - first_token_at)


def tree_cpu_seconds(pids: Iterable[int]) -> float:
    """User plus system CPU seconds of these processes and all their children."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            root = psutil.Process(pid)
            members = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for member in members:
            try:
                total += process_cpu_seconds(member)
            except psutil.NoSuchProcess:  # a child that ended between the listing and the reading
                continue
    return total


def process_cpu_seconds(process) -> float:
    """User plus system CPU seconds of one psutil.Process, its children left out."""
    times = process.cpu_times()
    return times.user + times.system


def settle(pids: Sequence[int], *, idle_share: float = 0.05, window_s: float = 0.25, limit_s: float = 10.0,
           cpu_seconds=tree_cpu_seconds, sleep=time.sleep, clock=time.monotonic) -> float:
    """Wait until every server in the race is idle; returns the seconds waited.

    A server can keep a core busy after its last reply: vLLM's CPU engine
    polls for about a second after a request ends (measured: 0.25 CPU s per
    0.25 s for 1.0 s, then nothing). Whoever runs next would share the two
    cores with that spin, which cost modeld 0.9 s of time to first token
    whenever it followed vLLM. Idle means under idle_share of one core over
    window_s; after limit_s the race goes on and the wait is on record."""
    started = clock()
    while True:
        before = cpu_seconds(pids)
        sleep(window_s)
        if cpu_seconds(pids) - before < idle_share * window_s or clock() - started >= limit_s:
            return clock() - started


class CpuPerToken:
    """Where one stream's CPU goes, per token: the server's front process
    (modeld's daemon, which relays each token from its model's worker over
    gRPC; llama-server's whole process), its children (modeld's llama.cpp
    worker), and this benchmark's client. llama.cpp's threads spin on both
    cores between steps, so the figures that include them read about 2
    cores whatever the work; the front's and the client's do not."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.front, self.client, self.tokens = psutil.Process(pid), psutil.Process(), 0

    def _reading(self) -> tuple[float, float, float]:
        """(front, front with its children, client) CPU seconds so far."""
        return process_cpu_seconds(self.front), tree_cpu_seconds([self.front.pid]), process_cpu_seconds(self.client)

    def __enter__(self) -> "CpuPerToken":
        self.start = self._reading()
        return self

    def count(self, results: list[dict]) -> list[dict]:
        self.tokens += sum(r["tokens"] for r in results)
        return results

    def __exit__(self, *exc) -> None:
        front, tree, client = ((e - s) * 1e3 / max(self.tokens, 1) for s, e in zip(self.start, self._reading()))
        self.figures = {"front": round(front, 3), "children": round(tree - front, 3), "client": round(client, 3)}
