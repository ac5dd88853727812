"""An EngineCore made expert-parallel, and the lockstep step of one EP rank.

Every rank of an epoch runs the same sequence of steps: each step begins with one small
all-reduce that tells every rank whether any rank has work, whether every rank is leaving,
and which epoch each rank votes to move to; then every rank runs one forward (a dummy over
zero tokens when it has nothing of its own), so the MoE collectives of all ranks line up.

A switch to a newer epoch is prepare -> commit (elastic/ep.py): a rank of the current
group votes for a pending epoch only once every rank joining it (a rank not in the current
group) has arrived in the store, so the current group goes on serving while the joiners
get there. The group moves at the step where every rank that *continues* in the new epoch
voted for it (``sync_verdict``; a second one-flag all-reduce spreads that verdict to all):
the ranks it leaves out go at that boundary, whether they saw the epoch (they leave, their
requests move to survivors) or not (a node cut off from etcd: its ranks see the group move
on and drop out of it). A joiner that never arrives stalls nothing: the leader aborts the
switch with a newer epoch. The same all-reduce lets a whole group leave together (every
rank draining, no work anywhere), so no rank ever exits while its peers are inside a
collective with it.
"""

from __future__ import annotations

import time
from typing import Callable, NamedTuple

import torch

from planaria.elastic.ep import (CollectiveError, EPGroup, EPSpec, ExpertParallel, apply_expert_parallel,
                        arrive, arrived, connect_store)


class SyncResult(NamedTuple):
    any_work: bool  # some rank has work: every rank runs a forward (a dummy without work)
    switch_to: int | None  # the group moves to this epoch now (ranks it does not name leave)
    exit: bool  # every rank is leaving and none has work: leave together now


def sync_verdict(current_ranks: list[str], new_ranks: list[str], votes: list[int], newest: int) -> bool:
    """Whether the group moves to epoch ``newest`` now: every rank of the current group
    that continues in it (``new_ranks`` names it) voted for it. A rank that leaves need not
    have seen it: a node cut off from etcd never learns the epoch that drops its ranks, and
    the rest of the group must not wait on it; it sees the group move on and drops out.
    Engine ids unknown (``current_ranks`` empty): every rank must have voted for it."""
    if not current_ranks:
        return all(v == newest for v in votes)
    staying = set(new_ranks)
    return all(v == newest for eid, v in zip(current_ranks, votes) if eid in staying)


class EPRank:
    """Owns the group of the current epoch for one engine core."""

    def __init__(self, core, spec: EPSpec, bind_host: str | None = None) -> None:
        self.core = core
        self.spec = spec
        self.bind_host = bind_host  # gloo's address (None: the one that routes to the store)
        self.group: EPGroup | None = None
        self.switch_times_s: dict[str, float] = {}
        self._store = None
        self._store_addr = ""

    # -- the rendezvous store ----------------------------------------------------------------
    def store(self, rendezvous: str):
        if self._store is None or self._store_addr != rendezvous:
            self._store = connect_store(rendezvous)
            self._store_addr = rendezvous
        return self._store

    def arrive(self, spec: EPSpec) -> None:
        """Prepare: this rank is at the switch point of ``spec``."""
        arrive(self.store(spec.rendezvous), spec)

    def all_arrived(self, spec: EPSpec) -> bool:
        return arrived(self.store(spec.rendezvous), spec.epoch, list(range(spec.world_size)))

    def joiners_arrived(self, spec: EPSpec) -> bool:
        """Every rank of ``spec`` that is not in the current group has arrived."""
        if self.group is None:
            joiners = list(range(spec.world_size))
        elif spec.ranks and self.spec.ranks:
            current = set(self.spec.ranks)
            joiners = [r for r, e in enumerate(spec.ranks) if e not in current]
        else:  # engine ids unknown: the ranks beyond the current world join
            joiners = list(range(self.spec.world_size, spec.world_size))
        return arrived(self.store(spec.rendezvous), spec.epoch, joiners)

    # -- forming and switching ---------------------------------------------------------------
    def form(self, spec: EPSpec | None = None, wait_s: float = 300.0) -> None:
        """Blocking prepare + commit (tests and the first group of a rank that has nothing
        else to do): arrive, wait for every rank, build the group."""
        spec = spec or self.spec
        self.arrive(spec)
        deadline = time.monotonic() + wait_s
        while not self.all_arrived(spec):
            if time.monotonic() > deadline:
                raise CollectiveError(f"epoch {spec.epoch}: not every rank arrived within {wait_s} s")
            time.sleep(0.005)
        self.commit(spec)

    def commit(self, spec: EPSpec, abandon: Callable[[], bool] | None = None) -> None:
        """Build ``spec``'s group (every rank has arrived) and route the MoE layers through it;
        ``abandon()`` true gives the forming up (CollectiveError): a newer epoch was written."""
        t0 = time.monotonic()
        self.group = EPGroup(spec, self.store(spec.rendezvous), bind_host=self.bind_host, abandon=abandon)
        runner = self.core.runner
        self.group.attach_shm(runner.spec.hidden_size, runner.spec.top_k, runner.dtype,
                              self.core.config.max_num_batched_tokens)
        self.spec = spec
        apply_expert_parallel(self.core.runner.model, ExpertParallel(self.group, spec.expert_map))
        self.switch_times_s["form_group_s"] = time.monotonic() - t0

    def sync(self, has_work: bool, pending: EPSpec | None = None, leaving: bool = False) -> SyncResult:
        """The small all-reduce that opens every lockstep step; every rank gets the same
        answer (``sync_verdict``).

        ``pending``: the newer epoch this rank may switch to now (its joiners arrived);
        ``leaving``: this rank is draining. Round 1 gathers, per rank, its work, whether it
        is leaving and the epoch it votes for. Only when some rank votes for a newer epoch,
        a round 2 (one more flag) spreads the verdict of the ranks that know that epoch:
        every rank that continues in it voted for it."""
        w = self.spec.world_size
        t = torch.zeros(2 + w, dtype=torch.long)
        t[0], t[1] = int(has_work), int(not leaving)
        t[2 + self.spec.rank] = pending.epoch if pending is not None else self.spec.epoch
        self.group.all_reduce_max(t)
        votes = [int(v) for v in t[2:]]
        newest = max(votes)
        if newest <= self.spec.epoch:
            return SyncResult(bool(t[0]), None, not bool(t[1]) and not bool(t[0]))
        knows = pending is not None and pending.epoch == newest
        verdict = torch.tensor([int(knows and sync_verdict(self.spec.ranks, pending.ranks, votes, newest))],
                               dtype=torch.long)
        self.group.all_reduce_max(verdict)
        return SyncResult(bool(t[0]), newest if verdict[0] else None, False)

    def leave(self) -> None:
        """Drop the current group (the MoE layers go back to local)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
        apply_expert_parallel(self.core.runner.model, None)

    def switch(self, new: EPSpec, abandon: Callable[[], bool] | None = None) -> bool:
        """Move to ``new``: leave the old group, re-home experts, arrive, build the new
        group. Returns False when this rank is not part of the new epoch (it should leave).
        Raises CollectiveError when the new group cannot form (or ``abandon()`` says to
        give it up)."""
        t0 = time.monotonic()
        self.leave()
        if new.rank < 0:
            self.spec = new
            return False
        new_range = new.expert_range()
        t1 = time.monotonic()
        if new_range != loaded_expert_range(self.core.runner.model):
            self.core.runner.reload_experts(new_range)
        t2 = time.monotonic()
        self.arrive(new)
        self.commit(new, abandon)
        self.switch_times_s.update(rehome_s=t2 - t1, total_s=time.monotonic() - t0)
        return True


def loaded_expert_range(model) -> tuple[int, int] | None:
    """The [start, end) of the experts in memory (None for a dense model)."""
    for layer in getattr(model, "layers", []):
        start = getattr(layer.mlp, "expert_start", None)
        if start is not None:
            return start, layer.mlp.expert_end
    return None


def make_ep_core(config, spec: EPSpec, progress=None):
    """EngineCore loading only the non-expert weights and this rank's experts."""
    # deferred: engine.core brings the whole model stack; ep_proc joins etcd before loading it
    from planaria.engine.core import EngineCore

    core = EngineCore(config, expert_range=spec.expert_range(), progress=progress)
    return core
