"""The engine-core wire protocol: one-byte type frames and msgspec msgpack payloads.

Every ZMQ message is ``[type, payload, *aux]``: ``type`` is one byte (``MsgType``),
``payload`` one msgspec-msgpack struct, and ``aux`` optional raw little-endian arrays that
carry large number lists outside msgpack. Zero-copy on send; on receive the frame is viewed
in place (``np.frombuffer``) and the one copy left is ``tolist()``, see ``_aux_list``:

- ADD with a prompt of ``aux_min_items`` tokens or more: ``[ADD, request, int32 ids]``;
  the request's ``prompt_token_ids`` is sent empty and refilled from the aux frame.
- OUTPUTS whose logprobs hold ``aux_min_items`` numbers or more:
  ``[OUTPUTS, outputs, LogprobsPack, int32 token ids, float64 logprobs]``.

Channels (who sends what, on which socket)::

    frontend ROUTER -> engine DEALER   HANDSHAKE_INIT HANDSHAKE_REJECT ADD ABORT UTILITY SHUTDOWN
    engine DEALER   -> frontend ROUTER HELLO READY
    engine PUSH     -> frontend PULL   OUTPUTS UTILITY_RESULT STATUS ERROR ENGINE_CORE_DEAD
                                       (OUTPUTS also carry the prefix cache's changes, kv_events)
    supervisor PUSH -> frontend PULL   ENGINE_CORE_DEAD (for an engine that could not send it)

Handshake: the engine connects its DEALER (identity = ``engine_identity(index)``) and sends
HELLO; the frontend answers HANDSHAKE_INIT (its PULL address and settings) or
HANDSHAKE_REJECT; the engine loads, connects PUSH, and sends READY on the DEALER. A
frontend that refuses READY (its config hash differs) answers HANDSHAKE_REJECT with the
reason, and the engine exits with ``engine.proc.EXIT_CONFIG_MISMATCH``.
No pickle anywhere: unknown types and bad payloads raise ``WireFormatError``, whatever the
decoder raised (a payload nested too deeply makes msgspec raise RecursionError).
"""

from __future__ import annotations

import enum
import re
import sys
from array import array
from typing import Any

import msgspec
import numpy as np

from planaria.engine.errors import WireFormatError
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, Logprobs

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 256 * 2**20
DEFAULT_AUX_MIN_ITEMS = 1024
# A step's outputs go in messages of about this many bytes at most (split_outputs): one
# request's big output (prompt logprobs of a long prompt) never takes other requests'
# tokens with it past a receiver's limit, nor makes one huge allocation.
OUTPUTS_MESSAGE_BUDGET_BYTES = 16 * 2**20

if sys.byteorder != "little" or array("i").itemsize != 4:  # aux frames are int32 LE
    raise ImportError("engine.wire needs a little-endian platform with a 4-byte C int")


class MsgType:
    """One-byte frame types (bytes, so they go on the socket as they are)."""

    # frontend -> engine
    ADD = b"\x01"
    ABORT = b"\x02"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x04"
    HANDSHAKE_INIT = b"\x05"
    HANDSHAKE_REJECT = b"\x06"
    WAKEUP = b"\x07"  # internal to an engine process: never accepted from a socket
    # engine -> frontend
    HELLO = b"\x10"
    READY = b"\x11"
    OUTPUTS = b"\x12"
    UTILITY_RESULT = b"\x13"
    ENGINE_CORE_DEAD = b"\x14"
    ERROR = b"\x15"
    STATUS = b"\x16"


TYPE_NAMES = {v: k for k, v in vars(MsgType).items() if isinstance(v, bytes)}


# ---- handshake ---------------------------------------------------------------------------

class Hello(msgspec.Struct, kw_only=True):
    engine_index: int
    pid: int
    protocol_version: int


class HandshakeInit(msgspec.Struct, kw_only=True):
    # {"output": "ipc://..."}: where the engine's PUSH for this frontend connects
    addresses: dict[str, str]
    # {"client_index": 0, "engine_config": {...} (optional), ...}
    settings: dict[str, Any] = {}
    protocol_version: int = PROTOCOL_VERSION


class HandshakeReject(msgspec.Struct, kw_only=True):
    reason: str


# engine/kv_segment.py's segment file names: engine{ID}-{PID}.kv
KV_SEGMENT_NAME = re.compile(r"engine(\d{1,6})-(\d{1,10})\.kv\Z")


class Ready(msgspec.Struct, kw_only=True):
    engine_index: int
    num_kv_blocks: int
    max_model_len: int
    protocol_version: int
    config_hash: str
    kv_cache_bytes: int
    kv_source: str
    pid: int = 0
    vocab_size: int = 0
    block_size: int = 0  # tokens per KV block: the frontend's router hashes prompts by it (0: not said)
    kv_segment: str = ""  # its KV cache's segment, which outlives it (engine/kv_segment.py); "": none


# ---- requests, control -------------------------------------------------------------------

class AbortRequests(msgspec.Struct, kw_only=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, kw_only=True):
    call_id: int
    method: str
    args: dict[str, Any] = {}


class UtilityErrorCode(str, enum.Enum):
    """Why a utility call failed (``UtilityResult.code``); callers decide on it, never on
    the ``error`` text. Set in one place, ``EngineCoreProc._utility`` (engine/proc.py)."""

    UNKNOWN_METHOD = "unknown_method"  # no such utility on this engine
    BAD_ARGUMENT = "bad_argument"      # malformed call, or arguments the utility refuses
    BAD_STATE = "bad_state"            # not allowed in the engine's current state
    CONFLICT = "conflict"              # another operation is in progress (a weight load)
    PERMISSION = "permission"          # not enabled on this engine (fault injection)
    INTERNAL = "internal"              # anything else: a bug, see the engine's log

    @classmethod
    def of(cls, value: str | None) -> "UtilityErrorCode":
        """The code a result carries; INTERNAL when it carries none (an engine older than
        the field) or one this side does not know (a newer engine)."""
        try:
            return cls(value)
        except ValueError:
            return cls.INTERNAL


class UtilityResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    call_id: int
    ok: bool
    result: Any = None
    error: str | None = None
    engine_index: int = 0
    # A UtilityErrorCode value when not ok. A plain str on the wire, absent by default, so
    # results with and without it decode on both sides; read it with UtilityErrorCode.of.
    code: str | None = None


class Shutdown(msgspec.Struct, kw_only=True, omit_defaults=True):
    drain_timeout_s: float | None = None  # None: the engine's setting; 0: abort now


class EngineDead(msgspec.Struct, kw_only=True, omit_defaults=True):
    engine_index: int
    reason: str
    pid: int | None = None  # set when known: a frontend ignores a notice for an older pid
    # time.monotonic() (CLOCK_MONOTONIC: one clock for every process of a machine) when the
    # engine's loop caught the fatal fault; None when not known (a supervisor's report)
    fault_monotonic_s: float | None = None
    # what ended it, once the supervisor reaped it (a second notice for the same pid):
    # "external" (SIGKILL from outside: an operator, the OOM killer; a SIGSTOPped process
    # the watchdog killed), "fault" (an exit code, a crash signal, a step that hung while
    # running), "" not known yet. The poison quarantine counts only faults.
    cause: str = ""
    # the engine request ids that took their first step in the batch it died in (its
    # flight record, engine/flight_record.py), when the supervisor could read it: a crash
    # is pinned on them, not on requests that had been running there
    suspects: list[str] = []


class EngineStatus(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A change of the engine's lifecycle state (see engine.lifecycle.EngineState)."""

    engine_index: int
    state: str
    reason: str = ""
    requests_dropped: bool = False  # its in-flight requests are gone (replay them elsewhere)
    pid: int = 0
    # with requests_dropped: a draining engine handed them over (their KV stays in its
    # segment, unwritten, while it drains): move them, no fault
    handed_over: bool = False
    # DRAINING with a handover to come: the engine keeps decoding while each frontend has the
    # survivors copy the bulk of its requests' KV (utility "prefetch_kv"), then asks it to
    # hand them over (utility "hand_over"); past HANDOVER_WAIT_S it hands the rest over anyway
    handover_pending: bool = False


class WireError(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A message the engine could not use and could not pin to a request."""

    engine_index: int
    message: str
    request_id: str | None = None


class LogprobsPack(msgspec.Struct, array_like=True):
    counts: list[int]  # per output: number of Logprobs entries, -1 where there were none
    widths: list[int]  # per entry: number of (token id, logprob) pairs
    sampled_ranks: list[int]  # per entry


SCHEMAS: dict[bytes, type] = {
    MsgType.ADD: EngineCoreRequest,
    MsgType.ABORT: AbortRequests,
    MsgType.UTILITY: UtilityCall,
    MsgType.SHUTDOWN: Shutdown,
    MsgType.HANDSHAKE_INIT: HandshakeInit,
    MsgType.HANDSHAKE_REJECT: HandshakeReject,
    MsgType.HELLO: Hello,
    MsgType.READY: Ready,
    MsgType.OUTPUTS: EngineCoreOutputs,
    MsgType.UTILITY_RESULT: UtilityResult,
    MsgType.ENGINE_CORE_DEAD: EngineDead,
    MsgType.ERROR: WireError,
    MsgType.STATUS: EngineStatus,
}
ENGINE_INPUT_TYPES = frozenset({MsgType.ADD, MsgType.ABORT, MsgType.UTILITY, MsgType.SHUTDOWN,
                                MsgType.HANDSHAKE_INIT, MsgType.HANDSHAKE_REJECT})
FRONTEND_INPUT_TYPES = frozenset({MsgType.HELLO, MsgType.READY, MsgType.OUTPUTS,
                                  MsgType.UTILITY_RESULT, MsgType.ENGINE_CORE_DEAD,
                                  MsgType.ERROR, MsgType.STATUS})


def engine_identity(engine_index: int) -> bytes:
    """The DEALER identity of an engine: its index, 2 bytes little-endian (as in vLLM)."""
    return engine_index.to_bytes(2, "little")


def engine_index_of(identity: bytes) -> int:
    return int.from_bytes(identity, "little")


class WireEncoder:
    """Encodes ``(type, struct)`` into frames. One per thread.

    With ``reuse_buffer`` the payload frame is a bytearray reused by the next call:
    send it (copying, ``copy=True``) before encoding again. Aux frames are fresh arrays, safe
    to send with ``copy=False``.
    """

    def __init__(self, *, reuse_buffer: bool = True,
                 aux_min_items: int = DEFAULT_AUX_MIN_ITEMS) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._buf = bytearray() if reuse_buffer else None
        self.aux_min_items = aux_min_items

    def _payload(self, obj: Any) -> bytes | bytearray:
        if self._buf is None:
            return self._enc.encode(obj)
        # the bytearray itself, never a memoryview of it: an export would pin its size
        self._enc.encode_into(obj, self._buf)
        return self._buf

    def encode(self, msg_type: bytes, obj: Any) -> list:
        if msg_type == MsgType.ADD and len(obj.prompt_token_ids) >= self.aux_min_items:
            try:
                ids = array("i", obj.prompt_token_ids)
            except (OverflowError, TypeError):
                ids = None  # not int32: send inline, let the engine judge it
            if ids is not None:
                stripped = msgspec.structs.replace(obj, prompt_token_ids=[])
                return [msg_type, self._payload(stripped), ids]
        if msg_type == MsgType.OUTPUTS:
            packed = self._pack_logprobs(obj)
            if packed is not None:
                return packed
        return [msg_type, self._payload(obj)]

    def _pack_logprobs(self, outs: EngineCoreOutputs) -> list | None:
        total = 0
        for o in outs.outputs:
            if o.new_logprobs:
                total += sum(len(lp.token_ids) for lp in o.new_logprobs)
        if total < self.aux_min_items:
            return None
        counts, widths, ranks = [], [], []
        ids, lps = array("i"), array("d")
        stripped = []
        try:
            for o in outs.outputs:
                if o.new_logprobs is None:
                    counts.append(-1)
                    stripped.append(o)
                    continue
                counts.append(len(o.new_logprobs))
                for lp in o.new_logprobs:
                    if len(lp.token_ids) != len(lp.logprobs):
                        return None  # irregular: let msgpack carry it as it is
                    widths.append(len(lp.token_ids))
                    ranks.append(lp.sampled_rank)
                    ids.extend(lp.token_ids)
                    lps.extend(lp.logprobs)
                stripped.append(msgspec.structs.replace(o, new_logprobs=None))
        except (OverflowError, TypeError):
            return None
        body = msgspec.structs.replace(outs, outputs=stripped)
        pack = self._enc.encode(LogprobsPack(counts, widths, ranks))
        return [MsgType.OUTPUTS, self._payload(body), pack, ids, lps]


class WireDecoder:
    """Decodes frames of the types in ``accept``; anything else raises WireFormatError."""

    def __init__(self, accept: frozenset[bytes], *,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.accept = accept
        self.max_message_bytes = max_message_bytes
        self._decoders = {t: msgspec.msgpack.Decoder(SCHEMAS[t]) for t in accept}
        self._pack_decoder = msgspec.msgpack.Decoder(LogprobsPack)

    def decode(self, frames: list) -> tuple[bytes, Any]:
        if len(frames) < 2:
            raise WireFormatError(f"expected [type, payload, ...], got {len(frames)} frame(s)")
        msg_type = bytes(frames[0])
        size = sum(memoryview(f).nbytes for f in frames)
        if size > self.max_message_bytes:
            raise WireFormatError(f"message of {size} bytes exceeds the limit of "
                                  f"{self.max_message_bytes} bytes", msg_type=msg_type,
                                  request_id=_recover_id(frames))
        decoder = self._decoders.get(msg_type)
        if decoder is None:
            raise WireFormatError(f"unknown or unexpected message type {msg_type[:8]!r}")
        try:
            obj = decoder.decode(frames[1])
            if msg_type == MsgType.ADD:
                if len(frames) == 3:
                    if obj.prompt_token_ids:
                        raise WireFormatError("ADD has both inline and aux prompt tokens")
                    obj.prompt_token_ids = _aux_list(frames[2], "<i4")
                elif len(frames) != 2:
                    raise WireFormatError(f"ADD with {len(frames)} frames")
            elif msg_type == MsgType.OUTPUTS and len(frames) != 2:
                obj = self._unpack_logprobs(obj, frames)
            elif len(frames) != 2:
                raise WireFormatError(f"{TYPE_NAMES[msg_type]} with {len(frames)} frames")
        except WireFormatError as exc:
            exc.msg_type = msg_type
            exc.request_id = exc.request_id or _recover_id(frames)
            raise
        except Exception as exc:  # noqa: BLE001 - RecursionError (deep nesting) included
            raise WireFormatError(f"bad {TYPE_NAMES[msg_type]} payload: {_decode_failure(exc)}",
                                  msg_type=msg_type, request_id=_recover_id(frames)) from exc
        return msg_type, obj

    def _unpack_logprobs(self, outs: EngineCoreOutputs, frames: list) -> EngineCoreOutputs:
        if len(frames) != 5:
            raise WireFormatError(f"OUTPUTS with {len(frames)} frames")
        pack = self._pack_decoder.decode(frames[2])
        ids = _aux_list(frames[3], "<i4")
        lps = _aux_list(frames[4], "<f8")
        if (len(pack.counts) != len(outs.outputs) or len(pack.widths) != len(pack.sampled_ranks)
                or sum(pack.widths) != len(ids) or len(ids) != len(lps)
                or sum(c for c in pack.counts if c > 0) != len(pack.widths)):
            raise WireFormatError("OUTPUTS logprobs pack does not match its arrays")
        entry = pos = 0
        for o, count in zip(outs.outputs, pack.counts):
            if count < 0:
                continue
            entries = []
            for _ in range(count):
                w = pack.widths[entry]
                entries.append(Logprobs(ids[pos:pos + w], lps[pos:pos + w], pack.sampled_ranks[entry]))
                entry += 1
                pos += w
            o.new_logprobs = entries
        return outs


def _aux_list(frame, dtype: str) -> list:
    """The numbers of an aux frame as a Python list.

    The frame (a zmq buffer or bytes) is viewed in place by ``np.frombuffer``: no copy, and
    a ValueError when its length is not a multiple of the item size. ``tolist()`` then
    builds the Python ints/floats, which is a copy and is required downstream: a request's
    prompt becomes ``Request.all_token_ids``, a list the scheduler appends to and hashes
    block by block, and ``Logprobs`` fields are lists the frontend turns into JSON.
    Measured here for 5,120 int32 ids + 5,120 float64 logprobs: the views take 0.5 us, the
    copies that ``array.frombytes`` used to make 1 us, ``tolist()`` about 95 us: building
    the Python objects is the whole cost, so keeping arrays would only pay off if the
    consumers took arrays.
    """
    return np.frombuffer(frame, dtype=dtype).tolist()


def _decode_failure(exc: Exception) -> str:
    """What went wrong decoding a payload, for the sender: msgspec raises RecursionError
    for nesting deeper than the interpreter's recursion limit."""
    if isinstance(exc, RecursionError):
        return "nested too deeply"
    return str(exc) or type(exc).__name__


def _recover_id(frames: list) -> str | None:
    """Best effort: the request_id of a message whose payload failed its schema."""
    if len(frames) < 2:
        return None
    try:
        obj = msgspec.msgpack.decode(frames[1])
    except Exception:  # noqa: BLE001 - best effort: a deeply nested payload raises RecursionError
        return _leading_str_field(frames[1], b"request_id")
    if isinstance(obj, dict):
        rid = obj.get("request_id")
        if isinstance(rid, str) and 0 < len(rid) <= 1024:
            return rid
    return None


def _leading_str_field(payload, name: bytes) -> str | None:
    """The string value of ``name`` when it is the first key of the msgpack map ``payload``
    (structs are encoded in field order: request_id leads an ADD), read without decoding the
    rest, which may be nested too deeply to decode at all; None otherwise."""
    buf = bytes(memoryview(payload)[:2048])

    def read_str(pos: int) -> tuple[bytes, int] | None:
        if pos >= len(buf):
            return None
        head = buf[pos]
        if 0xA0 <= head <= 0xBF:
            size, pos = head & 0x1F, pos + 1
        elif head == 0xD9 and pos + 1 < len(buf):
            size, pos = buf[pos + 1], pos + 2
        elif head == 0xDA and pos + 2 < len(buf):
            size, pos = int.from_bytes(buf[pos + 1:pos + 3], "big"), pos + 3
        else:
            return None
        return (buf[pos:pos + size], pos + size) if pos + size <= len(buf) else None

    if not buf:
        return None
    pos = {0xDE: 3, 0xDF: 5}.get(buf[0], 1 if 0x81 <= buf[0] <= 0x8F else 0)
    key = read_str(pos) if pos else None
    if key is None or key[0] != name:
        return None
    value = read_str(key[1])
    if value is None or not value[0]:
        return None
    try:
        return value[0].decode()
    except UnicodeDecodeError:
        return None


def recover_call_id(frames: list) -> int | None:
    """Best effort: the call_id of a UTILITY message that failed its schema."""
    if len(frames) < 2:
        return None
    try:
        obj = msgspec.msgpack.decode(frames[1])
    except Exception:  # noqa: BLE001 - best effort, as _recover_id
        return None
    if isinstance(obj, dict):
        cid = obj.get("call_id")
        if isinstance(cid, int) and not isinstance(cid, bool):
            return cid
    return None


def output_size(out: EngineCoreOutput) -> int:
    """An upper estimate of ``out``'s bytes on the wire (msgpack: at most 9 bytes a number)."""
    size = 128 + len(out.request_id) + 9 * len(out.new_token_ids) + len(out.error or "")
    for lps in (out.new_logprobs, out.prompt_logprobs):
        if lps:
            size += sum(24 + 18 * len(lp.token_ids) for lp in lps)
    if out.pooled:
        size += 9 * len(out.pooled)
    return size


def split_outputs(outputs: list[EngineCoreOutput], budget_bytes: int = OUTPUTS_MESSAGE_BUDGET_BYTES
                  ) -> list[list[EngineCoreOutput]]:
    """``outputs`` in order, cut into runs of at most ``budget_bytes`` (estimated; an output
    bigger than that alone makes a run of its own). Nearly every step is one run."""
    runs: list[list[EngineCoreOutput]] = [[]]
    size = 0
    for out in outputs:
        n = output_size(out)
        if runs[-1] and size + n > budget_bytes:
            runs.append([])
            size = 0
        runs[-1].append(out)
        size += n
    return runs
