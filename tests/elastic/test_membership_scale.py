"""bench/membership_scale.py, short: 16 simulated nodes (one worker process) on the real
membership, election, watch and controller code against a real etcd.

The first epoch forms with all 16 engines serving; a crashed node's epoch is re-formed
within its lease TTL plus a margin; the leader's crash elects exactly one new leader,
which re-forms the epoch, without every node campaigning at once.
"""

from __future__ import annotations

import pytest

from bench.membership_scale import HERD_LIMIT, Options, run_one

pytestmark = pytest.mark.timeout(180)

NUM_NODES = 16
TTL_S = 2
MARGIN_S = 2.0


@pytest.fixture(scope="module")
def result(etcd_server, tmp_path_factory) -> dict:
    opts = Options(ttl_s=TTL_S, nodes_per_worker=NUM_NODES, engine_load_s=0.5, switch_delay_s=0.02)
    return run_one(etcd_server, NUM_NODES, opts, tmp_path_factory.mktemp("membership-scale"),
                   phases=("form", "loss", "failover"))


def test_first_epoch_names_every_engine_and_is_served(result):
    form = result["form"]
    assert form["full_epoch"] >= 1
    assert form["full_epoch_s"] <= form["all_serving_s"] < 60


def test_node_loss_reforms_within_the_lease_ttl_and_a_margin(result):
    loss = result["loss"]
    # From the crash: the rest of its lease, etcd's expiry check (every 0.5 s), the leader.
    assert loss["crash_to_expiry_s"] + loss["epoch_s"] <= TTL_S + MARGIN_S
    assert loss["served_s"] >= loss["epoch_s"]
    assert loss["rejoin"]["world_size"] == NUM_NODES


def test_leader_failover_elects_exactly_one_new_leader(result):
    failover = result["failover"]
    assert failover["new"] != failover["old"]
    assert failover["leader_puts"] == 1
    assert failover["believed_leaders"] == [failover["new"]]
    assert failover["reform"]  # the old leader's engine was a rank: the new leader re-formed
    assert failover["campaigns"] <= HERD_LIMIT
