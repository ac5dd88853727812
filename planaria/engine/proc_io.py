"""The sockets of an engine-core process: handshake, the input thread, the output thread.

Each thread owns its sockets (ZMQ sockets are not thread-safe); the busy loop talks to them
only through queues. One frontend = one DEALER (requests in) + one PUSH (outputs out).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import zmq

from planaria.common.sockets import CurveClientKeys, engine_curve_keys, set_curve_client
from planaria.engine.errors import ConfigMismatchError, EngineHandshakeError, WireFormatError
from planaria.engine.messages import EngineCoreOutput, EngineCoreOutputs, OutputErrorCode
from planaria.engine.wire import (ENGINE_INPUT_TYPES, PROTOCOL_VERSION, HandshakeInit, Hello, MsgType,
                         UtilityErrorCode, UtilityResult, WireDecoder, WireEncoder, WireError,
                         engine_identity, recover_call_id)

log = logging.getLogger(__name__)

_HELLO_RESEND_S = 2.0
_STOP = object()


def _should_log(count: int) -> bool:
    """Per-message warnings: the first 20, then every 1000th (a flood must not fill the log)."""
    return count <= 20 or count % 1000 == 0


@dataclass
class FrontendLink:
    """One frontend as the engine sees it. ``slot`` is its position in the input addresses."""

    slot: int
    input_address: str
    dealer: zmq.Socket
    output_address: str | None = None
    client_index: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    curve: CurveClientKeys | None = None  # a CurveZMQ link (TCP to an extra client): both sockets


def handshake(ctx: zmq.Context, engine_index: int, input_addresses: list[str],
              output_addresses: list[str] | None, timeout_s: float,
              should_stop=lambda: False,
              curve: Mapping[str, CurveClientKeys] | None = None) -> list[FrontendLink]:
    """Connect a DEALER per frontend, send HELLO, collect every HANDSHAKE_INIT.

    ``curve``: {input address: keys} of the links that are CurveZMQ clients (default: what
    ``PLANARIA_ENGINE_CURVE`` gives, common/sockets.py); with a wrong server key the link
    never connects, and the handshake times out like with an absent frontend.

    HELLO is re-sent every few seconds (a frontend that restarts before answering loses
    it). Raises ConfigMismatchError on a reject or a protocol mismatch, and
    EngineHandshakeError at the timeout.
    """
    enc, dec = WireEncoder(reuse_buffer=False), WireDecoder(ENGINE_INPUT_TYPES)
    hello = enc.encode(MsgType.HELLO, Hello(engine_index=engine_index, pid=os.getpid(),
                                             protocol_version=PROTOCOL_VERSION))
    if curve is None:
        try:
            curve = engine_curve_keys()
        except ValueError as exc:
            raise EngineHandshakeError(f"CurveZMQ keys: {exc}") from exc
    links = []
    for slot, addr in enumerate(input_addresses):
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, engine_identity(engine_index))
        sock.setsockopt(zmq.LINGER, 0)
        keys = curve.get(addr)
        if keys is not None:
            set_curve_client(sock, keys)
        sock.connect(addr)
        links.append(FrontendLink(slot=slot, input_address=addr, dealer=sock, client_index=slot,
                                  curve=keys))
    pending = {link.dealer: link for link in links}
    poller = zmq.Poller()
    for sock in pending:
        poller.register(sock, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    next_hello = 0.0
    while pending:
        now = time.monotonic()
        if should_stop():
            raise EngineHandshakeError("stopped by a signal during the handshake")
        if now >= deadline:
            missing = ", ".join(link.input_address for link in pending.values())
            raise EngineHandshakeError(f"no HANDSHAKE_INIT within {timeout_s:.0f} s from {missing}")
        if now >= next_hello:
            for sock in pending:
                sock.send_multipart(hello)
            next_hello = now + _HELLO_RESEND_S
        wait_s = min(deadline, next_hello, now + 0.2) - now
        for sock, _ in poller.poll(timeout=max(1, int(wait_s * 1000))):
            link = pending.get(sock)
            if link is None:
                continue
            try:
                msg_type, msg = dec.decode(sock.recv_multipart())
            except WireFormatError as exc:
                log.warning("handshake: ignoring a bad message from %s: %s", link.input_address, exc)
                continue
            if msg_type == MsgType.HANDSHAKE_REJECT:
                raise ConfigMismatchError(f"frontend {link.input_address} refused this engine: "
                                          f"{msg.reason}")
            if msg_type != MsgType.HANDSHAKE_INIT:
                log.warning("handshake: ignoring %r before HANDSHAKE_INIT", msg_type)
                continue
            if msg.protocol_version != PROTOCOL_VERSION:
                raise ConfigMismatchError(
                    f"frontend {link.input_address} speaks protocol {msg.protocol_version}, "
                    f"this engine speaks {PROTOCOL_VERSION}")
            link.settings = dict(msg.settings)
            ci = link.settings.get("client_index", link.slot)
            link.client_index = ci if isinstance(ci, int) else link.slot
            link.output_address = msg.addresses.get("output")
            del pending[sock]
    for link in links:
        if output_addresses:
            link.output_address = output_addresses[link.slot]
        if not link.output_address:
            raise EngineHandshakeError(f"frontend {link.input_address} gave no output address")
    return links


class InputThread(threading.Thread):
    """Reads every DEALER, decodes, and puts ``(slot, type, msg)`` on the input queue.

    A malformed message never reaches the busy loop: it is logged and answered here (error
    output when a request id can be recovered, a failed UtilityResult for a utility call,
    else an ERROR notice). Nothing one message does ends this thread: any exception is
    logged (rate-limited) and counted (``num_malformed``, ``num_failed``).
    """

    def __init__(self, engine_index: int, links: list[FrontendLink], input_queue: queue.SimpleQueue,
                 output_queue: queue.SimpleQueue, max_message_bytes: int,
                 on_abort: Callable[[int, list[str]], None] | None = None) -> None:
        super().__init__(name=f"engine{engine_index}-input", daemon=True)
        self.engine_index = engine_index
        # on_abort(slot, ids), on this thread, before the ABORT is queued: the eager path
        # (as in vLLM v1) that lets an abort land while the busy loop is inside a forward.
        self.on_abort = on_abort
        self.links = links
        self.input_queue = input_queue
        self.output_queue = output_queue
        self.decoder = WireDecoder(ENGINE_INPUT_TYPES, max_message_bytes=max_message_bytes)
        self.num_malformed = 0  # messages that did not decode (answered, see _malformed)
        self.num_failed = 0  # messages whose handling raised (a bug: logged, skipped)
        self._stop_event = threading.Event()

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        poller = zmq.Poller()
        by_sock = {}
        for link in self.links:
            poller.register(link.dealer, zmq.POLLIN)
            by_sock[link.dealer] = link
        try:
            while not self._stop_event.is_set():
                for sock, _ in poller.poll(timeout=100):
                    # drain what is there: many frames per poll under load
                    for _ in range(256):
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._handle_guarded(by_sock[sock].slot, [f.buffer for f in frames])
        except zmq.ContextTerminated:
            pass
        finally:
            for link in self.links:
                link.dealer.close(linger=0)

    def _handle_guarded(self, slot: int, frames: list) -> None:
        """One message; whatever it raises is logged and counted, and the thread reads on
        (a reader that ends would leave every later request unanswered)."""
        try:
            self._handle(slot, frames)
        except Exception:  # noqa: BLE001 - one message never stops the reader
            self.num_failed += 1
            if _should_log(self.num_failed):
                log.exception("input thread: message #%d from frontend %d failed; reading on",
                              self.num_failed, slot)

    def _handle(self, slot: int, frames: list) -> None:
        try:
            msg_type, msg = self.decoder.decode(frames)
        except WireFormatError as exc:
            self._malformed(slot, frames, exc)
            return
        except Exception as exc:  # noqa: BLE001 - WireDecoder wraps decode errors; a bug, then
            self._malformed(slot, frames, WireFormatError(f"undecodable message: {type(exc).__name__}: {exc}"))
            return
        if msg_type == MsgType.HANDSHAKE_INIT:
            return  # a late answer to a re-sent HELLO
        # HANDSHAKE_REJECT after READY (the frontend checks the config hash there) goes to
        # the busy loop, which stops the engine with EXIT_CONFIG_MISMATCH.
        if msg_type == MsgType.ABORT and self.on_abort is not None:
            # Both paths, as vLLM v1 does: the eager one reaches a running step, the queued
            # one keeps ABORT ordered after its ADD; aborting twice is a no-op.
            try:
                self.on_abort(slot, msg.request_ids)
            except Exception:  # a bug there must not stop the input thread
                log.exception("eager abort failed; the queued abort still applies")
        self.input_queue.put((slot, msg_type, msg))

    def _malformed(self, slot: int, frames: list, exc: WireFormatError) -> None:
        self.num_malformed += 1
        if _should_log(self.num_malformed):
            log.warning("malformed message #%d from frontend %d: %s", self.num_malformed, slot, exc)
        if exc.request_id is not None and exc.msg_type == MsgType.ADD:
            out = EngineCoreOutput(request_id=exc.request_id, finish_reason="error",
                                   error=f"malformed request: {exc}",
                                   error_code=OutputErrorCode.INVALID_REQUEST.value)
            self.output_queue.put((slot, MsgType.OUTPUTS, EngineCoreOutputs(
                engine_index=self.engine_index, outputs=[out], timestamp=time.time())))
            return
        if exc.msg_type == MsgType.UTILITY:
            call_id = recover_call_id(frames)
            if call_id is not None:
                self.output_queue.put((slot, MsgType.UTILITY_RESULT, UtilityResult(
                    call_id=call_id, ok=False, error=f"malformed utility call: {exc}",
                    code=UtilityErrorCode.BAD_ARGUMENT.value, engine_index=self.engine_index)))
                return
        self.output_queue.put((slot, MsgType.ERROR, WireError(
            engine_index=self.engine_index, message=str(exc)[:500], request_id=exc.request_id)))


class OutputThread(threading.Thread):
    """Owns one PUSH per frontend; encodes ``(slot | None, type, msg)`` items and sends them.

    ``slot`` None means every frontend. The payload buffer is reused (sent with copy);
    aux frames go zero-copy. ``stop()`` sends what is queued, then closes the sockets with
    ``linger_ms`` so a last ENGINE_CORE_DEAD still leaves the process.
    """

    def __init__(self, engine_index: int, ctx: zmq.Context, links: list[FrontendLink],
                 output_queue: queue.SimpleQueue, linger_ms: int, send_timeout_ms: int) -> None:
        super().__init__(name=f"engine{engine_index}-output", daemon=True)
        self.links = links
        self.output_queue = output_queue
        self.linger_ms = linger_ms
        self.num_dropped = 0
        self._socks = []
        for link in links:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, linger_ms)
            sock.setsockopt(zmq.SNDTIMEO, send_timeout_ms)
            if link.curve is not None:  # the same server's PULL
                set_curve_client(sock, link.curve)
            sock.connect(link.output_address)
            self._socks.append(sock)

    def stop(self, timeout_s: float) -> bool:
        """Send what is queued, close the sockets; False if that did not end in time."""
        self.output_queue.put(_STOP)
        self.join(timeout_s)
        return not self.is_alive()

    def run(self) -> None:
        enc = WireEncoder()
        try:
            while True:
                item = self.output_queue.get()
                if item is _STOP:
                    break
                slot, msg_type, msg = item
                try:
                    frames = enc.encode(msg_type, msg)
                except Exception:  # a bug, never a reason to stop sending
                    log.exception("cannot encode a %r message", msg_type)
                    continue
                targets = self._socks if slot is None else [self._socks[slot]]
                for sock in targets:
                    self._send(sock, frames)
        finally:
            for sock in self._socks:
                sock.close(linger=self.linger_ms)

    def _send(self, sock: zmq.Socket, frames: list) -> None:
        last = len(frames) - 1
        try:
            for i, frame in enumerate(frames):
                sock.send(frame, flags=zmq.SNDMORE if i < last else 0, copy=i < 2)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EAGAIN:
                log.error("send failed: %s", exc)
                return
            # the frontend has not read for send_timeout_ms: it is gone or wedged
            self.num_dropped += 1
            log.error("frontend not reading; dropped an output message (%d so far)", self.num_dropped)


def send_all(links: list[FrontendLink], msg_type: bytes, msg: Any) -> None:
    """Send on every DEALER (READY): main thread, before the input thread owns them."""
    frames = WireEncoder(reuse_buffer=False).encode(msg_type, msg)
    for link in links:
        link.dealer.send_multipart(frames)

