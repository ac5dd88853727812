"""The engine-core process of an expert-parallel cluster.

Like ``engine.proc`` (same sockets, handshake, faults, shutdown), plus:

- the engine registers itself in etcd (``engines/<id>``, on a lease of its own, so a dead
  engine's record expires; its supervisor also deletes it at once when it sees the exit)
  and watches the ``epoch`` key;
- it starts outside any group and joins the first epoch that names it before it tells the
  frontends READY (so no request waits on a rank outside a group); a scale-up engine is
  launched with ``kv_cache_bytes`` (kv_source "reused") and skips profiling;
- every step is a lockstep EP step (elastic/ep_engine.py); a newer epoch is adopted at a
  step boundary once every rank of the current group is ready for it, i.e. every joining
  rank has arrived (prepare -> commit); requests are kept;
- a rank not named by the new epoch (scale-down) tells its frontends it is leaving with
  ENGINE_CORE_DEAD (their journals replay its requests on survivors) and exits 0;
- a collective or a switch that fails (a peer died, hung, or never arrived) makes the rank
  UNHEALTHY with its requests kept and ``failed_epoch`` in its etcd record; it still takes
  requests (they queue), and the leader's next epoch (a re-form without the lost rank, or
  the abort of a failed switch) brings the group back. A failed switch never kills a rank.

Launch: ``python -m planaria.elastic.ep_proc --engine-index I --engine-id ID --input-addr ... \
    --config-json ... --etcd-endpoints host:port --cluster NAME [--bind-host IP]``
(``--bind-host``: the node's routable address, which gloo binds); a secured etcd's TLS files,
user and password file come in ``PLANARIA_ETCD_*`` environment variables
(elastic/etcd_security.py), never on the command line.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import time

import msgspec

from planaria.common.logging import bind_process
from planaria.elastic.ep import CollectiveError, EPSpec
from planaria.elastic.ep_engine import EPRank, make_ep_core
from planaria.elastic.etcd_security import EtcdSecurity
from planaria.elastic.keys import EngineRecord, EngineRecordState, Epoch, KeyLayout, decode, epoch_problem
from planaria.elastic.rank_epochs import Arrive, Form, Leave, RankAction, RankEpochs, RankPhase, Refuse
from planaria.engine import envs
from planaria.engine.config import EngineConfig
from planaria.engine.errors import RequestExecutionError
from planaria.engine.lifecycle import EXIT_OK, EXIT_USAGE, EngineExit, EngineState, SetState
from planaria.engine.proc import EngineCoreProc, ProcSettings
from planaria.engine.proc_entry import json_arg, setup_logging
from planaria.engine.wire import MsgType

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.005  # an idle rank re-syncs this often (start latency of new work)
EP_FAULT_ENV = "PLANARIA_EP_FAULT"  # chaos tests (with PLANARIA_FAULT_INJECTION=1)
LATE_WATCH_S = 1.0  # PLANARIA_EP_FAULT=late_epoch_watch: a leaving rank's watch this late
COLLECTIVE_WAIT_S = 0.5  # in one collective longer than this: waiting on a peer


class EPEngineCoreProc(EngineCoreProc):
    def __init__(self, engine_index: int, engine_id: str, node_id: str, input_addresses: list[str],
                 config: EngineConfig, etcd_endpoints: list[str], cluster: str,
                 settings: ProcSettings | None = None, lease_ttl_s: float = 3.0,
                 collective_timeout_s: float = 10.0, etcd_security=None, bind_host: str | None = None) -> None:
        super().__init__(engine_index, input_addresses, config, settings)
        self.engine_id, self.node_id = engine_id, node_id
        self.etcd_endpoints, self.cluster = etcd_endpoints, cluster
        self.etcd_security = etcd_security
        self.bind_host = bind_host
        self.lease_ttl_s, self.collective_timeout_s = lease_ttl_s, collective_timeout_s
        self.keys = KeyLayout(cluster)
        self.ep: EPRank | None = None
        self._num_experts: int | None = None  # the model's, for the epoch check
        # Every epoch decision (take, prepare, form, switch, fail, leave): elastic/rank_epochs.py.
        self.rank = RankEpochs(engine_id, problem=lambda e: epoch_problem(e, num_experts=self._num_experts))
        self._membership = None
        self._watch = None
        self._forming = False
        # the last lockstep sync said some rank has work: a rank without work of its own
        # must not sit in its idle poll (IDLE_POLL_S) before the next sync, or every step of
        # its peers waits that long for it (5 ms of a 15 ms decode step)
        self._group_busy = False
        self._error = ""
        self.timings: dict[str, float] = {}
        self._started_at = time.time()
        # Chaos tests only: "stop_after_arrive" makes a joining rank SIGSTOP itself once,
        # right after it arrived at an epoch (a rank that hangs mid-switch).
        self._fault = os.environ.get(EP_FAULT_ENV, "") if envs.get().fault_injection else ""

    # -- etcd --------------------------------------------------------------------------------
    def _start_cluster(self) -> None:
        from planaria.elastic.membership import Membership

        self._membership = Membership.from_endpoints(self.etcd_endpoints, self.cluster, self.engine_id,
                                                     ttl_s=self.lease_ttl_s,
                                                     security=self.etcd_security).start()
        self._record(EngineRecordState.LOADING)
        self._watch = self._membership.watch_prefix(self.keys.epoch, self._on_epoch_events)

    def _record(self, state: EngineRecordState) -> None:
        core = self.core
        spec = self.ep.spec if self.ep is not None and self.ep.group is not None else None
        rec = EngineRecord(engine_id=self.engine_id, node_id=self.node_id,
                           rank=spec.rank if spec else None, epoch=spec.epoch if spec else 0, state=state,
                           addresses={"pid": str(os.getpid()), "engine_index": str(self.engine_index),
                                      "num_kv_blocks": str(core.num_kv_blocks if core else 0),
                                      "transport": self.ep.group.transport if spec else ""},
                           kv_cache_bytes=core.kv_cache_bytes if core else 0,
                           kv_source=core.kv_source if core else "",
                           timings={**(core.init_timings if core else {}), **self.timings},
                           served_epoch=self.rank.served, failed_epoch=self.rank.failed,
                           error=self._error)
        try:
            self._membership.put_engine(rec)
        except Exception as exc:  # etcd down: remembered and re-written when it returns
            log.warning("engine %s: record not written now (%s)", self.engine_id, exc)

    def _on_epoch_events(self, events) -> None:
        """The watch thread: offer each valid epoch to the state machine, wake the loop."""
        if self._fault == "late_epoch_watch" and self.rank.leaving:  # its peers learn an epoch first
            time.sleep(LATE_WATCH_S)
        for ev in events:
            if ev.key == self.keys.epoch and ev.value is not None and self._offer_epoch(ev.value):
                self.input_queue.put((None, MsgType.WAKEUP, None))  # the loop takes the epoch

    def _offer_epoch(self, value: bytes) -> bool:
        """Decode and check an epoch read from etcd; True when it is newer than every one offered."""
        try:
            epoch = decode(self.keys.epoch, value, Epoch)
        except Exception as exc:
            log.error("undecodable epoch: %s", exc)
            return False
        problem = self._epoch_refusal(epoch)
        if problem:
            log.error("engine %s: epoch %d refused: %s", self.engine_id, epoch.number, problem)
            return False
        return self.rank.offer(epoch)

    def _catch_up(self, number: int) -> bool:
        """The group agreed to move to epoch ``number``, which the watch has not brought
        this rank yet (its peers' watches were quicker): read the epoch key now. True when
        it is that epoch and is now this rank's pending one."""
        try:
            value = self._membership.read(self.keys.epoch) if self._membership is not None else None
        except Exception as exc:  # noqa: BLE001 - etcd unreachable: the rank drops out of the group
            log.warning("engine %s: epoch %d not read (%s)", self.engine_id, number, exc)
            return False
        if value is not None:
            self._offer_epoch(value)
            self._act(self.rank.take())
        return self.rank.pending_number == number

    def _epoch_refusal(self, epoch: Epoch) -> str | None:
        """Why this engine must not act on ``epoch`` (keys.epoch_problem with what this
        engine knows: the model's expert count once its load read the config, the
        rendezvous addresses of the nodes in etcd), or None. Runs on the watch thread: it
        never imports transformers itself (its lazy imports are not thread-safe: importing
        it here while the main thread loads the model failed the load with "cannot import
        name 'AutoConfig'"); the epoch is checked again when the loop takes it."""
        known = None
        if epoch.ranks and self._membership is not None:
            try:
                known = {n.addresses.get("rendezvous", "") for n in self._membership.list_nodes()}
            except Exception as exc:  # noqa: BLE001 - etcd unreachable: checked without them
                log.warning("engine %s: node records not read (%s); rendezvous not checked",
                            self.engine_id, exc)
        return epoch_problem(epoch, num_experts=self._num_experts, rendezvous_addresses=known)

    def _spec_for(self, epoch: Epoch) -> EPSpec:
        rank = epoch.ranks.index(self.engine_id) if self.engine_id in epoch.ranks else -1
        backend = "nccl" if self.config.device.startswith("cuda") else "gloo"
        return EPSpec(epoch=epoch.number, rank=rank, world_size=epoch.world_size, rendezvous=epoch.rendezvous,
                      expert_map=epoch.expert_map, timeout_s=self.collective_timeout_s, backend=backend,
                      ranks=list(epoch.ranks))

    # -- load ---------------------------------------------------------------------------------
    def _load(self) -> None:
        t0 = time.monotonic()
        self._start_cluster()
        self.timings["cluster_s"] = time.monotonic() - t0  # etcd: connect, lease, record, watch
        # Load this rank's experts of the newest epoch that names it (else the first share).
        epoch = self.rank.latest
        from planaria.elastic.planner import expert_map
        from planaria.engine.models.loader import load_hf_config, spec_from_config

        spec_m = spec_from_config(load_hf_config(self.config.model))
        self._num_experts = spec_m.num_experts
        if epoch is not None and self.engine_id in epoch.ranks:
            spec = self._spec_for(epoch)
        else:
            w = (epoch.world_size + 1) if epoch is not None else 1
            spec = EPSpec(epoch=-1, rank=w - 1, world_size=w, rendezvous="", expert_map=expert_map(spec_m.num_experts, w))
        self.timings["started_at"] = self._started_at
        self.timings["load_begin_at"] = time.time()
        self.core = make_ep_core(self.config, spec)
        self._dtype_text = self.core.dtype_text
        self._record_flights()
        self.ep = EPRank(self.core, msgspec.structs.replace(spec, epoch=-1), bind_host=self.bind_host)
        self.timings["load_s"] = time.monotonic() - t0
        if envs.get().gc_freeze:  # now, not between joining the group and READY (0.1-0.2 s)
            gc.collect()
            gc.freeze()
        self.rank.skip_stale()  # an epoch naming us from before READY is a previous incarnation's
        self.timings["ready_at"] = time.time()
        self._record(EngineRecordState.READY)
        self._join_first_group()

    def _join_first_group(self) -> None:
        """Wait (loaded, READY in etcd) for an epoch that names us and join it. The frontends
        hear READY only after this, so no request is routed to a rank outside a group."""
        while not self.rank.in_group:
            if self.lifecycle.num_signals:
                log.info("engine %s: stopped before joining a group", self.engine_id)
                raise SystemExit(EXIT_OK)
            self._outside_step()
            if not self.rank.in_group:
                time.sleep(IDLE_POLL_S)

    # -- the lockstep loop ---------------------------------------------------------------------
    def _busy_loop(self) -> int:
        """Like EngineCoreProc's, with a lockstep sync before each step. A fault's recovery
        is a re-formed group (lifecycle.on_group_lost/on_group_formed); a draining rank
        leaves at an epoch boundary (rank_epochs), or when its drain deadline passes."""
        lifecycle = self.lifecycle
        try:
            while True:
                busy = self.rank.in_group and (self._group_busy or self.core.has_unfinished_requests())
                self._process_inputs(block_s=0 if busy else IDLE_POLL_S)
                self._carry_out(lifecycle.on_leave_tick(time.monotonic()))
                if not self.rank.in_group:
                    self._outside_step()
                    if not self.rank.in_group:
                        self._carry_out(lifecycle.on_reform_tick(time.monotonic()))
                    continue
                self._act(self.rank.take())  # a newer epoch becomes pending
                self._group_step()
        except EngineExit as exc:
            return exc.code

    def _group_step(self) -> None:
        """One lockstep round in the group: sync, then switch, leave together, or step."""
        rank, number = self.rank, self.rank.current.number
        has_work = self.lifecycle.can_step and self.core.has_unfinished_requests()
        try:
            pending = self._spec_for(rank.pending) if rank.pending is not None else None
            ready = pending is not None and self._joiners_arrived(pending)
            self._group_busy = False
            result = self.ep.sync(has_work, pending if ready else None, leaving=rank.leaving)
            self._group_busy = result.any_work
            if result.switch_to is not None and (rank.pending_number == result.switch_to
                                                 or self._catch_up(result.switch_to)):
                self._act(rank.switch_agreed())
            elif result.switch_to is not None:  # an epoch this rank has not seen leaves it out
                self._group_failed(number, CollectiveError(
                    f"the group moved on to epoch {result.switch_to}, which this rank has not seen"))
            elif result.exit:
                self._act(rank.exit_agreed())
            elif result.any_work:
                self._ep_step(has_work)
        except CollectiveError as exc:
            self._group_failed(number, exc)

    def _outside_step(self) -> None:
        """One non-blocking step toward a group, for a rank outside one: take the newest
        epoch naming us and arrive (prepare); once every rank of it arrived, form (commit)."""
        self._act(self.rank.take())
        target = self.rank.target
        if target is None or self.rank.phase is not RankPhase.PREPARING:
            return
        try:
            ready = self.ep.all_arrived(self._spec_for(target))
        except CollectiveError as exc:
            self._group_failed(target.number, exc)
            return
        if ready:
            self._act(self.rank.all_arrived())

    def _act(self, action: RankAction | None) -> None:
        """Carry out what the rank's state machine decided."""
        match action:
            case None:
                return
            case Refuse(epoch=epoch, problem=problem):
                log.error("engine %s: epoch %d refused: %s", self.engine_id, epoch.number, problem)
            case Arrive(epoch=epoch):
                self._arrive(epoch)
            case Form(epoch=epoch):
                self._form(epoch)
            case Leave(reason=reason):
                self._leave(reason)

    def _arrive(self, epoch: Epoch) -> None:
        try:
            self.ep.arrive(self._spec_for(epoch))
        except CollectiveError as exc:
            self._group_failed(epoch.number, exc)
            return
        self.timings["arrived_at"] = time.time()
        if self._fault == "stop_after_arrive":
            self._fault = ""
            log.warning("engine %s: fault injection: SIGSTOP after arriving at epoch %d",
                        self.engine_id, epoch.number)
            os.kill(os.getpid(), signal.SIGSTOP)

    def _joiners_arrived(self, spec: EPSpec) -> bool:
        try:
            return self.ep.joiners_arrived(spec)
        except CollectiveError as exc:  # the store is unreachable: the current group goes on
            log.warning("engine %s: arrivals of epoch %d unknown: %s", self.engine_id, spec.epoch, exc)
            return False

    def _ep_step(self, has_work: bool) -> None:
        try:
            outputs = self.core.step(force_forward=True)[0] if has_work else self._dummy()
        except RequestExecutionError as exc:
            self.core.fail_requests(exc.request_ids, f"request execution failed: {exc}")
            return
        except CollectiveError:
            raise
        except Exception as exc:
            self._engine_fault(exc)
            return
        if outputs:
            self._publish(outputs)
        self._offer_weights_handover()

    def _dummy(self) -> list:
        self.core.execute_dummy_step()
        return []

    def _form(self, epoch: Epoch) -> None:
        """Commit: build ``epoch``'s group (re-homing experts; from a group: leaving it first)."""
        t0 = time.monotonic()
        spec = self._spec_for(epoch)
        self._forming = True
        newer = lambda: (self.rank.latest or epoch).number > epoch.number  # noqa: E731 - a dead rank's re-form
        try:
            self.ep.switch(spec, abandon=newer)
        except Exception as exc:  # noqa: BLE001 - a failed switch never kills the rank
            self._group_failed(epoch.number, exc)
            return
        finally:
            self._forming = False
        self.rank.formed()
        self.timings["switch_s"] = time.monotonic() - t0
        self.timings["serving_at"] = time.time()
        self.timings.update(self.ep.switch_times_s)
        self._carry_out(self.lifecycle.on_group_formed(spec.epoch))
        log.info("engine %s: rank %d of %d in epoch %d over %s (%.3f s)", self.engine_id, spec.rank,
                 spec.world_size, spec.epoch, self.ep.group.transport, self.timings["switch_s"])
        bind_process(rank=spec.rank, epoch=spec.epoch)  # every later log line names the rank
        self._record(EngineRecordState.DRAINING if self.rank.leaving else EngineRecordState.SERVING)

    def _leave(self, reason: str) -> None:
        """Leave the cluster at an epoch boundary: requests in flight go to survivors (the
        frontends' journals replay them on ENGINE_CORE_DEAD), then exit 0."""
        self.ep.leave()
        self._record(EngineRecordState.STOPPED)
        if self._req_slot:
            self._send_dead(reason)
            self._req_slot.clear()
        else:
            self._send_status(EngineState.STOPPED, f"left the cluster: {reason}", False)
        log.info("engine %s: left the cluster: %s", self.engine_id, reason)
        raise EngineExit(EXIT_OK)

    def _group_failed(self, epoch: int, exc: BaseException) -> None:
        """A collective, or the forming of ``epoch``'s group, failed (a peer died, hung, or
        never came). Requests are kept; the rank reports the failed epoch in etcd and goes
        on with the newest epoch that names it: one the leader wrote already (a group broken
        by a departing rank), or its next (a re-form without the lost rank, or an abort)."""
        log.error("engine %s: group of epoch %d failed: %s", self.engine_id, epoch, exc)
        if self.core is not None:
            self.core.recover_after_fault()
        self.rank.failed_at(epoch)
        self.ep.leave()
        self._error = f"{type(exc).__name__}: {exc}"[:400]
        # a rank that served: UNHEALTHY (not announced) until re-formed, or dead at the deadline
        self._carry_out(self.lifecycle.on_group_lost(str(exc), time.monotonic()))
        self._record(EngineRecordState.DRAINING if self.rank.leaving else EngineRecordState.UNHEALTHY)

    def _carry_out(self, actions) -> None:
        """The lifecycle's actions; a drain (SIGTERM, SHUTDOWN) makes a rank leave at an epoch
        boundary: its record says DRAINING (the leader re-forms without it) first."""
        for action in actions:
            if isinstance(action, SetState) and action.state is EngineState.DRAINING and not self.rank.leaving:
                self.rank.request_leave()
                if self._membership is not None:
                    self._record(EngineRecordState.DRAINING)
            super()._carry_out([action])

    def _heartbeat(self):
        """Waiting for (or forming) a group, or on a peer inside a collective, is not a hang:
        report no work meanwhile, so the supervisor's hang detector only judges ranks that
        could step (a peer that hangs is the one it kills: it is silent, or stuck outside a
        collective; the collective timeout bounds the wait of the others)."""
        beat = super()._heartbeat()
        group = self.ep.group if self.ep is not None else None
        waiting = group is not None and group.waiting_since is not None \
            and time.monotonic() - group.waiting_since > COLLECTIVE_WAIT_S
        if group is None or self.lifecycle.reforming or self._forming or waiting:
            beat = msgspec.structs.replace(beat, has_work=False)
        return beat

    # -- utilities -----------------------------------------------------------------------------
    def _u_get_info(self) -> dict:
        info = super()._u_get_info()
        spec = self.ep.spec if self.ep else None
        info.update(engine_id=self.engine_id, epoch=spec.epoch if spec else None,
                    rank=spec.rank if spec else None, phase=self.rank.phase.value, timings=self.timings)
        return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m planaria.elastic.ep_proc", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine-index", type=int, required=True)
    p.add_argument("--engine-id", required=True)
    p.add_argument("--node-id", default="node0")
    p.add_argument("--input-addr", action="append", required=True)
    p.add_argument("--config-json", required=True)
    p.add_argument("--settings-json")
    p.add_argument("--etcd-endpoints", required=True, help="comma-separated host:port list")
    p.add_argument("--cluster", default="default")
    p.add_argument("--lease-ttl-s", type=float, default=3.0)
    p.add_argument("--collective-timeout-s", type=float, default=10.0)
    p.add_argument("--bind-host", default=None,
                   help="the address gloo binds (this node's routable address; default: the one "
                        "that routes to the rendezvous store)")
    args = p.parse_args(argv)
    try:
        config = msgspec.convert(json_arg(args.config_json), EngineConfig)
        config.validate()
        settings = msgspec.convert(json_arg(args.settings_json), ProcSettings) if args.settings_json else None
    except Exception as exc:  # bad JSON or a bad config value: usage error
        print(f"elastic.ep_proc: bad arguments: {exc}", file=sys.stderr)
        return EXIT_USAGE
    settings = settings or ProcSettings()
    try:  # TLS files, user and password file come through the environment (never argv)
        security = EtcdSecurity.from_env().validate()
    except ValueError as exc:
        print(f"elastic.ep_proc: bad etcd settings in the environment: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.engine_index, settings.log_level)
    proc = EPEngineCoreProc(args.engine_index, args.engine_id, args.node_id, args.input_addr, config,
                            args.etcd_endpoints.split(","), args.cluster, settings, args.lease_ttl_s,
                            args.collective_timeout_s, etcd_security=security, bind_host=args.bind_host)
    try:
        return proc.run()
    finally:
        if proc._watch is not None:
            proc._watch.stop()
        if proc._membership is not None:
            proc._membership.close(revoke=True)


if __name__ == "__main__":
    sys.exit(main())
