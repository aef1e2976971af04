from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UnitState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNIT_STATE_UNSPECIFIED: _ClassVar[UnitState]
    STARTING: _ClassVar[UnitState]
    SERVING: _ClassVar[UnitState]
    NOT_SERVING: _ClassVar[UnitState]
    DRAINING: _ClassVar[UnitState]
UNIT_STATE_UNSPECIFIED: UnitState
STARTING: UnitState
SERVING: UnitState
NOT_SERVING: UnitState
DRAINING: UnitState

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchLoadRequest(_message.Message):
    __slots__ = ("min_interval_ms", "heartbeat_ms", "watcher")
    MIN_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    WATCHER_FIELD_NUMBER: _ClassVar[int]
    min_interval_ms: int
    heartbeat_ms: int
    watcher: str
    def __init__(self, min_interval_ms: _Optional[int] = ..., heartbeat_ms: _Optional[int] = ..., watcher: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("name", "role", "address", "healthy", "reason", "since_ms")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HEALTHY_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SINCE_MS_FIELD_NUMBER: _ClassVar[int]
    name: str
    role: str
    address: str
    healthy: bool
    reason: str
    since_ms: int
    def __init__(self, name: _Optional[str] = ..., role: _Optional[str] = ..., address: _Optional[str] = ..., healthy: _Optional[bool] = ..., reason: _Optional[str] = ..., since_ms: _Optional[int] = ...) -> None: ...

class LoadReport(_message.Message):
    __slots__ = ("unit_id", "state", "outstanding", "capacity", "running", "waiting", "kv_cache_usage", "nodes", "seq", "timestamp_ms", "http_url", "grpc_target", "prefix_cache_hit_rate", "models", "prefix_cache_queries", "prefix_cache_hits", "prefix_cache_resets", "named_metrics", "prefix_blocks", "watcher_outstanding")
    class NamedMetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    UNIT_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_MS_FIELD_NUMBER: _ClassVar[int]
    HTTP_URL_FIELD_NUMBER: _ClassVar[int]
    GRPC_TARGET_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_RESETS_FIELD_NUMBER: _ClassVar[int]
    NAMED_METRICS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WATCHER_OUTSTANDING_FIELD_NUMBER: _ClassVar[int]
    unit_id: str
    state: UnitState
    outstanding: int
    capacity: int
    running: int
    waiting: int
    kv_cache_usage: float
    nodes: _containers.RepeatedCompositeFieldContainer[NodeStatus]
    seq: int
    timestamp_ms: int
    http_url: str
    grpc_target: str
    prefix_cache_hit_rate: float
    models: _containers.RepeatedScalarFieldContainer[str]
    prefix_cache_queries: int
    prefix_cache_hits: int
    prefix_cache_resets: int
    named_metrics: _containers.ScalarMap[str, float]
    prefix_blocks: PrefixBlocks
    watcher_outstanding: int
    def __init__(self, unit_id: _Optional[str] = ..., state: _Optional[_Union[UnitState, str]] = ..., outstanding: _Optional[int] = ..., capacity: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., nodes: _Optional[_Iterable[_Union[NodeStatus, _Mapping]]] = ..., seq: _Optional[int] = ..., timestamp_ms: _Optional[int] = ..., http_url: _Optional[str] = ..., grpc_target: _Optional[str] = ..., prefix_cache_hit_rate: _Optional[float] = ..., models: _Optional[_Iterable[str]] = ..., prefix_cache_queries: _Optional[int] = ..., prefix_cache_hits: _Optional[int] = ..., prefix_cache_resets: _Optional[int] = ..., named_metrics: _Optional[_Mapping[str, float]] = ..., prefix_blocks: _Optional[_Union[PrefixBlocks, _Mapping]] = ..., watcher_outstanding: _Optional[int] = ...) -> None: ...

class PrefixBlocks(_message.Message):
    __slots__ = ("epoch", "from_seq", "seq", "full", "added", "removed", "chunk_chars", "added_packed", "removed_packed")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    FROM_SEQ_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHUNK_CHARS_FIELD_NUMBER: _ClassVar[int]
    ADDED_PACKED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_PACKED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    from_seq: int
    seq: int
    full: bool
    added: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    chunk_chars: int
    added_packed: bytes
    removed_packed: bytes
    def __init__(self, epoch: _Optional[int] = ..., from_seq: _Optional[int] = ..., seq: _Optional[int] = ..., full: _Optional[bool] = ..., added: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., chunk_chars: _Optional[int] = ..., added_packed: _Optional[bytes] = ..., removed_packed: _Optional[bytes] = ...) -> None: ...
