"""The etcd key layout under ``/planaria/<cluster>/`` and the records stored there.

Values are msgspec structs encoded as JSON, so ``etcdctl get --prefix /planaria/`` is
readable by a person. Times are wall-clock seconds since the epoch (``time.time()``),
because they are read on other hosts.

| key                                   | struct       | lease            |
| ------------------------------------- | ------------ | ---------------- |
| ``nodes/<node_id>``                   | NodeInfo     | the node's lease |
| ``engines/<engine_id>``               | EngineRecord | the node's lease |
| ``leader``                            | node id text | the leader's     |
| ``epoch``                             | Epoch        | none             |
| ``desired``                           | Desired      | none             |
| ``placement``                         | Placement    | none             |
| ``kv_budget/<fingerprint>/<device>``  | KVBudget     | none             |
| ``ops/<op_id>``                       | OpRecord     | none             |

Nothing read from etcd is trusted: anyone who can write to it could put anything there.
:func:`decode` refuses (:class:`RecordDecodeError`) a value that is not valid JSON of the
struct, nests too deep, holds a string longer than ``MAX_TEXT_CHARS``, a container longer
than ``MAX_ITEMS``, a number that is negative, not finite or past ``MAX_INT``, or breaks
its struct's own rules (an ``Epoch`` whose ``world_size`` is not its rank count, whose
ranks repeat, or whose expert map points past its ranks or is not contiguous; a
``Desired`` past ``MAX_ENGINES``; ...). What needs the cluster's context (the epoch's
expert map covers the model's experts, its rendezvous is a known node's) is
:func:`epoch_problem`, for the callers that have it.
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

import math
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from planaria.elastic.errors import RecordDecodeError

ROOT = "/planaria"


class EngineRecordState(str, Enum):
    """Lifecycle of an engine as the cluster sees it: the state in its etcd record
    (``engines/<id>``). The engine process's own lifecycle is engine.lifecycle.EngineState.

    STARTING -> LOADING -> PROFILING -> READY -> SERVING
    SERVING -> PAUSED (step boundary of a group switch) -> SERVING
    SERVING|READY -> UNHEALTHY (a collective or a group switch failed: requests kept,
        ``failed_epoch`` says which epoch; waits for the leader's next epoch) -> SERVING
    SERVING -> DRAINING (scale-down: requests moved to survivors) -> STOPPED
    any -> FAILED (crashed, hung, or lost mid-collective)
    """

    STARTING = "starting"
    LOADING = "loading"
    PROFILING = "profiling"
    READY = "ready"
    SERVING = "serving"
    PAUSED = "paused"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class OpPhase(str, Enum):
    """Phases of a scale operation; DONE, FAILED and CANCELLED are final.

    PENDING -> LAUNCHING -> PAUSING -> SWITCHING -> RESUMING -> DONE
    any non-final -> FAILED | CANCELLED
    """

    PENDING = "pending"
    LAUNCHING = "launching"
    PAUSING = "pausing"
    SWITCHING = "switching"
    RESUMING = "resuming"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in (OpPhase.DONE, OpPhase.FAILED, OpPhase.CANCELLED)


class NodeInfo(msgspec.Struct, kw_only=True):
    node_id: str
    host: str
    addresses: dict[str, str] = {}  # role -> "host:port", e.g. {"admin": ..., "zmq": ...}
    capacity: dict[str, int] = {}   # {"engines": its --engines, "max_engines": its --max-engines}
    started_at: float = 0.0


class EngineRecord(msgspec.Struct, kw_only=True):
    engine_id: str
    node_id: str
    rank: int | None = None         # EP rank in `epoch`; None before joining a group
    epoch: int = 0
    state: EngineRecordState = EngineRecordState.STARTING
    addresses: dict[str, str] = {}  # e.g. {"input": "tcp://...", "output": "tcp://..."}
    kv_cache_bytes: int = 0
    kv_source: str = ""             # "profiled" | "reused" | "given" | "" (not yet known)
    timings: dict[str, float] = {}  # start-up and switch phases, seconds (bench/ reads them)
    served_epoch: int = 0           # the last epoch this engine served in (0: never)
    failed_epoch: int = 0           # the last epoch whose group it failed to form or run
    error: str = ""                 # why, for failed_epoch


class Epoch(msgspec.Struct, kw_only=True):
    number: int
    world_size: int
    ranks: list[str]                # rank -> engine id
    expert_map: list[int]           # expert -> rank
    rendezvous: str = ""            # "host:port" of the TCPStore for this epoch
    leader: str = ""                # node id of the leader that wrote it
    created_at: float = 0.0


class Desired(msgspec.Struct, kw_only=True):
    num_engines: int
    op_id: str
    requested_at: float = 0.0


class KVBudget(msgspec.Struct, kw_only=True):
    kv_cache_bytes: int
    block_size: int
    num_blocks: int
    engine_id: str
    recorded_at: float = 0.0


class OpRecord(msgspec.Struct, kw_only=True):
    op_id: str
    kind: str                       # "scale_up" | "scale_down" | "reform"
    phase: OpPhase = OpPhase.PENDING
    target: int = 0                 # desired number of engines
    progress: str = ""              # human-readable, e.g. "2/3 engines loaded"
    error: str = ""
    updated_at: float = 0.0


T = TypeVar("T")

_ENCODER = msgspec.json.Encoder()

MAX_TEXT_CHARS = 4096     # any string in a record (ids, addresses, errors, progress)
MAX_ITEMS = 65536         # any list or dict in a record (ranks, expert map, addresses)
MAX_INT = 2**63 - 1       # any integer
MAX_ENGINES = 4096        # a desired size or a world size
MAX_RECORD_BYTES = 4 << 20


def encode(record: msgspec.Struct) -> bytes:
    return _ENCODER.encode(record)


def decode(key: str | bytes, data: bytes, cls: type[T]) -> T:
    """Decode ``data`` stored at ``key`` into ``cls`` and check it (module docstring);
    :class:`RecordDecodeError` if it is not one, or not a sane one."""
    name = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    if len(data) > MAX_RECORD_BYTES:
        raise RecordDecodeError(name, ValueError(f"{len(data)} bytes, more than {MAX_RECORD_BYTES}"))
    try:
        record = msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, ValueError, TypeError) as exc:
        raise RecordDecodeError(name, exc) from exc
    problem = _bounds_problem(record, "$") or _CHECKS.get(cls, _no_check)(record)
    if problem:
        raise RecordDecodeError(name, ValueError(problem))
    return record


def _bounds_problem(value: Any, path: str, depth: int = 0) -> str | None:
    """The first string too long, container too big, or number negative, not finite or
    too large in ``value`` (a decoded record), else None."""
    if depth > 16:
        return f"{path}: nested too deep"
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, str):
        return f"{path}: a string of {len(value)} characters" if len(value) > MAX_TEXT_CHARS else None
    if isinstance(value, int):
        return None if 0 <= value <= MAX_INT else f"{path}: {value} is out of range"
    if isinstance(value, float):
        return None if math.isfinite(value) and value >= 0 else f"{path}: {value} is not a finite number >= 0"
    if isinstance(value, Enum):
        return None
    if isinstance(value, msgspec.Struct):
        items: Iterable[tuple[str, Any]] = ((f, getattr(value, f)) for f in value.__struct_fields__)
    elif isinstance(value, dict):
        if len(value) > MAX_ITEMS:
            return f"{path}: {len(value)} entries"
        for k in value:
            problem = _bounds_problem(k, f"{path} key", depth + 1)
            if problem:
                return problem
        items = ((str(k)[:40], v) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        if len(value) > MAX_ITEMS:
            return f"{path}: {len(value)} items"
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return None
    for name, item in items:
        problem = _bounds_problem(item, f"{path}.{name}", depth + 1)
        if problem:
            return problem
    return None


def _segment_problem(kind: str, value: str) -> str | None:
    return None if value and "/" not in value else f"{kind} {value!r} is empty or has a '/'"


def address_problem(address: str) -> str | None:
    """Why ``address`` is not ``host:port`` (port 1-65535), or None."""
    host, sep, port = address.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 < int(port) < 65536:
        return f"{address!r} is not host:port"
    return None


def _epoch_problem(epoch: Epoch) -> str | None:
    """An epoch's own consistency (no cluster context needed)."""
    if epoch.world_size != len(epoch.ranks):
        return f"world_size {epoch.world_size} but {len(epoch.ranks)} ranks"
    if epoch.world_size > MAX_ENGINES:
        return f"world_size {epoch.world_size} is over {MAX_ENGINES}"
    if len(set(epoch.ranks)) != len(epoch.ranks):
        return "a rank appears twice"
    for engine_id in epoch.ranks:
        problem = _segment_problem("rank engine id", engine_id)
        if problem:
            return problem
    if epoch.expert_map and not epoch.ranks:
        return "an expert map without ranks"
    if any(r >= epoch.world_size for r in epoch.expert_map):
        return f"an expert mapped to a rank past world_size {epoch.world_size}"
    if any(b < a for a, b in zip(epoch.expert_map, epoch.expert_map[1:])):
        return "the expert map is not contiguous (rank numbers go down)"
    if epoch.rendezvous:
        return address_problem(epoch.rendezvous)
    return None


def epoch_problem(epoch: Epoch, *, num_experts: int | None = None,
                  rendezvous_addresses: Iterable[str] | None = None) -> str | None:
    """Why ``epoch`` must not be acted on in this cluster, or None: its own consistency,
    its expert map covering ``num_experts`` (when a rank holds them), its rendezvous one of
    ``rendezvous_addresses`` (the known nodes')."""
    problem = _epoch_problem(epoch)
    if problem:
        return problem
    if num_experts is not None and epoch.ranks and len(epoch.expert_map) != num_experts:
        return f"the expert map covers {len(epoch.expert_map)} experts, the model has {num_experts}"
    if rendezvous_addresses is not None and epoch.ranks:
        known = set(rendezvous_addresses)
        if epoch.rendezvous not in known:
            return f"rendezvous {epoch.rendezvous!r} is no known node's ({', '.join(sorted(known)) or 'none'})"
    return None


def desired_problem(desired: Desired, max_engines: int) -> str | None:
    """Why ``desired`` must not be acted on (its size not within [1, max_engines]), or None."""
    if not 1 <= desired.num_engines <= max_engines:
        return f"desired size {desired.num_engines} is not within [1, {max_engines}]"
    return None


def _desired_problem(desired: Desired) -> str | None:
    if desired.num_engines > MAX_ENGINES:
        return f"desired size {desired.num_engines} is over {MAX_ENGINES}"
    return _segment_problem("op_id", desired.op_id)


def _node_problem(node: NodeInfo) -> str | None:
    return _segment_problem("node_id", node.node_id)


def _engine_problem(record: EngineRecord) -> str | None:
    return _segment_problem("engine_id", record.engine_id) or _segment_problem("node_id", record.node_id)


def _no_check(_record: Any) -> None:
    return None


_CHECKS: dict[type, Callable[[Any], str | None]] = {
    Epoch: _epoch_problem, Desired: _desired_problem, NodeInfo: _node_problem, EngineRecord: _engine_problem}


def _check_segment(kind: str, value: str) -> str:
    if not value or "/" in value:
        raise ValueError(f"{kind} must be non-empty and contain no '/', got {value!r}")
    return value


class KeyLayout:
    """Every key of one cluster. ``KeyLayout("prod").engine("e0")`` ->
    ``/planaria/prod/engines/e0``."""

    def __init__(self, cluster: str) -> None:
        self.cluster = _check_segment("cluster", cluster)
        self.prefix = f"{ROOT}/{cluster}/"

    @property
    def nodes_prefix(self) -> str:
        return self.prefix + "nodes/"

    @property
    def engines_prefix(self) -> str:
        return self.prefix + "engines/"

    @property
    def ops_prefix(self) -> str:
        return self.prefix + "ops/"

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def epoch(self) -> str:
        return self.prefix + "epoch"

    @property
    def desired(self) -> str:
        return self.prefix + "desired"

    @property
    def placement(self) -> str:
        """node id -> engine count (elastic/placement.py), written by the leader."""
        return self.prefix + "placement"

    def node(self, node_id: str) -> str:
        return self.nodes_prefix + _check_segment("node_id", node_id)

    def engine(self, engine_id: str) -> str:
        return self.engines_prefix + _check_segment("engine_id", engine_id)

    def kv_budget(self, model_fingerprint: str, device_kind: str) -> str:
        return (f"{self.prefix}kv_budget/{_check_segment('model_fingerprint', model_fingerprint)}"
                f"/{_check_segment('device_kind', device_kind)}")

    def op(self, op_id: str) -> str:
        return self.ops_prefix + _check_segment("op_id", op_id)

    @staticmethod
    def last_segment(key: str | bytes) -> str:
        text = key.decode() if isinstance(key, bytes) else key
        return text.rsplit("/", 1)[-1]
