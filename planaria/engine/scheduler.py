"""vLLM v1-style scheduler: one token budget per step, running requests first, chunked
prefill, recompute preemption, prefix-cache hits, FCFS or priority. Pure Python.
Siblings of one prompt (``group_id``, n > 1) prefill once (engine/prefix_groups.py).

``schedule()`` decides what runs and advances ``num_computed_tokens`` optimistically (so a
second batch can be scheduled while the first is in flight); ``update_from_output()``
applies the sampled tokens and decides which requests finished.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from planaria.engine.kv_cache_manager import KVCacheManager
from planaria.engine.prefix_groups import PrefixGroups
from planaria.engine.request import Request, RequestStatus


@dataclass(slots=True)
class ScheduledRequest:
    req: Request
    num_tokens: int  # tokens computed for this request in this step
    start_pos: int  # num_computed_tokens before this step
    block_ids: list[int]
    samples: bool  # the step ends at the last known token: a new token is sampled
    decode: bool = False  # one token with context before it: attention reads the paged cache


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    num_batched_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # The decodes' block tables, in the order of `scheduled`, a copy taken when the batch
    # was scheduled (KVCacheManager.decode_table): [decodes, most blocks of any] int64.
    decode_block_table: np.ndarray | None = None
    decode_ids: list[str] = field(default_factory=list)
    decode_num_blocks: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled


class _Waiting:
    """FCFS deque or a priority heap behind one interface."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._dq: deque[Request] = deque()
        self._heap: list[Request] = []

    def __len__(self) -> int:
        return len(self._dq) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        return iter(self._dq if self.policy == "fcfs" else sorted(self._heap))

    def add(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._dq.append(req)
        else:
            heapq.heappush(self._heap, req)

    def add_front(self, req: Request) -> None:  # preempted requests resume first
        if self.policy == "fcfs":
            self._dq.appendleft(req)
        else:
            heapq.heappush(self._heap, req)

    def peek(self) -> Request:
        return self._dq[0] if self.policy == "fcfs" else self._heap[0]

    def pop(self) -> Request:
        return self._dq.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)

    def remove(self, req: Request) -> None:
        if self.policy == "fcfs":
            self._dq.remove(req)
        else:
            self._heap.remove(req)
            heapq.heapify(self._heap)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, policy: str = "fcfs", enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.enable_chunked_prefill = enable_chunked_prefill
        self.requests: dict[str, Request] = {}
        self.waiting = _Waiting(policy)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed, first runs only (SchedulerStats)
        self.groups = PrefixGroups()
        self.admit_new = True  # False: waiting requests that never ran stay waiting (weight swap)

    # -- intake ---------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            return  # joins `waiting` when its grammar is ready (grammar_ready)
        self._enqueue(req)

    def grammar_ready(self, req: Request) -> None:
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        if not self.groups.hold(req):  # a sibling waits for its group's prefill
            self.waiting.add(req)

    def _release_siblings(self) -> None:
        """Held siblings whose leader's prompt is scheduled (or who no longer wait for it)
        go to the front of the queue: they arrived with their leader."""
        for req in reversed(self.groups.release()):
            self.waiting.add_front(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.requests) - len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        self._release_siblings()
        return bool(self.waiting) or any(not r.in_flight for r in self.running)

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._release_siblings()
        budget = self.max_num_batched_tokens

        # 1. Running requests, in order; preempt from the tail when blocks run out.
        i = 0
        max_model_len = self.max_model_len
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.in_flight:
                i += 1
                continue
            computed = req.num_computed_tokens
            num_new = min(len(req.all_token_ids) - computed, budget, max_model_len - computed)
            if num_new <= 0:
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req, num_new)
                if blocks is not None:
                    break
                victim = self._pick_victim()  # never one scheduled in this step: it is in flight
                if victim is None or victim is req:
                    self._preempt(req, out)
                    break
                self._preempt(victim, out)
                i = self.running.index(req)
            if req.status != RequestStatus.RUNNING:
                continue  # req itself was preempted; running[i] is now the next one
            self._emit(out, req, num_new, blocks)
            budget -= num_new
            i += 1

        # 2. Waiting requests, if nothing was preempted this step.
        self._release_siblings()  # a leader above may have scheduled its prompt's last chunk
        if not out.preempted_req_ids:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting.peek()
                if not self.admit_new and req.num_preemptions == 0:
                    break
                computed_blocks, num_computed = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_computed
                if num_new > budget:
                    if not self.enable_chunked_prefill:
                        break
                    num_new = budget
                req.num_computed_tokens = num_computed
                blocks = self.kv.allocate_slots(req, num_new, computed_blocks)
                if blocks is None:
                    req.num_computed_tokens = 0
                    break
                self.waiting.pop()
                req.status = RequestStatus.RUNNING
                if req.num_preemptions == 0:
                    req.num_cached_tokens = num_computed
                self.running.append(req)
                self._emit(out, req, num_new, blocks)
                budget -= num_new
                if self.groups.has_waiters(req.group_id):
                    self._release_siblings()  # into this very batch, if the budget allows
        out.num_batched_tokens = self.max_num_batched_tokens - budget
        if out.decode_ids:
            out.decode_block_table = self.kv.decode_table(out.decode_ids, out.decode_num_blocks)
        return out

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int, blocks: list[int]) -> None:
        start = req.num_computed_tokens
        end = req.num_computed_tokens = start + num_new
        num_prompt = len(req.prompt_token_ids)
        if start < num_prompt and not req.num_preemptions:
            self.num_prefill_tokens += min(end, num_prompt) - start
        req.in_flight = True
        decode = num_new == 1 and start > 0
        if decode:
            out.decode_ids.append(req.request_id)
            nb = start // self.kv.block_size + 1
            if nb > out.decode_num_blocks:
                out.decode_num_blocks = nb
        out.scheduled.append(ScheduledRequest(req, num_new, start, blocks, end == len(req.all_token_ids), decode))

    def preempt_running(self) -> list[str]:
        """Preempt every running request that is not in flight (they recompute their KV)."""
        out = SchedulerOutput()
        for req in [r for r in reversed(self.running) if not r.in_flight]:
            self._preempt(req, out)
        return out.preempted_req_ids

    def _pick_victim(self) -> Request | None:
        candidates = [r for r in self.running if not r.in_flight]
        if not candidates:
            return None
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_front(req)
        out.preempted_req_ids.append(req.request_id)

    # -- results --------------------------------------------------------------------------
    def update_from_output(self, sched: SchedulerOutput, sampled: list[int]) -> list[Request]:
        """Apply one sampled token per scheduled request (ignored where ``samples`` is
        False: a partial prefill). Returns the requests that got a token, finished or not;
        finished ones are already removed and their blocks freed."""
        touched: list[Request] = []
        running = RequestStatus.RUNNING
        for sr, token in zip(sched.scheduled, sampled):
            req = sr.req
            req.in_flight = False
            if req.status is not running or not sr.samples:
                continue  # aborted or preempted while in flight; or a partial prefill
            req.output_token_ids.append(token)  # Request.append_output_token, inlined (per token)
            req.all_token_ids.append(token)
            touched.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status)
        return touched

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        num_output = len(req.output_token_ids)
        if num_output >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if params.stop_token_ids and token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or len(req.all_token_ids) >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """Abort (or fail) requests wherever they are. Unknown ids are ignored."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                self.waiting.remove(req)
            # WAITING_FOR_PREFIX: _finish takes it out of its group's waiters
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING and req in self.running:
            self.running.remove(req)
        req.status = status
        self.kv.free(req)
        self.groups.remove(req)
        self.requests.pop(req.request_id, None)

    def stop_string_hit(self, req: Request) -> None:
        """A frontend-detected stop string: finish as 'stop'."""
        self.finish_requests([req.request_id], RequestStatus.FINISHED_STOPPED)
