"""Per-model counters behind the ModelStatistics RPC (Triton's figures) and
the load figures modeld.v1.Node reports to a gateway."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hdrh.histogram import HdrHistogram

from modeld.backends.errors import ErrorKind
from modeld.server.batcher import BatchReport

# Failures that say something about this node rather than about the request:
# another node might have served the same call. Bad input, unknown names,
# missing capabilities and callers that left are the caller's doing, and must
# not make a gateway think less of the node.
SERVER_SIDE_KINDS = frozenset({
    ErrorKind.INTERNAL, ErrorKind.UNAVAILABLE, ErrorKind.RESOURCE_EXHAUSTED, ErrorKind.DEADLINE_EXCEEDED,
})

# Microseconds from 1 us to one hour: a whole generation stream can take
# minutes. Two significant digits keep each histogram at 3,328 counters
# (26 KiB) with quantiles within 1%.
_LOWEST_US, _HIGHEST_US, _DIGITS = 1, 3_600_000_000, 2


class WindowedQuantiles:
    """Latency quantiles over the recent past, not since start.

    Two HDR histograms take turns: samples go into `current`; every
    `window_s` it becomes `previous` and a cleared one takes its place, so a
    quantile covers the last one to two windows. After two idle windows both
    are empty and every quantile is 0. Event-loop only; not thread-safe.
    """

    def __init__(self, window_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, not {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._current = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        self._previous = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
        self._window_start = clock()
        # merging the two histograms walks every counter (~0.3 ms here), so
        # quantiles are kept until a sample or a rotation changes them
        self._cached: dict[float, float] = {}

    @property
    def num_samples(self) -> int:
        self._rotate()
        return self._current.get_total_count() + self._previous.get_total_count()

    def record(self, seconds: float) -> None:
        self._rotate()
        micros = min(max(round(seconds * 1e6), _LOWEST_US), _HIGHEST_US)
        self._current.record_value(micros)
        self._cached.clear()

    def quantile(self, q: float) -> float:
        """The q-quantile (0 < q <= 1) in seconds; 0.0 without samples."""
        if not 0 < q <= 1:
            raise ValueError(f"a quantile is in (0, 1], not {q}")
        self._rotate()
        if q not in self._cached:
            self._cached[q] = self._compute(q)
        return self._cached[q]

    def _compute(self, q: float) -> float:
        current, previous = self._current, self._previous
        if previous.get_total_count() == 0 or current.get_total_count() == 0:
            source = current if previous.get_total_count() == 0 else previous
        else:
            source = HdrHistogram(_LOWEST_US, _HIGHEST_US, _DIGITS)
            source.add(previous)
            source.add(current)
        if source.get_total_count() == 0:
            return 0.0
        return source.get_value_at_percentile(q * 100) / 1e6

    def _rotate(self) -> None:
        elapsed = int((self._clock() - self._window_start) // self.window_s)
        if elapsed <= 0:
            return
        self._previous, self._current = self._current, self._previous
        self._current.reset()
        if elapsed >= 2:  # the newest samples are older than a whole window too
            self._previous.reset()
        self._window_start += elapsed * self.window_s
        self._cached.clear()


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class ModelStats:
    last_inference_ms: int = 0
    inference_count: int = 0  # rows served, as Triton counts them
    execution_count: int = 0  # backend runs
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    batches: dict[int, Duration] = field(default_factory=dict)
    # modeld.v1.Node's figures
    num_requests: int = 0  # calls that entered the engine, however they ended
    num_in_flight: int = 0  # calls inside the engine now
    num_server_failures: int = 0  # failures of a SERVER_SIDE_KINDS kind
    recent_latency: WindowedQuantiles = field(default_factory=WindowedQuantiles)  # successful calls

    def record_batch(self, report: BatchReport) -> None:
        self.execution_count += 1
        self.inference_count += report.batch_size
        self.compute_infer.add(report.compute_ns, report.num_requests)
        for queue_ns in report.queue_ns:
            self.queue.add(queue_ns)
        self.batches.setdefault(report.batch_size, Duration()).add(report.compute_ns)

    def begin_call(self) -> None:
        self.num_requests += 1
        self.num_in_flight += 1

    def end_call(self) -> None:
        self.num_in_flight -= 1

    def record_success(self, ns: int) -> None:
        self.success.add(ns)
        self.recent_latency.record(ns / 1e9)
        self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, ns: int) -> None:
        self.fail.add(ns)
        self.last_inference_ms = int(time.time() * 1000)

    def count_failure(self, kind: ErrorKind) -> None:
        """A call that failed with `kind`; only SERVER_SIDE_KINDS count."""
        if kind in SERVER_SIDE_KINDS:
            self.num_server_failures += 1
