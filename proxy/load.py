"""The load report: what a unit says about its state and load, on every wire.

One dataclass, converted to the gRPC message, the ``/load`` JSON and the Redis value
here and nowhere else.
"""

from __future__ import annotations

import json
import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import StrEnum
from typing import Any, Final

from librt.base64 import b64decode, b64encode

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


class PrefixBlocks:
    """What the unit's engine holds in its prefix cache, named as gateways name blocks
    of a prompt's text (``proxy.prefix_chunks``): the changes numbered (from_seq, seq],
    or with ``full`` the whole set as of ``seq``. ``epoch`` is random per sidecar
    process. See docs/architecture.md, Prefix affinity from what the engines hold.

    The block numbers are kept as they came: a sidecar builds them as numbers, a reader
    gets them packed (``pack_blocks``) off the wire, and each form is made from the
    other only when asked for (``added`` / ``added_packed``). The compiled gateway's
    map reads the packed form without a Python int a block (a report carries up to a
    thousand). Immutable (``Final``); a plain class rather than a frozen dataclass,
    whose ``__init__`` is interpreted even in the compiled build."""

    __slots__ = ("_added", "_added_packed", "_removed", "_removed_packed", "chunk_chars",
                 "epoch", "from_seq", "full", "seq")  # fmt: skip

    def __init__(
        self,
        epoch: int,
        from_seq: int,
        seq: int,
        full: bool,
        added: tuple[int, ...] = (),
        removed: tuple[int, ...] = (),
        chunk_chars: int = 0,
    ) -> None:
        self.epoch: Final = epoch
        self.from_seq: Final = from_seq
        self.seq: Final = seq
        self.full: Final = full
        self.chunk_chars: Final = chunk_chars
        self._added: tuple[int, ...] | None = added
        self._removed: tuple[int, ...] | None = removed
        self._added_packed: bytes | None = None
        self._removed_packed: bytes | None = None

    @classmethod
    def packed(
        cls,
        epoch: int,
        from_seq: int,
        seq: int,
        full: bool,
        added: bytes,
        removed: bytes,
        chunk_chars: int,
    ) -> PrefixBlocks:
        """Blocks as read off the wire: ``added`` and ``removed`` packed, at most
        MAX_REPORT_BLOCKS of each kept (TypeError: not a whole number of 8 bytes)."""
        blocks = cls(epoch, from_seq, seq, full, (), (), chunk_chars)
        blocks._added, blocks._added_packed = None, _checked(added)
        blocks._removed, blocks._removed_packed = None, _checked(removed)
        return blocks

    @property
    def added(self) -> tuple[int, ...]:
        if self._added is None:
            self._added = unpack_blocks(self.added_packed)
        return self._added

    @property
    def removed(self) -> tuple[int, ...]:
        if self._removed is None:
            self._removed = unpack_blocks(self.removed_packed)
        return self._removed

    @property
    def added_packed(self) -> bytes:
        if self._added_packed is None:
            self._added_packed = pack_blocks(self.added)
        return self._added_packed

    @property
    def removed_packed(self) -> bytes:
        if self._removed_packed is None:
            self._removed_packed = pack_blocks(self.removed)
        return self._removed_packed

    def _fields(self) -> tuple[object, ...]:
        return (self.epoch, self.from_seq, self.seq, self.full, self.added, self.removed,
                self.chunk_chars)  # fmt: skip

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrefixBlocks):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __repr__(self) -> str:
        return (
            f"PrefixBlocks(epoch={self.epoch}, from_seq={self.from_seq}, seq={self.seq}, "
            f"full={self.full}, added={self.added}, removed={self.removed}, "
            f"chunk_chars={self.chunk_chars})"
        )

    def to_dict(self) -> dict[str, Any]:
        # The block numbers packed (``pack_blocks``) in base64: a JSON array of a
        # thousand 20-digit numbers is twice the bytes and most of a reader's parse.
        return {
            "epoch": self.epoch,
            "from_seq": self.from_seq,
            "seq": self.seq,
            "full": self.full,
            "added": b64encode(self.added_packed).decode(),
            "removed": b64encode(self.removed_packed).decode(),
            "chunk_chars": self.chunk_chars,
        }

    def to_pb(self) -> load_pb2.PrefixBlocks:
        return load_pb2.PrefixBlocks(
            epoch=self.epoch,
            from_seq=self.from_seq,
            seq=self.seq,
            full=self.full,
            added_packed=self.added_packed,
            removed_packed=self.removed_packed,
            chunk_chars=self.chunk_chars,
        )

    @classmethod
    def from_pb(cls, msg: load_pb2.PrefixBlocks) -> PrefixBlocks:
        if msg.added or msg.removed:  # a sidecar of before the packed fields
            return cls(
                msg.epoch,
                msg.from_seq,
                msg.seq,
                msg.full,
                tuple(msg.added[:MAX_REPORT_BLOCKS]),
                tuple(msg.removed[:MAX_REPORT_BLOCKS]),
                msg.chunk_chars,
            )
        return cls.packed(
            msg.epoch,
            msg.from_seq,
            msg.seq,
            msg.full,
            msg.added_packed,
            msg.removed_packed,
            msg.chunk_chars,
        )

    @classmethod
    def from_dict(cls, data: Any) -> PrefixBlocks:
        if not isinstance(data, dict):
            raise TypeError("prefix_blocks: not an object")
        epoch, from_seq, seq = _whole(data["epoch"]), _whole(data["from_seq"]), _whole(data["seq"])
        full, chunk_chars = data["full"] is True, _whole(data.get("chunk_chars", 0))
        added, removed = data.get("added", ""), data.get("removed", "")
        if isinstance(added, str) and isinstance(removed, str):
            return cls.packed(epoch, from_seq, seq, full, _base64(added), _base64(removed),
                              chunk_chars)  # fmt: skip
        # a sidecar of before the packed form: arrays of numbers
        return cls(epoch, from_seq, seq, full, _blocks(added), _blocks(removed), chunk_chars)


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
    packed = array("Q")
    packed.frombytes(_checked(data))
    if not _LITTLE:
        packed.byteswap()
    return tuple(packed.tolist())


def _checked(data: bytes) -> bytes:
    """Packed block numbers, at most MAX_REPORT_BLOCKS of them."""
    if len(data) % 8:
        raise TypeError("prefix_blocks: packed blocks are not a whole number of 8 bytes")
    return data if len(data) <= 8 * MAX_REPORT_BLOCKS else data[: 8 * MAX_REPORT_BLOCKS]


def _base64(value: str) -> bytes:
    """Base64 text as bytes, by librt's decoder (about 25 times binascii's on a report's
    blocks), held to binascii's strict mode by length: it skips what is not base64."""
    try:
        data = b64decode(value)
    except ValueError as exc:
        raise TypeError(f"prefix_blocks: packed blocks are not base64: {exc}") from None
    pad = 2 if value.endswith("==") else 1 if value.endswith("=") else 0
    if len(value) % 4 or len(data) != len(value) // 4 * 3 - pad:
        raise TypeError("prefix_blocks: packed blocks are not base64")
    return data


def _blocks(value: Any) -> tuple[int, ...]:
    """A JSON report's ``added`` or ``removed``: packed in base64, or (a sidecar of
    before the packed form) an array of numbers."""
    if isinstance(value, str):
        return unpack_blocks(_base64(value))
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
        return cls._from_pb(msg, True)[0]

    @classmethod
    def read_pb(cls, msg: load_pb2.LoadReport) -> tuple[LoadReport, PrefixBlocks | None]:
        """The report without its prefix blocks, and the blocks apart: what a gateway
        keeps of a unit's report, and what its map of blocks takes (one report built,
        not a second one without the blocks)."""
        return cls._from_pb(msg, False)

    @classmethod
    def _from_pb(
        cls, msg: load_pb2.LoadReport, with_blocks: bool
    ) -> tuple[LoadReport, PrefixBlocks | None]:
        blocks = PrefixBlocks.from_pb(msg.prefix_blocks) if msg.HasField("prefix_blocks") else None
        report = cls(
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
            prefix_blocks=blocks if with_blocks else None,
            watcher_outstanding=(
                msg.watcher_outstanding if msg.HasField("watcher_outstanding") else -1
            ),
        )
        return report, blocks

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LoadReport:
        return cls._from_dict(data, True)[0]

    @classmethod
    def read_dict(cls, data: dict[str, Any]) -> tuple[LoadReport, PrefixBlocks | None]:
        """``read_pb`` of a JSON report."""
        return cls._from_dict(data, False)

    @classmethod
    def _from_dict(
        cls, data: dict[str, Any], with_blocks: bool
    ) -> tuple[LoadReport, PrefixBlocks | None]:
        values = dict(data)
        values["state"] = _state(values["state"])
        values["nodes"] = tuple(NodeStatus(**n) for n in values.get("nodes", ()))
        values["models"] = tuple(values.get("models", ()))
        given = values.get("named_metrics") or {}
        if not isinstance(given, dict):
            raise TypeError("named_metrics: not an object")
        values["named_metrics"] = named_metrics(given)
        given_blocks = values.get("prefix_blocks")
        blocks = None if given_blocks is None else PrefixBlocks.from_dict(given_blocks)
        values["prefix_blocks"] = blocks if with_blocks else None
        known = cls.__dataclass_fields__
        report = cls(**{k: v for k, v in values.items() if k in known})  # a newer peer's extras
        return report, blocks


_STATES: dict[str, UnitState] = {str(state): state for state in UnitState}


def _state(name: object) -> UnitState:
    # A state this build does not know (a newer peer) is treated as not serving. A dict,
    # not UnitState(name): an Enum's call is interpreted Python, on every report.
    if not isinstance(name, str):
        return UnitState.NOT_SERVING
    return _STATES.get(name, UnitState.NOT_SERVING)
