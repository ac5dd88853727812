"""engine/lifecycle.py: every transition, table-driven, with plain floats for the clock.

A row: the lifecycle's state (and fields) before, one input, the actions it returns, and
the state (and fields) after. No model, no sockets, no threads.
"""

from __future__ import annotations

import pytest

from planaria.engine.errors import EngineStateError
from planaria.engine.lifecycle import (EXIT_CONFIG_MISMATCH, EXIT_DEAD, EXIT_OK, AbandonStart, Die,
                                       EngineLifecycle, EngineState, Refused, ResetPrefixCache, RollBack,
                                       SetState, Signalled, Step, Stop, Wait, Wake)

S = EngineState
SETTINGS = dict(drain_timeout_s=30.0, recovery_timeout_s=5.0, keep_requests_on_fault=False)
FAULT = "RuntimeError: boom"
DRAIN_REFUSAL = "engine is draining (shutting down); send it elsewhere"


def make(state: EngineState, **fields) -> EngineLifecycle:
    """A lifecycle in ``state``; keys of SETTINGS go to the constructor, others are set."""
    settings = {**SETTINGS, **{k: v for k, v in fields.items() if k in SETTINGS}}
    lc = EngineLifecycle(**settings)
    lc.state = state
    for key, value in fields.items():
        if key not in SETTINGS:
            setattr(lc, key, value)
    return lc


DRAINING = dict(deadline=130.0)
UNHEALTHY = dict(deadline=105.0, fault_reason=FAULT)
REFORMING = dict(reforming=True, reform_deadline=105.0, fault_reason="peer gone")

ROWS = [
    # (id, state before, fields before, input, actions, state after, fields after)
    # -- start and signals
    ("ready", S.STARTING, {}, ("on_ready",), [], S.RUNNING, {}),
    ("signal while running wakes the loop", S.RUNNING, {}, ("on_signal",), [Wake()], S.RUNNING,
     dict(num_signals=1, num_handled_signals=0)),
    ("first signal while starting wakes the loop", S.STARTING, {}, ("on_signal",), [Wake()], S.STARTING,
     dict(num_signals=1)),
    ("second signal while starting abandons the start", S.STARTING, dict(num_signals=1), ("on_signal",),
     [AbandonStart()], S.STARTING, dict(num_signals=2)),
    ("second signal while running only wakes", S.RUNNING, dict(num_signals=1, num_handled_signals=1),
     ("on_signal",), [Wake()], S.RUNNING, {}),
    ("wakeup without a new signal does nothing", S.RUNNING, {}, ("on_wakeup", 100.0), [], S.RUNNING, {}),
    ("first signal drains", S.RUNNING, dict(num_signals=1), ("on_wakeup", 100.0),
     [Signalled(1), SetState(S.DRAINING, "draining for up to 30.0 s")], S.DRAINING,
     dict(deadline=130.0, num_handled_signals=1)),
    ("two signals at once: drain, then abort", S.RUNNING, dict(num_signals=2), ("on_wakeup", 100.0),
     [Signalled(1), SetState(S.DRAINING, "draining for up to 30.0 s"), Signalled(2),
      Stop(aborted=True, cause="signal #2")], S.STOPPED, dict(num_handled_signals=2)),
    ("signals after the abort are left", S.RUNNING, dict(num_signals=3), ("on_wakeup", 100.0),
     [Signalled(1), SetState(S.DRAINING, "draining for up to 30.0 s"), Signalled(2),
      Stop(aborted=True, cause="signal #2")], S.STOPPED, dict(num_handled_signals=2)),
    ("second signal while draining aborts", S.DRAINING, dict(num_signals=2, num_handled_signals=1, **DRAINING),
     ("on_wakeup", 110.0), [Signalled(2), Stop(aborted=True, cause="signal #2")], S.STOPPED, {}),
    ("first signal with no drain time aborts", S.RUNNING, dict(num_signals=1, drain_timeout_s=0.0),
     ("on_wakeup", 100.0), [Signalled(1), Stop(aborted=True, cause="signal #1")], S.STOPPED, {}),
    # -- SHUTDOWN and refusal
    ("shutdown drains", S.RUNNING, {}, ("on_shutdown", 10.0, "SHUTDOWN message", 100.0),
     [SetState(S.DRAINING, "draining for up to 10.0 s")], S.DRAINING, dict(deadline=110.0)),
    ("shutdown without a time drains for the setting", S.RUNNING, {},
     ("on_shutdown", None, "SHUTDOWN message", 100.0),
     [SetState(S.DRAINING, "draining for up to 30.0 s")], S.DRAINING, dict(deadline=130.0)),
    ("shutdown of a paused engine drains", S.PAUSED, {}, ("on_shutdown", 10.0, "SHUTDOWN message", 100.0),
     [SetState(S.DRAINING, "draining for up to 10.0 s")], S.DRAINING, dict(deadline=110.0)),
    ("shutdown with 0 aborts", S.RUNNING, {}, ("on_shutdown", 0.0, "SHUTDOWN message", 100.0),
     [Stop(aborted=True, cause="SHUTDOWN message")], S.STOPPED, {}),
    ("shutdown of an unhealthy engine aborts", S.UNHEALTHY, UNHEALTHY,
     ("on_shutdown", 10.0, "SHUTDOWN message", 100.0), [Stop(aborted=True, cause="SHUTDOWN message")],
     S.STOPPED, {}),
    ("a second shutdown shortens the drain", S.DRAINING, DRAINING,
     ("on_shutdown", 5.0, "SHUTDOWN message", 100.0), [], S.DRAINING, dict(deadline=105.0)),
    ("a second shutdown never lengthens it", S.DRAINING, dict(deadline=105.0),
     ("on_shutdown", 30.0, "SHUTDOWN message", 100.0), [], S.DRAINING, dict(deadline=105.0)),
    ("refused by a frontend", S.RUNNING, {}, ("on_refused", 1, "config hash"),
     [Refused(1, "config hash")], S.STOPPED, {}),
    # -- before taking input
    ("busy: take only what arrived", S.RUNNING, {}, ("before_inputs", 100.0, True), [Wait(100.0)],
     S.RUNNING, {}),
    ("idle: block without a limit", S.RUNNING, {}, ("before_inputs", 100.0, False), [Wait(None)],
     S.RUNNING, {}),
    ("paused: block even with work", S.PAUSED, {}, ("before_inputs", 100.0, True), [Wait(None)],
     S.PAUSED, {}),
    ("unhealthy: block until the recovery deadline", S.UNHEALTHY, UNHEALTHY,
     ("before_inputs", 100.0, True), [Wait(105.0)], S.UNHEALTHY, {}),
    ("draining with work: take only what arrived", S.DRAINING, DRAINING, ("before_inputs", 100.0, True),
     [Wait(100.0)], S.DRAINING, {}),
    ("drained: stop before blocking", S.DRAINING, DRAINING, ("before_inputs", 100.0, False),
     [Stop(aborted=False)], S.STOPPED, {}),
    # -- after taking input
    ("running with work steps", S.RUNNING, {}, ("on_tick", 100.0, True), [Step()], S.RUNNING, {}),
    ("running without work does nothing", S.RUNNING, {}, ("on_tick", 100.0, False), [], S.RUNNING, {}),
    ("paused never steps", S.PAUSED, {}, ("on_tick", 100.0, True), [], S.PAUSED, {}),
    ("unhealthy inside its window waits", S.UNHEALTHY, UNHEALTHY, ("on_tick", 104.9, True), [],
     S.UNHEALTHY, {}),
    ("unhealthy at the end of its window dies", S.UNHEALTHY, UNHEALTHY, ("on_tick", 105.0, True),
     [Die(f"no recovery within 5.0 s after: {FAULT}")], S.DEAD, {}),
    ("unhealthy without a deadline waits", S.UNHEALTHY, dict(fault_reason="peer gone"),
     ("on_tick", 1e9, True), [], S.UNHEALTHY, {}),
    ("draining with work steps", S.DRAINING, DRAINING, ("on_tick", 100.0, True), [Step()], S.DRAINING, {}),
    ("draining, drained: stop", S.DRAINING, DRAINING, ("on_tick", 100.0, False), [Stop(aborted=False)],
     S.STOPPED, {}),
    ("draining at the deadline: abort", S.DRAINING, DRAINING, ("on_tick", 130.0, True),
     [Stop(aborted=True, cause="drain timeout")], S.STOPPED, {}),
    ("drain tick ignores a running engine", S.RUNNING, {}, ("on_drain_tick", 100.0, True), [], S.RUNNING, {}),
    ("drain tick never steps", S.DRAINING, DRAINING, ("on_drain_tick", 100.0, True), [], S.DRAINING, {}),
    ("drain tick: drained", S.DRAINING, DRAINING, ("on_drain_tick", 100.0, False), [Stop(aborted=False)],
     S.STOPPED, {}),
    ("drain tick: the timeout says so", S.DRAINING, DRAINING, ("on_drain_tick", 131.0, True),
     [Stop(aborted=True, cause="drain timeout")], S.STOPPED, {}),
    # -- faults
    ("fault without a recovery window dies", S.RUNNING, dict(recovery_timeout_s=0.0),
     ("on_fault", FAULT, 100.0), [Die(FAULT, fault_monotonic_s=100.0)], S.DEAD, {}),
    ("fault opens the recovery window, drops requests", S.RUNNING, {}, ("on_fault", FAULT, 100.0),
     [SetState(S.UNHEALTHY, FAULT, drop_requests=True)], S.UNHEALTHY,
     dict(deadline=105.0, fault_reason=FAULT)),
    ("fault keeps requests when asked to", S.RUNNING, dict(keep_requests_on_fault=True),
     ("on_fault", FAULT, 100.0), [SetState(S.UNHEALTHY, FAULT, drop_requests=False)], S.UNHEALTHY, {}),
    ("fault while draining replaces the drain deadline", S.DRAINING, DRAINING, ("on_fault", FAULT, 100.0),
     [SetState(S.UNHEALTHY, FAULT, drop_requests=True)], S.UNHEALTHY, dict(deadline=105.0)),
    # -- utilities
    ("pause", S.RUNNING, {}, ("pause",), [SetState(S.PAUSED, "paused (requests kept)")], S.PAUSED, {}),
    ("resume a paused engine", S.PAUSED, {}, ("resume",), [SetState(S.RUNNING, "resumed")], S.RUNNING, {}),
    ("resume after a fault rolls the batch back", S.UNHEALTHY, UNHEALTHY, ("resume",),
     [RollBack(), SetState(S.RUNNING, "resumed")], S.RUNNING, dict(deadline=None, fault_reason="")),
    ("reset a running engine", S.RUNNING, {}, ("reset",),
     [SetState(S.RUNNING, "reset", drop_requests=True), ResetPrefixCache()], S.RUNNING, {}),
    ("reset a paused engine", S.PAUSED, {}, ("reset",),
     [SetState(S.RUNNING, "reset", drop_requests=True), ResetPrefixCache()], S.RUNNING, {}),
    ("reset after a fault", S.UNHEALTHY, UNHEALTHY, ("reset",),
     [RollBack(), SetState(S.RUNNING, "reset", drop_requests=True), ResetPrefixCache()], S.RUNNING,
     dict(deadline=None, fault_reason="")),
    # -- expert parallelism: the group
    ("group lost while starting: just the next epoch", S.STARTING, {}, ("on_group_lost", "peer gone", 100.0),
     [], S.STARTING, dict(reforming=False, reform_deadline=None)),
    ("group lost while running: unhealthy, not announced", S.RUNNING, {},
     ("on_group_lost", "peer gone", 100.0), [], S.UNHEALTHY,
     dict(reforming=True, reform_deadline=105.0, fault_reason="peer gone")),
    ("group lost while draining keeps draining", S.DRAINING, DRAINING, ("on_group_lost", "peer gone", 100.0),
     [], S.DRAINING, dict(reforming=True, reform_deadline=105.0)),
    ("group lost again keeps the first deadline", S.UNHEALTHY, REFORMING,
     ("on_group_lost", "again", 103.0), [], S.UNHEALTHY, dict(reform_deadline=105.0, fault_reason="again")),
    ("without a recovery time a re-form waits 120 s", S.RUNNING, dict(recovery_timeout_s=0.0),
     ("on_group_lost", "peer gone", 100.0), [], S.UNHEALTHY, dict(reform_deadline=220.0)),
    ("group re-formed", S.UNHEALTHY, REFORMING, ("on_group_formed", 7),
     [SetState(S.RUNNING, "re-formed at epoch 7")], S.RUNNING,
     dict(reforming=False, reform_deadline=None, fault_reason="")),
    ("group formed without a loss", S.RUNNING, {}, ("on_group_formed", 7), [], S.RUNNING, {}),
    ("re-form inside its window waits", S.UNHEALTHY, REFORMING, ("on_reform_tick", 104.0), [],
     S.UNHEALTHY, {}),
    ("re-form at the end of its window dies", S.UNHEALTHY, REFORMING, ("on_reform_tick", 105.0),
     [Die("no new epoch within 5.0 s after: peer gone")], S.DEAD, {}),
    ("re-form tick of a rank in its group", S.RUNNING, {}, ("on_reform_tick", 1e9), [], S.RUNNING, {}),
]


@pytest.mark.parametrize("state, before, event, actions, after, fields_after",
                         [pytest.param(*row[1:], id=row[0]) for row in ROWS])
def test_transition(state, before, event, actions, after, fields_after):
    lc = make(state, **before)
    method, *args = event
    assert getattr(lc, method)(*args) == actions
    assert lc.state == after
    assert {k: getattr(lc, k) for k in fields_after} == fields_after


REFUSED_CALLS = [
    ("pause", S.PAUSED), ("pause", S.DRAINING), ("pause", S.UNHEALTHY), ("pause", S.STOPPED),
    ("resume", S.RUNNING), ("resume", S.DRAINING), ("resume", S.DEAD),
    ("reset", S.DRAINING), ("reset", S.STOPPED), ("reset", S.DEAD),
]


@pytest.mark.parametrize("method, state", REFUSED_CALLS, ids=[f"{m} in {s.value}" for m, s in REFUSED_CALLS])
def test_utility_refused_by_the_state_changes_nothing(method, state):
    lc = make(state, **UNHEALTHY)
    with pytest.raises(EngineStateError, match=f"cannot {method} in state {state.value}"):
        getattr(lc, method)()
    assert lc.state == state and lc.deadline == 105.0 and lc.fault_reason == FAULT


REFUSALS = [
    # (id, state, fields, why a new request is refused)
    ("running takes it", S.RUNNING, {}, None),
    ("paused takes it (it waits)", S.PAUSED, {}, None),
    ("draining refuses", S.DRAINING, DRAINING, DRAIN_REFUSAL),
    ("unhealthy refuses with the fault", S.UNHEALTHY, UNHEALTHY, f"engine is unhealthy: {FAULT}"),
    ("re-forming takes it (it waits for the group)", S.UNHEALTHY, REFORMING, None),
    ("re-forming while draining takes it", S.DRAINING, dict(DRAINING, **REFORMING), None),
]


@pytest.mark.parametrize("state, fields, refusal", [pytest.param(*r[1:], id=r[0]) for r in REFUSALS])
def test_refusal_for_new_request(state, fields, refusal):
    assert make(state, **fields).refusal_for_new_request() == refusal


@pytest.mark.parametrize("action, code, reason", [
    (Stop(aborted=False), EXIT_OK, "shutdown (drained)"),
    (Stop(aborted=True), EXIT_OK, "shutdown: in-flight work aborted"),
    (Stop(aborted=True, cause="drain timeout"), EXIT_OK, "shutdown (drain timeout): in-flight work aborted"),
    (Refused(0, "config hash"), EXIT_CONFIG_MISMATCH, "config hash"),
    (Die("boom"), EXIT_DEAD, "boom"),
], ids=["drained", "aborted", "aborted with a cause", "refused", "dead"])
def test_terminal_actions_name_their_exit(action, code, reason):
    assert action.exit_code == code and action.reason == reason


@pytest.mark.parametrize("state, can_step", [(s, s in (S.RUNNING, S.DRAINING)) for s in S],
                         ids=[s.value for s in S])
def test_only_running_and_draining_engines_step(state, can_step):
    assert make(state).can_step is can_step


def test_a_new_lifecycle_is_starting_with_nothing_pending():
    lc = EngineLifecycle()
    assert (lc.state, lc.deadline, lc.fault_reason, lc.num_signals, lc.reforming) == (S.STARTING, None, "", 0, False)
    assert lc.drain_timeout_s == 30.0 and lc.recovery_timeout_s == 0.0 and lc.reform_timeout_s == 120.0
