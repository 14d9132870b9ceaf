from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchStatsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class ModelLoad(_message.Message):
    __slots__ = ("name", "backend", "state", "memory_bytes", "in_flight", "queue_depth", "kv_cells_used", "kv_cells_capacity", "p99_latency_s", "p95_latency_s", "request_count", "failure_count", "pull_bytes_done", "pull_bytes_total")
    NAME_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    P99_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    P95_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_DONE_FIELD_NUMBER: _ClassVar[int]
    PULL_BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    name: str
    backend: str
    state: str
    memory_bytes: int
    in_flight: int
    queue_depth: int
    kv_cells_used: int
    kv_cells_capacity: int
    p99_latency_s: float
    p95_latency_s: float
    request_count: int
    failure_count: int
    pull_bytes_done: int
    pull_bytes_total: int
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_capacity: _Optional[int] = ..., p99_latency_s: _Optional[float] = ..., p95_latency_s: _Optional[float] = ..., request_count: _Optional[int] = ..., failure_count: _Optional[int] = ..., pull_bytes_done: _Optional[int] = ..., pull_bytes_total: _Optional[int] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "models", "memory_used_bytes", "memory_budget_bytes", "in_flight", "queue_depth", "kv_cells_used", "kv_cells_capacity", "uptime_s", "gpu_memory_used_bytes", "gpu_memory_total_bytes", "draining", "unhealthy_backends", "daemon_memory_bytes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_CELLS_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GPU_MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    UNHEALTHY_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    models: _containers.RepeatedCompositeFieldContainer[ModelLoad]
    memory_used_bytes: int
    memory_budget_bytes: int
    in_flight: int
    queue_depth: int
    kv_cells_used: int
    kv_cells_capacity: int
    uptime_s: float
    gpu_memory_used_bytes: int
    gpu_memory_total_bytes: int
    draining: bool
    unhealthy_backends: _containers.RepeatedCompositeFieldContainer[UnhealthyBackend]
    daemon_memory_bytes: int
    def __init__(self, node_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_capacity: _Optional[int] = ..., uptime_s: _Optional[float] = ..., gpu_memory_used_bytes: _Optional[int] = ..., gpu_memory_total_bytes: _Optional[int] = ..., draining: _Optional[bool] = ..., unhealthy_backends: _Optional[_Iterable[_Union[UnhealthyBackend, _Mapping]]] = ..., daemon_memory_bytes: _Optional[int] = ...) -> None: ...

class UnhealthyBackend(_message.Message):
    __slots__ = ("name", "reason", "retry_in_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_IN_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    retry_in_s: float
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., retry_in_s: _Optional[float] = ...) -> None: ...
