"""A draining engine's requests handed over with their KV: EngineClient's side (a mixin of
engine/client.py's EngineClient; the engine's side is engine/proc.py, the design
docs/kv_salvage.md).

    _hand_over(index, pid)     for each of this client's requests on a draining engine (or
                               one offering them for a "hand_over" weight load), a survivor
                               copies its KV while the engine keeps decoding, then the engine
                               drops them and the journal moves each to the engine that copied
    _other_weights(index)      the engines a weight handover must not go to
    _transfer_kv(...)          the copy relayed through this client when the survivor cannot
                               read the engine's segment (another node; engine/kv_transfer.py),
                               bounded per part, in rate and in time
"""

from __future__ import annotations

import asyncio
import logging
import time

from planaria.engine.engine_info import EngineInfoState
from planaria.engine.errors import EngineDeadError
from planaria.engine.messages import REPLAY_ID_SEP

log = logging.getLogger("planaria.engine.client")

HANDOVER_PREFETCH_S = 3.0  # a survivor's KV copy for a handover, and the engine's hand_over, at most
HANDOVER_PIN_S = 30.0  # a moved request goes to the engine that copied its KV if it comes within this
MAX_HANDOVER_PINS = 4096
KV_TRANSFER_PART_BYTES = 8 << 20  # K/V per message of a relayed pre-copy (engine/kv_transfer.py)
KV_TRANSFER_BYTES_PER_S = 256 << 20  # and per second, per client (the network serves the streams too)


class Handover:
    """EngineClient's handover methods; they use its engines, streams, routing and
    utility calls."""

    async def _hand_over(self, index: int, pid: int | None) -> None:
        """Engine ``index`` drains handing its requests over (engine/proc.py): for each of
        this client's requests there, a survivor (routed as a new request would be) copies
        the KV committed so far from the engine's segment while the engine keeps decoding;
        then the engine drops them (utility "hand_over") and the journal moves them, each
        to the engine that copied its KV, where only what was committed since is copied."""
        info = self._engines.get(index)
        segment = info.kv_segment if info is not None else ""
        streams = [(rid, st) for rid, st in self._streams.items() if st.engine_index == index]
        # a drain hands over to any survivor; a "hand_over" weight load (the engine stays,
        # RUNNING) only to engines on its old weights with no load of their own in progress
        weights = info is not None and info.state == EngineInfoState.RUNNING
        exclude = {index}
        if streams and weights:
            exclude |= await self._other_weights(index)
            if len(exclude) >= len(self._engines):
                log.info("engine %d: no engine serves its old weights: its requests finish there", index)
                return

        async def prefetch(rid: str, st) -> None:  # st: client.py's _Stream
            req = st.request
            if req is None:
                return
            target = self._route(req, exclude, None).index
            if segment and req.sampling_params.prompt_logprobs is None:
                token_ids = list(req.prompt_token_ids) + st.output_ids
                salt = {"cache_salt": req.cache_salt} if req.cache_salt else {}
                try:
                    got = await self.call_utility(target, "prefetch_kv", {
                        "segment": segment, "token_ids": token_ids, **salt}, timeout_s=HANDOVER_PREFETCH_S)
                    if isinstance(got, dict) and got.get("seen") is False:  # another node: relay the blocks
                        await self._transfer_kv(index, target, token_ids, salt)
                except Exception as exc:  # noqa: BLE001 - the move copies everything itself then
                    log.info("engine %d: KV prefetch of %s on engine %d failed: %s", index, rid, target, exc)
                    if not weights:
                        return
            elif not weights:
                return
            # pinned: the move goes to the engine that copied its KV (a weight handover's
            # move also when the copy failed: that engine serves the old weights)
            now = time.monotonic()
            if len(self._handover_pins) > MAX_HANDOVER_PINS:  # pins of moves that never came
                self._handover_pins = {k: v for k, v in self._handover_pins.items() if v[1] > now - HANDOVER_PIN_S}
            self._handover_pins[rid.split(REPLAY_ID_SEP, 1)[0]] = (target, now)

        if not streams:
            return  # nothing of this client's there: the engine drains without waiting for it
        if weights and any(st.request is None for _, st in streams):
            return  # one it could not pin to the old weights: they finish there
        try:
            await asyncio.gather(*(prefetch(rid, st) for rid, st in streams))
            info = self._engines.get(index)
            if info is not None and info.pid == pid and info.state in (EngineInfoState.DRAINING,
                                                                       EngineInfoState.RUNNING):
                await self.call_utility(index, "hand_over", {}, timeout_s=HANDOVER_PREFETCH_S)
        except EngineDeadError as exc:  # gone meanwhile: its requests were failed over as a death
            log.info("engine %d: gone before the handover: %s", index, exc)
        except Exception as exc:  # noqa: BLE001 - the engine hands everything over at its deadline
            log.warning("engine %d: handover request failed: %s", index, exc)

    async def _other_weights(self, index: int) -> set[int]:
        """The engines a weight handover from ``index`` must not go to: those whose weight
        version differs from its, that have a load in progress, or that do not answer."""
        others = [e for e in self._engines.values() if e.index != index and e.state == EngineInfoState.RUNNING]
        results = await asyncio.gather(*(self.call_utility(i, "weight_status", {}, timeout_s=HANDOVER_PREFETCH_S)
                                         for i in [index] + [e.index for e in others]), return_exceptions=True)
        mine = results[0].get("version") if isinstance(results[0], dict) else None
        bad = {e.index for e in self._engines.values() if e.state != EngineInfoState.RUNNING}
        for e, r in zip(others, results[1:]):
            load = r.get("load") if isinstance(r, dict) else None
            busy = isinstance(load, dict) and load.get("state") in ("reading", "ready")
            if mine is None or not isinstance(r, dict) or r.get("version") != mine or busy:
                bad.add(e.index)
        return bad

    async def _transfer_kv(self, source: int, target: int, token_ids: list[int], salt: dict) -> int:
        """A handover's pre-copy to an engine that cannot read the source's segment (another
        node): the committed blocks relayed part by part (engine/kv_transfer.py), at most
        KV_TRANSFER_PART_BYTES each, one transfer at a time per client, at most
        ``kv_transfer_bytes_per_s`` (a part waits until the bytes before it are within the
        rate), within HANDOVER_PREFETCH_S; the number of blocks the target took."""
        deadline = time.monotonic() + HANDOVER_PREFETCH_S
        start = taken = 0
        async with self._transfer_lock:
            began, sent = time.monotonic(), 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                part = await self.call_utility(source, "export_kv", {
                    "token_ids": token_ids, "start_block": start, "max_bytes": KV_TRANSFER_PART_BYTES, **salt},
                    timeout_s=left)
                hashes = part.get("hashes") if isinstance(part, dict) else None
                data = part.get("data") if isinstance(part, dict) else None
                if not hashes or not isinstance(hashes, list) or not isinstance(data, (bytes, bytearray, memoryview)):
                    break
                due = began + (sent + len(data)) / self.kv_transfer_bytes_per_s  # the rate's bound
                if due >= deadline:
                    break
                if due > time.monotonic():
                    await asyncio.sleep(due - time.monotonic())
                got = await self.call_utility(target, "import_kv", {
                    "token_ids": token_ids, "hashes": hashes, "data": data,
                    "fingerprint": part.get("fingerprint"), "layout": part.get("layout"), "start_block": start,
                    **salt}, timeout_s=max(0.001, deadline - time.monotonic()))
                sent += len(data)
                taken += int(got.get("blocks", 0)) if isinstance(got, dict) else 0
                start += len(hashes)
                if start >= int(part.get("num_full_blocks") or 0):
                    break
            self.kv_transfer_bytes += sent
            self.kv_transfer_s += time.monotonic() - began
        return taken
