"""The shared-memory transport of expert-parallel ranks on one node (elastic/shm_group.py):
real processes mapping one segment; a peer SIGKILLed or leaving mid-collective is seen at
once (not at the collective timeout); hostile cards; the segment never outlives a group."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from planaria.elastic import shm_group
from planaria.elastic.errors import ElasticError
from planaria.elastic.shm_group import Layout, ShmCollectiveError, ShmGroup
from planaria.kernels import cpu_ext

pytestmark = pytest.mark.skipif(not cpu_ext.available(), reason="the C++ kernels are not built")

TIMEOUT_S = 30.0


def _layout(world: int = 2) -> Layout:
    return Layout(world, 16, 8, 2, torch.bfloat16)


def _rank(path, rank, world, peers, steps, die_at, q):
    g = ShmGroup(path, rank, _layout(world), peers, TIMEOUT_S)
    q.put(("mapped", rank, None))
    if die_at is not None:  # the queue's feeder thread dies with the process: flush it now
        q.close()
        q.join_thread()
    try:
        for i in range(steps):
            if i == die_at:
                os.kill(os.getpid(), signal.SIGKILL)
            t = torch.tensor([rank * 10 + i, -i], dtype=torch.long)
            g.all_reduce_max(t)
            assert t.tolist() == [(world - 1) * 10 + i, -i], t
        q.put(("done", rank, None))
    except ShmCollectiveError as exc:
        q.put(("error", rank, (str(exc), time.monotonic())))


def _run(world, steps, die_at=None, die_rank=1):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = shm_group.create_segment(0, _layout(world).size())
    # spawn children through a parent-side barrier: each learns the others' pids from the queue
    readers = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=_rank_wait_peers, args=(path, r, world, steps, die_at if r == die_rank else None,
                                                       readers[r], q)) for r in range(world)]
    for p in procs:
        p.start()
    peers = [(p.pid, shm_group.process_start(p.pid)) for p in procs]
    for rq in readers:
        rq.put(peers)
    try:
        mapped = [q.get(timeout=60) for _ in range(world)]
        assert all(m[0] == "mapped" for m in mapped), mapped
        os.unlink(path)  # every rank mapped it: the group keeps working without the file
        results = {}
        expect = world - (1 if die_at is not None else 0)
        for _ in range(expect):
            kind, rank, info = q.get(timeout=60)
            results[rank] = (kind, info, time.monotonic())
        return results
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        if os.path.exists(path):
            os.unlink(path)


def _rank_wait_peers(path, rank, world, steps, die_at, peers_q, q):
    peers = peers_q.get(timeout=60)
    _rank(path, rank, world, peers, steps, die_at, q)


def test_all_reduce_across_processes_many_rounds():
    results = _run(3, 300)
    assert {r: v[0] for r, v in results.items()} == {0: "done", 1: "done", 2: "done"}


def test_a_sigkilled_peer_is_seen_at_once_not_at_the_timeout():
    t0 = time.monotonic()
    results = _run(2, 10_000, die_at=50)
    kind, info, _ = results[0]
    assert kind == "error", results
    assert "gone" in info[0] or "left" in info[0]
    assert info[1] - t0 < 15.0 < TIMEOUT_S  # spawn start-up included; the detection is ~10 ms


def test_a_peer_that_leaves_wakes_the_waiters():
    path = shm_group.create_segment(1, _layout().size())
    try:
        me = (os.getpid(), shm_group.process_start(os.getpid()))
        a = ShmGroup(path, 0, _layout(), [me, me], TIMEOUT_S)
        b = ShmGroup(path, 1, _layout(), [me, me], TIMEOUT_S)
        b.close()  # rank 1 leaves without taking part in the next collective
        t0 = time.monotonic()
        with pytest.raises(ShmCollectiveError, match="left the group"):
            a.all_reduce_max(torch.zeros(2, dtype=torch.long))
        assert time.monotonic() - t0 < 1.0
    finally:
        os.unlink(path)


def test_segment_file_is_private_and_sized():
    lay = _layout()
    path = shm_group.create_segment(7, lay.size())
    try:
        st = os.stat(path)
        assert st.st_size == lay.size() and st.st_mode & 0o777 == 0o600
        with pytest.raises(ElasticError, match="expected"):
            ShmGroup(path, 0, Layout(2, 32, 8, 2, torch.bfloat16), [(1, 1), (1, 1)], 1.0)
    finally:
        os.unlink(path)


def test_dead_creators_segments_are_swept():
    d = shm_group.shm_dir()
    stale = os.path.join(d, f"planaria-ep-{os.getuid()}-999999999-3-deadbeef")
    open(stale, "wb").close()
    path = shm_group.create_segment(3, 4096)
    try:
        assert not os.path.exists(stale)
    finally:
        os.unlink(path)


def test_layout_fits_the_budget_or_declines():
    lay = Layout.fit(2, 576, 2, torch.bfloat16, 2048, 32 << 20)
    assert lay is not None and 16 <= lay.capacity <= 2048 and lay.size() <= 32 << 20
    assert Layout.fit(2, 576, 2, torch.bfloat16, 64, 32 << 20).capacity == 64
    assert Layout.fit(8, 8192, 8, torch.bfloat16, 2048, 1 << 20) is None


def test_cards_are_parsed_as_hostile_and_decide_alike():
    good = {"node": "n", "pid": 1, "start": 2, "shm": True}
    assert shm_group.shared_node([good, dict(good, pid=3)])
    assert not shm_group.shared_node([good])
    assert not shm_group.shared_node([good, dict(good, node="other")])
    assert not shm_group.shared_node([good, dict(good, shm=False)])
    for raw in (b"\xff", b"[1]", b'{"node": 1, "pid": 1, "start": 1}', b"{" * 10):
        with pytest.raises(ElasticError):
            shm_group.parse_card(raw)


def test_gloo_is_kept_when_asked(monkeypatch):
    monkeypatch.setenv(shm_group.ENV_TRANSPORT, "gloo")
    assert not shm_group.wanted()
    monkeypatch.setenv(shm_group.ENV_TRANSPORT, "auto")
    assert shm_group.wanted()


def test_assign_experts_shares_a_layers_experts_out_by_load():
    owner = [0, 0, 1, 1]
    # one token's two experts both on rank 0: one goes to rank 1
    assert shm_group.assign_experts([1, 1, 0, 0], owner, 2) == [0, 1, 1, 1]
    # already balanced: the owners keep them
    assert shm_group.assign_experts([1, 0, 1, 0], owner, 2) == [0, 0, 1, 1]
    # a heavy expert alone on one rank, the light ones on the other
    assert shm_group.assign_experts([50, 1, 1, 1], owner, 2) == [0, 1, 1, 1]
    # nothing active: the owners (nothing is computed)
    assert shm_group.assign_experts([0, 0, 0, 0], owner, 2) == owner
    # every active expert to one rank, each rank some, with three ranks
    got = shm_group.assign_experts([3, 3, 3, 3, 3, 3], [0, 0, 1, 1, 2, 2], 3)
    assert sorted(got.count(q) for q in range(3)) == [2, 2, 2]


_E, _H, _I, _K = 6, 32, 24, 2


def _experts():
    g = torch.Generator().manual_seed(7)
    return (torch.randn(_E, 2 * _I, _H, generator=g) * 0.2, torch.randn(_E, _H, _I, generator=g) * 0.2)


def _tokens(rank: int, layer: int, n: int):
    g = torch.Generator().manual_seed(100 * rank + layer)
    x = torch.randn(n, _H, generator=g)
    ids = torch.stack([torch.randperm(_E, generator=g)[:_K] for _ in range(n)]) if n else \
        torch.empty(0, _K, dtype=torch.long)
    if layer % 2:  # skewed: every token of every rank routed to experts 0 and 1 (rank 0's)
        ids = torch.tensor([[0, 1]] * n, dtype=torch.long).view(n, _K)
    return x, torch.rand(n, _K, generator=g), ids


def _moe_rank(path, rank, world, peers_q, q, node_keys, counts, capacity):
    import types

    peers = peers_q.get(timeout=60)
    g = ShmGroup(path, rank, Layout(world, capacity, _H, _K, torch.float32), peers, TIMEOUT_S)
    w13, w2 = _experts()
    owner = torch.tensor([e * world // _E for e in range(_E)])  # contiguous shares
    mine = (owner == rank).nonzero().view(-1).tolist()
    lo, hi = mine[0], mine[-1] + 1
    moe = types.SimpleNamespace(w13=w13[lo:hi].contiguous(), w2=w2[lo:hi].contiguous(), expert_start=lo,
                                num_experts=_E, node_w13=w13, node_w2=w2, node_key=node_keys[rank])
    outs = []
    for layer in range(4):  # rounds of `capacity` tokens: 6 tokens in rounds of 4 take two
        x, w, ids = _tokens(rank, layer, counts[rank])
        outs.append(g.moe(moe, x, w, ids, owner).numpy())  # by value: the process exits next
    q.put((rank, outs, g.balanced_layers))


@pytest.mark.parametrize("node_keys,counts", [((5, 5, 5), [1, 6, 0]), ((5, 0, 5), [1, 6, 0]),
                                              ((5, 6, 5), [1, 6, 0]), ((5, 5, 5), [1, 60, 0])],
                         ids=["balanced", "no-views", "other-file", "past-the-kernel"])
def test_moe_pairs_give_the_one_engine_bits_wherever_they_are_computed(node_keys, counts):
    """Shared out by load or computed by the owners, a layer's outputs are the one engine's,
    bit for bit, in the C++ kernel's regime; past it (a round of 61 tokens x 2 > 16 pairs x 6
    experts: the torch code, whose batched matmul would read every expert) the owners compute."""
    from planaria.kernels.moe import grouped_expert_mlp

    world = 3
    heavy = sum(counts) * _K > 16 * _E
    capacity = 64 if heavy else 4  # heavy: one round of all 61 tokens
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    path = shm_group.create_segment(0, Layout(world, capacity, _H, _K, torch.float32).size())
    readers = [ctx.Queue() for _ in range(world)]
    procs = [ctx.Process(target=_moe_rank, args=(path, r, world, readers[r], q, node_keys, counts, capacity))
             for r in range(world)]
    for p in procs:
        p.start()
    try:
        peers = [(p.pid, shm_group.process_start(p.pid)) for p in procs]
        for rq in readers:
            rq.put(peers)
        results = {}
        for _ in range(world):
            rank, outs, balanced = q.get(timeout=120)
            results[rank] = (outs, balanced)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        os.unlink(path)
    w13, w2 = _experts()
    for rank, (outs, balanced) in results.items():
        assert balanced == (4 if len(set(node_keys)) == 1 and not heavy else 0)
        for layer, got in enumerate(outs):
            x, w, ids = _tokens(rank, layer, counts[rank])
            want = grouped_expert_mlp(x, w13, w2, w, ids)  # one engine: every expert here
            if heavy:  # the torch code's sums follow its batch
                torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-5, atol=1e-5)
            else:
                assert torch.equal(torch.from_numpy(got), want), (rank, layer)


def test_the_kernels_share_out_experts_as_assign_experts_does():
    g = torch.Generator().manual_seed(3)
    for trial in range(200):
        world = 1 + trial % 4
        E = world * (1 + trial % 5)
        owner = torch.tensor([e * world // E for e in range(E)])
        n = int(torch.randint(0, 40, (1,), generator=g))
        ids = torch.randint(0, E, (n, 2), generator=g)
        if trial % 3 == 0:  # skewed
            ids = ids % max(1, E // 3)
        pairs = torch.bincount(ids.view(-1), minlength=E).tolist()
        want = shm_group.assign_experts(pairs, owner.tolist(), world)
        for rank in range(world):
            mine, rows = torch.ops.planaria.moe_share(ids, owner, world, rank, 1000, shm_group._EXPERT_COST)
            assert rows.tolist() == [a * 1000 for a in want]
            assert mine.tolist() == [[e if want[e] == rank else -1 for e in row] for row in ids.tolist()]
    with pytest.raises(RuntimeError, match="out of range"):  # a peer's ids are checked
        torch.ops.planaria.moe_share(torch.tensor([[0, 9]]), torch.tensor([0, 1]), 2, 0, 10, 16)
