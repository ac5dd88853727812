"""An EngineCore made expert-parallel, and the lockstep step of one EP rank.

Every rank of an epoch runs the same sequence of steps: each step begins with one small
all-reduce that tells every rank whether any rank has work and which epoch each rank is
ready to move to; then every rank runs one forward (a dummy over zero tokens when it has
nothing of its own), so the MoE collectives of all ranks line up.

A switch to a newer epoch is prepare -> commit (elastic/ep.py): a rank of the current
group counts a pending epoch as *ready* only once every rank joining it (a rank not in the
current group) has arrived in the store, so the current group goes on serving while the
joiners get there; all ranks of the group switch at the same step boundary once all are
ready (the sync's min == max). A joiner that never arrives stalls nothing: the leader
aborts the switch with a newer epoch. The same all-reduce lets a whole group leave
together (every rank draining, no work anywhere), so no rank ever exits while its peers
are inside a collective with it.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import torch

from planaria.elastic.ep import (CollectiveError, EPGroup, EPSpec, ExpertParallel, apply_expert_parallel,
                        arrive, arrived, connect_store)


class SyncResult(NamedTuple):
    any_work: bool  # some rank has work: every rank runs a forward (a dummy without work)
    switch: bool  # every rank is ready for the same newer epoch: switch now
    exit: bool  # every rank is leaving and none has work: leave together now


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

    def commit(self, spec: EPSpec) -> None:
        """Build ``spec``'s group (every rank has arrived) and route the MoE layers through it."""
        t0 = time.monotonic()
        self.group = EPGroup(spec, self.store(spec.rendezvous), bind_host=self.bind_host)
        self.spec = spec
        apply_expert_parallel(self.core.runner.model, ExpertParallel(self.group, spec.expert_map))
        self.switch_times_s["form_group_s"] = time.monotonic() - t0

    def sync(self, has_work: bool, pending: int | None = None, leaving: bool = False) -> SyncResult:
        """The small all-reduce that opens every lockstep step.

        ``pending``: the newer epoch this rank may switch to now (its joiners arrived);
        ``leaving``: this rank is draining. Every rank gets the same answer: any rank has
        work; every rank is ready for the same newer epoch (switch); every rank is leaving
        and none has work (exit together)."""
        p = self.spec.epoch if pending is None else pending
        t = torch.tensor([int(has_work), p, -p, -int(leaving)], dtype=torch.long)
        self.group.all_reduce_max(t)
        any_work = bool(t[0])
        max_pending, min_pending, all_leaving = int(t[1]), -int(t[2]), -int(t[3]) == 1
        switch = max_pending > self.spec.epoch and min_pending == max_pending
        return SyncResult(any_work, switch, all_leaving and not any_work and not switch)

    def leave(self) -> None:
        """Drop the current group (the MoE layers go back to local)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
        apply_expert_parallel(self.core.runner.model, None)

    def switch(self, new: EPSpec) -> bool:
        """Move to ``new``: leave the old group, re-home experts, arrive, build the new
        group. Returns False when this rank is not part of the new epoch (it should leave).
        Raises CollectiveError when the new group cannot form."""
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
        self.commit(new)
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
    from planaria.engine.core import EngineCore

    core = EngineCore(config, expert_range=spec.expert_range(), progress=progress)
    return core
