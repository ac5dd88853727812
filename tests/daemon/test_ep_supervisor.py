"""The supervisor following its node's share of the leader's placement (EP mode), with a
fake spawner and clock and a fake EPNode (its cached placement and KV figure)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

from planaria.daemon.ep_supervisor import EPSupervisor
from planaria.daemon.slot import AfterExit, SlotState
from planaria.elastic.placement import Placement
from tests.daemon.test_supervisor_logic import beat, die, engine_child, make


def ep_sup(num_engines=1, **flags):
    flags.setdefault("num_standby", 0)
    sup, spawner, clock, notifier, deaths = make(num_engines, parallel="ep", node_id="a",
                                                 runtime_dir=flags.pop("runtime_dir", "/nonexistent"), **flags)
    node = SimpleNamespace(node_id="a", placement=None, kv_figure=None)
    sup.ep = EPSupervisor(node, sup.log)
    return sup, spawner, clock, node


def place(node, **shares):
    node.placement = Placement(engines=shares, target=sum(shares.values()))


def test_nothing_placed_yet_keeps_the_nodes_engines():
    sup, spawner, _clock, _node = ep_sup(2)
    sup.tick()
    assert sorted(sup.engines) == [0, 1] and len(spawner.children) == 3


def test_a_larger_share_adds_engines_with_the_reused_kv_figure():
    sup, spawner, _clock, node = ep_sup(1)
    beat(sup, 0, kv=5 << 20, source="profiled")
    node.kv_figure = 4 << 20  # the group's kv_budget (another node's engines)
    place(node, a=3, b=1)
    sup.tick()
    assert sorted(sup.engines) == [0, 1, 2]
    for i in (1, 2):
        argv = engine_child(spawner, i).spec.argv
        assert argv[argv.index("--engine-id") + 1] == f"a-e{i}"
        config = argv[argv.index("--config-json") + 1]
        assert '"kv_cache_bytes":4194304' in config and '"kv_source":"reused"' in config
    sup.tick()  # matched: nothing more
    assert len(spawner.children) == 4


def test_a_smaller_share_drains_the_highest_ids_whatever_the_epoch_says():
    """Every removed engine is asked to drain: a rank leaves its group at an epoch boundary
    on its own (elastic/rank_epochs.py), so the supervisor's view of the epoch (older or
    newer than the engine's) decides nothing. Reading the newest epoch here, which already
    left the rank out, once made the supervisor stop a rank that was still mid-collective."""
    sup, spawner, _clock, node = ep_sup(3)
    for i in range(3):
        beat(sup, i)
    place(node, a=1, b=1)
    sup.tick()
    for i in (1, 2):
        assert sup.engines[i].after_exit is AfterExit.REMOVE and sup.engines[i].state is SlotState.STOPPING
        assert engine_child(spawner, i).signals == [signal.SIGTERM]
    assert sup.engines[0].state is SlotState.RUNNING and not engine_child(spawner, 0).signals
    die(sup, engine_child(spawner, 1), code=0)  # it left at the epoch
    die(sup, engine_child(spawner, 2), code=0)
    assert sorted(sup.engines) == [0]
    sup.tick()
    assert sorted(sup.engines) == [0]


def test_a_share_back_up_while_an_engine_drains_adds_a_new_one():
    sup, spawner, _clock, node = ep_sup(2)
    beat(sup, 0)
    beat(sup, 1)
    place(node, a=1)
    sup.tick()
    assert sup.engines[1].after_exit is AfterExit.REMOVE
    place(node, a=2)
    sup.tick()  # the draining one goes on leaving; a new slot takes its place
    assert sorted(sup.engines) == [0, 1, 2] and sup.engines[1].after_exit is AfterExit.REMOVE
    die(sup, engine_child(spawner, 1), code=0)
    sup.tick()
    assert sorted(sup.engines) == [0, 2] and len(spawner.children) == 4


def test_a_share_of_zero_removes_every_engine_and_a_restart_is_not_a_new_slot():
    sup, spawner, _clock, node = ep_sup(1)
    beat(sup, 0)
    place(node, a=1)
    die(sup, engine_child(spawner, 0))  # crashed: restarted in its own slot, not re-placed
    sup.tick()
    assert sorted(sup.engines) == [0] and sup.engines[0].state is SlotState.BACKOFF
    place(node, a=0)
    sup.tick()
    assert sup.engines == {}  # no process: the slot just goes


def test_the_ep_poll_keeps_the_loop_waking():
    sup, _spawner, clock, _node = ep_sup(1)
    assert sup.tick() <= clock() + 0.1 + 1e-9


def test_multi_host_flags_are_checked():
    import pytest

    from planaria.daemon import config as config_mod

    def build(**flags):
        return config_mod.build({"model": "/m", "parallel": "ep", **flags}, environ={})

    assert build(etcd_listen="10.0.0.1:2379").etcd_listen_address() == ("10.0.0.1", 2379)
    assert build(etcd_listen="10.0.0.1").etcd_listen_address() == ("10.0.0.1", None)
    assert build(etcd_listen="[fd00::1]:2379").etcd_listen_address() == ("fd00::1", 2379)
    assert build().etcd_listen_address() == ("127.0.0.1", None)
    assert build(advertise_host="10.0.0.2").advertise_host == "10.0.0.2"
    for flags, message in [({"advertise_host": "node-b"}, "--advertise-host wants an IP"),
                           ({"etcd_listen": "10.0.0.1:http"}, "--etcd-listen wants"),
                           ({"etcd_listen": "10.0.0.1:2379", "etcd_endpoints": "10.0.0.1:2379"},
                            "give one or the other")]:
        with pytest.raises(config_mod.ConfigError, match=message):
            build(**flags)


def test_engines_of_a_routable_node_bind_gloo_to_its_address():
    sup, spawner, _clock, _node = ep_sup(1, advertise_host="10.0.0.2")
    argv = engine_child(spawner, 0).spec.argv
    assert argv[argv.index("--bind-host") + 1] == "10.0.0.2"
    sup, spawner, _clock, _node = ep_sup(1)
    assert "--bind-host" not in engine_child(spawner, 0).spec.argv


# -- warm standbys ---------------------------------------------------------------------------
def standby_sup(tmp_path, num_standby=1):
    sup, spawner, clock, node = ep_sup(1, num_standby=num_standby, runtime_dir=str(tmp_path), state_dir=str(tmp_path))
    written = {}
    sup.standby.write = lambda child, line: written.__setitem__(child.pid, line)
    return sup, spawner, clock, node, written


def standbys(spawner):
    return [c for c in spawner.children if c.spec.key[0] == "standby" and c.returncode is None]


def test_a_standby_starts_once_an_engine_serves_and_a_scale_up_takes_it(tmp_path):
    import json

    sup, spawner, clock, node, written = standby_sup(tmp_path)
    sup.tick()
    assert not standbys(spawner)  # its imports would slow the first engines' start
    beat(sup, 0, kv=5 << 20)
    sup.tick()
    [sb] = standbys(spawner)
    assert sb.spec.argv[1:3] == ["-m", "planaria.elastic.standby"] and sb.spec.stdin_pipe
    assert sup.status()["standby"]["processes"] == [{"pid": sb.pid, "state": "warming", "uptime_s": 0.0}]
    (tmp_path / "standby-1.ready").touch()  # what elastic.standby does once warm
    assert sup.status()["standby"]["processes"][0]["state"] == "ready"
    assert sb in sup.live_children()
    place(node, a=2)
    sup.tick()
    assert sup.engines[1].child is sb  # the standby process goes on as engine 1
    assignment = json.loads(written[sb.pid])
    assert assignment["argv"][assignment["argv"].index("--engine-id") + 1] == "a-e1"
    assert '"kv_source":"reused"' in assignment["argv"][assignment["argv"].index("--config-json") + 1]
    assert assignment["log_path"].endswith("engine-1.log") and assignment["env"] == {"PLANARIA_ENGINE_ID": "1"}
    assert "warm standby pid" in (tmp_path / "logs" / "engine-1.log").read_text()
    assert sup.status()["standby"]["processes"] == [] and sup.status()["standby"]["num_taken"] == 1
    clock.t += 5
    sup.tick()
    assert standbys(spawner) == []  # replaced later, not during the join
    clock.t += 6
    sup.tick()
    assert len(standbys(spawner)) == 1


def test_a_restart_takes_the_standby_and_a_dead_standby_is_replaced_with_backoff(tmp_path):
    sup, spawner, clock, node, written = standby_sup(tmp_path)
    beat(sup, 0)
    sup.tick()
    [sb] = standbys(spawner)
    die(sup, engine_child(spawner, 0))
    clock.t += 1.0  # the restart backoff
    sup.tick()
    assert sup.engines[0].child is sb and sb.pid in written
    clock.t += 11
    sup.tick()
    [sb2] = standbys(spawner)
    die(sup, sb2, code=1)  # a standby that dies young: replaced after 20 s, then 40 s
    assert sup.engines[0].child is sb  # nothing else changed
    clock.t += 15
    sup.tick()
    assert not standbys(spawner)
    clock.t += 6
    sup.tick()
    assert len(standbys(spawner)) == 1


def test_shutdown_stops_the_standby_by_pid(tmp_path):
    sup, spawner, clock, node, written = standby_sup(tmp_path)
    beat(sup, 0)
    sup.tick()
    [sb] = standbys(spawner)
    sup.begin_shutdown()
    assert sb.signals == [signal.SIGTERM] and not sup.done
    die(sup, sb, code=-15)
    die(sup, engine_child(spawner, 0), code=0)
    die(sup, spawner.live(("frontend",))[-1], code=0)
    assert sup.done


def test_a_node_the_leader_has_not_placed_yet_keeps_its_engines():
    sup, spawner, _clock, node = ep_sup(1)
    place(node, b=2)  # written before this node's record reached the leader
    sup.tick()
    assert sorted(sup.engines) == [0] and not engine_child(spawner, 0).signals
