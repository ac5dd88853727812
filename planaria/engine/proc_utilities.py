"""An engine process's utility calls (UtilityCall -> UtilityResult): ``_u_<method>(**args)``
for each method a frontend may call, and the one place a utility's exception becomes a
``UtilityErrorCode``. A mixin of engine/proc.py's EngineCoreProc (its core, lifecycle,
input queue and settings); the wire is engine/wire.py's."""

from __future__ import annotations

import inspect
import os
import time

import msgspec

from planaria.engine import envs
from planaria.engine.errors import (EngineStateError, FaultInjectionDisabledError, WeightLoadError,
                                    WeightLoadInProgressError)
from planaria.engine.lifecycle import EngineExit
from planaria.engine.wire import MsgType, UtilityCall, UtilityErrorCode, UtilityResult

FAULT_INJECTION_ENV = envs.FAULT_INJECTION


class UtilityCalls:
    def _utility(self, call: UtilityCall) -> UtilityResult:
        """Run ``_u_<method>(**args)``. The one place a utility's exception becomes a
        ``UtilityErrorCode``: callers decide on the code; the text is for people."""
        fn = getattr(self, f"_u_{call.method}", None)
        if fn is None:
            return UtilityResult(call_id=call.call_id, ok=False, engine_index=self.engine_index,
                                 error=f"unknown utility method {call.method!r}",
                                 code=UtilityErrorCode.UNKNOWN_METHOD.value)
        try:
            result = fn(**call.args)
        except EngineExit:
            raise
        except Exception as exc:  # the caller gets the error and its code; the engine goes on
            codes = ((WeightLoadInProgressError, UtilityErrorCode.CONFLICT),  # before its base
                     (WeightLoadError, UtilityErrorCode.BAD_ARGUMENT),
                     (EngineStateError, UtilityErrorCode.BAD_STATE),
                     (FaultInjectionDisabledError, UtilityErrorCode.PERMISSION),
                     (ValueError, UtilityErrorCode.BAD_ARGUMENT))
            code = next((c for t, c in codes if isinstance(exc, t)), UtilityErrorCode.INTERNAL)
            if isinstance(exc, TypeError):  # arguments that do not fit the utility: the caller's
                try:
                    inspect.signature(fn).bind(**call.args)
                except TypeError:
                    code = UtilityErrorCode.BAD_ARGUMENT
            return UtilityResult(call_id=call.call_id, ok=False, engine_index=self.engine_index,
                                 error=f"{type(exc).__name__}: {exc}", code=code.value)
        return UtilityResult(call_id=call.call_id, ok=True, result=result,
                             engine_index=self.engine_index)

    def _u_ping(self) -> dict:
        return {"pid": os.getpid(), "state": self.state.value, "step_counter": self.core.step_counter,
                "num_requests": len(self._req_slot), "time": time.time()}

    def _u_prefetch_kv(self, segment: str, token_ids: list[int], cache_salt: str | None = None) -> dict:
        """A survivor's share of a handover: copy the committed KV of a request of the
        draining engine whose segment is ``segment`` now (EngineCore.prefetch_kv)."""
        from planaria.engine.kv_segment import NAME_RE, segment_dir

        blocks = self.core.prefetch_kv(segment, token_ids, cache_salt)
        directory = segment_dir()
        # not seen: another node's engine (the frontend relays the blocks: engine/kv_transfer.py)
        seen = directory is not None and NAME_RE.match(segment) is not None and (directory / segment).exists()
        return {"blocks": blocks, "seen": seen}

    def _u_export_kv(self, token_ids: list[int], cache_salt: str | None = None, start_block: int = 0,
                     max_bytes: int = 8 << 20) -> dict:
        """A part of a handover's pre-copy to an engine of another node (engine/kv_transfer.py)."""
        from planaria.engine import kv_transfer

        return kv_transfer.export_kv(self.core, token_ids, cache_salt, start_block, max_bytes)

    def _u_import_kv(self, token_ids: list[int], hashes: list[int], data: bytes, fingerprint: bytes, layout: dict,
                     cache_salt: str | None = None, start_block: int = 0) -> dict:
        """The survivor's side of ``export_kv``: checked, then into the prefix cache."""
        from planaria.engine import kv_transfer

        return kv_transfer.import_kv(self.core, token_ids, hashes, data, fingerprint, layout, cache_salt, start_block)

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

    def _u_pause(self) -> str:  # EngineStateError (from the lifecycle) when not running
        self._carry_out(self.lifecycle.pause())
        return self.state.value

    def _u_resume(self) -> str:
        self._carry_out(self.lifecycle.resume())
        return self.state.value

    def _u_reset(self) -> str:
        self._carry_out(self.lifecycle.reset())
        return self.state.value

    def _u_fault_inject(self, kind: str, exit_code: int = 137, seconds: float = 3600.0) -> str:
        """Chaos tests only (PLANARIA_FAULT_INJECTION=1): "fatal" / "request" make the next
        model step raise; "exit" ends the process at once (no ENGINE_CORE_DEAD, like
        SIGKILL); "hang" blocks the loop (a hung step)."""
        if not self._fault_injection:
            raise FaultInjectionDisabledError(f"fault injection is disabled (set {FAULT_INJECTION_ENV}=1)")
        if kind in ("fatal", "request"):
            self.core.inject_step_fault(kind)
        elif kind == "exit":
            os._exit(exit_code)
        elif kind == "hang":
            time.sleep(seconds)
        else:
            raise ValueError(f"unknown fault kind {kind!r}")
        return kind
