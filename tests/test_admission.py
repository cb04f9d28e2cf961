"""Admission control and the scheduler's preemption policy, without a model: a fake clock drives the
controller; the scheduler runs over a real KV manager."""
from __future__ import annotations

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


def test_aimd_gain_falls_on_missed_ttft_and_recovers():
    ctl, clock = controller(ttft_slo=1.0)
    for _ in range(ctl.AIMD_WINDOW):
        t = ctl.admit(CRITICAL, 10)
        clock.now += 2.0  # TTFT 2 s > 1 s
        ctl.started(t)
    assert ctl.gain == pytest.approx(0.7)
    for _ in range(ctl.AIMD_WINDOW):
        t = ctl.admit(CRITICAL, 10)
        clock.now += 0.1
        ctl.started(t)
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
