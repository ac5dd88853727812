"""A handover to an engine that cannot read the draining engine's KV segment (another node,
engine/kv_transfer.py), with real engine processes and an EngineClient over real sockets:
each engine has a segment dir of its own, as engines of two nodes do. The draining engine
(SIGUSR2, what the supervisor sends for a drain with survivors) keeps decoding while the
client relays its request's committed blocks to the survivor (prefetch_kv says the segment
is not seen there; export_kv / import_kv in bounded parts), then takes the request back;
the move's replay finds the blocks in the survivor's prefix cache and its tokens are the
uninterrupted run's; the relay keeps to the client's byte rate."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import uuid
from pathlib import Path

import pytest

from planaria.engine.client import EngineClient
from planaria.engine.errors import EngineFaultError
from planaria.engine.kv_segment import SEGMENT_DIR_ENV
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams
from tests.engine._engine_procs import LoopThread, engine_config, spawn_engine, stop_engine

pytestmark = pytest.mark.timeout(240)
PROMPT = [20 + (11 * i) % 400 for i in range(200)]
NUM_OUT = 800  # long enough to be running still when the (rate-bound) relay is done
RATE = 4 << 20  # bytes/s of the relay (EngineClient.kv_transfer_bytes_per_s): ~0.1 s for its ~416 KiB


def _req(rid: str, prompt: list[int], max_tokens: int, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt),
                             sampling_params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                             **kw)


def test_a_handover_across_nodes_relays_the_kv_and_the_move_continues_exactly(tiny_moe, tmp_path):
    dirs = [Path("/dev/shm") / f"planaria-test-{uuid.uuid4().hex[:12]}" for _ in range(2)]
    for d in dirs:
        d.mkdir(mode=0o700)
    lt = LoopThread()
    client = EngineClient(num_engines=2, runtime_dir=tmp_path)
    client.kv_transfer_bytes_per_s = RATE
    in_addr, _ = client.bind()
    cfg = engine_config(Path(tiny_moe), max_model_len=1024, kv_cache_bytes=16 * 2**20)
    procs = [spawn_engine(i, in_addr, tmp_path, cfg, env={SEGMENT_DIR_ENV: str(dirs[i])}) for i in range(2)]
    try:
        lt.run(client.start(timeout_s=120), timeout_s=150)
        segments = [e.kv_segment for e in client.engines]
        assert all(segments), segments

        async def drained_stream() -> tuple[int, list[int]]:
            tokens: list[int] = []
            source = None
            try:
                async for out in client.generate(_req("moving", PROMPT, NUM_OUT)):
                    tokens += out.new_token_ids
                    if source is None and len(tokens) >= 8:
                        source = next(e.index for e in client.engines if e.num_routed)
                        os.kill(procs[source].pid, signal.SIGUSR2)
            except EngineFaultError:  # handed over: the frontend's journal moves it (below, by hand)
                return source, tokens
            raise AssertionError(f"the stream was not handed over ({len(tokens)} tokens)")

        source, emitted = lt.run(drained_stream(), timeout_s=120)
        target = 1 - source
        assert 8 <= len(emitted) < NUM_OUT
        stats = lt.run(client.call_utility(target, "get_stats"))
        relayed = stats["num_salvaged_blocks"] if isinstance(stats, dict) else stats.num_salvaged_blocks
        bs = client.engines[target].block_size
        assert relayed >= len(PROMPT) // bs, stats  # at least the prompt's blocks came over the wire
        # the relay kept to the client's rate (set low here)
        assert client.kv_transfer_bytes > 0 and client.kv_transfer_s >= client.kv_transfer_bytes / RATE, \
            (client.kv_transfer_bytes, client.kv_transfer_s)

        async def collect(req):
            return [o async for o in client.generate(req)]

        # the move: prompt + output so far, naming the source's segment (not seen there: refused)
        outs = lt.run(collect(_req("moving~r1", PROMPT + emitted, NUM_OUT - len(emitted),
                                   num_prior_output_tokens=len(emitted), kv_salvage=segments[source])))
        assert outs[0].num_cached_tokens >= len(PROMPT) // bs * bs
        moved = emitted + [t for o in outs for t in o.new_token_ids]
        reference = [t for o in lt.run(collect(_req("reference", PROMPT, NUM_OUT))) for t in o.new_token_ids]
        assert moved == reference
    finally:
        lt.run(client.close())
        for p in procs:
            stop_engine(p)
        lt.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
