"""EngineCoreProc: an EngineCore in its own process, behind ZMQ sockets.

    input thread (DEALER per frontend) -> input queue -> busy loop (EngineCore.step)
                                                          -> output queue -> output thread (PUSH)

The busy loop is the only thread that changes the core. It blocks on the input queue when
idle, drains it when busy, steps, and pushes outputs (plus SchedulerStats when they
change). The one exception: the input thread also puts ABORTs on the core's aborts queue
(``EngineCore.queue_aborts``), which the step applies between the forward and its output
update, so an abort that arrives mid-forward gets no token from that step. Faults: a ``RequestExecutionError`` fails those requests and the loop goes on; any
other exception makes the engine UNHEALTHY and, unless a "reset"/"resume" utility call
comes within ``recovery_timeout_s``, it dies: ENGINE_CORE_DEAD to every frontend, sockets
lingered, exit code 1 (EXIT_DEAD). A frontend that finds a config hash unlike its own in
READY answers HANDSHAKE_REJECT with the reason; the engine logs it and exits with
EXIT_CONFIG_MISMATCH (4), a configuration error rather than a crash (see the EXIT_*
constants for every exit code). A coordinator SUB socket (DP wave / stats fan-in) is not wired yet;
it would be one more socket in the input thread, feeding the same queue.

Launch: ``python -m planaria.engine.proc --engine-index 0 --input-addr ipc://... --config-json '{...}'``
or ``multiprocessing`` (spawn) with ``target=run_engine_core``.
"""

from __future__ import annotations

import argparse
import enum
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
import zmq

from planaria.engine import envs
from planaria.engine.config import EngineConfig
from planaria.engine.errors import ConfigMismatchError, EngineHandshakeError, RequestExecutionError
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from planaria.engine.proc_io import FrontendLink, InputThread, OutputThread, handshake, send_all
from planaria.engine.wire import (DEFAULT_MAX_MESSAGE_BYTES, PROTOCOL_VERSION, EngineDead, EngineStatus,
                         MsgType, Ready, UtilityCall, UtilityResult)

log = logging.getLogger(__name__)

FAULT_INJECTION_ENV = envs.FAULT_INJECTION
# Exit codes of an engine-core process (a supervisor reads them):
EXIT_OK = 0  # stopped: drained, aborted on request, or a signal during the handshake
EXIT_DEAD = 1  # fatal fault or failed start (ENGINE_CORE_DEAD was sent): a crash, restart it
EXIT_USAGE = 2  # bad command-line arguments or config
EXIT_HANDSHAKE = 3  # no frontend completed the handshake in time (or gave no output address)
# A frontend refused this engine (HANDSHAKE_REJECT: config hash or protocol version), or
# the engine refused a frontend's protocol version. A configuration error, not a crash:
# the same engine with the same settings is refused again, so do not restart it as is.
EXIT_CONFIG_MISMATCH = 4


class EngineState(str, enum.Enum):
    """Lifecycle of an engine-core process.

    STARTING -> RUNNING (READY sent); RUNNING <-> PAUSED ("pause"/"resume");
    RUNNING|PAUSED -> DRAINING (SIGTERM / SHUTDOWN) -> STOPPED (drained, exit 0);
    DRAINING -> STOPPED (second signal, SHUTDOWN with 0, or drain timeout: work aborted);
    any -> UNHEALTHY (engine-level fault) -> RUNNING ("reset"/"resume") | DEAD (exit 1).
    any -> STOPPED (a frontend sent HANDSHAKE_REJECT after READY: exit EXIT_CONFIG_MISMATCH).
    """

    STARTING = "starting"
    RUNNING = "running"
    PAUSED = "paused"
    DRAINING = "draining"
    UNHEALTHY = "unhealthy"
    STOPPED = "stopped"
    DEAD = "dead"


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


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


class EngineCoreProc:
    def __init__(self, engine_index: int, input_addresses: list[str], config: EngineConfig | None,
                 settings: ProcSettings | None = None, output_addresses: list[str] | None = None,
                 core_factory: Callable[[EngineConfig], Any] | None = None) -> None:
        if output_addresses and len(output_addresses) != len(input_addresses):
            raise ValueError("give one output address per input address, or none")
        self.engine_index = engine_index
        self.input_addresses = list(input_addresses)
        self.output_addresses = list(output_addresses) if output_addresses else None
        self.config = config
        self.settings = settings or ProcSettings()
        self._core_factory = core_factory
        self.core = None
        self.state = EngineState.STARTING
        self.input_queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is signal-safe
        self.output_queue: queue.SimpleQueue = queue.SimpleQueue()
        self._req_slot: dict[str, int] = {}  # in-flight request id -> frontend slot
        self._num_signals = 0
        self._handled_signals = 0
        self._deadline: float | None = None  # drain or recovery deadline (monotonic)
        self._fault_reason = ""
        self._last_stats = None
        self._last_stats_sent = 0.0
        self._fault_injection = envs.get().fault_injection  # read once, at process start
        self._links: list[FrontendLink] = []

    # -- lifecycle --------------------------------------------------------------------------
    def run(self) -> int:
        """Handshake, load, serve until stopped or dead. Returns the process exit code."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        ctx = zmq.Context()
        input_thread = output_thread = heartbeat_thread = None
        sockets_closed = True
        try:
            try:
                self._links = handshake(ctx, self.engine_index, self.input_addresses,
                                        self.output_addresses, self.settings.handshake_timeout_s,
                                        should_stop=lambda: self._num_signals > 0)
            except EngineHandshakeError as exc:
                if self._num_signals:
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
            self.state = EngineState.RUNNING
            timings = {"since_exec_s": _since_exec_s(),  # where the start-up went
                       **(getattr(self.core, "init_timings", None) or {})}
            log.info("engine %d ready: %d KV blocks, max_model_len %d; start-up %s", self.engine_index,
                     self.core.num_kv_blocks, self.core.max_model_len,
                     " ".join(f"{k}={v:.3f}" for k, v in timings.items()))
            input_thread = InputThread(self.engine_index, self._links, self.input_queue,
                                       self.output_queue, self.settings.max_message_bytes,
                                       on_abort=self._abort_eagerly)
            input_thread.start()
            if self.settings.heartbeat_address:
                from planaria.engine.heartbeat import HeartbeatThread

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
            from planaria.engine.core import create_engine_core  # EngineCore, or the pooling core

            self._core_factory = create_engine_core
        self.core = self._core_factory(self.config)

    def _ready(self) -> Ready:
        core = self.core
        return Ready(engine_index=self.engine_index, num_kv_blocks=core.num_kv_blocks,
                     max_model_len=core.max_model_len, protocol_version=PROTOCOL_VERSION,
                     config_hash=core.config_hash(), kv_cache_bytes=core.kv_cache_bytes,
                     kv_source=core.kv_source, pid=os.getpid(), vocab_size=core.vocab_size)

    def _heartbeat(self):
        """For the supervisor (heartbeat thread): read without locks, never blocks."""
        from planaria.engine.heartbeat import Heartbeat

        core = self.core
        sched = core.scheduler
        return Heartbeat(engine_index=self.engine_index, pid=os.getpid(),
                         step_counter=core.step_counter, state=self.state.value,
                         has_work=core.has_unfinished_requests() or not self.input_queue.empty(),
                         num_running=sched.num_running, num_waiting=sched.num_waiting,
                         kv_usage=round(core.kv.usage, 4), kv_cache_bytes=core.kv_cache_bytes,
                         num_kv_blocks=core.num_kv_blocks, kv_source=core.kv_source,
                         timestamp=time.time())

    def _abort_eagerly(self, slot: int, request_ids: list[str]) -> None:
        """Input thread: hand this frontend's in-flight requests among ``request_ids`` to
        the core's aborts queue, applied between the running forward and its output
        update (EngineCore.queue_aborts). Reads only (dict gets, atomic under the GIL);
        the ABORT also stays on the input queue, so ids not added yet and an idle loop
        are handled there, in order."""
        queue_aborts = getattr(self.core, "queue_aborts", None)
        if queue_aborts is None:
            return
        ids = [rid for rid in request_ids if self._req_slot.get(rid) == slot]
        if ids:
            queue_aborts(ids)

    def _on_signal(self, signum, frame) -> None:
        # Runs on the main thread between bytecodes; SimpleQueue.put is reentrant-safe.
        self._num_signals += 1
        if self.state == EngineState.STARTING and self._num_signals >= 2:
            raise SystemExit(EXIT_OK)  # second signal while loading: give up the load
        self.input_queue.put((None, MsgType.WAKEUP, None))

    # -- the busy loop ----------------------------------------------------------------------
    def _busy_loop(self) -> int:
        try:
            while True:
                if self.state == EngineState.DRAINING and not self.core.has_unfinished_requests():
                    self._stop(aborted=False)  # before blocking: a drained engine is done
                self._process_inputs()
                now = time.monotonic()
                if self.state == EngineState.UNHEALTHY:
                    if now >= self._deadline:
                        self._die(f"no recovery within {self.settings.recovery_timeout_s} s "
                                  f"after: {self._fault_reason}")
                    continue
                if self.state == EngineState.DRAINING:
                    if not self.core.has_unfinished_requests():
                        self._stop(aborted=False)
                    if now >= self._deadline:
                        self._stop(aborted=True, cause="drain timeout")
                if self.state in (EngineState.RUNNING, EngineState.DRAINING) \
                        and self.core.has_unfinished_requests():
                    self._step()
        except _Exit as exc:
            return exc.code

    def _idle(self) -> bool:
        return self.state in (EngineState.PAUSED, EngineState.UNHEALTHY) \
            or not self.core.has_unfinished_requests()

    def _process_inputs(self, block_s: float | None = None) -> None:
        """Block for the first item when idle (until the drain/recovery deadline), then drain."""
        if block_s is None and self._idle():
            block_s = (max(0.0, self._deadline - time.monotonic())
                       if self._deadline is not None else None)
            try:
                self._handle(*self.input_queue.get(timeout=block_s))
            except queue.Empty:
                return
        elif block_s:
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
        elif msg_type == MsgType.UTILITY:
            self.output_queue.put((slot, MsgType.UTILITY_RESULT, self._utility(msg)))
        elif msg_type == MsgType.SHUTDOWN:
            timeout_s = msg.drain_timeout_s
            self._begin_shutdown(self.settings.drain_timeout_s if timeout_s is None else timeout_s,
                                 "SHUTDOWN message")
        elif msg_type == MsgType.HANDSHAKE_REJECT:
            self._refused(slot, msg.reason)
        elif msg_type == MsgType.WAKEUP:
            while self._handled_signals < self._num_signals:
                self._handled_signals += 1
                first = self._handled_signals == 1
                log.info("engine %d: signal %d: %s", self.engine_index, self._handled_signals,
                         "draining" if first else "aborting")
                self._begin_shutdown(self.settings.drain_timeout_s if first else 0.0,
                                     f"signal #{self._handled_signals}")

    def _add(self, slot: int, req: EngineCoreRequest) -> None:
        refusal = {EngineState.DRAINING: "engine is draining (shutting down); send it elsewhere",
                   EngineState.UNHEALTHY: f"engine is unhealthy: {self._fault_reason}"}.get(self.state)
        if refusal is None and req.request_id in self._req_slot:
            refusal = f"request id {req.request_id!r} is already in use"
        if refusal is not None:
            self._send_outputs(slot, [EngineCoreOutput(request_id=req.request_id,
                                                       finish_reason="error", error=refusal)])
            return
        self._req_slot[req.request_id] = slot
        self.core.add_request(req)  # never raises for bad input: an error output follows

    def _step(self) -> None:
        core = self.core
        try:
            if self.config.max_concurrent_batches > 1:
                outputs, executed = core.step_with_batch_queue()
                outputs = outputs or []
            else:
                outputs, executed = core.step()
        except RequestExecutionError as exc:  # pinned to some requests: fail them, go on
            log.warning("engine %d: %s", self.engine_index, exc)
            self._fail_requests(exc.request_ids, f"request execution failed: {exc}")
            return
        except Exception as exc:
            self._engine_fault(exc, time.monotonic())
            return
        self._publish(outputs)
        if not executed and not outputs:
            self._process_inputs(block_s=0.001)  # nothing schedulable yet: do not spin

    def _fail_requests(self, request_ids: list[str], error: str) -> None:
        if hasattr(self.core, "fail_requests"):
            self.core.fail_requests(request_ids, error)  # error outputs come with the next step
            return
        self.core.abort_requests(request_ids)
        for rid in request_ids:
            slot = self._req_slot.pop(rid, None)
            if slot is not None:
                self._send_outputs(slot, [EngineCoreOutput(request_id=rid, finish_reason="error",
                                                           error=error)])

    def _publish(self, outputs: list[EngineCoreOutput]) -> None:
        details = self.core.take_iteration_details() if hasattr(self.core, "take_iteration_details") else None
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
        for slot, outs in by_slot.items():
            self._send_outputs(slot, outs, stats if changed else None)
        if changed and (counts_changed or now - self._last_stats_sent >= self.settings.stats_interval_s):
            for link in self._links:
                if link.slot not in by_slot:
                    self._send_outputs(link.slot, [], stats)
        if changed and (by_slot or counts_changed or now - self._last_stats_sent >= self.settings.stats_interval_s):
            self._last_stats = stats
            self._last_stats_sent = now

    def _send_outputs(self, slot: int, outputs: list[EngineCoreOutput], stats=None) -> None:
        self.output_queue.put((slot, MsgType.OUTPUTS, EngineCoreOutputs(
            engine_index=self.engine_index, outputs=outputs, scheduler_stats=stats,
            timestamp=time.time())))

    # -- state changes ----------------------------------------------------------------------
    def _set_state(self, state: EngineState, reason: str = "", requests_dropped: bool = False) -> None:
        self.state = state
        self.output_queue.put((None, MsgType.STATUS, EngineStatus(
            engine_index=self.engine_index, state=state.value, reason=reason,
            requests_dropped=requests_dropped, pid=os.getpid())))

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
        if fault_monotonic_s is None:
            fault_monotonic_s = time.monotonic()
        reason = f"{type(exc).__name__}: {exc}"
        if self.settings.recovery_timeout_s <= 0:
            # ENGINE_CORE_DEAD leaves before the traceback is formatted and logged
            self._die(reason, fault_monotonic_s, exc)
        log.error("engine %d: engine-level fault: %s", self.engine_index, reason, exc_info=exc)
        self._fault_reason = reason
        self._deadline = time.monotonic() + self.settings.recovery_timeout_s
        dropped = False if self.settings.keep_requests_on_fault else self._drop_all_requests()
        self._set_state(EngineState.UNHEALTHY, reason, requests_dropped=dropped)

    def _recover(self, reset: bool) -> None:
        if self.state == EngineState.UNHEALTHY and hasattr(self.core, "recover_after_fault"):
            self.core.recover_after_fault()  # roll back the batch the failed step left in flight
        dropped = self._drop_all_requests() if reset else False
        if reset and hasattr(self.core, "reset_prefix_cache"):
            self.core.reset_prefix_cache()
        self._deadline = None
        self._fault_reason = ""
        self._set_state(EngineState.RUNNING, "reset" if reset else "resumed", requests_dropped=dropped)

    def _begin_shutdown(self, drain_timeout_s: float, cause: str = "shutdown") -> None:
        if drain_timeout_s <= 0 or self.state == EngineState.UNHEALTHY:
            self._stop(aborted=True, cause=cause)
        if self.state != EngineState.DRAINING:
            self._deadline = time.monotonic() + drain_timeout_s
            self._set_state(EngineState.DRAINING, f"draining for up to {drain_timeout_s} s")
        else:
            self._deadline = min(self._deadline, time.monotonic() + drain_timeout_s)

    def _stop(self, aborted: bool, cause: str = "") -> NoReturn:
        """Aborted: the in-flight requests are dropped; the STOPPED status says so
        (requests_dropped) and why, and a frontend fails them with that reason."""
        dropped = self._drop_all_requests() if aborted else False
        reason = (f"shutdown{f' ({cause})' if cause else ''}: in-flight work aborted" if aborted
                  else "shutdown (drained)")
        self._set_state(EngineState.STOPPED, reason, requests_dropped=dropped)
        log.info("engine %d stopped (%s)", self.engine_index, "aborted" if aborted else "drained")
        raise _Exit(EXIT_OK)

    def _refused(self, slot: int, reason: str) -> NoReturn:
        """A frontend refused this engine after READY (config hash mismatch): stop with
        EXIT_CONFIG_MISMATCH; the other frontends learn it from the STOPPED status."""
        log.error("engine %d: frontend %d refused this engine: %s", self.engine_index, slot, reason)
        dropped = self._drop_all_requests()
        self._set_state(EngineState.STOPPED, f"refused by frontend {slot}: {reason}",
                        requests_dropped=dropped)
        raise _Exit(EXIT_CONFIG_MISMATCH)

    def _die(self, reason: str, fault_monotonic_s: float | None = None,
             exc: BaseException | None = None) -> NoReturn:
        self.state = EngineState.DEAD
        self._send_dead(reason, fault_monotonic_s)
        if exc is not None:
            log.error("engine %d: engine-level fault", self.engine_index, exc_info=exc)
        raise _Exit(EXIT_DEAD)

    def _send_dead(self, reason: str, fault_monotonic_s: float | None = None) -> None:
        self.output_queue.put((None, MsgType.ENGINE_CORE_DEAD, EngineDead(
            engine_index=self.engine_index, reason=reason, pid=os.getpid(),
            fault_monotonic_s=fault_monotonic_s)))
        log.error("engine %d dead: %s", self.engine_index, reason)

    # -- utilities --------------------------------------------------------------------------
    def _utility(self, call: UtilityCall) -> UtilityResult:
        fn = getattr(self, f"_u_{call.method}", None)
        if fn is None:
            return UtilityResult(call_id=call.call_id, ok=False, engine_index=self.engine_index,
                                 error=f"unknown utility method {call.method!r}")
        try:
            result = fn(**call.args)
        except _Exit:
            raise
        except Exception as exc:  # the caller gets the error; the engine goes on
            return UtilityResult(call_id=call.call_id, ok=False, engine_index=self.engine_index,
                                 error=f"{type(exc).__name__}: {exc}")
        return UtilityResult(call_id=call.call_id, ok=True, result=result,
                             engine_index=self.engine_index)

    def _u_ping(self) -> dict:
        return {"pid": os.getpid(), "state": self.state.value, "step_counter": self.core.step_counter,
                "num_requests": len(self._req_slot), "time": time.time()}

    def _u_get_stats(self):
        return self.core.get_stats()

    def _u_get_info(self) -> dict:
        ready = msgspec.structs.asdict(self._ready())
        return {**ready, **self._u_ping()}

    def _u_reset_prefix_cache(self):
        return self.core.reset_prefix_cache()

    def _u_load_weights(self, model_dir: str, version: str | None = None, mode: str = "finish_old") -> dict:
        """Read new weights on a thread, swap them in at a step boundary (EngineCore.load_weights);
        the read's end wakes an idle loop so the swap happens at once."""
        wake = lambda: self.input_queue.put((None, MsgType.WAKEUP, None))  # noqa: E731
        return self.core.load_weights(model_dir, version, mode, on_read=wake)

    def _u_weight_status(self) -> dict:
        """The weight version in place and the current or last load (EngineCore.weight_status)."""
        return self.core.weight_status()

    def _u_pause(self) -> str:
        if self.state != EngineState.RUNNING:
            raise ValueError(f"cannot pause in state {self.state.value}")
        self._set_state(EngineState.PAUSED, "paused (requests kept)")
        return self.state.value

    def _u_resume(self) -> str:
        if self.state not in (EngineState.PAUSED, EngineState.UNHEALTHY):
            raise ValueError(f"cannot resume in state {self.state.value}")
        if (self.state == EngineState.UNHEALTHY and self._req_slot
                and not hasattr(self.core, "recover_after_fault")):
            raise ValueError("this engine core cannot resume requests after a fault "
                             "(no recover_after_fault); use 'reset'")
        self._recover(reset=False)
        return self.state.value

    def _u_reset(self) -> str:
        if self.state in (EngineState.DRAINING, EngineState.STOPPED, EngineState.DEAD):
            raise ValueError(f"cannot reset in state {self.state.value}")
        self._recover(reset=True)
        return self.state.value

    def _u_fault_inject(self, kind: str, exit_code: int = 137, seconds: float = 3600.0) -> str:
        """Chaos tests only (PLANARIA_FAULT_INJECTION=1): "fatal" / "request" make the next
        model step raise; "exit" ends the process at once (no ENGINE_CORE_DEAD, like
        SIGKILL); "hang" blocks the loop (a hung step)."""
        if not self._fault_injection:
            raise PermissionError(f"fault injection is disabled (set {FAULT_INJECTION_ENV}=1)")
        if kind in ("fatal", "request"):
            self.core.runner.fault_next_step = kind
        elif kind == "exit":
            os._exit(exit_code)
        elif kind == "hang":
            time.sleep(seconds)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return kind


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
    _setup_logging(engine_index, settings.log_level)
    proc = EngineCoreProc(engine_index, input_addresses, config, settings, output_addresses)
    sys.exit(proc.run())


def _since_exec_s() -> float:
    """Seconds since this process started (interpreter start and imports included)."""
    import psutil

    return time.time() - psutil.Process().create_time()


def _setup_logging(engine_index: int, level: str) -> None:
    from planaria.daemon.logging import configure_child  # the daemon's format: JSON lines in its log files

    configure_child(getattr(logging, level.upper(), logging.INFO), engine_id=engine_index)


def _json_arg(text: str | None) -> Any:
    if text is None:
        return None
    if text.startswith("@"):
        with open(text[1:], "rb") as f:
            text = f.read()
    return msgspec.json.decode(text)


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
        config = _json_arg(args.config_json)
        settings = _json_arg(args.settings_json)
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
