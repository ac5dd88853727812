"""EngineClient: a frontend's asyncio view of N engine-core processes over ZMQ.

It binds a ROUTER (requests out, HELLO/READY in) and a PULL (outputs in); engines connect.
One reader task per socket dispatches into per-request queues, so a generate costs one
send and one queue hand-off per message. Every engine is shown in ``client.engines``.

    client = EngineClient(num_engines=2, runtime_dir=tmp)   # ipc paths in tmp
    await client.start()                                      # waits for 2 READY
    async for out in client.generate(request): ...            # EngineCoreOutput until finished
    await client.abort(request_id)                            # also on leaving the loop early
    await client.call_utility(0, "get_stats")
    await client.close()

Faults: ENGINE_CORE_DEAD (from the engine, or from any sender on the PULL socket, or
``mark_engine_dead`` for the supervisor) makes every in-flight generate on that engine
raise ``EngineDeadError``; an engine STATUS that dropped its requests raises
``EngineFaultError`` there. Both mean "replay elsewhere". A restarted engine (new HELLO)
is accepted again. Requests with one ``group_id`` (n > 1 siblings) go to the engine the
group's first open one went to, while it runs, so they share its prefill
(engine/prefix_groups.py).

Routing (engine/kv_router.py, ``routing``): with "kv" (the default) a new request goes to
the running engine that holds the longest prefix of its prompt, weighed against load; with
"least-loaded" to the least-loaded one. What each engine holds is its ``PrefixIndex``
(engine/prefix_index.py), fed by the KV events that come with the engine's outputs and
emptied the moment the engine is reported dead, restarts (a new process has a new, empty
index), drains or stops (scaled away, left its epoch); events of any other process of that
engine are ignored. Prompts are hashed as the engines hash them (engine/block_pool.py,
the block size of the engines' READY, the request's ``cache_salt``). Replays of a dead
engine's requests are routed the same way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path
import time
from typing import Any, AsyncIterator, Callable, Iterable

import msgspec
import zmq
import zmq.asyncio
from zmq.auth.thread import ThreadAuthenticator

from planaria.common.sockets import CurveKeySet, bind_private, ipc_addresses, set_curve_server
from planaria.engine.errors import (EngineDeadError, EngineFaultError, EngineHandshakeError,
                           NoEngineAvailableError, UtilityCallError, WireFormatError)
from planaria.engine.engine_info import EngineInfo, EngineInfoState
from planaria.engine.handover import HANDOVER_PIN_S, KV_TRANSFER_BYTES_PER_S, Handover
from planaria.engine.kv_router import Route, RouteReason, Router, RouteWeights, RoutingPolicy
from planaria.engine.messages import REPLAY_ID_SEP, EngineCoreOutput, EngineCoreRequest, KVCacheEvents
from planaria.engine.prefix_index import PrefixIndex
from planaria.engine.wire import (DEFAULT_MAX_MESSAGE_BYTES, FRONTEND_INPUT_TYPES, KV_SEGMENT_NAME, PROTOCOL_VERSION,
                         AbortRequests, HandshakeInit, HandshakeReject, MsgType, Shutdown,
                         UtilityCall, UtilityErrorCode, WireDecoder, WireEncoder, engine_identity,
                         engine_index_of)

log = logging.getLogger(__name__)


MAX_SUSPECTS = 256  # request ids of one death report kept (a flight record holds fewer)
_REACHABLE = (EngineInfoState.RUNNING, EngineInfoState.PAUSED, EngineInfoState.DRAINING)
_NO_CALLS = (EngineInfoState.DEAD, EngineInfoState.STOPPED, EngineInfoState.REFUSED, EngineInfoState.CONNECTING)
_GONE = (EngineInfoState.STOPPED, EngineInfoState.DEAD)
# an engine in these states keeps no prefix index: it is gone, or takes no new requests
_NO_INDEX = (EngineInfoState.DEAD, EngineInfoState.STOPPED, EngineInfoState.REFUSED, EngineInfoState.DRAINING)
DEFAULT_BLOCK_SIZE = 16  # EngineConfig's: until an engine's READY says otherwise


class _Stream:
    __slots__ = ("engine_index", "queue", "group_id", "num_prompt_tokens", "request", "output_ids")

    def __init__(self, engine_index: int, group_id: str | None = None, num_prompt_tokens: int = 0,
                 request: EngineCoreRequest | None = None) -> None:
        self.engine_index = engine_index
        self.queue: asyncio.Queue = asyncio.Queue()
        self.group_id = group_id
        self.num_prompt_tokens = num_prompt_tokens  # until its first output is counted, then 0
        self.request = request  # as sent (its prompt: a handover's survivor copies its KV)
        self.output_ids: list[int] = []  # tokens the engine sent for it so far


class EngineClient(Handover):
    def __init__(self, num_engines: int, runtime_dir: str | Path | None = None, *,
                 client_index: int = 0, input_address: str | None = None,
                 output_address: str | None = None, engine_config: Any = None,
                 expected_config_hash: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 routing: RoutingPolicy | str = RoutingPolicy.KV,
                 route_weights: RouteWeights = RouteWeights()) -> None:
        """Addresses: ipc under ``runtime_dir``, else the given ones, else tcp loopback on
        free ports. ``engine_config`` (EngineConfig or dict) is handed to engines started
        without one. ``expected_config_hash`` None: every engine must match the first.
        ``routing``: "kv" or "least-loaded" (engine/kv_router.py)."""
        if runtime_dir is not None:
            input_address, output_address = ipc_addresses(runtime_dir, client_index)
        self.num_engines = num_engines
        self.client_index = client_index
        self.input_address = input_address or "tcp://127.0.0.1:*"
        self.output_address = output_address or "tcp://127.0.0.1:*"
        self.engine_config = engine_config
        self.expected_config_hash = expected_config_hash
        self.router = Router(RoutingPolicy(routing), route_weights)
        # on_iteration_details(engine_index, [IterationDetails]): the engines' step records
        self.on_iteration_details: Callable[[int, list], None] | None = None
        self._engines: dict[int, EngineInfo] = {}
        # pid -> what ended that engine process ("external" | "fault"), from the
        # supervisor's notice after it reaped it (bounded: the newest 4096 pids)
        self.death_causes: dict[int, str] = {}
        # engine pid -> the requests in their first step when it died (EngineDead.suspects)
        self.death_suspects: dict[int, list[str]] = {}
        self._streams: dict[str, _Stream] = {}
        self._groups: dict[str, list[int]] = {}  # group_id -> [engine index, open streams]
        self._calls: dict[int, tuple[int, asyncio.Future]] = {}
        self._call_ids = itertools.count(1)
        self._waiters: list[asyncio.Future] = []
        self._enc = WireEncoder(reuse_buffer=False)
        self._dec = WireDecoder(FRONTEND_INPUT_TYPES, max_message_bytes=max_message_bytes)
        self._ctx: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []
        self._handover_tasks: set[asyncio.Task] = set()  # _hand_over, one per draining engine
        # original request id -> (engine that copied its KV for a handover, when)
        self._handover_pins: dict[str, tuple[int, float]] = {}
        self._transfer_lock = asyncio.Lock()  # one relayed KV pre-copy at a time (_transfer_kv)
        self.kv_transfer_bytes_per_s = KV_TRANSFER_BYTES_PER_S
        self.kv_transfer_bytes = 0  # K/V relayed so far (_transfer_kv), and the time it took
        self.kv_transfer_s = 0.0
        self._closed = False
        self.num_bad_messages = 0  # messages the readers could not use (see _router_loop)
        # fn(engine_index, reason), on the loop, when an engine's in-flight work is lost
        # (death, restart, dropped requests) just before its generates raise
        self.loss_listeners: list[Callable[[int, str], None]] = []

    # -- lifecycle --------------------------------------------------------------------------
    @property
    def engines(self) -> list[EngineInfo]:
        return [self._engines[i] for i in sorted(self._engines)]

    # CurveZMQ, for a client that engines reach over TCP (use_curve); off by default
    _curve_secret_key: bytes | None = None
    _curve_authorized: CurveKeySet | None = None
    _auth = None  # the ZAP authenticator thread, with authorized keys

    def use_curve(self, secret_key: bytes, authorized_keys: Iterable[bytes | str] | None = None) -> None:
        """Before bind(): both sockets are CurveZMQ servers with ``secret_key`` (z85), so an
        engine connects only knowing this client's public key (`planaria serve
        --extra-client-addresses tcp://... --extra-client-server-key NAME.key`).
        ``authorized_keys``: z85 public keys of the engines let in (ZAP), e.g. the daemon's
        STATE_DIR/extra-client-keys/engine.key; None admits any engine that has this
        server's public key."""
        if self._ctx is not None:
            raise RuntimeError("use_curve() must come before bind()")
        self._curve_secret_key = secret_key
        self._curve_authorized = None if authorized_keys is None else CurveKeySet(authorized_keys)

    def bind(self) -> tuple[str, str]:
        """Bind both sockets (idempotent); returns the (ROUTER, PULL) addresses to give engines.
        ipc socket files are made 0600 (``bind_private``): another local user who could
        connect would be taken for an engine and sent prompts."""
        if self._ctx is not None:
            return self.input_address, self.output_address
        self._ctx = zmq.asyncio.Context()
        if self._curve_authorized is not None:
            # ZAP is answered on the context's inproc socket, from a thread: a plain
            # (not asyncio) view of the same context.
            self._auth = ThreadAuthenticator(zmq.Context.shadow(self._ctx.underlying))
            self._auth.start()
            self._auth.configure_curve_callback("*", self._curve_authorized)
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unknown engine: an error, not a drop
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted engine takes its identity
        self._router.setsockopt(zmq.LINGER, 0)
        if self._curve_secret_key is not None:
            set_curve_server(self._router, self._curve_secret_key)
        bind_private(self._router, self.input_address)  # an ipc file is 0600: no one else poses as an engine
        self.input_address = self._router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if self._curve_secret_key is not None:
            set_curve_server(self._pull, self._curve_secret_key)
        bind_private(self._pull, self.output_address)
        self.output_address = self._pull.getsockopt(zmq.LAST_ENDPOINT).decode()
        return self.input_address, self.output_address

    async def start(self, wait_ready: bool = True, timeout_s: float = 300.0) -> None:
        self.bind()
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._router_loop(), name="engine-client-router"),
                           asyncio.create_task(self._pull_loop(), name="engine-client-pull")]
        if wait_ready:
            await self.wait_for_engines(self.num_engines, timeout_s)

    async def wait_for_engines(self, num_engines: int, timeout_s: float) -> None:
        """Until ``num_engines`` engines are running. Raises EngineHandshakeError on a
        refused engine or at the timeout (with every engine's state)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while True:
            refused = [e for e in self._engines.values() if e.state == EngineInfoState.REFUSED]
            if refused:
                raise EngineHandshakeError("; ".join(f"engine {e.index}: {e.reason}" for e in refused))
            if sum(e.healthy for e in self._engines.values()) >= num_engines:
                return
            left = deadline - loop.time()
            if left <= 0:
                states = ", ".join(f"{e.index}={e.state}{f' ({e.reason})' if e.reason else ''}"
                                   for e in self.engines) or "none connected"
                raise EngineHandshakeError(f"{num_engines} engine(s) not ready within {timeout_s} s: {states}")
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, left)
            except asyncio.TimeoutError:
                pass

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        for index in list(self._engines):
            self._fail_engine(index, EngineFaultError, "the engine client closed")
        if self._ctx is not None:
            self._router.close(linger=0)
            self._pull.close(linger=0)
            if self._auth is not None:
                self._auth.stop()
            self._ctx.term()

    # -- requests ---------------------------------------------------------------------------
    async def generate(self, request: EngineCoreRequest) -> AsyncIterator[EngineCoreOutput]:
        """Yield the request's outputs until the finished one. Leaving early aborts it."""
        rid = request.request_id
        stream = self._submit(request)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the engine no longer has it
                    raise item
                finished = item.finish_reason is not None
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(rid) is stream:
                del self._streams[rid]
                self._leave_group(stream)
                info = self._engines.get(stream.engine_index)
                if info is not None:
                    info.num_in_flight -= 1
            if not finished:
                self._send(stream.engine_index, MsgType.ABORT, AbortRequests(request_ids=[rid]))

    def engine_of(self, request_id: str) -> int | None:
        """The engine an in-flight request was sent to (None once it ended)."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.engine_index

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._send(stream.engine_index, MsgType.ABORT, AbortRequests(request_ids=[request_id]))
            stream.queue.put_nowait(EngineCoreOutput(request_id=request_id, finish_reason="abort"))

    def _submit(self, request: EngineCoreRequest) -> _Stream:
        if self._closed or self._ctx is None:
            raise RuntimeError("the engine client is not started, or closed")
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in flight on this client")
        if request.client_index != self.client_index:
            request = msgspec.structs.replace(request, client_index=self.client_index)
        tried: set[int] = set()
        group = request.group_id
        # a request a draining engine handed over goes where its KV was copied (prefetch_kv)
        pin = self._handover_pins.pop(rid.split(REPLAY_ID_SEP, 1)[0], None) if request.kv_salvage else None
        pin = pin[0] if pin is not None and pin[1] > time.monotonic() - HANDOVER_PIN_S else None
        while True:
            index = self._group_engine(group, tried)
            if index is not None:
                route = Route(index, RouteReason.GROUP)
            elif pin is not None and pin not in tried and self._engines.get(pin) is not None \
                    and self._engines[pin].healthy:
                route = Route(pin, RouteReason.PREFIX)
                index = pin
            else:
                route = self._route(request, tried, route.hashes if tried else None)
                index = route.index
            tried.add(index)
            if self._send(index, MsgType.ADD, self._with_peer(request, route)):
                stream = self._streams[rid] = _Stream(index, group, len(request.prompt_token_ids), request)
                info = self._engines[index]
                info.num_in_flight += 1
                self._count_route(info, route)
                if group is not None:
                    entry = self._groups.get(group)
                    if entry is None or entry[0] != index:  # the first, or its engine failed
                        entry = self._groups[group] = [index, 0]
                    entry[1] += 1
                return stream

    def _with_peer(self, request: EngineCoreRequest, route: Route) -> EngineCoreRequest:
        """A request routed away from the engine holding more of its prompt (BALANCE) names
        that engine's KV segment: on the same node the receiving engine copies those blocks
        instead of computing them (core._copy_from_peer). Not a replay's (it names its own)."""
        peer = self._engines.get(route.peer) if route.peer is not None else None
        if peer is None or not peer.healthy or not peer.kv_segment or request.kv_salvage:
            return request
        return msgspec.structs.replace(request, kv_peer=peer.kv_segment)

    def _group_engine(self, group: str | None, exclude: set[int]) -> int | None:
        entry = self._groups.get(group) if group is not None else None
        if entry is None or entry[0] in exclude:
            return None
        info = self._engines.get(entry[0])
        return entry[0] if info is not None and info.healthy else None

    def _leave_group(self, stream: _Stream) -> None:
        entry = self._groups.get(stream.group_id) if stream.group_id is not None else None
        if entry is not None and entry[0] == stream.engine_index:
            entry[1] -= 1
            if entry[1] <= 0:
                del self._groups[stream.group_id]

    def _running(self, exclude: set[int]) -> list[EngineInfo]:
        return [e for e in self._engines.values() if e.healthy and e.index not in exclude]

    def _block_size(self) -> int:
        sizes = [e.block_size for e in self._engines.values() if e.healthy and e.block_size > 0]
        if sizes:
            return sizes[0]  # every engine's (the config hash covers it)
        configured = self.engine_config.get("block_size") if isinstance(self.engine_config, dict) else \
            getattr(self.engine_config, "block_size", None)
        return configured if isinstance(configured, int) and configured > 0 else DEFAULT_BLOCK_SIZE

    def _route(self, request: EngineCoreRequest, exclude: set[int], hashes: list[int] | None) -> Route:
        """Where ``request`` goes (engine/kv_router.py); ``hashes``: its prompt's block
        hashes when already computed (they are, once, when a choice is to be made)."""
        running = self._running(exclude)
        if not running:
            states = ", ".join(f"{e.index}={e.state}" for e in self.engines) or "none connected"
            raise NoEngineAvailableError(f"no running engine can take the request ({states})")
        return self.router.route(running, request, hashes, self._block_size())

    def _count_route(self, info: EngineInfo, route: Route) -> None:
        self.router.count(route)
        info.num_routed += 1
        if info.died_at_s > info.ready_at_s or not info.healthy:
            info.num_routed_while_down += 1  # a check for the bench: cannot happen (_running)

    def routing_status(self) -> dict[str, Any]:
        """Per engine: blocks in its prefix index, requests routed, their hit rate; the
        decisions by reason (``planaria status``, /metrics)."""
        return self.router.status(self.engines)

    def _drop_index(self, info: EngineInfo) -> None:
        """The engine's cache is gone or takes no more requests: forget it at once."""
        info.prefix.clear()

    def _send(self, index: int, msg_type: bytes, msg: Any) -> bool:
        """Send to one engine now. False (and the engine marked unreachable) when it is
        not connected; a send that has to wait (HWM) completes later."""
        frames = [engine_identity(index), *self._enc.encode(msg_type, msg)]
        fut = self._router.send_multipart(frames, copy=False)
        if fut.done():
            exc = fut.exception()
            if exc is None:
                return True
            if isinstance(exc, zmq.ZMQError) and exc.errno == zmq.EHOSTUNREACH:
                info = self._engines.get(index)
                if info is not None and info.state in _REACHABLE:
                    self._set_state(info, EngineInfoState.UNREACHABLE, "not connected to this frontend")
                return False
            raise exc
        fut.add_done_callback(_log_send_failure)
        return True

    # -- utilities, control -----------------------------------------------------------------
    async def call_utility(self, engine_index: int, method: str, args: dict | None = None,
                           timeout_s: float | None = 30.0) -> Any:
        info = self._engines.get(engine_index)
        if info is None or info.state in _NO_CALLS:
            raise EngineDeadError(engine_index, None, f"engine is {info.state if info else 'unknown'}")
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (engine_index, fut)
        try:
            if not self._send(engine_index, MsgType.UTILITY,
                              UtilityCall(call_id=call_id, method=method, args=args or {})):
                raise EngineDeadError(engine_index, None, "engine is not connected")
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._calls.pop(call_id, None)

    def shutdown_engine(self, engine_index: int, drain_timeout_s: float | None = None) -> bool:
        """Ask one engine to drain and exit (0: abort its work now)."""
        return self._send(engine_index, MsgType.SHUTDOWN, Shutdown(drain_timeout_s=drain_timeout_s))

    def mark_engine_dead(self, engine_index: int, reason: str, pid: int | None = None,
                         fault_monotonic_s: float | None = None, cause: str = "",
                         suspects: list[str] | None = None) -> None:
        """The supervisor's report (call on the client's event loop): fail the engine's work.

        With ``pid``, a report about an older incarnation than the one connected is ignored.
        ``fault_monotonic_s``: when the engine hit the fault (its own ENGINE_CORE_DEAD).
        """
        info = self._engines.get(engine_index)
        if suspects and pid is not None:
            self.death_suspects[pid] = list(suspects)[:MAX_SUSPECTS]
            while len(self.death_suspects) > 4096:
                self.death_suspects.pop(next(iter(self.death_suspects)))
        if cause and pid is not None:
            self.death_causes[pid] = cause
            while len(self.death_causes) > 4096:
                self.death_causes.pop(next(iter(self.death_causes)))
            if info is not None and (info.pid != pid or info.state == EngineInfoState.DEAD):
                return  # the cause of a death already handled (or of an older incarnation)
        if info is None:
            info = self._engines[engine_index] = EngineInfo(index=engine_index, state=EngineInfoState.DEAD)
        if pid is not None and info.pid is not None and pid != info.pid:
            log.info("ignoring a death report for engine %d pid %d (now pid %d)", engine_index, pid, info.pid)
            return
        # the earliest known time of this death (the engine's own report, the supervisor's,
        # else now), never a previous death's
        died_s = time.monotonic() if fault_monotonic_s is None else fault_monotonic_s
        if info.state != EngineInfoState.DEAD:
            info.died_at_s = time.time()
            info.fault_monotonic_s = died_s
        elif fault_monotonic_s is not None and (not info.fault_monotonic_s
                                                or fault_monotonic_s < info.fault_monotonic_s):
            info.fault_monotonic_s = fault_monotonic_s
        self._set_state(info, EngineInfoState.DEAD, reason)
        self._drop_index(info)
        self._fail_engine(engine_index, EngineDeadError, reason)

    def _fail_engine(self, index: int, error_type: type, reason: str) -> None:
        if not self._closed:
            for listener in self.loss_listeners:
                try:
                    listener(index, reason)
                except Exception:
                    log.exception("engine loss listener failed")
        for rid, stream in self._streams.items():
            if stream.engine_index == index:
                stream.queue.put_nowait(error_type(index, rid, reason))
        for call_index, fut in self._calls.values():
            if call_index == index and not fut.done():
                fut.set_exception(error_type(index, None, reason))

    def _set_state(self, info: EngineInfo, state: EngineInfoState, reason: str = "") -> None:
        if info.state != state:
            log.info("engine %d: %s -> %s %s", info.index, info.state, state, reason)
        info.state, info.reason = state, reason
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    # -- reader tasks -----------------------------------------------------------------------
    # Both readers take one message at a time and survive it whatever it holds: a bad one
    # (WireFormatError, deep nesting included) or one whose handling raises is counted in
    # num_bad_messages, logged (the first 20, then every 1000th), and skipped. A reader
    # that ended would leave every request hanging while the frontend looks healthy.
    async def _router_loop(self) -> None:
        while True:
            frames = await self._router.recv_multipart(copy=False)
            try:
                self._on_router_message(frames[0].bytes, [f.buffer for f in frames[1:]])
            except Exception as exc:  # noqa: BLE001 - one message never ends the reader
                self._bad_message("ROUTER", exc)

    def _on_router_message(self, identity: bytes, frames: list) -> None:
        msg_type, msg = self._dec.decode(frames)
        if msg_type == MsgType.HELLO:
            self._on_hello(identity, msg)
        elif msg_type == MsgType.READY:
            self._on_ready(identity, msg)
        else:
            log.warning("unexpected %r on the ROUTER socket", msg_type)

    def _bad_message(self, socket_name: str, exc: Exception) -> None:
        self.num_bad_messages += 1
        n = self.num_bad_messages
        if n <= 20 or n % 1000 == 0:
            log.warning("bad message #%d on the %s socket, skipped: %s", n, socket_name, exc,
                        exc_info=not isinstance(exc, WireFormatError))  # a traceback for a bug only

    def _on_hello(self, identity: bytes, hello) -> None:
        index = engine_index_of(identity)
        if index != hello.engine_index:
            log.warning("HELLO from identity %d says engine %d", index, hello.engine_index)
        info = self._engines.setdefault(index, EngineInfo(index=index))
        if hello.protocol_version != PROTOCOL_VERSION:
            reason = (f"engine {index} (pid {hello.pid}) speaks protocol {hello.protocol_version}, "
                      f"this frontend speaks {PROTOCOL_VERSION}")
            log.error("refusing engine: %s", reason)
            info.pid = hello.pid
            self._set_state(info, EngineInfoState.REFUSED, reason)
            self._reply(identity, MsgType.HANDSHAKE_REJECT, HandshakeReject(reason=reason))
            return
        if info.pid != hello.pid:  # a new incarnation: what the old one had is lost
            if info.pid is not None:
                if info.state != EngineInfoState.DEAD:  # it died unreported
                    info.died_at_s = time.time()
                self._fail_engine(index, EngineDeadError, f"engine restarted (pid {info.pid} -> {hello.pid})")
            info.pid = hello.pid
            info.stats = None
            info.prefix = PrefixIndex()  # a new process: an empty cache
            self._set_state(info, EngineInfoState.CONNECTING)
        settings: dict[str, Any] = {"client_index": self.client_index}
        if self.engine_config is not None:
            settings["engine_config"] = msgspec.to_builtins(self.engine_config)
        self._reply(identity, MsgType.HANDSHAKE_INIT, HandshakeInit(
            addresses={"output": self.output_address}, settings=settings))

    def _on_ready(self, identity: bytes, ready) -> None:
        index = engine_index_of(identity)
        info = self._engines.setdefault(index, EngineInfo(index=index, pid=ready.pid))
        expected = self.expected_config_hash or next(
            (e.config_hash for e in self._engines.values() if e.config_hash and e.index != index), None)
        if ready.protocol_version != PROTOCOL_VERSION or (expected and ready.config_hash != expected):
            reason = (f"engine {index} config hash {ready.config_hash} / protocol {ready.protocol_version} "
                      f"does not match this frontend's {expected} / {PROTOCOL_VERSION}")
            log.error("refusing engine: %s", reason)
            self._set_state(info, EngineInfoState.REFUSED, reason)
            # the engine logs the reason and exits with EXIT_CONFIG_MISMATCH
            self._reply(identity, MsgType.HANDSHAKE_REJECT, HandshakeReject(reason=reason))
            return
        info.pid = ready.pid or info.pid
        info.num_kv_blocks, info.max_model_len = ready.num_kv_blocks, ready.max_model_len
        info.config_hash, info.kv_cache_bytes = ready.config_hash, ready.kv_cache_bytes
        info.kv_source = ready.kv_source
        info.kv_segment = ready.kv_segment if isinstance(ready.kv_segment, str) and \
            KV_SEGMENT_NAME.match(ready.kv_segment) else ""
        info.block_size = ready.block_size if isinstance(ready.block_size, int) and 0 < ready.block_size <= 2**16 else 0
        info.prefix.limit(ready.num_kv_blocks)
        info.num_handshakes += 1
        info.ready_at_s = time.time()
        self._set_state(info, EngineInfoState.RUNNING)

    def _reply(self, identity: bytes, msg_type: bytes, msg: Any) -> None:
        fut = self._router.send_multipart([identity, *self._enc.encode(msg_type, msg)])
        fut.add_done_callback(_log_send_failure)

    async def _pull_loop(self) -> None:
        while True:
            frames = await self._pull.recv_multipart(copy=False)
            try:
                self._on_pull_message([f.buffer for f in frames])
            except Exception as exc:  # noqa: BLE001 - one message never ends the reader
                self._bad_message("PULL", exc)

    def _on_pull_message(self, frames: list) -> None:
        msg_type, msg = self._dec.decode(frames)
        if msg_type == MsgType.OUTPUTS:
            self._on_outputs(msg)
        elif msg_type == MsgType.UTILITY_RESULT:
            entry = self._calls.get(msg.call_id)
            if entry is not None and not entry[1].done():
                if msg.ok:
                    entry[1].set_result(msg.result)
                else:
                    entry[1].set_exception(UtilityCallError(msg.error or "utility call failed",
                                                            UtilityErrorCode.of(msg.code)))
        elif msg_type == MsgType.ENGINE_CORE_DEAD:
            self.mark_engine_dead(msg.engine_index, msg.reason, msg.pid, msg.fault_monotonic_s, msg.cause,
                                  msg.suspects)
        elif msg_type == MsgType.STATUS:
            self._on_status(msg)
        elif msg_type == MsgType.ERROR:
            log.warning("engine %d could not use a message: %s", msg.engine_index, msg.message)
        else:
            log.warning("unexpected %r on the PULL socket", msg_type)

    def _on_outputs(self, outs) -> None:
        info = self._engines.get(outs.engine_index)
        if info is not None and outs.scheduler_stats is not None:
            info.stats = outs.scheduler_stats
        if outs.iteration_details and self.on_iteration_details is not None:
            self.on_iteration_details(outs.engine_index, outs.iteration_details)
        if outs.kv_events is not None and info is not None:
            self._on_kv_events(info, outs.kv_events)
        streams = self._streams
        for out in outs.outputs:
            stream = streams.get(out.request_id)
            if stream is not None:
                if stream.num_prompt_tokens and info is not None and stream.engine_index == info.index \
                        and out.finish_reason != "error":
                    info.num_routed_prompt_tokens += stream.num_prompt_tokens
                    info.num_routed_cached_tokens += min(max(0, out.num_cached_tokens), stream.num_prompt_tokens)
                    stream.num_prompt_tokens = 0  # counted once, at its first output
                if out.new_token_ids:
                    stream.output_ids += out.new_token_ids
                stream.queue.put_nowait(out)

    def _on_kv_events(self, info: EngineInfo, events: KVCacheEvents) -> None:
        """Into the engine's prefix index, when they are its current process's and it keeps one."""
        if info.state in _NO_INDEX or (events.pid and info.pid is not None and events.pid != info.pid):
            return
        info.prefix.apply(events)

    def _on_status(self, status) -> None:
        info = self._engines.get(status.engine_index)
        if info is None or (status.pid and info.pid and status.pid != info.pid):
            return  # an older incarnation
        if info.state == EngineInfoState.REFUSED:
            return
        try:
            state = EngineInfoState(status.state)
        except ValueError:
            log.warning("engine %d: STATUS with an unknown state %r", status.engine_index, status.state)
            return
        self._set_state(info, state, status.reason)
        if state in _NO_INDEX or status.requests_dropped:
            self._drop_index(info)
        if status.handover_pending and state in (EngineInfoState.DRAINING, EngineInfoState.RUNNING) \
                and not self._closed:
            task = asyncio.ensure_future(self._hand_over(info.index, info.pid))
            self._handover_tasks.add(task)
            task.add_done_callback(self._handover_tasks.discard)
        if status.requests_dropped or state in _GONE:
            error_type = EngineDeadError if state in _GONE else EngineFaultError
            info.handing_over = bool(status.handed_over and status.requests_dropped)
            try:
                self._fail_engine(status.engine_index, error_type, status.reason or status.state)
            finally:
                info.handing_over = False


def _log_send_failure(fut: asyncio.Future) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.warning("engine client send failed: %s", fut.exception())
