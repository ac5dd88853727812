"""RequestJournal as plain logic, the Generator's replay loop over a fake client, and one
check against a real EngineCore that a replayed seeded request continues exactly."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from planaria.engine.errors import EngineDeadError, NoEngineAvailableError
from planaria.engine.messages import EngineCoreOutput, EngineCoreRequest, Logprobs
from planaria.engine.sampling_params import SamplingParams
from planaria.frontend.errors import ServiceUnavailableError
from planaria.frontend.generation import Generator
from planaria.frontend.journal import (HOLD_FOR_CAUSE_S, SUSPECT_STAGGER_S, SUSPECT_WAIT_S, FailRequest, Hold, Replay,
                                      RequestJournal, replay_request)
from planaria.frontend.metrics import FrontendMetrics


class Clock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def ecr(rid: str = "r", prompt=(1, 2, 3), priority: int = 0, **sp) -> EngineCoreRequest:
    params = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    params.update(sp)
    return EngineCoreRequest(request_id=rid, prompt_token_ids=list(prompt), priority=priority,
                             sampling_params=SamplingParams(**params), eos_token_id=0, arrival_time=5.0)


# -- the journal --------------------------------------------------------------------------
def test_replay_request_continues_from_the_streamed_tokens():
    orig = ecr(max_tokens=10, min_tokens=6, seed=7, temperature=0.8, stop=["x"], priority=2)
    r = replay_request(orig, [9, 8, 7, 6], 1)
    assert r.request_id == "r~r1" and r.prompt_token_ids == [1, 2, 3, 9, 8, 7, 6]
    assert r.num_prior_output_tokens == 4
    p = r.sampling_params
    assert (p.max_tokens, p.min_tokens, p.seed, p.temperature, p.stop) == (6, 2, 7, 0.8, ["x"])
    assert (r.arrival_time, r.priority, r.eos_token_id) == (5.0, 2, 0)
    assert orig.prompt_token_ids == [1, 2, 3] and orig.sampling_params.max_tokens == 10  # untouched
    r2 = replay_request(msgspec.structs.replace(orig, sampling_params=SamplingParams(max_tokens=None, min_tokens=2)),
                        [5, 5, 5], 2)
    assert r2.sampling_params.max_tokens is None and r2.sampling_params.min_tokens == 0
    # a replay of a replay counts all prior output
    assert replay_request(r, [1], 2).num_prior_output_tokens == 5
    assert r.structured_output_prefix_tokens is None
    so = msgspec.structs.replace(orig, structured_output={"type": "regex", "value": "a+"})
    assert replay_request(replay_request(so, [4, 5], 1), [6], 2).structured_output_prefix_tokens == [4, 5, 6]


def test_replay_keeps_token_controls_and_bad_words_see_the_streamed_prefix():
    """A replay resubmits the same logit_bias / allowed_token_ids / bad words; the tokens
    streamed before the death are the replay's prompt tail, and the engine's sampler
    counts them as output (num_prior_output_tokens), so a bad word begun before the death
    is still cut after it."""
    import torch

    from planaria.engine.request import Request
    from planaria.engine.sampler import Sampler
    from planaria.engine.sampling_metadata import PRIOR_OUTPUT_TOKENS_KEY, SamplingMetadata

    orig = ecr(logit_bias={5: -100.0}, allowed_token_ids=[8, 9, 11, 12], bad_words_token_ids=[[9, 8, 11]])
    r = replay_request(orig, [9, 8], 1)
    p = r.sampling_params
    assert (p.logit_bias, p.allowed_token_ids, p.bad_words_token_ids) == ({5: -100.0}, [8, 9, 11, 12], [[9, 8, 11]])
    req = Request(r.request_id, r.prompt_token_ids, p, r.eos_token_id, max_tokens=8)
    req.extra[PRIOR_OUTPUT_TOKENS_KEY] = r.num_prior_output_tokens  # what EngineCore does
    row = torch.zeros(1, 16)
    row[0, 11], row[0, 12] = 5.0, 4.0
    assert int(Sampler()(row, SamplingMetadata.build([req], 16, "cpu")).sampled_token_ids[0]) == 12
    fresh = Request("f", list(orig.prompt_token_ids), p, 0, max_tokens=8)  # nothing streamed: 11 allowed
    assert int(Sampler()(row, SamplingMetadata.build([fresh], 16, "cpu")).sampled_token_ids[0]) == 11


def test_engine_death_marks_only_its_requests_and_replays_carry_on():
    clock = Clock()
    j = RequestJournal(max_replays=3, clock=clock, quarantine_after=0)  # replays alone here
    for rid, engine in (("a", 0), ("b", 1), ("c", 0)):
        j.open(ecr(rid))
        j.on_submitted(rid, engine)
    j.on_tokens("a", [4, 5])
    j.on_tokens("a", [6])
    clock.now_s = 101.0
    assert sorted(j.on_engine_dead(0)) == ["a", "c"]
    assert j.get("b").lost_at_s is None and j.get("b").engine_index == 1
    clock.now_s = 101.5
    j.on_lost("a")  # the per-stream error, a moment later: the notice's time is kept
    act = j.decide("a")
    assert isinstance(act, Replay) and act.num_replays == 1
    assert act.request.prompt_token_ids == [1, 2, 3, 4, 5, 6] and act.request.sampling_params.max_tokens == 7
    j.on_submitted("a", 1)
    clock.now_s = 101.25 + 1.0
    assert j.on_replay_token("a") == pytest.approx(1.25)  # notice -> the replay's first token
    assert j.on_replay_token("a") is None
    j.on_tokens("a", [7])
    act = j.decide("a")  # its second engine fails too
    assert act.request.request_id == "a~r2" and act.request.prompt_token_ids == [1, 2, 3, 4, 5, 6, 7]
    assert act.request.num_prior_output_tokens == 4
    assert j.num_replays_total == 2
    j.close("a")
    assert "a" not in j and len(j) == 2


def test_replay_limit_and_nothing_left_to_do():
    j = RequestJournal(max_replays=2, quarantine_after=0)
    j.open(ecr("a"))
    assert isinstance(j.decide("a"), Replay) and isinstance(j.decide("a"), Replay)
    fail = j.decide("a")
    assert isinstance(fail, FailRequest) and fail.code == "replay_limit" and "3 times" in fail.reason
    j.open(ecr("b", max_tokens=2))
    j.on_tokens("b", [1, 2])
    assert j.decide("b").code == "request_done"
    j0 = RequestJournal(max_replays=0)
    j0.open(ecr("c"))
    assert j0.decide("c").code == "replay_limit"
    with pytest.raises(ValueError):
        j0.open(ecr("c"))
    with pytest.raises(ValueError):
        RequestJournal(max_replays=-1)


def test_a_request_in_flight_on_two_dead_engines_is_quarantined():
    j = RequestJournal()  # the defaults: max_replays 20, quarantine after 2 deaths
    assert (j.max_replays, j.quarantine_after) == (20, 2)
    for rid in ("poison", "bystander"):
        j.open(ecr(rid))
        j.on_submitted(rid, 0)
    assert sorted(j.on_engine_dead(0)) == ["bystander", "poison"]
    first = j.decide("poison")
    assert isinstance(first, Replay) and first.request.request_id == "poison~r1"
    assert isinstance(j.decide("bystander"), Replay)
    j.on_submitted("poison", 1)  # the replay goes to engine 1, which dies too
    assert j.on_engine_dead(1) == ["poison"]
    fail = j.decide("poison")
    assert isinstance(fail, FailRequest) and fail.code == "quarantined"
    assert fail.reason.startswith("request quarantined: in flight on 2 engines that died")
    assert j.num_quarantined_total == 1 and j.num_replays_total == 2
    assert j.get("poison").num_engine_deaths == 2 and j.get("bystander").num_engine_deaths == 1
    # a request with nothing left to produce is done, not quarantined
    j.open(ecr("done", max_tokens=1))
    j.on_tokens("done", [7])
    j.decide("done")
    assert j.decide("done").code == "request_done"
    # quarantine_after=3 allows two replays; the replay limit still applies before it
    j3 = RequestJournal(max_replays=1, quarantine_after=3)
    j3.open(ecr("a"))
    assert isinstance(j3.decide("a"), Replay)
    assert j3.decide("a").code == "replay_limit"
    j3 = RequestJournal(max_replays=5, quarantine_after=3)
    j3.open(ecr("a"))
    assert [type(j3.decide("a")).__name__ for _ in range(3)] == ["Replay", "Replay", "FailRequest"]
    assert j3.num_quarantined_total == 1
    with pytest.raises(ValueError):
        RequestJournal(quarantine_after=-1)


def test_a_death_from_before_the_send_is_not_counted_against_the_request():
    """Two engines killed at once: engine 0's requests, replayed onto engine 1 before its
    death notice arrived, never ran there; a request that was sent to an engine before it
    died is counted (CLOCK_MONOTONIC times: when sent, when the engine died)."""
    j = RequestJournal()
    for rid in ("bystander", "poison"):
        j.open(ecr(rid))
        j.on_sent(rid, 10.0)
        j.on_submitted(rid, 0)
    j.on_engine_dead(0, died_monotonic_s=20.0)
    assert isinstance(j.decide("bystander"), Replay) and isinstance(j.decide("poison"), Replay)
    j.on_sent("bystander", 20.5)  # replayed onto engine 1, which had died at 20.2
    j.on_submitted("bystander", 1)
    j.on_sent("poison", 30.0)  # replayed onto engine 1's next incarnation, which dies at 31
    j.on_submitted("poison", 2)
    assert j.on_engine_dead(1, died_monotonic_s=20.2) == ["bystander"]
    assert isinstance(j.decide("bystander"), Replay)
    assert j.get("bystander").num_engine_deaths == 1
    assert j.on_engine_dead(2, died_monotonic_s=31.0) == ["poison"]
    assert j.decide("poison").code == "quarantined"
    # unknown times count the death, as before
    j.open(ecr("u"))
    j.on_submitted("u", 3)
    j.on_engine_dead(3)
    j.decide("u")
    j.on_sent("u", 40.0)
    j.on_submitted("u", 4)
    j.on_engine_dead(4)
    assert j.decide("u").code == "quarantined"



def test_deaths_from_outside_do_not_count_toward_the_quarantine():
    """A fault storm: engines SIGKILLed from outside (or stopped and then killed by the
    watchdog) while the request runs on them. Their causes come with the supervisor's
    notice after the reap ("external"): those deaths do not count, and the request is
    replayed as often as it takes; a crash ("fault") counts as before. A death whose cause
    is not known yet counts."""
    causes: dict[int, str] = {}
    j = RequestJournal(cause_of=causes.get)
    j.open(ecr("storm"))
    for k in range(6):  # six external kills in a row: replayed each time
        j.on_submitted("storm", k % 2)
        j.on_engine_dead(k % 2, pid=100 + k)
        assert isinstance(j.decide("storm"), Replay), k
        causes[100 + k] = "external"  # the reap notice arrives just after
    assert j.get("storm").num_engine_deaths == 1  # the last one: its cause came after its decision
    j.on_submitted("storm", 0)
    j.on_engine_dead(0, pid=200)  # a crash: its cause is not known yet at the decision
    assert isinstance(j.decide("storm"), Replay)
    causes[200] = "fault"
    j.on_submitted("storm", 1)
    j.on_engine_dead(1, pid=201)  # a second crash: quarantined
    assert j.decide("storm").code == "quarantined"


def test_a_death_seen_just_after_the_send_counts_only_when_the_engine_ran_the_request():
    """Death times are when a death was seen: one seen within DEATH_TIME_SLACK_S of the
    send, with no token from that engine, is taken as from before the send (both engines
    SIGKILLed at once, the second's death seen 3 ms after the replay left); with a token
    from it, or later than the slack, it counts."""
    from planaria.frontend.journal import DEATH_TIME_SLACK_S

    j = RequestJournal()
    for rid in ("bystander", "ran", "late"):
        j.open(ecr(rid))
        j.on_sent(rid, 10.0)
        j.on_submitted(rid, 0)
    j.on_engine_dead(0, died_monotonic_s=20.0)
    for rid in ("bystander", "ran", "late"):
        assert isinstance(j.decide(rid), Replay)
        j.on_sent(rid, 20.002)
        j.on_submitted(rid, 1)
    j.on_tokens("ran", [5])  # engine 1 produced a token for it: it got it and ran it
    j.on_submitted("late", 2)
    assert sorted(j.on_engine_dead(1, died_monotonic_s=20.005)) == ["bystander", "ran"]
    assert isinstance(j.decide("bystander"), Replay) and j.get("bystander").num_engine_deaths == 1
    assert j.decide("ran").code == "quarantined"
    assert j.on_engine_dead(2, died_monotonic_s=20.002 + DEATH_TIME_SLACK_S + 0.01) == ["late"]
    assert j.decide("late").code == "quarantined"

# -- the Generator's replay loop over a fake client -------------------------------------
class _Info:
    def __init__(self, index: int) -> None:
        self.index, self.state, self.pid, self.stats = index, "running", index + 100, None
        self.fault_monotonic_s = None  # when its death was seen (the supervisor's report)

    @property
    def healthy(self) -> bool:
        return self.state == "running"


class ScriptedClient:
    """Token k of a request is always 100 + k (as greedy would be), whatever engine runs it;
    ``kill_at``: {output position: engine loss} to raise when a request reaches it."""

    def __init__(self, num_engines: int = 2, kill_at=None) -> None:
        self.engines = [_Info(i) for i in range(num_engines)]
        self.kill_at = dict(kill_at or {})
        self.submitted: list[EngineCoreRequest] = []
        self.loss_listeners = []
        self._where: dict[str, int] = {}

    def engine_of(self, rid: str):
        return self._where.get(rid)

    def lose(self, index: int) -> None:
        self.engines[index].state = "dead"
        for fn in self.loss_listeners:
            fn(index, "killed")

    async def generate(self, req: EngineCoreRequest):
        healthy = [e for e in self.engines if e.healthy]
        if not healthy:
            raise NoEngineAvailableError("none running")
        engine = healthy[len(self.submitted) % len(healthy)].index
        self.submitted.append(req)
        self._where[req.request_id] = engine
        p = req.sampling_params
        start = req.num_prior_output_tokens
        for k in range(start, start + p.max_tokens):
            await asyncio.sleep(0)
            if k in self.kill_at:
                self.kill_at.pop(k)(self, engine)
                raise EngineDeadError(engine, req.request_id, "killed by the test")
            last = k == start + p.max_tokens - 1
            # prompt logprobs, when asked for, come with the first token (as from EngineCore)
            plp = ([Logprobs([t], [-1.0], 1) for t in req.prompt_token_ids[1:]]
                   if p.prompt_logprobs is not None and k == start else None)
            yield EngineCoreOutput(request_id=req.request_id, new_token_ids=[100 + k],
                                   finish_reason="length" if last else None, prompt_logprobs=plp)


class ListDetok:
    def __init__(self, ids, params) -> None:
        self.ids: list[int] = []
        self.stop = params.stop

    def update(self, ids):
        self.ids.extend(ids)
        for s in self.stop:
            if s in self.text():
                return s
        return None

    def text(self) -> str:
        return "".join(chr(65 + i % 26) for i in self.ids)

    def get_delta_text(self) -> str:
        return ""

    def flush(self) -> str:
        return self.text()


def collect(gen: Generator, req: EngineCoreRequest):
    async def main():
        return [d async for d in gen.generate(req)]
    return asyncio.run(main())


def test_generator_replays_on_a_survivor_without_gaps_or_repeats():
    def kill(client, engine):
        client.lose(engine)
    client = ScriptedClient(kill_at={3: kill, 7: kill})
    client.engines[1].state = "running"
    metrics = FrontendMetrics()
    # two deaths under one request: the quarantine (see the test after next) is off here
    gen = Generator(client, ListDetok, metrics, journal=RequestJournal(quarantine_after=0))

    def revive_then_kill(c, engine):  # the second death: bring the first engine back first
        c.engines[0].state = "running"
        c.lose(engine)
    client.kill_at[7] = revive_then_kill
    deltas = collect(gen, ecr(max_tokens=10))
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == [100 + k for k in range(10)] and deltas[-1].finish_reason == "length"
    assert deltas[-1].num_output_tokens == 10
    assert [r.request_id for r in client.submitted] == ["r", "r~r1", "r~r2"]
    assert client.submitted[2].prompt_token_ids == [1, 2, 3] + [100 + k for k in range(7)]
    assert len(gen.journal) == 0
    text = metrics.render(client.engines)
    assert "planaria_request_replays_total 2" in text and "planaria_replay_latency_seconds_count 2" in text
    assert 'planaria_request_success_total{finished_reason="length"} 1' in text
    # no engine here caches anything: each replay computed its whole prompt again
    recomputed = sum(len(r.prompt_token_ids) for r in client.submitted[1:])
    assert "planaria_replay_recomputed_tokens_count 2\n" in text
    assert f"planaria_replay_recomputed_tokens_sum {recomputed}\n" in text


def test_replay_request_keeps_or_drops_prompt_logprobs():
    orig = ecr(prompt_logprobs=3, logprobs=1)
    assert replay_request(orig, [], 1).sampling_params.prompt_logprobs == 3
    dropped = replay_request(orig, [9], 1, with_prompt_logprobs=False).sampling_params
    assert dropped.prompt_logprobs is None and dropped.logprobs == 1


def test_a_replay_after_the_prompt_logprobs_arrived_does_not_ask_again():
    """They come with the first token: a death after it replays without them (the client has
    them, and the replay's prompt holds output tokens); the client sees them once."""
    def kill(client, engine):
        client.lose(engine)
    client = ScriptedClient(kill_at={3: kill})
    gen = Generator(client, ListDetok, journal=RequestJournal(quarantine_after=0))
    deltas = collect(gen, ecr(max_tokens=6, prompt_logprobs=2))
    assert [t for d in deltas for t in d.token_ids] == [100 + k for k in range(6)]
    got = [d.prompt_logprobs for d in deltas if d.prompt_logprobs is not None]
    assert len(got) == 1 and [e.token_ids[0] for e in got[0]] == [2, 3]  # prompt tokens 1..P-1
    assert deltas[0].prompt_logprobs is got[0]
    assert [r.sampling_params.prompt_logprobs for r in client.submitted] == [2, None]


def test_a_replay_before_any_token_asks_for_the_prompt_logprobs_again():
    def kill(client, engine):
        client.lose(engine)
    client = ScriptedClient(kill_at={0: kill})
    gen = Generator(client, ListDetok, journal=RequestJournal(quarantine_after=0))
    deltas = collect(gen, ecr(max_tokens=4, prompt_logprobs=1))
    assert [r.sampling_params.prompt_logprobs for r in client.submitted] == [1, 1]
    assert client.submitted[1].prompt_token_ids == [1, 2, 3]
    assert [e.token_ids[0] for e in deltas[0].prompt_logprobs] == [2, 3]
    assert sum(d.prompt_logprobs is not None for d in deltas) == 1


def test_a_replay_onto_an_engine_killed_at_the_same_moment_is_not_quarantined():
    """Both engines SIGKILLed at once: engine 0's death is seen first and its request is
    replayed onto engine 1, whose death is seen 1 ms later, before any token: that death is
    not the request's doing, so it is replayed again (onto engine 0, back by then) and
    completes; with the quarantine on (the default)."""
    def kill_0(c, engine):
        c.engines[0].fault_monotonic_s = time.monotonic()
        c.lose(0)
        c.kill_at[3] = kill_1  # engine 1 is dead already; its replay gets no token

    def kill_1(c, engine):
        c.engines[1].fault_monotonic_s = time.monotonic()  # seen just after the replay left
        c.engines[0].state = "running"
        c.lose(1)
    client = ScriptedClient(kill_at={3: kill_0})
    gen = Generator(client, ListDetok, FrontendMetrics())
    deltas = collect(gen, ecr(max_tokens=6))
    assert [t for d in deltas for t in d.token_ids] == [100 + k for k in range(6)]
    assert [(r.request_id, client.engine_of(r.request_id)) for r in client.submitted] == \
        [("r", 0), ("r~r1", 1), ("r~r2", 0)]
    assert gen.journal.num_quarantined_total == 0


def test_generator_waits_for_an_engine_to_come_back():
    async def main():
        client = ScriptedClient(num_engines=1)

        def kill(c, engine):
            c.lose(engine)
            asyncio.get_running_loop().call_later(0.2, setattr, c.engines[0], "state", "running")
        client.kill_at = {2: kill}
        gen = Generator(client, ListDetok, replay_wait_s=5.0)
        t0 = asyncio.get_running_loop().time()
        deltas = [d async for d in gen.generate(ecr(max_tokens=5))]
        assert asyncio.get_running_loop().time() - t0 >= 0.2
        return [t for d in deltas for t in d.token_ids]
    assert asyncio.run(main()) == [100, 101, 102, 103, 104]


def test_a_new_request_waits_for_an_engine_that_is_restarting():
    """No engine serving when it arrives (both restarting): it waits, then runs; with none
    back within the wait it gets a 503 saying so."""
    async def main():
        client = ScriptedClient(num_engines=1)
        client.engines[0].state = "dead"
        asyncio.get_running_loop().call_later(0.2, setattr, client.engines[0], "state", "running")
        gen = Generator(client, ListDetok, replay_wait_s=5.0)
        return [t for d in [d async for d in gen.generate(ecr(max_tokens=3))] for t in d.token_ids]
    assert asyncio.run(main()) == [100, 101, 102]
    client = ScriptedClient(num_engines=1)
    client.engines[0].state = "dead"
    gen = Generator(client, ListDetok, FrontendMetrics(), replay_wait_s=0.1)
    with pytest.raises(ServiceUnavailableError) as ei:
        collect(gen, ecr(max_tokens=3))
    assert ei.value.code == "no_engine_available" and "no engine could take the request within 0.1 s" in str(ei.value)


def test_generator_gives_up_with_503_past_the_limit_or_when_no_engine_returns():
    def kill(c, engine):
        c.lose(engine)
    client = ScriptedClient(num_engines=1, kill_at={1: kill})
    gen = Generator(client, ListDetok, FrontendMetrics(), replay_wait_s=0.1)
    with pytest.raises(ServiceUnavailableError) as ei:
        collect(gen, ecr(max_tokens=5))
    assert ei.value.status == 503 and ei.value.code == "no_engine_available"
    assert "no engine came back" in str(ei.value) and len(gen.journal) == 0

    def kill_keep(c, engine):  # the engine "dies" but stays usable: only the limit stops it
        for fn in c.loss_listeners:
            fn(engine, "flaky")
    flaky = ScriptedClient(num_engines=1, kill_at={1: kill_keep, 2: kill_keep, 3: kill_keep, 4: kill_keep})
    metrics = FrontendMetrics()
    gen = Generator(flaky, ListDetok, metrics, journal=RequestJournal(max_replays=3, quarantine_after=0))
    with pytest.raises(ServiceUnavailableError) as ei:
        collect(gen, ecr(max_tokens=8))
    assert ei.value.code == "engine_dead" and "replay limit 3" in str(ei.value)
    assert len(flaky.submitted) == 4
    assert 'planaria_request_errors_total{kind="replay_limit"} 1' in metrics.render(flaky.engines)
    # a new request with no engine at all waits replay_wait_s for one, then is refused
    t0 = time.monotonic()
    with pytest.raises(ServiceUnavailableError) as ei:
        collect(Generator(ScriptedClient(num_engines=0), ListDetok, replay_wait_s=0.2), ecr())
    assert ei.value.code == "no_engine_available" and "no engine could take the request" in str(ei.value)
    assert 0.2 <= time.monotonic() - t0 < 5


def test_generator_quarantines_a_request_two_engines_died_under_and_counts_it():
    def kill(c, engine):
        c.lose(engine)
    client = ScriptedClient(num_engines=3, kill_at={1: kill, 3: kill})  # each incarnation kills its engine
    metrics = FrontendMetrics()
    gen = Generator(client, ListDetok, metrics)  # the default journal: quarantine after 2 deaths
    with pytest.raises(ServiceUnavailableError) as ei:
        collect(gen, ecr(max_tokens=8))
    assert ei.value.status == 503 and "request quarantined: in flight on 2 engines that died" in str(ei.value)
    assert [r.request_id for r in client.submitted] == ["r", "r~r1"]  # never a third engine
    assert sorted(e.state for e in client.engines) == ["dead", "dead", "running"]
    text = metrics.render(client.engines)
    assert 'planaria_request_errors_total{kind="quarantined"} 1' in text
    assert gen.journal.num_quarantined_total == 1 and len(gen.journal) == 0
    # the surviving engine still serves the next request
    assert [t for d in collect(gen, ecr("next", max_tokens=3)) for t in d.token_ids] == [100, 101, 102]


def test_stop_string_is_checked_across_the_replay():
    def kill(c, engine):
        c.lose(engine)
    client = ScriptedClient(kill_at={2: kill})
    gen = Generator(client, ListDetok)
    # tokens 100.. decode to "WXYZAB...": "XYZ" spans the replay boundary (positions 1..3)
    deltas = collect(gen, ecr(max_tokens=10, stop=["XYZ"]))
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "XYZ"
    assert [t for d in deltas for t in d.token_ids] == [100, 101, 102, 103]


# -- against a real engine core -----------------------------------------------------------
@pytest.mark.parametrize("sp", [dict(temperature=0.9, seed=1234, top_p=0.95),
                                dict(temperature=1.0, seed=99, presence_penalty=0.5, frequency_penalty=0.3),
                                dict(temperature=0.0)])
def test_a_replayed_request_draws_what_the_uninterrupted_run_drew(tiny_moe, sp):
    from planaria.engine.config import EngineConfig
    from planaria.engine.core import EngineCore

    core = EngineCore(EngineConfig(model=tiny_moe, kv_cache_bytes=8 * 2**20, max_model_len=256,
                                   num_threads=1, enable_prefix_caching=False))

    def run(req: EngineCoreRequest) -> list[int]:
        core.add_request(req)
        out: list[int] = []
        while core.has_unfinished_requests():
            for o in core.step()[0]:
                assert o.error is None, o.error
                out.extend(o.new_token_ids)
        return out

    orig = ecr("full", prompt=[11, 12, 13, 14, 15], max_tokens=24, min_tokens=20, **sp)
    full = run(orig)
    assert len(full) == 24
    for cut in (1, 9, 23):
        assert full[:cut] + run(replay_request(orig, full[:cut], 1)) == full, cut
    bad = msgspec.structs.replace(replay_request(orig, full[:5], 9), num_prior_output_tokens=99)
    core.add_request(bad)
    assert "num_prior_output_tokens" in core.step()[0][0].error


# -- the flight record: a crash pinned on the requests in their first step ------------------

def _on_engine(j, rids, engine, pid, sent=10.0):
    for rid in rids:
        if rid not in j:
            j.open(ecr(rid))
        j.on_sent(rid, sent)
        j.on_submitted(rid, engine)
    return j.on_engine_dead(engine, died_monotonic_s=sent + 5.0, pid=pid)


def test_a_crash_in_a_sole_requests_first_step_quarantines_it_and_spares_the_others():
    """The poison request crashes engine 0 at its first step; the flight record names it
    alone. It waits for the cause (a crash), then fails quarantined at once, without being
    replayed onto a survivor; the requests that had been running there are replayed and the
    death is not counted against them."""
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    _on_engine(j, ["bystander", "poison"], 0, pid=100)
    suspects[100] = ["poison"]
    assert isinstance(j.decide("bystander"), Replay)  # not pinned: replayed at once
    held = j.decide("poison")
    assert isinstance(held, Hold) and held.until_s == clock.now_s + HOLD_FOR_CAUSE_S
    causes[100] = "fault"
    fail = j.decide("poison")
    assert fail.code == "quarantined" and "first step" in fail.reason
    assert j.get("bystander").num_engine_deaths == 0 and j.num_quarantined_total == 1


def test_a_kill_from_outside_during_a_first_step_pins_nothing():
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    _on_engine(j, ["new"], 0, pid=100)
    suspects[100] = ["new"]
    assert isinstance(j.decide("new"), Hold)
    causes[100] = "external"  # the chaos test's SIGKILL, the OOM killer
    assert isinstance(j.decide("new"), Replay) and j.get("new").num_engine_deaths == 0


def test_a_pinned_request_whose_cause_never_comes_is_counted_as_before():
    clock, suspects = Clock(), {}
    j = RequestJournal(clock=clock, suspects_of=suspects.get)
    _on_engine(j, ["new"], 0, pid=100)
    suspects[100] = ["new"]
    assert isinstance(j.decide("new"), Hold)
    clock.now_s += HOLD_FOR_CAUSE_S
    assert isinstance(j.decide("new"), Replay) and j.get("new").num_engine_deaths == 1


def test_several_requests_in_their_first_step_share_the_crash_as_before():
    """Two requests started in the crashing batch: either may be the poison. Each counts the
    death (quarantined at two, as without a flight record); the ones already running do not."""
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    _on_engine(j, ["a", "b", "old"], 0, pid=100)
    suspects[100], causes[100] = ["a", "b"], "fault"
    clock.now_s += 2 * SUSPECT_STAGGER_S  # both turns have come (one turn apart: the test below)
    assert [type(j.decide(r)).__name__ for r in ("a", "b", "old")] == ["Replay", "Replay", "Replay"]
    assert [j.get(r).num_engine_deaths for r in ("a", "b", "old")] == [1, 1, 0]
    # replayed onto engine 1, which crashes with "a" alone in its first step: "a" goes, "b" stays
    _on_engine(j, ["a", "b"], 1, pid=101, sent=30.0)
    clock.now_s += 2 * SUSPECT_STAGGER_S
    suspects[101], causes[101] = [j.get("a").engine_request_id], "fault"  # "a~r1"
    assert j.decide("a").code == "quarantined"
    assert isinstance(j.decide("b"), Replay) and j.get("b").num_engine_deaths == 1


def test_a_decode_step_crash_names_nobody_and_counts_as_before():
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    _on_engine(j, ["a"], 0, pid=100)
    causes[100] = "fault"  # no flight record entry (or an empty one: a decode-only batch)
    assert isinstance(j.decide("a"), Replay) and j.get("a").num_engine_deaths == 1


def test_a_pinned_request_counts_however_soon_the_engine_died():
    """A poison request kills a fast engine within the 0.25 s slack of its send, which used
    to count as 'died before it got there': it was replayed up to the replay limit, taking
    an engine down each time. The flight record proves it ran there."""
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    j.open(ecr("p"))
    j.on_sent("p", 10.0)
    j.on_submitted("p", 0)
    j.on_engine_dead(0, died_monotonic_s=10.05, pid=100)  # 50 ms after the send, no token
    suspects[100], causes[100] = ["p", "other"], "fault"
    clock.now_s += SUSPECT_STAGGER_S  # its turn (first in the record)
    assert isinstance(j.decide("p"), Replay) and j.get("p").num_engine_deaths == 1


def test_several_pinned_requests_are_replayed_one_turn_apart():
    clock, causes, suspects = Clock(), {}, {}
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get)
    _on_engine(j, ["x", "y", "bystander"], 0, pid=100)
    suspects[100], causes[100] = ["x", "y"], "fault"
    lost = j.get("x").lost_at_s
    assert isinstance(j.decide("bystander"), Replay)  # at once
    assert j.decide("x") == Hold(lost + SUSPECT_STAGGER_S)
    assert j.decide("y") == Hold(lost + 2 * SUSPECT_STAGGER_S)
    clock.now_s = lost + SUSPECT_STAGGER_S
    assert isinstance(j.decide("x"), Replay) and isinstance(j.decide("y"), Hold)
    clock.now_s = lost + 2 * SUSPECT_STAGGER_S
    assert isinstance(j.decide("y"), Replay)


def test_pinned_requests_of_a_crash_wait_for_two_engines_before_their_replay():
    """With one engine left (the crashed one restarting), a replayed poison would take the
    last engine and every stream on it down: the pinned requests wait until two serve, so
    the next crash, naming the poison alone, leaves a survivor; bystanders go at once."""
    clock, causes, suspects, healthy = Clock(), {}, {}, [1]
    j = RequestJournal(clock=clock, cause_of=causes.get, suspects_of=suspects.get, num_healthy=lambda: healthy[0])
    _on_engine(j, ["x", "y", "bystander"], 0, pid=100)
    suspects[100], causes[100] = ["x", "y"], "fault"
    assert isinstance(j.decide("bystander"), Replay)
    clock.now_s += 5.0  # their turns have come, but one engine serves
    assert isinstance(j.decide("x"), Hold) and isinstance(j.decide("y"), Hold)
    healthy[0] = 2  # the crashed one is back: one at a time again, from now
    back = clock.now_s
    assert j.decide("x") == Hold(back + SUSPECT_STAGGER_S) and j.decide("y") == Hold(back + 2 * SUSPECT_STAGGER_S)
    clock.now_s = back + SUSPECT_STAGGER_S
    assert isinstance(j.decide("x"), Replay) and isinstance(j.decide("y"), Hold)
    clock.now_s = back + 2 * SUSPECT_STAGGER_S
    assert isinstance(j.decide("y"), Replay)
    _on_engine(j, ["z"], 1, pid=101)
    suspects[101], causes[101] = ["z", "w"], "fault"
    healthy[0] = 1
    clock.now_s += SUSPECT_WAIT_S + 1  # never two again: it goes after the wait
    assert isinstance(j.decide("z"), Replay)
