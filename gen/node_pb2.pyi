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
    __slots__ = ("name", "backend", "state", "memory_bytes", "in_flight", "queue_depth", "kv_cells_used", "kv_cells_capacity", "p99_latency_s", "p95_latency_s", "request_count", "failure_count", "pull_bytes_done", "pull_bytes_total", "base", "wait_for_pull")
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
    BASE_FIELD_NUMBER: _ClassVar[int]
    WAIT_FOR_PULL_FIELD_NUMBER: _ClassVar[int]
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
    base: str
    wait_for_pull: bool
    def __init__(self, name: _Optional[str] = ..., backend: _Optional[str] = ..., state: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_capacity: _Optional[int] = ..., p99_latency_s: _Optional[float] = ..., p95_latency_s: _Optional[float] = ..., request_count: _Optional[int] = ..., failure_count: _Optional[int] = ..., pull_bytes_done: _Optional[int] = ..., pull_bytes_total: _Optional[int] = ..., base: _Optional[str] = ..., wait_for_pull: _Optional[bool] = ...) -> None: ...

class NodeStats(_message.Message):
    __slots__ = ("node_id", "models", "memory_used_bytes", "memory_budget_bytes", "in_flight", "queue_depth", "kv_cells_used", "kv_cells_capacity", "uptime_s", "gpu_memory_used_bytes", "gpu_memory_total_bytes", "draining", "unhealthy_backends", "daemon_memory_bytes", "http_port")
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
    HTTP_PORT_FIELD_NUMBER: _ClassVar[int]
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
    http_port: int
    def __init__(self, node_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelLoad, _Mapping]]] = ..., memory_used_bytes: _Optional[int] = ..., memory_budget_bytes: _Optional[int] = ..., in_flight: _Optional[int] = ..., queue_depth: _Optional[int] = ..., kv_cells_used: _Optional[int] = ..., kv_cells_capacity: _Optional[int] = ..., uptime_s: _Optional[float] = ..., gpu_memory_used_bytes: _Optional[int] = ..., gpu_memory_total_bytes: _Optional[int] = ..., draining: _Optional[bool] = ..., unhealthy_backends: _Optional[_Iterable[_Union[UnhealthyBackend, _Mapping]]] = ..., daemon_memory_bytes: _Optional[int] = ..., http_port: _Optional[int] = ...) -> None: ...

class UnhealthyBackend(_message.Message):
    __slots__ = ("name", "reason", "retry_in_s")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_IN_S_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    retry_in_s: float
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ..., retry_in_s: _Optional[float] = ...) -> None: ...

class WatchKvEventsRequest(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class KvEvents(_message.Message):
    __slots__ = ("snapshot", "models", "sequence")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    models: _containers.RepeatedCompositeFieldContainer[ModelKvEvents]
    sequence: int
    def __init__(self, snapshot: _Optional[bool] = ..., models: _Optional[_Iterable[_Union[ModelKvEvents, _Mapping]]] = ..., sequence: _Optional[int] = ...) -> None: ...

class ModelKvEvents(_message.Message):
    __slots__ = ("model", "block_size", "stored", "removed", "cleared", "cache")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    cleared: bool
    cache: str
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., cleared: _Optional[bool] = ..., cache: _Optional[str] = ...) -> None: ...

class PromptBlocksRequest(_message.Message):
    __slots__ = ("generate", "model_infer")
    GENERATE_FIELD_NUMBER: _ClassVar[int]
    MODEL_INFER_FIELD_NUMBER: _ClassVar[int]
    generate: bytes
    model_infer: bytes
    def __init__(self, generate: _Optional[bytes] = ..., model_infer: _Optional[bytes] = ...) -> None: ...

class PromptBlocksResponse(_message.Message):
    __slots__ = ("model", "block_size", "hashes", "num_prompt_tokens")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASHES_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    model: str
    block_size: int
    hashes: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    def __init__(self, model: _Optional[str] = ..., block_size: _Optional[int] = ..., hashes: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...
