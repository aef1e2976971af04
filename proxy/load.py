"""The load report: what a unit says about its state and load, on every wire.

One dataclass, converted to the gRPC message, the ``/load`` JSON and the Redis value
here and nowhere else.
"""

from __future__ import annotations

import binascii
import json
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any

from proxy.pb.unitproxy.v1 import load_pb2


class UnitState(StrEnum):
    STARTING = "STARTING"
    SERVING = "SERVING"
    NOT_SERVING = "NOT_SERVING"
    DRAINING = "DRAINING"


@dataclass(frozen=True, slots=True)
class NodeStatus:
    name: str
    role: str  # "leader" | "follower"
    address: str
    healthy: bool
    reason: str
    since_ms: int


# Bounds on a report's named metrics: how many, and how long a name may be.
MAX_NAMED_METRICS = 32
MAX_METRIC_NAME = 64
# Named metrics a sidecar reports so that a gateway sends a higher class over capacity
# as the unit admits it (sidecar.priority_headroom): the allowance, and the requests
# outstanding of each class below interactive (the rest are interactive).
PRIORITY_HEADROOM = "priority_headroom"
OUTSTANDING_STANDARD = "outstanding_standard"
OUTSTANDING_BATCH = "outstanding_batch"

# A gateway's name for itself (random per process), on each request it sends a unit and
# in its watch of the unit's reports: the reports to it count its requests apart
# (``LoadReport.watcher_outstanding``).
GATEWAY_HEADER = "x-unitproxy-gateway"
MAX_GATEWAY_NAME = 64


def gateway_name(value: object) -> str | None:
    """A gateway's name as given (a header, metadata, a query), None where there is
    none or it is no name (not text, empty or over MAX_GATEWAY_NAME characters)."""
    if isinstance(value, str) and 0 < len(value) <= MAX_GATEWAY_NAME:
        return value
    return None


def named_metrics(given: Mapping[str, Any]) -> dict[str, float]:
    """What of ``given`` a report carries as named metrics: names of 1 to
    MAX_METRIC_NAME characters with finite numbers, at most MAX_NAMED_METRICS of them
    (past that, the names that sort first: a map has no order on the wire). The rest
    is dropped: a reader does not trust a peer to keep the bounds."""
    kept: dict[str, float] = {}
    if not given:
        return kept
    names = sorted(given) if len(given) > MAX_NAMED_METRICS else list(given)
    for name in names:
        value = given[name]
        if (
            isinstance(name, str)
            and 0 < len(name) <= MAX_METRIC_NAME
            and isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
        ):
            kept[name] = float(value)
            if len(kept) == MAX_NAMED_METRICS:
                break
    return kept


def joined_metrics(engine: Mapping[str, float], sidecar: Mapping[str, float]) -> dict[str, float]:
    """A sidecar's report's named metrics: its engine's (``EngineStats.named_metrics``)
    and its own (``SidecarCore.set_metric``), its own winning a tie; a new dict."""
    if not engine:
        return dict(sidecar)
    return named_metrics({**engine, **sidecar})


# A reader keeps at most this many block hashes of one report (a sidecar sends fewer:
# its sidecar.prefix_report_blocks and MAX_DELTA_BLOCKS).
MAX_REPORT_BLOCKS = 65_536
MAX_DELTA_BLOCKS = 1024  # changes in one report; the rest follow in the next


@dataclass(frozen=True, slots=True)
class PrefixBlocks:
    """What the unit's engine holds in its prefix cache, named as gateways name blocks
    of a prompt's text (``proxy.prefix_chunks``): the changes numbered (from_seq, seq],
    or with ``full`` the whole set as of ``seq``. ``epoch`` is random per sidecar
    process. See docs/architecture.md, Prefix affinity from what the engines hold."""

    epoch: int
    from_seq: int
    seq: int
    full: bool
    added: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()
    chunk_chars: int = 0

    def to_dict(self) -> dict[str, Any]:
        # The block numbers packed (``pack_blocks``) in base64: a JSON array of a
        # thousand 20-digit numbers is twice the bytes and most of a reader's parse.
        return {
            "epoch": self.epoch,
            "from_seq": self.from_seq,
            "seq": self.seq,
            "full": self.full,
            "added": binascii.b2a_base64(pack_blocks(self.added), newline=False).decode(),
            "removed": binascii.b2a_base64(pack_blocks(self.removed), newline=False).decode(),
            "chunk_chars": self.chunk_chars,
        }

    def to_pb(self) -> load_pb2.PrefixBlocks:
        return load_pb2.PrefixBlocks(
            epoch=self.epoch,
            from_seq=self.from_seq,
            seq=self.seq,
            full=self.full,
            added_packed=pack_blocks(self.added),
            removed_packed=pack_blocks(self.removed),
            chunk_chars=self.chunk_chars,
        )

    @classmethod
    def from_pb(cls, msg: load_pb2.PrefixBlocks) -> PrefixBlocks:
        # A sidecar of before the packed fields sent the repeated ones.
        return cls(
            msg.epoch,
            msg.from_seq,
            msg.seq,
            msg.full,
            tuple(msg.added[:MAX_REPORT_BLOCKS]) if msg.added else unpack_blocks(msg.added_packed),
            (
                tuple(msg.removed[:MAX_REPORT_BLOCKS])
                if msg.removed
                else unpack_blocks(msg.removed_packed)
            ),
            msg.chunk_chars,
        )

    @classmethod
    def from_dict(cls, data: Any) -> PrefixBlocks:
        if not isinstance(data, dict):
            raise TypeError("prefix_blocks: not an object")
        return cls(
            _whole(data["epoch"]),
            _whole(data["from_seq"]),
            _whole(data["seq"]),
            data["full"] is True,
            _blocks(data.get("added", "")),
            _blocks(data.get("removed", "")),
            _whole(data.get("chunk_chars", 0)),
        )


_LITTLE = sys.byteorder == "little"


def pack_blocks(blocks: Sequence[int]) -> bytes:
    """Block numbers as the wire packs them: 8 bytes each, little-endian (a number that
    is not a 64-bit unsigned one raises OverflowError or TypeError)."""
    packed = array("Q", blocks)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_blocks(data: bytes) -> tuple[int, ...]:
    """``pack_blocks``' numbers back, at most MAX_REPORT_BLOCKS of them."""
    if len(data) % 8:
        raise TypeError("prefix_blocks: packed blocks are not a whole number of 8 bytes")
    packed = array("Q")
    packed.frombytes(data[: 8 * MAX_REPORT_BLOCKS])
    if not _LITTLE:
        packed.byteswap()
    return tuple(packed.tolist())


def _blocks(value: Any) -> tuple[int, ...]:
    """A JSON report's ``added`` or ``removed``: packed in base64, or (a sidecar of
    before the packed form) an array of numbers."""
    if isinstance(value, str):
        try:
            return unpack_blocks(binascii.a2b_base64(value, strict_mode=True))
        except binascii.Error as exc:
            raise TypeError(f"prefix_blocks: packed blocks are not base64: {exc}") from None
    if not isinstance(value, list):
        raise TypeError("prefix_blocks: added and removed must be base64 text or lists")
    return _wholes(value[:MAX_REPORT_BLOCKS])


def _wholes(values: list[Any]) -> tuple[int, ...]:
    """Block numbers, checked all at once (a report carries up to a thousand)."""
    out = tuple(values)
    if out and (set(map(type, out)) != {int} or min(out) < 0 or max(out) >= 1 << 64):
        for value in out:
            _whole(value)  # names the first that is not
    return out


def _whole(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 64:
        raise TypeError(f"prefix_blocks: {value!r} is not a 64-bit unsigned number")
    return value


@dataclass(frozen=True, slots=True)
class LoadReport:
    unit_id: str
    state: UnitState
    outstanding: int
    capacity: int
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = -1.0
    nodes: tuple[NodeStatus, ...] = field(default_factory=tuple)
    seq: int = 0
    timestamp_ms: int = 0
    http_url: str = ""
    grpc_target: str = ""
    prefix_cache_hit_rate: float = -1.0
    models: tuple[str, ...] = ()
    prefix_cache_queries: int = 0  # prompt tokens looked up since the engine started
    prefix_cache_hits: int = 0  # of which were cached
    prefix_cache_resets: int = 0  # times the prefix cache was emptied since start
    # Signals beyond these fields, by name (bounded: ``named_metrics``); not hashed.
    named_metrics: dict[str, float] = field(default_factory=dict, hash=False)
    # The prefix blocks the engine holds (None: its engine does not tell).
    prefix_blocks: PrefixBlocks | None = None
    # Of outstanding, the requests of the watcher this report goes to, as it named
    # itself (WatchLoadRequest.watcher); -1: not counted apart.
    watcher_outstanding: int = -1

    def to_dict(self) -> dict[str, Any]:
        # Field by field, not asdict: asdict deep-copies every block number of
        # prefix_blocks one by one (4 ms for a report of 1,024 changes).
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        data["named_metrics"] = dict(self.named_metrics)
        data["prefix_blocks"] = None if self.prefix_blocks is None else self.prefix_blocks.to_dict()
        data["state"] = str(self.state)
        data["nodes"] = [asdict(n) for n in self.nodes]
        data["models"] = list(self.models)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    def to_pb(self) -> load_pb2.LoadReport:
        return load_pb2.LoadReport(
            unit_id=self.unit_id,
            state=load_pb2.UnitState.Value(str(self.state)),
            outstanding=self.outstanding,
            capacity=self.capacity,
            running=self.running,
            waiting=self.waiting,
            kv_cache_usage=self.kv_cache_usage,
            nodes=[load_pb2.NodeStatus(**asdict(n)) for n in self.nodes],
            seq=self.seq,
            timestamp_ms=self.timestamp_ms,
            http_url=self.http_url,
            grpc_target=self.grpc_target,
            prefix_cache_hit_rate=self.prefix_cache_hit_rate,
            models=self.models,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            prefix_cache_resets=self.prefix_cache_resets,
            named_metrics=self.named_metrics,
            prefix_blocks=None if self.prefix_blocks is None else self.prefix_blocks.to_pb(),
            watcher_outstanding=None if self.watcher_outstanding < 0 else self.watcher_outstanding,
        )

    @classmethod
    def from_pb(cls, msg: load_pb2.LoadReport) -> LoadReport:
        return cls(
            unit_id=msg.unit_id,
            state=_state(load_pb2.UnitState.Name(msg.state)),
            outstanding=msg.outstanding,
            capacity=msg.capacity,
            running=msg.running,
            waiting=msg.waiting,
            kv_cache_usage=msg.kv_cache_usage,
            nodes=tuple(
                NodeStatus(n.name, n.role, n.address, n.healthy, n.reason, n.since_ms)
                for n in msg.nodes
            ),
            seq=msg.seq,
            timestamp_ms=msg.timestamp_ms,
            http_url=msg.http_url,
            grpc_target=msg.grpc_target,
            prefix_cache_hit_rate=msg.prefix_cache_hit_rate,
            models=tuple(msg.models),
            prefix_cache_queries=msg.prefix_cache_queries,
            prefix_cache_hits=msg.prefix_cache_hits,
            prefix_cache_resets=msg.prefix_cache_resets,
            named_metrics=named_metrics(msg.named_metrics) if msg.named_metrics else {},
            prefix_blocks=(
                PrefixBlocks.from_pb(msg.prefix_blocks) if msg.HasField("prefix_blocks") else None
            ),
            watcher_outstanding=(
                msg.watcher_outstanding if msg.HasField("watcher_outstanding") else -1
            ),
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReport:
        values = dict(data)
        values["state"] = _state(values["state"])
        values["nodes"] = tuple(NodeStatus(**n) for n in values.get("nodes", ()))
        values["models"] = tuple(values.get("models", ()))
        given = values.get("named_metrics") or {}
        if not isinstance(given, dict):
            raise TypeError("named_metrics: not an object")
        values["named_metrics"] = named_metrics(given)
        blocks = values.get("prefix_blocks")
        values["prefix_blocks"] = None if blocks is None else PrefixBlocks.from_dict(blocks)
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in values.items() if k in known})  # a newer peer's extras


def _state(name: str) -> UnitState:
    # A state this build does not know (a newer peer) is treated as not serving.
    try:
        return UnitState(name)
    except ValueError:
        return UnitState.NOT_SERVING
