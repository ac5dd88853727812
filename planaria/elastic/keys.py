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
"""

from __future__ import annotations

from enum import Enum
from typing import TypeVar

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


def encode(record: msgspec.Struct) -> bytes:
    return _ENCODER.encode(record)


def decode(key: str | bytes, data: bytes, cls: type[T]) -> T:
    """Decode ``data`` stored at ``key`` into ``cls``; :class:`RecordDecodeError` if not."""
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        name = key.decode() if isinstance(key, bytes) else key
        raise RecordDecodeError(name, exc) from exc


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
