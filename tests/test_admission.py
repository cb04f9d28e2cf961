"""Admission control and the scheduler's preemption policy, without a model: a fake clock drives the
controller; the scheduler runs over a real KV manager."""
from __future__ import annotations

import statistics
import time

import pytest

from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.admission import (
    AdmissionConfig,
    AdmissionController,
    DegradePolicy,
    Rejected,
    parse_degrade,
    parse_priority,
    parse_shed_after,
)

CRITICAL, STANDARD, SHEDDABLE = -1, 0, 1


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def controller(**kw) -> tuple[AdmissionController, Clock]:
    clock = Clock()
    config = AdmissionConfig(**{"max_queued_tokens": 1000, "max_queued_requests": 100, **kw})
    return AdmissionController(config, clock), clock


def rejection(ctl: AdmissionController, priority: int, cost: int, deadline: float | None = None) -> Rejected:
    with pytest.raises(Rejected) as info:
        ctl.admit(priority, cost, deadline)
    return info.value


def test_sheddable_is_refused_first_then_standard_and_critical_last():
    ctl, _ = controller()
    for _ in range(4):
        ctl.admit(STANDARD, 100)  # 400 queued: past sheddable's share (500) with one more of 200
    assert rejection(ctl, SHEDDABLE, 200).code == "overloaded"
    for _ in range(4):
        ctl.admit(STANDARD, 100)
    assert rejection(ctl, STANDARD, 100).status == 429  # 800 + 100 > 0.8 * 1000
    ctl.admit(CRITICAL, 900)  # critical sees only the critical queue ahead of it: nothing
    assert rejection(ctl, CRITICAL, 200).code == "overloaded"
    assert ctl.rejected == {("sheddable", "overloaded"): 1, ("standard", "overloaded"): 1,
                            ("critical", "overloaded"): 1}


def test_an_empty_queue_always_admits_even_an_oversized_request():
    ctl, _ = controller()
    ticket = ctl.admit(SHEDDABLE, 5000)
    assert ctl.queued_tokens["sheddable"] == 5000
    ctl.finished(ticket)
    ctl.finished(ticket)  # idempotent
    assert ctl.queued_tokens["sheddable"] == 0 and ctl.in_flight == 0


def test_request_count_bound():
    ctl, _ = controller(max_queued_requests=4)
    for _ in range(3):
        ctl.admit(STANDARD, 1)  # 3 + 1 > 0.8 * 4
    assert rejection(ctl, STANDARD, 1).code == "queue_full"


def saturate(ctl: AdmissionController, clock: Clock, cost: int, per_interval: int, intervals: int) -> None:
    """Keeps the queue non-empty while `per_interval` requests of `cost` start every 0.5 s."""
    backlog = [ctl.admit(CRITICAL, cost)]
    for _ in range(intervals):
        for _ in range(per_interval):
            backlog.append(ctl.admit(CRITICAL, cost))
            ticket = backlog.pop(0)
            ctl.started(ticket)
            ctl.finished(ticket)
        clock.now += 0.5
    ctl._tick()


def test_drain_rate_is_measured_only_while_saturated_and_sets_the_bound():
    ctl, clock = controller(ttft_slo=2.0, max_queued_tokens=100_000)
    t = ctl.admit(STANDARD, 50)
    clock.now += 1.0
    ctl.started(t)  # the queue ran empty in this interval: no capacity sample
    assert ctl.rate is None and ctl.limit_tokens == 100_000
    saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # 1000 tokens/s
    assert ctl.rate == pytest.approx(1000, rel=0.05)
    assert ctl.limit_tokens == pytest.approx(ctl.gain * 1000 * 2.0, rel=0.05)


def test_light_load_that_never_backlogs_the_engine_does_not_pass_for_low_capacity():
    clock = Clock()
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=100_000), clock, backlogged=lambda: False)
    saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # the queue is never empty, the engine never full
    assert ctl.rate is None and ctl.limit_tokens == 100_000


def test_retry_after_comes_from_the_drain_rate():
    ctl, clock = controller(max_queued_tokens=100_000, ttft_slo=1.0)
    saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # rate 1000/s, bound about 1000 * gain
    refused = None
    while refused is None:
        try:
            ctl.admit(STANDARD, 500)
        except Rejected as exc:
            refused = exc
    queued = sum(ctl.queued_tokens.values())
    assert refused.code == "overloaded"
    assert 1 <= refused.retry_after <= max(1, -(-(queued + 500) // 1000))


def feed_ttfts(ctl: AdmissionController, clock: Clock, ttft: float) -> None:
    """One AIMD window of requests admitted and started one at a time, each after `ttft` seconds."""
    for _ in range(ctl.AIMD_WINDOW):
        t = ctl.admit(CRITICAL, 10)
        clock.now += ttft
        ctl.started(t)


def test_aimd_gain_falls_on_missed_ttft_and_recovers():
    ctl, clock = controller(ttft_slo=1.0)
    feed_ttfts(ctl, clock, 2.0)  # TTFT 2 s > 1 s
    assert ctl.gain == pytest.approx(0.7)
    feed_ttfts(ctl, clock, 0.1)
    assert ctl.gain == pytest.approx(0.8)


def test_deadline_that_the_queue_cannot_meet_is_refused_at_once():
    ctl, clock = controller(max_queued_tokens=100_000, ttft_slo=10.0)
    saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # 1000 tokens/s, 100 queued
    for _ in range(20):
        ctl.admit(STANDARD, 100)  # about 2.1 s of queue ahead now
    assert rejection(ctl, STANDARD, 100, deadline=1.0).code == "deadline_unmeetable"
    ctl.admit(STANDARD, 100, 10.0)


def test_an_old_queue_ahead_refuses_at_once_before_the_rate_is_known():
    ctl, clock = controller(ttft_slo=1.0, max_queued_tokens=100_000)
    ctl.admit(STANDARD, 10)
    clock.now += 0.9  # over sheddable's 0.5 s and standard's 0.8 s, under critical's 1 s
    assert rejection(ctl, SHEDDABLE, 10).message.startswith("server overloaded: the oldest request")
    assert rejection(ctl, STANDARD, 10).code == "overloaded"
    ctl.admit(CRITICAL, 10)  # the standard request is not ahead of critical work


def test_queued_tickets_get_a_shed_time_by_class():
    ctl, clock = controller(ttft_slo=2.0, shed_after={"sheddable": 1.0, "standard": 2.0})
    shed, std, crit = (ctl.admit(p, 10) for p in (SHEDDABLE, STANDARD, CRITICAL))
    assert (shed.shed_at, std.shed_at, crit.shed_at) == (clock.now + 2.0, clock.now + 4.0, None)
    exc = ctl.shed(shed)
    assert (exc.status, exc.code, ctl.rejected[("sheddable", "shed")]) == (429, "shed", 1)
    ctl.finished(shed)
    assert ctl.queued_tokens["sheddable"] == 0 and ctl.in_flight == 2


def test_draining_refuses_with_503():
    ctl, _ = controller()
    ctl.draining = True
    exc = rejection(ctl, CRITICAL, 10)
    assert (exc.status, exc.code) == (503, "draining") and exc.retry_after >= 1


def test_control_off_admits_everything_as_one_class():
    ctl, _ = controller(enabled=False, max_queued_tokens=10)
    for p in (SHEDDABLE, CRITICAL, STANDARD):
        ctl.admit(p, 1000)
    assert ctl.queued_tokens["standard"] == 3000
    assert ctl.degrade(SHEDDABLE) is None


def test_degradation_applies_under_pressure_only():
    ctl, _ = controller(degrade_at=0.5, degrade={"sheddable": DegradePolicy(max_tokens=8, single_sample=True)})
    assert ctl.degrade(SHEDDABLE) is None
    ctl.admit(CRITICAL, 600)
    assert ctl.degrade(SHEDDABLE) == DegradePolicy(8, True)
    assert ctl.degrade(STANDARD) is None  # no policy for standard
    assert ctl.degraded["sheddable"] == 1


def test_parsers():
    assert [parse_priority(v) for v in ("critical", "Standard", "sheddable", "-5", 7, None)] == [-1, 0, 1, -5, 7, 0]
    with pytest.raises(ValueError, match="priority must be"):
        parse_priority("urgent")
    assert parse_degrade("sheddable:max_tokens=64,n=1;standard:max_tokens=256") == {
        "sheddable": DegradePolicy(64, True), "standard": DegradePolicy(256, False)}
    assert parse_degrade("") == {}
    for bad in ("vip:max_tokens=1", "sheddable:max_tokens=0", "standard:n=2"):
        with pytest.raises(ValueError, match="degrade"):
            parse_degrade(bad)
    assert parse_shed_after("sheddable=1, standard=2.5") == {"sheddable": 1.0, "standard": 2.5}
    assert parse_shed_after("") == {}
    for bad in ("vip=1", "sheddable=0", "standard=x", "sheddable"):
        with pytest.raises(ValueError, match="shed-after"):
            parse_shed_after(bad)


# ---- the scheduler's side: priorities and preemption economics ----

BLOCK = 4


def request(rid: str, num_prompt: int, priority: int = 0, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=64), arrival, 0, priority)


def run_step(sched: Scheduler):
    """One schedule() as the engine does it: computed tokens advance, decodes get a token."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
    return out


def test_waiting_critical_preempts_the_cheapest_sheddable_for_a_seat():
    sched = Scheduler(KVCacheManager(64, BLOCK, enable_prefix_caching=False), max_num_seqs=2,
                      max_num_batched_tokens=256)
    long_shed, short_shed = request("long", 40, SHEDDABLE, 0.0), request("short", 8, SHEDDABLE, 1.0)
    sched.add(long_shed)
    sched.add(short_shed)
    run_step(sched)
    critical = request("crit", 8, CRITICAL, 2.0)
    sched.add(critical)
    out = run_step(sched)
    assert out.preempted == [(short_shed, "priority")]  # fewer tokens to recompute than the long one
    assert critical in sched.running and long_shed in sched.running
    assert sched.preemptions == {"kv_pressure": 0, "priority": 1}


def test_a_fresh_critical_request_waits_briefly_for_a_seat_before_preempting():
    sched = Scheduler(KVCacheManager(64, BLOCK), max_num_seqs=1, max_num_batched_tokens=256,
                      priority_preemption_delay=60.0)
    sched.add(request("shed", 8, SHEDDABLE))
    run_step(sched)
    sched.add(request("crit", 8, CRITICAL, time.monotonic()))
    assert run_step(sched).preempted == []  # it arrived just now: a seat may free up first


def test_a_less_important_request_never_preempts_a_more_important_one():
    sched = Scheduler(KVCacheManager(64, BLOCK), max_num_seqs=1, max_num_batched_tokens=256)
    critical = request("crit", 8, CRITICAL)
    sched.add(critical)
    run_step(sched)
    sched.add(request("std", 8, STANDARD, 1.0))
    sched.add(request("std2", 8, STANDARD, 2.0))  # same class as each other: no preemption among them
    for _ in range(3):
        assert run_step(sched).preempted == []
    assert sched.running == [critical]


def test_kv_pressure_takes_the_least_important_then_cheapest_and_spares_the_protected():
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=False)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=256, protect_after=1)
    a = request("a", 12, STANDARD, 0.0)  # 7 of 8 blocks; the next step wants two more
    b = request("b", 11, SHEDDABLE, 1.0)
    c = request("c", 4, SHEDDABLE, 2.0)
    for r in (a, b, c):
        sched.add(r)
    run_step(sched)
    c.num_preemptions = 1  # c was preempted before: protected, so b goes although it holds more
    out = run_step(sched)
    assert [(r.request_id, why) for r, why in out.preempted] == [("b", "kv_pressure")]
    assert a in sched.running and c in sched.running


# ---- serving what it can serve (issue #38): refusals only where a real queue would break the target ----

def engine_view(waiting: list[int]):
    """backlogged() / waiting() of a fake engine whose waiting count the test sets in waiting[0]."""
    return (lambda: waiting[0] > 0), (lambda: waiting[0])


def test_no_backlog_means_no_adaptive_refusal_however_slow_the_prefill():
    # Every admitted request is in the engine's batch (nothing waits for a seat): tickets that have not
    # produced a first token are being prefilled, not queued. Long TTFTs and a measured rate that would
    # bound the queue below them refuse nothing; only the hard bound (the KV pool's worth) does.
    clock, waiting = Clock(), [0]
    backlogged, count = engine_view(waiting)
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=10_000, ttft_slo=1.0), clock, backlogged, count)
    ctl.rate, ctl.gain = 100.0, ctl.MIN_GAIN  # a bound of 25 tokens, were there a queue
    tickets = [ctl.admit(STANDARD, 640) for _ in range(12)]  # 7,680 tokens, under 0.8 x 10,000
    clock.now += 5.0  # five targets without a first token
    tickets.append(ctl.admit(STANDARD, 10))
    assert rejection(ctl, STANDARD, 640).message.endswith("against a bound of 8000")  # the hard bound only
    for t in tickets:
        ctl.started(t)  # TTFTs of 5 s, over the target, but no queue: the gain is left alone
    assert ctl.gain == ctl.MIN_GAIN and ctl.rejected == {("standard", "overloaded"): 1}


def test_the_age_rule_looks_at_requests_the_engine_has_not_started():
    clock, waiting = Clock(), [0]
    backlogged, count = engine_view(waiting)
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=100_000, ttft_slo=1.0), clock, backlogged, count)
    in_prefill = [ctl.admit(STANDARD, 100) for _ in range(3)]
    clock.now += 3.0  # three targets in their prefill: not a queue
    young = ctl.admit(STANDARD, 100)
    waiting[0] = 1  # the engine has no seat for it yet
    assert ctl.unstarted() == [young]
    ctl.admit(STANDARD, 100)  # the one waiting has waited 0 s: admitted
    waiting[0] = 2
    clock.now += 0.9  # now it has waited 0.9 s of a 1 s target (standard's share: 0.8 s)
    assert rejection(ctl, STANDARD, 100).message.startswith("server overloaded: the oldest request")
    ctl.admit(CRITICAL, 100)  # critical work has nothing of its class ahead
    assert len(in_prefill) == 3


def test_the_rate_bound_refuses_only_past_its_margin():
    ctl, clock = controller(ttft_slo=1.0, max_queued_tokens=100_000, margin=1.5)
    saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # 1000 tokens/s while backlogged
    ctl.gain = 1.0
    assert ctl.limit_tokens == pytest.approx(1000, rel=0.05)
    queued = sum(ctl.queued_tokens.values())
    admitted = 0
    with pytest.raises(Rejected):
        while True:
            ctl.admit(CRITICAL, 50)
            admitted += 1
    # critical's share is 1: refused once the queue would pass 1.5 x (1000 tokens/s x 1 s)
    assert queued + 50 * admitted <= 1.5 * ctl.limit_tokens < queued + 50 * (admitted + 1)


def test_ttfts_behind_a_backlog_still_cut_the_gain():
    clock, waiting = Clock(), [1]
    backlogged, count = engine_view(waiting)
    ctl = AdmissionController(AdmissionConfig(ttft_slo=1.0), clock, backlogged, count)
    feed_ttfts(ctl, clock, 2.0)
    assert ctl.gain == pytest.approx(0.7)
    waiting[0] = 0
    feed_ttfts(ctl, clock, 2.0)  # the same TTFTs with no queue in the engine: the prefill's own time
    assert ctl.gain == pytest.approx(0.7)


def test_retry_after_is_jittered_and_grows_with_the_overload():
    import random

    def refusals(extra: int) -> list[int]:
        clock = Clock()
        ctl = AdmissionController(AdmissionConfig(max_queued_tokens=100_000, ttft_slo=1.0), clock,
                                  rng=random.Random(7))
        saturate(ctl, clock, cost=100, per_interval=5, intervals=6)  # 1000 tokens/s
        ctl.gain = 1.0
        for _ in range(14):
            ctl.admit(CRITICAL, 100)  # 1,500 queued: the 1.5 x bound is full
        out = []
        for _ in range(extra):  # refused demand piles up within the window: the overload grows
            with pytest.raises(Rejected) as info:
                ctl.admit(STANDARD, 1000)
            out.append(info.value.retry_after)
        return out

    light, heavy = refusals(3), refusals(40)
    assert all(1 <= r <= 60 for r in light + heavy)
    assert len(set(heavy)) >= 4  # spread out, not one value for every client
    assert statistics.median(heavy[-10:]) > 2 * statistics.median(light)  # 40 refusals of 1,000 tokens in 5 s: 8x


def test_a_closed_loop_the_engine_can_carry_is_never_refused():
    """16 users, 512-token prompts, 128-token answers, over a simulated engine with 64 seats whose prefill
    alone takes longer than the TTFT target: every request is served, none refused (issue #38)."""
    clock, waiting = Clock(), [0]
    backlogged, count = engine_view(waiting)
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=93_200, ttft_slo=2.0), clock, backlogged, count)
    step, ttft, decode = 0.3, 2.6, 6.0  # seconds: the first token comes later than the target, whatever the queue
    events = [(0.01 * u, u, "arrive", None) for u in range(16)]  # (time, user, what, ticket)
    served = 0
    while events and clock.now < 300:
        events.sort(key=lambda e: e[0])
        clock.now, user, what, ticket = events.pop(0)
        if what == "arrive":
            ticket = ctl.admit(STANDARD, 512 + 128)  # a refusal raises and fails the test
            waiting[0] += 1  # waits for the engine's next step
            events.append((clock.now + step, user, "scheduled", ticket))
        elif what == "scheduled":
            waiting[0] -= 1
            events.append((clock.now + ttft - step, user, "first", ticket))
        elif what == "first":
            ctl.started(ticket)
            events.append((clock.now + decode, user, "done", ticket))
        else:
            ctl.finished(ticket)
            served += 1
            events.append((clock.now, user, "arrive", None))
    assert served > 500 and ctl.rejected == {}


def test_standard_work_is_shed_only_while_the_door_refuses_and_only_if_not_started():
    clock, waiting = Clock(), [0]
    backlogged, count = engine_view(waiting)
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=1000, ttft_slo=1.0), clock, backlogged, count)
    shed, in_prefill, queued = ctl.admit(SHEDDABLE, 10), ctl.admit(STANDARD, 100), ctl.admit(STANDARD, 100)
    waiting[0] = 2  # the engine started the older standard one; the sheddable one (scheduled last) and the younger wait
    clock.now += 2.0  # past both classes' limits
    assert ctl.should_shed(shed)  # sheddable: its class's contract, always
    assert not ctl.should_shed(queued)  # nothing refused at the door: everything arriving is admitted
    assert rejection(ctl, STANDARD, 750).message.endswith("against a bound of 800")  # the door refuses now
    assert ctl.should_shed(queued) and not ctl.should_shed(in_prefill)  # overloaded: stale queued work goes
    clock.now += ctl.RETRY_WINDOW_S + 0.1
    assert not ctl.should_shed(queued)  # the refusals are old news
    ctl.started(queued)
    assert not ctl.should_shed(queued)


def simulate(users: int | None, arrivals_per_step: int, steps: int, seats: int | None = 64) -> AdmissionController:
    """A stepped engine with `seats` seats that starts at most 4 waiting 512-token prompts per 0.7 s step (a
    2,048-token budget) and decodes each answer for 20 steps. users: a closed loop of that many (each sends
    again when its answer ends); None: an open loop of arrivals_per_step new requests every step."""
    clock, waiting, running = Clock(), [], []  # waiting: tickets; running: [ticket, steps left]
    ctl = AdmissionController(AdmissionConfig(max_queued_tokens=93_200, ttft_slo=2.0, seats=seats), clock,
                              lambda: bool(waiting), lambda: len(waiting))

    def arrive() -> None:
        try:
            waiting.append(ctl.admit(STANDARD, 512 + 128))
        except Rejected:
            pass

    for _ in range(users or 0):
        arrive()
    for _ in range(steps):
        for _ in range(arrivals_per_step if users is None else 0):
            arrive()
        started = [waiting.pop(0) for _ in range(min(4, len(waiting), 64 - len(running)))]
        clock.now += 0.7
        for entry in running:
            entry[1] -= 1
        for ticket in [t for t, left in running if left == 0]:
            ctl.finished(ticket)
            if users:
                arrive()
        running[:] = [e for e in running if e[1] > 0]
        for ticket in started:
            ctl.started(ticket)
            running.append([ticket, 20])
        for ticket in [t for t in waiting if ctl.should_shed(t)]:
            waiting.remove(ticket)
            ctl.shed(ticket)
            ctl.finished(ticket)
    return ctl


def test_a_closed_loop_within_the_seats_is_queued_not_refused_however_long_its_ttft():
    # 64 users arrive at once: the last of them waits 16 steps (11 s, 5x the target) for its turn in the
    # token budget, yet every one of them has a seat: queued and served, none refused (issue #38).
    ctl = simulate(users=64, arrivals_per_step=0, steps=300)
    assert ctl.rejected == {} and ctl.admitted["standard"] > 400
    assert sum(simulate(users=64, arrivals_per_step=0, steps=300, seats=None).rejected.values()) > 0  # the rule's work


def test_an_open_loop_past_the_seats_is_still_refused():
    # 8 new requests per step against a capacity of 64 seats / 20 steps = 3.2: past the seats the time
    # rules refuse at the door or shed what waited too long, as they do without the seat rule.
    with_seats, without = simulate(None, 8, 120), simulate(None, 8, 120, seats=None)
    for ctl in (with_seats, without):
        refused = sum(ctl.rejected.values())
        assert refused > 8 * 120 / 2 and ctl.in_flight_seqs <= 64 + 2 * 8
    assert abs(sum(with_seats.rejected.values()) - sum(without.rejected.values())) < 8 * 120 / 10
