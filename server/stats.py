"""Per-model counters behind the ModelStatistics RPC (Triton's figures)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from modeld.server.batcher import BatchReport


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

    def record_batch(self, report: BatchReport) -> None:
        self.execution_count += 1
        self.inference_count += report.batch_size
        self.compute_infer.add(report.compute_ns, report.num_requests)
        for queue_ns in report.queue_ns:
            self.queue.add(queue_ns)
        self.batches.setdefault(report.batch_size, Duration()).add(report.compute_ns)

    def record_success(self, ns: int) -> None:
        self.success.add(ns)
        self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, ns: int) -> None:
        self.fail.add(ns)
        self.last_inference_ms = int(time.time() * 1000)
