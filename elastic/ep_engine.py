"""An EngineCore made expert-parallel, and the lockstep step of one EP rank.

Every rank of an epoch runs the same sequence of steps: each step begins with one small
all-reduce that tells every rank whether any rank has work and which epoch each rank has
been told to move to; then every rank runs one forward (a dummy over zero tokens when it
has nothing of its own), so the MoE collectives of all ranks line up.
"""

from __future__ import annotations

import time

import torch

from elastic.ep import EPGroup, EPSpec, ExpertParallel, apply_expert_parallel


class EPRank:
    """Owns the group of the current epoch for one engine core."""

    def __init__(self, core, spec: EPSpec) -> None:
        self.core = core
        self.spec = spec
        self.group: EPGroup | None = None
        self.pending: EPSpec | None = None
        self.switch_times_s: dict[str, float] = {}

    def form(self, spec: EPSpec | None = None) -> None:
        spec = spec or self.spec
        t0 = time.monotonic()
        self.group = EPGroup(spec)
        self.spec = spec
        apply_expert_parallel(self.core.runner.model, ExpertParallel(self.group, spec.expert_map))
        self.switch_times_s["form_group_s"] = time.monotonic() - t0

    def sync(self, has_work: bool) -> tuple[bool, bool]:
        """(any rank has work, every rank holds the same newer pending epoch)."""
        pending = self.pending.epoch if self.pending is not None else self.spec.epoch
        t = torch.tensor([int(has_work), pending, -pending], dtype=torch.long)
        self.group.all_reduce_max(t)
        any_work = bool(t[0])
        max_pending, min_pending = int(t[1]), -int(t[2])
        switch = max_pending > self.spec.epoch and min_pending == max_pending
        return any_work, switch

    def switch(self, new: EPSpec | None = None) -> bool:
        """Move to the pending epoch: re-home experts, rebuild the group. Returns False
        when this rank is not part of the new epoch (it should leave)."""
        new = new or self.pending
        self.pending = None
        t0 = time.monotonic()
        old_range = self.spec.expert_range() if self.group is not None else None
        if self.group is not None:
            self.group.destroy()
            self.group = None
        apply_expert_parallel(self.core.runner.model, None)
        if new.rank < 0:
            self.spec = new
            return False
        new_range = new.expert_range()
        t1 = time.monotonic()
        if new_range != old_range:
            self.core.runner.reload_experts(new_range)
        t2 = time.monotonic()
        self.form(new)
        self.switch_times_s.update(rehome_s=t2 - t1, total_s=time.monotonic() - t0)
        return True


def make_ep_core(config, spec: EPSpec, progress=None):
    """EngineCore loading only the non-expert weights and this rank's experts."""
    from engine.core import EngineCore

    core = EngineCore(config, expert_range=spec.expert_range(), progress=progress)
    return core
