"""The election's load on etcd, against a real etcd: followers send no campaign while
they see a leader, and when the leader key goes they do not all campaign at once.

bench/membership_scale.py found both at 64 and 256 simulated nodes: every follower
campaigned every ``retry_interval_s`` (ttl/3) whatever the watch said (N-1 transactions a
second on the leader key while idle), and all of them at the moment the key's deletion
reached them (N-1 at once).
"""

from __future__ import annotations

import time

from planaria.elastic.election import LeaderElection
from planaria.elastic.membership import Membership
from tests.elastic.conftest import wait_for


class CountedElection(LeaderElection):
    """The real election; remembers when each campaign transaction was sent, and each time
    its loop decided whether to campaign (the moments it had to send one)."""

    def __init__(self, membership: Membership) -> None:
        super().__init__(membership)
        self.campaigns: list[float] = []
        self.decisions: list[tuple[float, bool]] = []  # (when, campaign?)

    def campaign(self) -> bool:
        self.campaigns.append(time.monotonic())
        return super().campaign()

    def _should_campaign(self) -> bool:  # the loop's one decision, observed (no other seam)
        verdict = super()._should_campaign()
        self.decisions.append((time.monotonic(), verdict))
        return verdict

    def num_decisions_since(self, t: float, verdict: bool | None = None) -> int:
        return sum(1 for at, v in self.decisions if at >= t and (verdict is None or v == verdict))


def _start(members: list[Membership]) -> list[CountedElection]:
    return [CountedElection(m).start() for m in members]


def test_idle_followers_send_no_campaigns(make_membership):
    leader = LeaderElection(make_membership("lead")).start()
    followers: list[CountedElection] = []
    try:
        assert wait_for(lambda: leader.is_leader, timeout_s=5)
        followers = _start([make_membership(f"f{i}") for i in range(4)])
        # settled: each has seen the leader in its watch and decided, once, not to campaign
        assert wait_for(lambda: all(f.num_decisions_since(0.0, False) for f in followers), timeout_s=15)
        since = time.monotonic()
        # each loop has since had three chances to campaign (a retry interval apart: ttl 2 s / 3)
        assert wait_for(lambda: all(f.num_decisions_since(since) >= 3 for f in followers), timeout_s=20)
        late = [t for f in followers for t in f.campaigns if t >= since]
        assert late == [], f"{len(late)} campaign(s) while a leader was known"
        assert leader.is_leader and not any(f.is_leader for f in followers)
    finally:
        for e in [*followers, leader]:
            e.stop(resign=False)


def test_followers_spread_their_campaigns_when_the_key_goes(make_membership):
    # ttl 9 s: a retry interval, hence a campaign spread, of 3 s.
    leader = LeaderElection(make_membership("lead")).start()
    followers: list[CountedElection] = []
    try:
        assert wait_for(lambda: leader.is_leader, timeout_s=5)
        followers = _start([make_membership(f"f{i:02d}", ttl_s=9) for i in range(12)])
        # each has seen the leader in its watch (decided not to campaign)
        assert wait_for(lambda: all(f.num_decisions_since(0.0, False) for f in followers), timeout_s=15)
        resigned_at = time.monotonic()
        leader.stop(resign=True)  # the key goes at once, as after a lease expiry
        assert wait_for(lambda: sum(f.is_leader for f in followers) == 1, timeout_s=8)
        elected_at = time.monotonic()
        new = [f for f in followers if f.is_leader]
        # every other follower has had its moment since and decided, seeing the new key,
        # not to campaign: no campaign for this deletion is still to come
        others = [f for f in followers if f not in new]
        assert wait_for(lambda: all(f.num_decisions_since(elected_at, False) for f in others), timeout_s=15)
        assert len(new) == 1 and sum(f.is_leader for f in followers) == 1
        sent = sorted(t for f in followers for t in f.campaigns if t >= resigned_at)
        # Before: all 12 within milliseconds of the deletion. Now: one, plus those whose
        # moment came before the winner's key reached them.
        assert 1 <= len(sent) <= 6, f"{len(sent)} campaigns: {[round(t - resigned_at, 3) for t in sent]}"
    finally:
        for e in [*followers, leader]:
            e.stop(resign=False)
