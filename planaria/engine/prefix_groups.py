"""Sibling requests that share one prompt (``n > 1``): one prefill, the rest from the cache.

The frontend turns a request with ``n`` (or ``best_of``) choices into that many engine
requests with the same prompt and one ``group_id``, and sends them to one engine. Were they
all admitted at once, each would prefill the prompt: the prefix cache only knows a block
once a request has computed it. So the first sibling to arrive (the group's leader) is
admitted as usual, and the others wait as ``WAITING_FOR_PREFIX`` until the leader's prompt
has been computed (its full blocks are then in the prefix cache, shared by reference
count); then they join the waiting queue, and admission finds the prompt's full blocks as
cache hits, so each recomputes at most the prompt's last, partial block.

"Computed" means scheduled: the KV cache manager caches a block when it is allocated, and
a batch writes each layer's new keys and values before that layer's attention reads them,
so a sibling may run in the very batch whose leader computes the prompt's last chunk (or
in a later batch, queued behind it). The siblings are let go in the same ``schedule()``
call, at the front of the queue (they arrived with the leader). What the group prevents:
with a chunked prompt and a second batch scheduled while the first is in flight, a
sibling would compute the leader's next chunk itself (tests/engine/test_prefix_groups.py).

A sibling that wants prompt logprobs cannot take cached blocks (every position must run
through the model), so it never waits; it may lead, though (it computes the prompt and
its blocks are cached as anyone's): the frontend asks only the first sibling for them.

A waiter is also let go when the leader finished, was aborted or preempted (its blocks
may be gone; the waiters then simply prefill). A sibling that arrives after its leader's
prompt was scheduled is admitted at once. Pure Python, like the scheduler that owns it.
"""

from __future__ import annotations

from planaria.engine.request import Request, RequestStatus


class PrefixGroups:
    def __init__(self) -> None:
        self._leaders: dict[str, Request] = {}  # group_id -> the sibling that prefills
        self._waiters: dict[str, list[Request]] = {}  # group_id -> siblings held back

    def __len__(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    def hold(self, req: Request) -> bool:
        """Whether ``req`` (about to join the waiting queue) waits for its group's leader
        instead; the first of a group becomes its leader and is not held."""
        gid = req.group_id
        if gid is None or req.num_preemptions:
            return False
        leader = self._leaders.get(gid)
        if leader is None or leader is req or not _prefilling(leader):
            self._leaders[gid] = req
            return False
        if req.wants_prompt_logprobs:
            return False  # runs every prompt position itself: nothing to wait for
        req.status = RequestStatus.WAITING_FOR_PREFIX
        self._waiters.setdefault(gid, []).append(req)
        return True

    def has_waiters(self, group_id: str | None) -> bool:
        return group_id is not None and group_id in self._waiters

    def release(self) -> list[Request]:
        """The held siblings whose leader no longer needs them to wait, in arrival order;
        they are WAITING again and the caller queues them. A finished leader, kept only for
        this, goes with them."""
        if not self._waiters:
            return []
        out: list[Request] = []
        for gid in [g for g in self._waiters if not _prefilling(self._leaders[g])]:
            for req in self._waiters.pop(gid):
                req.status = RequestStatus.WAITING
                out.append(req)
            if self._leaders[gid].status.finished:
                del self._leaders[gid]
        return out

    def remove(self, req: Request) -> None:
        """``req`` ends (finished, aborted): out of its group's waiters; a leader is kept
        until its group has no live member, so ``release`` sees it has finished."""
        gid = req.group_id
        if gid is None:
            return
        waiters = self._waiters.get(gid)
        if waiters and req in waiters:
            waiters.remove(req)
            if not waiters:
                del self._waiters[gid]
        leader = self._leaders.get(gid)  # req itself, or one that ended before its last waiter
        if leader is not None and leader.status.finished and gid not in self._waiters:
            del self._leaders[gid]


def _prefilling(leader: Request) -> bool:
    """The leader's prompt is not yet all scheduled, and will be: it waits to be admitted
    (not preempted), or chunks of it are still to be scheduled."""
    status = leader.status
    if status.finished or status == RequestStatus.PREEMPTED or leader.num_preemptions:
        return False
    if status in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR):
        return True
    return leader.num_computed_tokens < leader.num_prompt_tokens
