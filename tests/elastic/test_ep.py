"""Expert parallelism across real processes (shared memory on one node, or gloo on
loopback): greedy outputs equal the single-engine outputs token for token, and a group
switch at a new world size keeps them."""

from __future__ import annotations

import socket

import pytest
import torch.multiprocessing as mp

from planaria.engine.config import EngineConfig
from planaria.engine.messages import EngineCoreRequest
from planaria.engine.sampling_params import SamplingParams

MAX_TOKENS = 10


def _prompts():
    import random

    rng = random.Random(7)
    return [[rng.randrange(3, 4096) for _ in range(n)] for n in (1, 3, 9, 17, 40, 64, 100, 5, 33, 70, 2, 12)]


def _invariant() -> bool:
    """The batch-invariant kernels where they are built: then a token gets the same bits
    whichever rank ran its experts and whatever its batch-mates (prompt logprobs included)."""
    import torch

    from planaria.kernels.linear import invariant_available

    return invariant_available(torch.device("cpu"), torch.float32)


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _params(i: int):
    # every third asks for prompt logprobs: computed on its rank alone, outside the collectives
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                          prompt_logprobs=2 if i % 3 == 0 else None)


def _rank_main(rank, model, world_sizes, port, result_q):
    """Each rank serves its share of prompts in lockstep; after the first half of the
    steps, every rank moves to epoch 1 at the second world size (if given)."""
    from planaria.elastic.ep import EPSpec, host_store
    from planaria.elastic.ep_engine import EPRank, make_ep_core
    from planaria.elastic.planner import expert_map

    store = host_store(f"127.0.0.1:{port}") if rank == 0 else None
    w0 = world_sizes[0]
    config = EngineConfig(model=model, kv_cache_bytes=32 * 2**20, max_num_seqs=8, batch_invariant=_invariant())
    num_experts = 8

    def spec(epoch, r, w):
        return EPSpec(epoch=epoch, rank=r if r < w else -1, world_size=w, rendezvous=f"127.0.0.1:{port}",
                      expert_map=expert_map(num_experts, w), timeout_s=20)

    ep = None
    core = None
    got: dict[str, list[int]] = {}
    steps = 0
    if rank < w0:
        core = make_ep_core(config, spec(0, rank, w0))
        ep = EPRank(core, spec(0, rank, w0))
        ep.form()
        for i, p in enumerate(_prompts()):
            if i % w0 == rank:
                core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=p, sampling_params=_params(i)))
    else:  # joins at epoch 1
        core = make_ep_core(config, spec(1, rank, world_sizes[1]))
        ep = EPRank(core, spec(1, rank, world_sizes[1]))
        ep.form()
    pending = None
    transports = [ep.group.transport]
    while True:
        any_work, switch_to, _exit = ep.sync(core.has_unfinished_requests(), pending)
        if switch_to is not None:
            if not ep.switch(pending):
                break  # left the group (scale-down); its requests were finished already
            pending = None
            continue  # the first call in a new group is always the sync
        if not any_work:
            break
        outs, _ = core.step(force_forward=True)
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                got[f"{o.request_id}:prompt"] = [lp.logprobs[0] for lp in o.prompt_logprobs]
        steps += 1
        if steps == 4 and len(world_sizes) > 1 and rank < w0:
            pending = spec(1, rank, world_sizes[1])
    got["transport"] = ep.group.transport if ep.group is not None else transports[-1]
    shm = ep.group.shm if ep.group is not None else None
    got["balanced"] = shm.balanced_layers if shm is not None else 0
    result_q.put((rank, got))
    del store


def _run(model, world_sizes, transport="shm", balanced=None):
    """Every rank's outputs merged; ``balanced``: whether the ranks shared each layer's
    experts out by load (None: not checked)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    n = max(world_sizes)
    procs = [ctx.Process(target=_rank_main, args=(r, model, world_sizes, port, q)) for r in range(n)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(n):
            rank, got = q.get(timeout=240)
            results[rank] = got
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    merged = {}
    for got in results.values():
        merged.update(got)
    assert {got["transport"] for got in results.values()} == {transport}
    if balanced is not None:
        assert all(bool(got["balanced"]) == balanced for got in results.values()), \
            [got["balanced"] for got in results.values()]
    del merged["transport"], merged["balanced"]
    return merged


@pytest.fixture(scope="module")
def reference(tiny_moe):
    from planaria.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=tiny_moe, kv_cache_bytes=32 * 2**20, max_num_seqs=8,
                                   batch_invariant=_invariant()))
    for i, p in enumerate(_prompts()):
        core.add_request(EngineCoreRequest(request_id=str(i), prompt_token_ids=p, sampling_params=_params(i)))
    got: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for o in core.step()[0]:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.prompt_logprobs is not None:
                got[f"{o.request_id}:prompt"] = [lp.logprobs[0] for lp in o.prompt_logprobs]
    return got


def _assert_same(got: dict, reference: dict) -> None:
    """Tokens equal; prompt logprobs equal up to float32 reduction order (experts summed
    across ranks)."""
    assert got.keys() == reference.keys() and sum(k.endswith(":prompt") for k in got) == 4
    for key, want in reference.items():
        if key.endswith(":prompt"):
            assert got[key] == pytest.approx(want, abs=1e-4), key
        else:
            assert got[key] == want, key


def test_ep_two_ranks_equals_single_engine(tiny_moe, reference):
    # one node: the shared-memory transport, each layer's experts shared out by load (both
    # ranks map the node's expert cache)
    got = _run(tiny_moe, [2], balanced=True)
    _assert_same(got, reference)
    if _invariant():  # every pair combined by the one-engine code: the same bits
        assert got == reference


def test_ep_two_ranks_owners_compute_without_the_expert_cache(tiny_moe, reference, monkeypatch):
    monkeypatch.setenv("PLANARIA_EXPERT_CACHE", "0")  # experts read from the checkpoint: no node views
    got = _run(tiny_moe, [2], balanced=False)
    _assert_same(got, reference)
    if _invariant():
        assert got == reference


def test_ep_two_ranks_over_gloo_equals_single_engine(tiny_moe, reference, monkeypatch):
    monkeypatch.setenv("PLANARIA_EP_TRANSPORT", "gloo")  # ranks on other nodes use gloo
    got = _run(tiny_moe, [2], "gloo")
    _assert_same(got, reference)
    if _invariant():
        assert got == reference


@pytest.mark.slow  # make test-all (the default suite stays within CI's time; see README)
def test_ep_switch_two_to_three_keeps_outputs(tiny_moe, reference):
    # Ranks 0-1 start at epoch 0; rank 2 joins at epoch 1 (world 3); experts re-homed.
    _assert_same(_run(tiny_moe, [2, 3]), reference)
