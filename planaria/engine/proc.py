"""EngineCoreProc: an EngineCore in its own process, behind ZMQ sockets.

    input thread (DEALER per frontend) -> input queue -> busy loop (EngineCore.step)
                                                          -> output queue -> output thread (PUSH)

The busy loop is the only thread that changes the core. It blocks on the input queue when
idle, drains it when busy, steps, and pushes outputs (plus SchedulerStats when they
change). The one exception: the input thread also puts ABORTs on the core's aborts queue
(``EngineCore.queue_aborts``), which the step applies between the forward and its output
update, so an abort that arrives mid-forward gets no token from that step.

One request never kills the engine: a message that does not decode is answered by the input
thread (engine/proc_io.py), whatever admitting a request raises becomes its error output
(``EngineCore.add_request``, ``error_code`` invalid_request or internal), and a request that
finds ``EngineConfig.max_num_waiting`` requests waiting is answered "overloaded" at once.

Faults: a ``RequestExecutionError`` fails those requests and the loop goes on; any
other exception makes the engine UNHEALTHY and, unless a "reset"/"resume" utility call
comes within ``recovery_timeout_s``, it dies: ENGINE_CORE_DEAD to every frontend, sockets
lingered, exit code 1 (EXIT_DEAD). A frontend that finds a config hash unlike its own in
READY answers HANDSHAKE_REJECT with the reason; the engine logs it and exits with
EXIT_CONFIG_MISMATCH (4), a configuration error rather than a crash (see the EXIT_*
constants for every exit code). A coordinator SUB socket (DP wave / stats fan-in) is not wired yet;
it would be one more socket in the input thread, feeding the same queue.

States, deadlines and exits are decided by ``engine.lifecycle.EngineLifecycle``; this process
reports inputs to it and carries out the actions it returns (``_carry_out``). The core is
reached only through ``engine.core_protocol.EngineCoreProtocol``. Utility calls (``_u_*``)
are engine/proc_utilities.py's, a mixin of EngineCoreProc.

Launch: ``python -m planaria.engine.proc --engine-index 0 --input-addr ipc://... --config-json '{...}'``
or ``multiprocessing`` (spawn) with ``target=run_engine_core``.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Callable, NoReturn

import msgspec
import psutil
import zmq

from planaria.engine import envs
from planaria.engine.config import EngineConfig
from planaria.engine.core_protocol import EngineCoreProtocol
from planaria.engine.errors import ConfigMismatchError, EngineHandshakeError, RequestExecutionError
from planaria.engine.flight_record import FlightRecorder
from planaria.engine.heartbeat import Heartbeat, HeartbeatThread
from planaria.engine.lifecycle import (EXIT_CONFIG_MISMATCH, EXIT_DEAD, EXIT_HANDSHAKE, EXIT_OK,
                                       EXIT_USAGE, AbandonStart, Action, Die, EngineExit, EngineLifecycle,
                                       EngineState, Refused, ResetPrefixCache, RollBack, SetState, Signalled,
                                       Step, Stop, Wait, Wake)
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, OutputErrorCode
from planaria.engine.proc_entry import json_arg, setup_logging
from planaria.engine.proc_io import FrontendLink, InputThread, OutputThread, handshake, send_all
from planaria.engine.proc_utilities import UtilityCalls
from planaria.engine.wire import (DEFAULT_MAX_MESSAGE_BYTES, PROTOCOL_VERSION, EngineDead, EngineStatus,
                         MsgType, Ready, UtilityCall, UtilityErrorCode, UtilityResult, split_outputs)

# The supervisor's "drain, handing the requests over" (other engines serve): SIGTERM's drain,
# but the in-flight requests move at once, their KV adopted from this engine's segment.
HANDOVER_SIGNAL = signal.SIGUSR2
HANDOVER_WAIT_S = 5.0  # a frontend that did not ask for its requests by then gets them anyway
log = logging.getLogger(__name__)

# The exit codes (EXIT_*) and states (EngineState) are engine.lifecycle's.


class ProcSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    handshake_timeout_s: float = 120.0
    drain_timeout_s: float = 30.0  # SIGTERM: finish in-flight work within this, then abort
    recovery_timeout_s: float = 0.0  # after an engine fault: wait this for "reset"/"resume"
    keep_requests_on_fault: bool = False  # keep in-flight requests across UNHEALTHY
    linger_ms: int = 2000  # how long a last message (ENGINE_CORE_DEAD) may take to leave
    send_timeout_ms: int = 5000  # a frontend not reading this long loses messages
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    stats_interval_s: float = 1.0  # re-send changed stats without outputs at most this often
    log_level: str = "INFO"
    heartbeat_address: str | None = None  # the supervisor's PULL (engine/heartbeat.py)
    heartbeat_interval_s: float = 0.5
    flight_record_path: str | None = None  # engine/flight_record.py: the supervisor reads it when we die


class EngineCoreProc(UtilityCalls):
    def __init__(self, engine_index: int, input_addresses: list[str], config: EngineConfig | None,
                 settings: ProcSettings | None = None, output_addresses: list[str] | None = None,
                 core_factory: Callable[[EngineConfig], EngineCoreProtocol] | None = None) -> None:
        if output_addresses and len(output_addresses) != len(input_addresses):
            raise ValueError("give one output address per input address, or none")
        self.engine_index = engine_index
        self.input_addresses = list(input_addresses)
        self.output_addresses = list(output_addresses) if output_addresses else None
        self.config = config
        self.settings = settings or ProcSettings()
        self._core_factory = core_factory
        self.core: EngineCoreProtocol | None = None
        self._dtype_text = ""  # set once the core is built: the heartbeat and ready line show it
        s = self.settings  # the states, deadlines and exits; this object carries out its actions
        self.lifecycle = EngineLifecycle(s.drain_timeout_s, s.recovery_timeout_s, s.keep_requests_on_fault)
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is signal-safe
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._req_slot: dict[str, int] = {}  # in-flight request id -> frontend slot
        self._last_stats = None
        self._last_stats_sent = 0.0
        self._kv_events_seq = 0  # KVCacheEvents batches sent (each to every frontend)
        self._fault_injection = envs.get().fault_injection  # read once, at process start
        self._links: list[FrontendLink] = []
        self._handover = False  # HANDOVER_SIGNAL came: a drain hands the requests over
        self._handover_deadline: float | None = None  # by when the requests not asked for go anyway
        self._num_handed_over = 0

    @property
    def state(self) -> EngineState:
        return self.lifecycle.state

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Handshake, load, serve until stopped or dead. Returns the process exit code."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
            signal.signal(HANDOVER_SIGNAL, self._on_handover_signal)
        ctx = zmq.Context()
        input_thread = output_thread = heartbeat_thread = None
        sockets_closed = True
        try:
            try:
                self._links = handshake(ctx, self.engine_index, self.input_addresses,
                                        self.output_addresses, self.settings.handshake_timeout_s,
                                        should_stop=lambda: self.lifecycle.num_signals > 0)
            except EngineHandshakeError as exc:
                if self.lifecycle.num_signals:
                    return EXIT_OK
                log.error("engine %d: handshake failed: %s", self.engine_index, exc)
                return EXIT_CONFIG_MISMATCH if isinstance(exc, ConfigMismatchError) else EXIT_HANDSHAKE
            output_thread = OutputThread(self.engine_index, ctx, self._links, self.output_queue,
                                         self.settings.linger_ms, self.settings.send_timeout_ms)
            output_thread.start()
            try:
                self._load()
                if envs.get().gc_freeze:  # start-up objects leave the collector's generations
                    gc.collect()
                    gc.freeze()
            except Exception as exc:  # any load failure: tell the frontends why, then die
                log.exception("engine %d: failed to start", self.engine_index)
                self._send_dead(f"failed to start: {type(exc).__name__}: {exc}")
                return EXIT_DEAD
            send_all(self._links, MsgType.READY, self._ready())
            self._carry_out(self.lifecycle.on_ready())
            timings = {"since_exec_s": _since_exec_s(), **self.core.init_timings}  # where the start-up went
            log.info("engine %d ready: %s, %d KV blocks, max_model_len %d; start-up %s", self.engine_index,
                     self._dtype_text, self.core.num_kv_blocks, self.core.max_model_len,
                     " ".join(f"{k}={v:.3f}" for k, v in timings.items()))
            input_thread = InputThread(self.engine_index, self._links, self.input_queue,
                                       self.output_queue, self.settings.max_message_bytes,
                                       on_abort=self._abort_eagerly)
            input_thread.start()
            if self.settings.heartbeat_address:
                heartbeat_thread = HeartbeatThread(ctx, self.settings.heartbeat_address,
                                                   self.settings.heartbeat_interval_s, self._heartbeat)
                heartbeat_thread.start()
            return self._busy_loop()
        finally:
            if heartbeat_thread is not None:
                heartbeat_thread.stop()
                heartbeat_thread.join(1.0)
            if input_thread is not None:
                input_thread.stop()
                input_thread.join(1.0)
            elif self._links:
                for link in self._links:
                    link.dealer.close(linger=0)
            if output_thread is not None:
                budget_s = (self.settings.send_timeout_ms + self.settings.linger_ms) / 1000 + 1.0
                sockets_closed = output_thread.stop(budget_s)
            if self.core is not None:
                try:
                    self.core.shutdown()
                except Exception:
                    log.exception("core shutdown failed")
            if sockets_closed:
                ctx.term()  # else a wedged send would block term forever: let exit reap it

    def _load(self) -> None:
        if self.config is None:
            raw = self._links[0].settings.get("engine_config")
            if raw is None:
                raise EngineHandshakeError("no engine config on the command line or in the handshake")
            self.config = msgspec.convert(raw, EngineConfig)
        if self._core_factory is None:
            # deferred: engine.core imports torch; the engine handshakes before it loads it
            from planaria.engine.core import create_engine_core  # EngineCore, or the pooling core

            self._core_factory = create_engine_core
        self.core = self._core_factory(self.config)
        self._dtype_text = self.core.dtype_text
        self._record_flights()

    def _record_flights(self) -> None:
        """Write the flight record where the supervisor looks for it (none when not told)."""
        if self.settings.flight_record_path:
            self.core.record_flights_to(FlightRecorder(self.settings.flight_record_path))

    def _ready(self) -> Ready:
        core = self.core
        return Ready(engine_index=self.engine_index, num_kv_blocks=core.num_kv_blocks,
                     max_model_len=core.max_model_len, protocol_version=PROTOCOL_VERSION,
                     config_hash=core.config_hash(), kv_cache_bytes=core.kv_cache_bytes,
                     kv_source=core.kv_source, pid=os.getpid(), vocab_size=core.vocab_size,
                     block_size=core.config.block_size, kv_segment=self._kv_segment_name())

    def _kv_segment_name(self) -> str:
        seg = getattr(getattr(self.core, "runner", None), "kv_segment", None)
        return seg.name if seg is not None else ""

    def _heartbeat(self):
        """For the supervisor (heartbeat thread): read without locks, never blocks."""
        core = self.core
        stats = core.get_stats()
        return Heartbeat(engine_index=self.engine_index, pid=os.getpid(),
                         step_counter=core.step_counter, state=self.state.value,
                         has_work=core.has_unfinished_requests() or not self.input_queue.empty(),
                         num_running=stats.num_running, num_waiting=stats.num_waiting,
                         kv_usage=stats.kv_usage, kv_cache_bytes=core.kv_cache_bytes,
                         num_kv_blocks=core.num_kv_blocks, kv_source=core.kv_source,
                         dtype=self._dtype_text, timestamp=time.time(),
                         num_salvaged_requests=stats.num_salvaged_requests,
                         num_salvaged_blocks=stats.num_salvaged_blocks, num_handed_over=self._num_handed_over)

    def _abort_eagerly(self, slot: int, request_ids: list[str]) -> None:
        """Input thread: hand this frontend's in-flight requests among ``request_ids`` to
        the core's aborts queue, applied between the running forward and its output
        update (EngineCore.queue_aborts). Reads only (dict gets, atomic under the GIL);
        the ABORT also stays on the input queue, so ids not added yet and an idle loop
        are handled there, in order."""
        ids = [rid for rid in request_ids if self._req_slot.get(rid) == slot]
        if ids:
            self.core.queue_aborts(ids)

    def _on_signal(self, signum, frame) -> None:
        # Runs on the main thread between bytecodes; SimpleQueue.put is reentrant-safe.
        self._carry_out(self.lifecycle.on_signal())

    def _on_handover_signal(self, signum, frame) -> None:
        """HANDOVER_SIGNAL: drain as SIGTERM does, but hand the requests over at once (other
        engines serve) instead of finishing them here, when their KV outlives this process
        (engine/kv_segment.py): the survivors adopt it; without a segment, a plain drain."""
        self._handover = True
        self._on_signal(signum, frame)

    # -- the busy loop ----------------------------------------------------------------------
    def _busy_loop(self) -> int:
        """Take input (blocking only when idle), then step, stop or die: as the lifecycle says."""
        lifecycle = self.lifecycle
        try:
            while True:
                self._carry_out(lifecycle.before_inputs(time.monotonic(), self.core.has_unfinished_requests()))
                self._carry_out(lifecycle.on_tick(time.monotonic(), self.core.has_unfinished_requests()))
        except EngineExit as exc:
            return exc.code

    def _process_inputs(self, block_s: float | None = 0.0) -> None:
        """Block up to ``block_s`` (None: no limit) for the first item, then drain the queue."""
        if self._handover_deadline is not None and time.monotonic() >= self._handover_deadline:
            log.warning("engine %d: %d request(s) not asked for within %.1f s of the handover: handed over now",
                        self.engine_index, len(self._req_slot), HANDOVER_WAIT_S)
            self._hand_over(None)
        if block_s is None or block_s > 0:
            try:
                self._handle(*self.input_queue.get(timeout=block_s))
            except queue.Empty:
                return
        while True:
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(*item)

    def _handle(self, slot: int | None, msg_type: bytes, msg: Any) -> None:
        if msg_type == MsgType.ADD:
            self._add(slot, msg)
        elif msg_type == MsgType.ABORT:
            ids = [rid for rid in msg.request_ids if self._req_slot.get(rid) == slot]
            if ids:
                self.core.abort_requests(ids)
        elif msg_type == MsgType.UTILITY and msg.method == "hand_over":  # needs the caller's slot
            weights = getattr(self.core, "weights_handover_open", None)
            if self._handover_deadline is None and not self._handover and not (weights is not None and weights()):
                result = UtilityResult(call_id=msg.call_id, ok=False, engine_index=self.engine_index,
                                       error="no handover in progress", code=UtilityErrorCode.BAD_STATE.value)
            else:
                result = UtilityResult(call_id=msg.call_id, ok=True, engine_index=self.engine_index,
                                       result={"handed_over": self._hand_over(slot)})
                if weights is not None and weights():  # the swap needs a step, and none may come
                    self.input_queue.put((None, MsgType.WAKEUP, None))
            self.output_queue.put((slot, MsgType.UTILITY_RESULT, result))
        elif msg_type == MsgType.UTILITY:
            self.output_queue.put((slot, MsgType.UTILITY_RESULT, self._utility(msg)))
            self._publish_kv_events()
        elif msg_type == MsgType.SHUTDOWN:
            self._carry_out(self.lifecycle.on_shutdown(msg.drain_timeout_s, "SHUTDOWN message", time.monotonic()))
        elif msg_type == MsgType.HANDSHAKE_REJECT:
            self._carry_out(self.lifecycle.on_refused(slot, msg.reason))
        elif msg_type == MsgType.WAKEUP:
            self._carry_out(self.lifecycle.on_wakeup(time.monotonic()))

    def _add(self, slot: int, req: EngineCoreRequest) -> None:
        """Admit one request, or answer it at once with an error output: refused by the
        lifecycle (draining, unhealthy: "overloaded", try elsewhere), a duplicate id
        ("invalid_request"), or the waiting queue at max_num_waiting ("overloaded")."""
        refusal, code = self.lifecycle.refusal_for_new_request(), OutputErrorCode.OVERLOADED
        if refusal is None and req.request_id in self._req_slot:
            refusal, code = f"request id {req.request_id!r} is already in use", OutputErrorCode.INVALID_REQUEST
        if refusal is None:
            num_waiting, limit = self.core.get_stats().num_waiting, self.config.waiting_limit
            if num_waiting >= limit:
                refusal = (f"engine {self.engine_index} is overloaded: {num_waiting} requests are "
                           f"waiting (max_num_waiting={limit}); retry later or elsewhere")
        if refusal is not None:
            self._send_outputs(slot, [EngineCoreOutput(request_id=req.request_id, finish_reason="error",
                                                       error=refusal, error_code=code.value)])
            return
        self._req_slot[req.request_id] = slot
        try:
            self.core.add_request(req)  # never raises by contract: an error output follows
        except Exception as exc:  # noqa: BLE001 - a core that breaks it still fails only this request
            from planaria.engine.core import admission_error  # deferred: torch, as in _load (loaded by now)

            self._req_slot.pop(req.request_id, None)
            self._send_outputs(slot, [admission_error(req.request_id, exc)])

    def _step(self) -> None:
        core = self.core
        try:
            if self.config.max_concurrent_batches > 1:
                outputs, executed = core.step_with_batch_queue()
                outputs = outputs or []
            else:
                outputs, executed = core.step()
        except RequestExecutionError as exc:  # pinned to some requests: fail them, go on
            log.warning("engine %d: %s", self.engine_index, exc)  # error outputs come with the next step
            self.core.fail_requests(exc.request_ids, f"request execution failed: {exc}")
            return
        except Exception as exc:
            self._engine_fault(exc, time.monotonic())
            return
        self._publish(outputs)
        self._offer_weights_handover()
        if not executed and not outputs:
            self._process_inputs(block_s=0.001)  # nothing schedulable yet: do not spin

    def _offer_weights_handover(self) -> None:
        """A "hand_over" weight load is read (engine/weight_update.py): offer the requests
        still on the old weights to the frontends, once (they move them, or let them finish)."""
        due = getattr(self.core, "weights_handover_due", None)
        if due is not None and due():
            self.output_queue.put((None, MsgType.STATUS, EngineStatus(
                engine_index=self.engine_index, state=self.state.value, pid=os.getpid(), handover_pending=True,
                reason="new weights read; handing its requests over to engines on the old weights")))

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        details = self.core.take_iteration_details()
        if details:  # EngineConfig.iteration_details: every frontend gets the step records
            for link in self._links:
                self.output_queue.put((link.slot, MsgType.OUTPUTS, EngineCoreOutputs(
                    engine_index=self.engine_index, iteration_details=details, timestamp=time.time())))
        by_slot: dict[int, list[EngineCoreOutput]] = defaultdict(list)
        for out in outputs:
            slot = self._req_slot.pop(out.request_id, None) if out.finished \
                else self._req_slot.get(out.request_id)
            if slot is None:
                log.debug("output for unknown request %s", out.request_id)
                continue
            by_slot[slot].append(out)
        stats = self.core.get_stats()
        changed = stats != self._last_stats
        counts_changed = self._last_stats is None or (stats.num_running, stats.num_waiting) != (
            self._last_stats.num_running, self._last_stats.num_waiting)
        now = time.monotonic()
        kv_events = self._take_kv_events()  # every frontend gets them: each routes by its own index
        for slot, outs in by_slot.items():
            self._send_outputs(slot, outs, stats if changed else None, kv_events)
        send_stats = changed and (counts_changed or now - self._last_stats_sent >= self.settings.stats_interval_s)
        if send_stats or kv_events is not None:
            for link in self._links:
                if link.slot not in by_slot:
                    self._send_outputs(link.slot, [], stats if send_stats else None, kv_events)
        if changed and (by_slot or counts_changed or now - self._last_stats_sent >= self.settings.stats_interval_s):
            self._last_stats = stats
            self._last_stats_sent = now

    def _send_outputs(self, slot: int, outputs: list[EngineCoreOutput], stats=None, kv_events=None) -> None:
        """One message, or several when the outputs are big (wire.split_outputs: a request's
        long prompt logprobs never push a message past the frontend's limit, where it would
        be dropped with every other request's tokens in it); the stats and the prefix
        cache's changes go with the last."""
        runs = split_outputs(outputs)
        for i, run in enumerate(runs):
            last = i == len(runs) - 1
            self.output_queue.put((slot, MsgType.OUTPUTS, EngineCoreOutputs(
                engine_index=self.engine_index, outputs=run, scheduler_stats=stats if last else None,
                timestamp=time.time(), kv_events=kv_events if last else None)))

    def _take_kv_events(self):
        """The core's prefix-cache changes since the last batch, numbered (KVCacheEvents.seq)."""
        events = self.core.take_kv_events()
        if events is None:
            return None
        self._kv_events_seq += 1
        events.seq, events.pid = self._kv_events_seq, os.getpid()
        return events

    def _publish_kv_events(self) -> None:
        """Outside a step (a utility call reset the prefix cache): the changes now."""
        kv_events = self._take_kv_events()
        if kv_events is not None:
            for link in self._links:
                self._send_outputs(link.slot, [], None, kv_events)

    # -- carrying out the lifecycle's actions (engine/lifecycle.py) ----------------------------
    def _carry_out(self, actions: list[Action]) -> None:
        for action in actions:
            match action:
                case Wait(until=until):
                    self._process_inputs(None if until is None else max(0.0, until - time.monotonic()))
                case Step():
                    self._step()
                case SetState(state=state, reason=reason, drop_requests=drop):
                    if state is EngineState.DRAINING and not drop and self._can_hand_over():
                        # The requests move with their KV: decoding goes on while each frontend
                        # has survivors copy the bulk, then asks for its requests (hand_over).
                        self._handover_deadline = time.monotonic() + HANDOVER_WAIT_S
                        self.output_queue.put((None, MsgType.STATUS, EngineStatus(
                            engine_index=self.engine_index, state=state.value, pid=os.getpid(),
                            reason=f"{reason}; handing its requests over", handover_pending=True)))
                        continue
                    self._send_status(state, reason, self._drop_all_requests() if drop else False)
                case Stop(aborted=aborted):
                    self._send_status(EngineState.STOPPED, action.reason,
                                      self._drop_all_requests() if aborted else False)
                    log.info("engine %d stopped (%s)", self.engine_index, "aborted" if aborted else "drained")
                    raise EngineExit(action.exit_code)
                case Refused(slot=slot, reason=reason):  # the other frontends learn it from STOPPED
                    log.error("engine %d: frontend %d refused this engine: %s", self.engine_index, slot, reason)
                    self._send_status(EngineState.STOPPED, f"refused by frontend {slot}: {reason}",
                                      self._drop_all_requests())
                    raise EngineExit(action.exit_code)
                case Die():
                    self._die(action)
                case RollBack():
                    self.core.recover_after_fault()  # the batch the failed step left in flight
                case ResetPrefixCache():
                    self.core.reset_prefix_cache()
                case Signalled(number=number):
                    log.info("engine %d: signal %d: %s", self.engine_index, number,
                             "draining" if action.draining else "aborting")
                case Wake():
                    self.input_queue.put((None, MsgType.WAKEUP, None))
                case AbandonStart():
                    raise SystemExit(EXIT_OK)

    def _send_status(self, state: EngineState, reason: str, requests_dropped: bool) -> None:
        self.output_queue.put((None, MsgType.STATUS, EngineStatus(
            engine_index=self.engine_index, state=state.value, reason=reason,
            requests_dropped=requests_dropped, pid=os.getpid())))

    def _hand_over(self, slot: int | None) -> int:
        """Drop the requests of frontend ``slot`` (None: of every frontend) as handed over:
        that frontend moves them, naming this engine's KV segment. Once handed over, a
        request's blocks are never written again here (no new request comes to a draining
        engine), so the segment holds them as they were."""
        ids = [rid for rid, s in self._req_slot.items() if slot is None or s == slot]
        for rid in ids:
            del self._req_slot[rid]
        self._num_handed_over += len(ids)
        if ids:
            try:
                self.core.abort_requests(ids)
            except Exception:
                log.exception("abort of %d handed-over requests failed", len(ids))
        if slot is None or not self._req_slot:
            self._handover_deadline = None
        self.output_queue.put((slot, MsgType.STATUS, EngineStatus(
            engine_index=self.engine_index, state=self.state.value, reason="requests handed over",
            requests_dropped=bool(ids), pid=os.getpid(), handed_over=bool(ids))))
        return len(ids)

    def _can_hand_over(self) -> bool:
        runner = getattr(self.core, "runner", None)
        return self._handover and getattr(runner, "kv_segment", None) is not None

    def _drop_all_requests(self) -> bool:
        """Abort every in-flight request without per-request outputs (a STATUS says so)."""
        ids = list(self._req_slot)
        self._req_slot.clear()
        if ids:
            try:
                self.core.abort_requests(ids)
            except Exception:
                log.exception("abort of %d requests failed", len(ids))
        return bool(ids)

    def _engine_fault(self, exc: BaseException, fault_monotonic_s: float | None = None) -> None:
        """``fault_monotonic_s``: time.monotonic() when the fault was caught (default: now)."""
        reason = f"{type(exc).__name__}: {exc}"
        now = time.monotonic() if fault_monotonic_s is None else fault_monotonic_s
        for action in self.lifecycle.on_fault(reason, now):
            if isinstance(action, Die):  # ENGINE_CORE_DEAD leaves before the traceback is logged
                self._die(action, exc)
            log.error("engine %d: engine-level fault: %s", self.engine_index, reason, exc_info=exc)
            self._carry_out([action])

    def _die(self, action: Die, exc: BaseException | None = None) -> NoReturn:
        self._send_dead(action.reason, action.fault_monotonic_s)
        if exc is not None:
            log.error("engine %d: engine-level fault", self.engine_index, exc_info=exc)
        raise EngineExit(action.exit_code)

    def _send_dead(self, reason: str, fault_monotonic_s: float | None = None) -> None:
        self.output_queue.put((None, MsgType.ENGINE_CORE_DEAD, EngineDead(
            engine_index=self.engine_index, reason=reason, pid=os.getpid(),
            fault_monotonic_s=fault_monotonic_s)))
        log.error("engine %d dead: %s", self.engine_index, reason)

# -- entry points ---------------------------------------------------------------------------

def run_engine_core(engine_index: int, input_addresses: list[str], config: EngineConfig | dict | None = None,
                    settings: ProcSettings | dict | None = None,
                    output_addresses: list[str] | None = None) -> NoReturn:
    """Process target (multiprocessing spawn, or ``main``): serve, then exit with the code."""
    if isinstance(config, dict):
        config = msgspec.convert(config, EngineConfig)
    if isinstance(settings, dict):
        settings = msgspec.convert(settings, ProcSettings)
    settings = settings or ProcSettings()
    setup_logging(engine_index, settings.log_level)
    proc = EngineCoreProc(engine_index, input_addresses, config, settings, output_addresses)
    sys.exit(proc.run())


def _since_exec_s() -> float:
    """Seconds since this process started (interpreter start and imports included)."""
    return time.time() - psutil.Process().create_time()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planaria.engine.proc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-index", type=int, required=True)
    p.add_argument("--input-addr", action="append", required=True,
                   help="a frontend's ROUTER address (repeat per frontend)")
    p.add_argument("--output-addr", action="append",
                   help="a frontend's PULL address (default: from the handshake)")
    p.add_argument("--config-json", help="EngineConfig as JSON, or @file (default: from the handshake)")
    p.add_argument("--settings-json", help="ProcSettings as JSON, or @file")
    args = p.parse_args(argv)
    try:
        config = json_arg(args.config_json)
        settings = json_arg(args.settings_json)
        if config is not None:
            config = msgspec.convert(config, EngineConfig)
            config.validate()
        settings = msgspec.convert(settings, ProcSettings) if settings is not None else None
    except (OSError, msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
        print(f"engine.proc: bad arguments: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as exc:  # EngineConfig.validate raises EngineError
        print(f"engine.proc: bad config: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        run_engine_core(args.engine_index, args.input_addr, config, settings, args.output_addr)
    except SystemExit as exc:
        return int(exc.code or 0)
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
