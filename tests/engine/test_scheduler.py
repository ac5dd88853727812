"""Scheduler tables: budgets, chunked prefill, preemption, prefix hits, priorities."""

import pytest

from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.request import Request, RequestStatus
from planaria.engine.sampling_params import SamplingParams
from planaria.engine.scheduler import Scheduler


def req(rid, n_prompt, max_tokens=4, priority=0, t=0.0, base=0, **sp):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_id=None, max_tokens=max_tokens, arrival_time=t, priority=priority)


def sched(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=128, policy="fcfs", chunked=True):
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget, max_len, policy, chunked)


def run_step(s, token=1):
    out = s.schedule()
    s.update_from_output(out, [token] * len(out.scheduled))
    return out


def test_budget_and_chunked_prefill():
    s = sched(budget=16)
    s.add_request(req("a", 40))
    out = s.schedule()
    assert [(x.req.request_id, x.num_tokens, x.samples) for x in out.scheduled] == [("a", 16, False)]
    s.update_from_output(out, [5])
    assert s.requests["a"].num_output_tokens == 0  # partial prefill samples nothing
    run_step(s)
    out = s.schedule()
    assert out.scheduled[0].num_tokens == 8 and out.scheduled[0].samples
    s.update_from_output(out, [5])
    assert s.requests["a"].output_token_ids == [5]


def test_no_chunking_waits_for_budget():
    s = sched(budget=16, chunked=False)
    s.add_request(req("big", 40))
    assert s.schedule().empty


def test_running_first_then_waiting_decode_budget():
    s = sched(budget=10)
    s.add_request(req("a", 6))
    run_step(s)
    s.add_request(req("b", 20, base=100))
    out = s.schedule()
    # a decodes (1 token) before b's prefill chunk takes the rest of the budget
    assert [(x.req.request_id, x.num_tokens) for x in out.scheduled] == [("a", 1), ("b", 9)]


def test_max_num_seqs_limits_running():
    s = sched(max_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, base=10 * i))
    out = s.schedule()
    assert len(out.scheduled) == 2 and s.num_waiting == 2


def test_finish_on_max_tokens_and_stop_ids_and_eos():
    s = sched()
    s.add_request(req("len", 3, max_tokens=2))
    s.add_request(req("stop", 3, max_tokens=10, base=50, stop_token_ids=[9]))
    r = req("eos", 3, max_tokens=10, base=90)
    r.eos_token_id = 7
    s.add_request(r)
    run_step(s, token=1)
    out = s.schedule()
    s.update_from_output(out, [1, 9, 7])
    assert s.requests == {}
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_min_tokens_defers_stop_and_ignore_eos():
    s = sched()
    r = req("m", 3, max_tokens=5, min_tokens=2)
    r.eos_token_id = 7
    s.add_request(r)
    run_step(s, token=7)
    assert r.status == RequestStatus.RUNNING
    run_step(s, token=7)
    assert r.status == RequestStatus.FINISHED_STOPPED
    s2 = sched()
    r2 = req("i", 3, max_tokens=3, ignore_eos=True)
    r2.eos_token_id = 7
    s2.add_request(r2)
    for _ in range(3):
        run_step(s2, token=7)
    assert r2.status == RequestStatus.FINISHED_LENGTH and r2.output_token_ids == [7, 7, 7]


def test_preemption_recompute_when_blocks_run_out():
    s = sched(num_blocks=4, block_size=4, budget=64)
    s.add_request(req("a", 7, max_tokens=20, t=0))
    s.add_request(req("b", 7, max_tokens=20, t=1, base=100))
    run_step(s)  # both prefilled: 7 tokens in 2 blocks each, the pool is full
    run_step(s)  # token 8 still fits in the second block
    assert s.num_preemptions == 0
    run_step(s)  # token 9 needs a third block -> b (the tail) is preempted
    b = [r for r in s.waiting][0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.num_preemptions == 1
    # b keeps its output tokens and recomputes prompt + outputs when resumed.
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    sr = out.scheduled[0]
    # Resumed from its own cached full block (a prefix hit), then everything else.
    assert sr.req is b and sr.start_pos == 4 and sr.start_pos + sr.num_tokens == b.num_tokens == 9


def test_prefix_hit_counts_cached_tokens():
    s = sched(block_size=4)
    s.add_request(req("a", 9))
    run_step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    r = req("b", 9)
    s.add_request(r)
    out = s.schedule()
    assert out.scheduled[0].start_pos == 8 and out.scheduled[0].num_tokens == 1
    assert r.num_cached_tokens == 8


def test_priority_policy_orders_waiting_and_preempts_lowest():
    s = sched(policy="priority", max_seqs=1)
    s.add_request(req("low", 3, priority=5, t=0))
    s.add_request(req("high", 3, priority=0, t=1, base=10))
    out = s.schedule()
    assert out.scheduled[0].req.request_id == "high"


def test_abort_anywhere_frees_blocks():
    s = sched(num_blocks=8)
    s.add_request(req("a", 5))
    s.add_request(req("b", 5, base=20))
    run_step(s)
    s.add_request(req("c", 5, base=40))
    done = s.finish_requests(["a", "c", "nope"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"a", "c"}
    assert s.kv.pool.num_free_blocks == 8 - 2


def test_in_flight_requests_are_not_rescheduled():
    s = sched()
    s.add_request(req("a", 3))
    first = s.schedule()
    assert s.schedule().empty  # a is in flight
    s.update_from_output(first, [1])
    assert not s.schedule().empty


@pytest.mark.parametrize("first, later, victim", [
    # (id, priority, arrival) admitted in step 1, then one more in step 2 (the running tail)
    ([("lo_a", 5, 0.0), ("lo_b", 5, 1.0)], ("hi", 0, 2.0), "lo_b"),  # lowest priority, not the tail
    ([("x", 5, 0.0), ("y", 5, 2.0)], ("z", 5, 1.0), "y"),  # equal priority: the latest arrival
])
def test_priority_preemption_picks_lowest_priority_latest_arrival(first, later, victim):
    """3 blocks of 4 tokens: two 3-token prompts and a 2-token one fill the pool; in step 3
    the first request's next token needs a block, so one of the other two is preempted.
    FCFS takes the running tail (the last admitted); priority takes the lowest priority
    (the largest value), and among equals the latest arrival."""
    for policy in ("priority", "fcfs"):
        s = sched(num_blocks=3, block_size=4, budget=64, policy=policy)
        for i, (rid, prio, t) in enumerate(first):
            s.add_request(req(rid, 3, max_tokens=8, priority=prio, t=t, base=100 * i))
        run_step(s)
        rid, prio, t = later
        s.add_request(req(rid, 2, max_tokens=8, priority=prio, t=t, base=900))
        run_step(s)
        assert [r.request_id for r in s.running] == [first[0][0], first[1][0], rid]
        assert s.kv.pool.num_free_blocks == 0
        out = run_step(s)
        if policy == "fcfs":
            assert out.preempted_req_ids[0] == rid  # the tail, whatever its priority
            continue
        assert out.preempted_req_ids == [victim]
        assert {sr.req.request_id for sr in out.scheduled} == {first[0][0], first[1][0], rid} - {victim}
        assert s.requests[victim].status == RequestStatus.PREEMPTED


def test_decode_block_table_follows_every_request_blocks():
    """The decodes' block table copied at scheduling (KVCacheManager.block_table rows,
    kept as blocks come and go) equals each request's block list, 0-padded: through row
    and column growth (40 requests, 30-block prompts), preemption (a pool too small for
    all), prefix hits (shared prompt heads) and finished requests' rows reused."""
    import random

    rng = random.Random(0)
    s = sched(num_blocks=120, block_size=4, max_seqs=40, budget=256, max_len=256)
    for i in range(40):
        s.add_request(req(f"r{i}", rng.randint(5, 120), max_tokens=rng.randint(1, 40), base=1000 * (i % 3)))
    checked = 0
    while s.requests:
        out = s.schedule()
        decodes = [x for x in out.scheduled if x.decode]
        assert [x.req.request_id for x in decodes] == out.decode_ids
        if decodes:
            table = out.decode_block_table
            assert table.shape == (len(decodes), max(x.start_pos // 4 + 1 for x in decodes))
            for row, x in zip(table.tolist(), decodes):
                n = min(len(x.block_ids), len(row))
                assert row[:n] == x.block_ids[:n] and not any(row[n:])
                assert x.start_pos // 4 < len(x.block_ids)
                checked += 1
        s.update_from_output(out, [7] * len(out.scheduled))
        kv = s.kv
        free_rows = set(range(kv.block_table.shape[0])) - set(kv.table_rows.values())
        assert not kv.block_table[sorted(free_rows)].any()  # a freed row is zeroed for its next owner
    assert checked > 200 and s.num_preemptions > 0
    assert kv.block_table.shape[0] >= 32 and kv.block_table.shape[1] >= 32  # both grew
