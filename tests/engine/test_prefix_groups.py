"""n > 1 siblings (one group_id) prefill once: the scheduler holds them back until the
first one's prompt is in the prefix cache (engine/prefix_groups.py)."""

from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.request import Request, RequestStatus
from planaria.engine.sampling_params import SamplingParams, sibling_seed
from planaria.engine.scheduler import Scheduler


def req(rid, n_prompt=18, max_tokens=4, group="g", **sp):
    return Request(rid, list(range(100, 100 + n_prompt)), SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_id=None, max_tokens=max_tokens, arrival_time=0.0, group_id=group)


def sched(budget=64, block_size=4, num_blocks=64, max_seqs=8):
    return Scheduler(KVCacheManager(num_blocks, block_size), max_seqs, budget, 128)


def step(s, token=7):
    out = s.schedule()
    s.update_from_output(out, [token] * len(out.scheduled))
    return out


def scheduled(out):
    return [(x.req.request_id, x.num_tokens) for x in out.scheduled]


def test_siblings_wait_for_the_first_prefill_then_hit_the_cache():
    s = sched()
    for r in ("a", "b", "c", "d"):
        s.add_request(req(r))
    assert [s.requests[r].status for r in "bcd"] == [RequestStatus.WAITING_FOR_PREFIX] * 3
    assert s.num_waiting == 4
    out = step(s)
    # the leader prefills; in the same batch each sibling takes the 4 full blocks (16
    # tokens) from the cache and computes only the prompt's last, partial block (2 tokens)
    assert scheduled(out) == [("a", 18), ("b", 2), ("c", 2), ("d", 2)]
    assert [s.requests[r].num_cached_tokens for r in "bcd"] == [16, 16, 16]
    assert s.num_prefill_tokens == 18 + 3 * 2


def test_two_batches_in_flight_without_a_group_prefill_the_prompt_twice():
    # The prefix cache alone shares blocks only once they were scheduled: with a chunked
    # prompt and a second batch scheduled while the first is in flight (the batch queue),
    # the sibling computes the leader's next chunk itself. The group holds it back.
    for group, second in ((None, [("b", 8)]), ("g", [])):
        s = sched(budget=8)
        s.add_request(req("a", group=group))
        s.add_request(req("b", group=group))
        assert scheduled(s.schedule()) == [("a", 8)]
        assert scheduled(s.schedule()) == second


def test_a_chunked_leader_holds_its_siblings_until_its_last_chunk_is_scheduled():
    s = sched(budget=8)
    s.add_request(req("a"))
    s.add_request(req("b"))
    assert scheduled(step(s)) == [("a", 8)]
    assert s.requests["b"].status == RequestStatus.WAITING_FOR_PREFIX
    assert scheduled(step(s)) == [("a", 8)]
    assert scheduled(step(s)) == [("a", 2), ("b", 2)]  # with the last chunk
    assert s.num_prefill_tokens == 18 + 2


def test_siblings_are_let_go_when_the_leader_ends_before_them():
    s = sched()
    s.add_request(req("a", max_tokens=1))
    s.add_request(req("b"))
    s.add_request(req("c", group="h", max_tokens=1))
    s.add_request(req("d", group="h"))
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)  # the leader ends first
    assert s.has_schedulable_requests()  # d is waiting again, not stranded
    assert s.requests["d"].status == RequestStatus.WAITING


def test_an_aborted_leader_releases_its_siblings_and_an_aborted_sibling_leaves():
    s = sched()
    for r in ("a", "b", "c"):
        s.add_request(req(r))
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out = step(s)
    assert scheduled(out) == [("b", 18)]  # nothing cached: b prefills itself
    assert "c" not in s.requests and not s.groups._waiters and len(s.groups) == 0
    assert not s.groups._leaders  # the ended leader went with its released sibling


def test_a_leader_that_ended_is_forgotten_when_its_last_waiter_is_aborted():
    s = sched()
    s.add_request(req("a"))
    s.add_request(req("b"))
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)  # kept: b still waits on it
    s.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert not s.groups._leaders and not s.groups._waiters and not s.requests


def test_a_sibling_arriving_after_the_prefill_is_admitted_at_once():
    s = sched()
    s.add_request(req("a"))
    step(s)
    s.add_request(req("b"))
    assert s.requests["b"].status == RequestStatus.WAITING
    assert scheduled(step(s)) == [("a", 1), ("b", 2)]
    assert len(s.groups) == 0


def test_preempted_siblings_recompute_without_waiting_again():
    s = sched()
    s.add_request(req("a"))
    s.add_request(req("x", group="other"))
    s.add_request(req("b", group="other"))
    out = s.schedule()
    s.update_from_output(out, [7] * len(out.scheduled))
    assert s.preempt_running()  # a and x (b ran with x): all recompute
    assert s.requests["a"].num_preemptions == 1
    out = step(s)
    assert {rid for rid, _ in scheduled(out)} >= {"a", "x"}


def test_a_request_wanting_prompt_logprobs_is_never_held():
    s = sched()
    s.add_request(req("a"))
    b = req("b", prompt_logprobs=0)
    b.prompt_logprobs = []
    s.add_request(b)
    assert scheduled(step(s)) == [("a", 18), ("b", 18)]


def test_sibling_seeds():
    assert [sibling_seed(5, j) for j in range(3)] == [5, 6, 7]
    assert sibling_seed(None, 3) is None
    assert sibling_seed(2**63 - 1, 1) == -(2**63)  # wraps inside int64


def test_offline_llm_n_shares_one_prefill_and_seeds_each_sibling(tiny_moe):
    from planaria.engine import LLM

    llm = LLM(tiny_moe, kv_cache_bytes=8 * 2**20, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=32,
              num_threads=1, block_size=16)
    prompt = list(range(3, 103))  # 100 tokens: prefilled in chunks of 32
    sp = SamplingParams(n=4, seed=5, temperature=1.0, max_tokens=8, ignore_eos=True)
    before = llm.core.scheduler.num_prefill_tokens
    (out,) = llm.generate([prompt], sp)
    used = llm.core.scheduler.num_prefill_tokens - before
    texts = [o.token_ids for o in out.outputs]
    assert len(texts) == 4 and len({tuple(t) for t in texts}) == 4
    assert 100 <= used <= 100 + 3 * 16
    singles = [llm.generate([prompt], SamplingParams(seed=5 + j, temperature=1.0, max_tokens=8, ignore_eos=True))[0]
               for j in range(4)]
    assert [s.token_ids for s in singles] == texts
