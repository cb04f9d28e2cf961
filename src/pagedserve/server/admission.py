"""Token-aware admission control: who gets into the engine's queue, who is told to come back, and when.

A request's cost is its KV need in tokens, prompt + max_tokens for each of its n samples. The queue
(admitted, no first token yet) is bounded in tokens and in requests. Those hard bounds (the KV pool, a
request count) always apply. Everything else refuses only where there is a real queue: the engine holds
requests it cannot start yet (at its seat, KV or token-budget limit). A ticket the engine is already
prefilling is being served, not queued: refusing newcomers cannot make its first token come sooner, it
only sends clients away from a server that would have served them (a closed loop of 16 users, issue
#38, got thousands of 429s from a server with seats and KV to spare). Likewise a request that finds a free
seat (in-flight sequences, its own included, within the engine's `seats`) is never refused for time: the
engine runs everything it holds in one batch, so it waits only for its turn in the token budget, which
refusing it cannot shorten (everyone ahead is already seated); a closed loop of up to `seats` users is
therefore queued and served. Only a request that would wait for a seat meets the time rules below.

While the engine is backlogged, the token bound adapts: the rate at which the queue drains (cost tokens
started per second while backlogged) times the TTFT target gives the queue that can be served in time,
and refusals start only past `margin` times that (the estimate is rough; a queue a little past it is
still better served than refused); an AIMD gain on top corrects it from the TTFTs of requests that
waited behind a backlog (a TTFT that is long from its own prefill alone says nothing about the queue).
Each priority class sees only the queue ahead of it (the engine schedules by priority) and may fill
only its share of the bound, so sheddable work is refused first, then standard, and critical last.
The age of the oldest request the engine has not started is bounded the same way (share x TTFT
target, CoDel's sojourn-time idea): it reacts at once where the rate estimate lags. Admitted requests
of a class with a queue-wait limit that are still not started by then are shed (a queued answer that
can only come late is work taken from one that can come in time): sheddable ones always, others only
while the door is refusing work (the server is overloaded) and the engine has not started them. Refusals are 429s with a
Retry-After: the time the queue ahead needs to drain, grown by the overload (refused demand over
capacity, recently) and jittered, so that refused clients come back spread out rather than together;
while draining or unhealthy, 503s.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

CLASSES = {"critical": -1, "standard": 0, "sheddable": 1}


def priority_class(priority: int) -> str:
    """vLLM-style integer priority (lower is more important) -> its class name."""
    return "critical" if priority < 0 else "standard" if priority == 0 else "sheddable"


def parse_priority(value: int | str | None) -> int:
    """'critical' | 'standard' | 'sheddable' | an integer (as int or text) -> integer priority."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    if text in CLASSES:
        return CLASSES[text]
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"priority must be one of {', '.join(CLASSES)} or an integer, not {value!r}") from None


@dataclass(slots=True)
class DegradePolicy:
    """What a class gives up under pressure."""

    max_tokens: int | None = None  # cap on max_tokens
    single_sample: bool = False  # n > 1 is served as n = 1


def parse_degrade(spec: str) -> dict[str, DegradePolicy]:
    """'sheddable:max_tokens=64,n=1;standard:max_tokens=256' -> per-class policies ('' for none)."""
    policies: dict[str, DegradePolicy] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        cls, _, opts = part.partition(":")
        if cls not in CLASSES:
            raise ValueError(f"degrade: unknown class {cls!r} (one of {', '.join(CLASSES)})")
        policy = DegradePolicy()
        for opt in filter(None, (o.strip() for o in opts.split(","))):
            key, _, value = opt.partition("=")
            if key == "max_tokens" and value.isdigit() and int(value) > 0:
                policy.max_tokens = int(value)
            elif key == "n" and value == "1":
                policy.single_sample = True
            else:
                raise ValueError(f"degrade: bad option {opt!r} (max_tokens=N or n=1)")
        policies[cls] = policy
    return policies


@dataclass(slots=True)
class AdmissionConfig:
    enabled: bool = True  # off: an unbounded FCFS queue, priorities ignored
    max_queued_tokens: int = 16384  # hard bound on the queue in cost tokens
    max_queued_requests: int = 256
    seats: int | None = None  # the engine's max_num_seqs: within it the time rules never refuse (None: no seat rule)
    ttft_slo: float = 2.0  # seconds; the adaptive bound aims the queue wait at it
    # The adaptive token bound refuses only past this many times the queue that drains within the target.
    margin: float = 1.5
    shares: dict[str, float] = field(default_factory=lambda: {"critical": 1.0, "standard": 0.8, "sheddable": 0.5})
    degrade_at: float = 0.5  # queue over this fraction of the bound counts as pressure
    degrade: dict[str, DegradePolicy] = field(
        default_factory=lambda: {"sheddable": DegradePolicy(max_tokens=64, single_sample=True)})
    # A class's admitted requests not started after this many TTFT targets are shed (429).
    shed_after: dict[str, float] = field(default_factory=lambda: {"sheddable": 1.0, "standard": 2.0})


def parse_shed_after(spec: str) -> dict[str, float]:
    """'sheddable=1,standard=2' (multiples of the TTFT target) -> per-class limits ('' for none)."""
    limits: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        cls, _, value = part.partition("=")
        try:
            limits[cls] = float(value)
        except ValueError:
            limits[cls] = -1.0
        if cls not in CLASSES or not 0 < limits[cls] < math.inf:
            raise ValueError(f"shed-after: bad entry {part!r} (CLASS=MULTIPLE, e.g. sheddable=1)")
    return limits


class Rejected(Exception):
    """A request refused at the door: status 429 or 503, an error code and when to retry."""

    def __init__(self, status: int, code: str, message: str, retry_after: int):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


@dataclass(slots=True, eq=False)
class Ticket:
    """One admitted request, from admission to its last token."""

    cls: str
    cost: int
    admitted_at: float
    seqs: int = 1  # sequences (prompts x n): the engine seats they take
    shed_at: float | None = None  # not started by then: shed
    started: bool = False
    done: bool = False
    key: int = 0
    behind_backlog: bool = False  # the engine was backlogged while this ticket waited (its TTFT says so)


class AdmissionController:
    RATE_INTERVAL_S = 0.5  # drain-rate samples are taken over intervals at least this long
    AIMD_WINDOW = 8  # TTFTs per gain update
    # When even an empty queue misses the target (service time alone is too long), the gain bottoms out
    # here instead of starving the engine: a short queue still keeps every seat busy.
    MIN_GAIN = 0.25

    RETRY_WINDOW_S = 5.0  # refused demand is counted over this long for the overload factor
    MAX_RETRY_AFTER_S = 60

    def __init__(self, config: AdmissionConfig, clock=time.monotonic,
                 backlogged: Callable[[], bool] | None = None, waiting: Callable[[], int] | None = None,
                 rng: random.Random | None = None):
        """backlogged() says whether the engine holds requests it cannot start yet (at its seat, KV or
        token-budget limit); only then is there a queue to bound or to measure capacity on. Default: the
        admission queue is non-empty, which also counts a request in prefill (a stricter controller).
        waiting() is how many requests the engine has not started: the youngest that many queued tickets
        (in the engine's order) are the ones waiting, older ones are in prefill (default: every queued
        ticket waits). rng jitters Retry-After (seed it for tests)."""
        self.config = config
        self.clock = clock
        self.backlogged = backlogged or (lambda: any(self.queued.values()))
        self.waiting = waiting
        self.rng = rng or random.Random()
        self.queued_tokens = dict.fromkeys(CLASSES, 0)
        self.queued: dict[str, dict[int, Ticket]] = {c: {} for c in CLASSES}  # admission order: oldest first
        self._keys = itertools.count()
        self.in_flight = 0
        self.in_flight_seqs = 0
        self.draining = False
        self.rate: float | None = None  # cost tokens started per second while saturated
        self.gain = 1.0
        self._interval_start = clock()
        self._interval_started_cost = 0
        self._interval_saturated = False
        self._ttfts: deque[float] = deque(maxlen=self.AIMD_WINDOW)
        self._refusals: deque[tuple[float, int]] = deque()  # (when, cost) of recent refusals
        self.rejected: dict[tuple[str, str], int] = {}  # (class, code) -> count
        self.admitted = dict.fromkeys(CLASSES, 0)
        self.degraded = dict.fromkeys(CLASSES, 0)

    # ---- the bound ----

    @property
    def limit_tokens(self) -> float:
        if self.rate is None:
            return self.config.max_queued_tokens
        return min(self.config.max_queued_tokens, max(1.0, self.gain * self.rate * self.config.ttft_slo))

    def ahead(self, cls: str) -> tuple[int, int, float]:
        """Queued tokens and requests that the engine starts before a new request of this class, and
        how long the oldest of them that the engine has not started yet has waited (0 if none)."""
        classes = [c for c in CLASSES if CLASSES[c] <= CLASSES[cls]]
        unstarted = self.unstarted()
        oldest = min((t.admitted_at for t in unstarted if t.cls in classes), default=self.clock())
        return (sum(self.queued_tokens[c] for c in classes), sum(len(self.queued[c]) for c in classes),
                self.clock() - oldest)

    def unstarted_tokens(self, cls: str) -> int:
        """Cost tokens of the tickets ahead of a new request of this class that the engine has not started."""
        return sum(t.cost for t in self.unstarted() if CLASSES[t.cls] <= CLASSES[cls])

    def unstarted(self) -> list[Ticket]:
        """The queued tickets the engine has not started: with waiting() given, the last that many in
        the engine's order (priority, then arrival); the others are in their prefill."""
        tickets = sorted((t for c in CLASSES for t in self.queued[c].values()),
                         key=lambda t: (CLASSES[t.cls], t.admitted_at, t.key))
        if self.waiting is None:
            return tickets
        n = self.waiting()
        return tickets[len(tickets) - n:] if n > 0 else []

    def pressure(self) -> float:
        """Queued tokens over the current bound: 0 idle, 1 full."""
        return sum(self.queued_tokens.values()) / self.limit_tokens

    def under_pressure(self) -> bool:
        return self.config.enabled and self.pressure() >= self.config.degrade_at

    def overload(self) -> float:
        """Demand refused over the last RETRY_WINDOW_S, as a multiple of the drain rate (0 when unknown):
        1 means as much again as the server drains was turned away."""
        now = self.clock()
        while self._refusals and self._refusals[0][0] < now - self.RETRY_WINDOW_S:
            self._refusals.popleft()
        if not self.rate or not self._refusals:
            return 0.0
        return sum(cost for _, cost in self._refusals) / self.RETRY_WINDOW_S / self.rate

    def retry_after(self, tokens: int) -> int:
        """Whole seconds (Retry-After's unit) to come back in: the time the given tokens take to drain (1 s
        while the rate is unknown), times (1 + overload), times a uniform jitter in [1, 2), so that clients
        refused together come back spread over a window that widens as the overload grows; 1-60 s."""
        drain = tokens / self.rate if self.rate else 1.0
        seconds = drain * (1.0 + self.overload()) * self.rng.uniform(1.0, 2.0)
        return min(self.MAX_RETRY_AFTER_S, max(1, math.ceil(seconds)))

    # ---- the door ----

    def admit(self, priority: int, cost: int, deadline_s: float | None = None, seqs: int = 1) -> Ticket:
        """A ticket for the request of `seqs` sequences, or Rejected. Always admits into an empty queue ahead."""
        cls = priority_class(priority) if self.config.enabled else "standard"
        self._tick()
        if self.draining:
            self._reject(cls, 503, "draining", "the server is draining for shutdown; retry on another replica",
                         cost, sum(self.queued_tokens.values()))
        if self.config.enabled:
            self._check_bounds(cls, cost, deadline_s, seqs)
        now = self.clock()
        shed_after = self.config.shed_after.get(cls) if self.config.enabled else None
        ticket = Ticket(cls, cost, now, seqs, None if shed_after is None else now + shed_after * self.config.ttft_slo,
                        key=next(self._keys))
        ticket.behind_backlog = self.config.enabled and self.backlogged()
        self.queued_tokens[cls] += cost
        self.queued[cls][ticket.key] = ticket
        self.in_flight += 1
        self.in_flight_seqs += seqs
        self.admitted[cls] += 1
        return ticket

    def seated(self, seqs: int) -> bool:
        """Whether a request of `seqs` sequences finds free seats beside everything in flight."""
        return self.config.seats is not None and self.in_flight_seqs + seqs <= self.config.seats

    def _check_bounds(self, cls: str, cost: int, deadline_s: float | None, seqs: int) -> None:
        tokens, requests, oldest_wait = self.ahead(cls)
        if tokens == 0:
            return
        share = self.config.shares[cls]
        hard = share * self.config.max_queued_tokens
        if tokens + cost > hard:  # the KV pool's worth (or --max-queued-tokens): always
            self._reject(cls, 429, "overloaded",
                         f"server overloaded: {tokens} tokens queued ahead of this {cls} request "
                         f"(cost {cost}) against a bound of {int(hard)}", cost, tokens + cost - hard)
        if requests + 1 > share * self.config.max_queued_requests:
            self._reject(cls, 429, "queue_full", f"the {cls} queue holds {requests} requests, its bound", cost, tokens)
        backlogged = self.backlogged() and not self.seated(seqs)
        if backlogged and oldest_wait > share * self.config.ttft_slo:
            self._reject(cls, 429, "overloaded", f"server overloaded: the oldest request queued ahead of this "
                         f"{cls} request has waited {oldest_wait:.1f}s", cost, tokens)
        bound = share * self.limit_tokens * self.config.margin
        waiting = self.unstarted_tokens(cls)  # a real queue: requests in their prefill are being served
        if backlogged and waiting + cost > bound:
            self._reject(cls, 429, "overloaded",
                         f"server overloaded: {waiting} tokens queued ahead of this {cls} request "
                         f"(cost {cost}) against a bound of {int(bound)}", cost, waiting + cost - bound)
        if deadline_s is not None and self.rate and tokens / self.rate >= deadline_s:
            self._reject(cls, 429, "deadline_unmeetable",
                         f"the queue ahead needs about {tokens / self.rate:.1f}s, past this request's "
                         f"{deadline_s:g}s deadline", cost, tokens)

    def _reject(self, cls: str, status: int, code: str, message: str, cost: int, wait_tokens: float) -> None:
        """Refuses with a Retry-After for wait_tokens of queue to drain; the refused cost counts as overload."""
        self.rejected[cls, code] = self.rejected.get((cls, code), 0) + 1
        retry = self.retry_after(int(wait_tokens))
        self._refusals.append((self.clock(), cost))
        raise Rejected(status, code, message, retry)

    def degrade(self, priority: int) -> DegradePolicy | None:
        """The class's degradation policy when the server is under pressure, else None."""
        cls = priority_class(priority)
        policy = self.config.degrade.get(cls)
        if policy is None or not self.under_pressure():
            return None
        self.degraded[cls] += 1
        return policy

    # ---- the ticket's life ----

    def started(self, ticket: Ticket) -> None:
        """First token out: the request leaves the queue; its TTFT feeds the gain."""
        if ticket.started or ticket.done:
            return
        ticket.started = True
        ticket.behind_backlog = ticket.behind_backlog or self.backlogged()
        self._dequeue(ticket)
        self._interval_started_cost += ticket.cost
        if ticket.behind_backlog:
            self._observe_ttft(self.clock() - ticket.admitted_at)
        self._tick()

    def finished(self, ticket: Ticket) -> None:
        """Last token out, error or abort: the ticket is returned (safe to call twice)."""
        if ticket.done:
            return
        if not ticket.started:
            self._dequeue(ticket)
        ticket.done = True
        self.in_flight -= 1
        self.in_flight_seqs -= ticket.seqs
        self._tick()

    def should_shed(self, ticket: Ticket) -> bool:
        """At a ticket's queue-wait limit: shed it? A sheddable ticket, always (its class's contract). Any
        other only while the server is overloaded, i.e. its door has refused work within RETRY_WINDOW_S,
        and only if the engine has not started it: then stale queued work makes room for fresh work that
        can still come in time. Without refusals everything that arrives is being admitted, so dropping a
        late ticket frees nothing for anyone (its client would only come back, behind the others)."""
        if ticket.started or ticket.done:
            return False
        if ticket.cls == "sheddable":
            return True
        self.overload()  # forgets refusals older than the window
        return bool(self._refusals) and ticket in self.unstarted()

    def shed(self, ticket: Ticket) -> Rejected:
        """The error for a ticket whose class's queue-wait limit passed before it started."""
        tokens = self.queued_tokens[ticket.cls]
        self.rejected[ticket.cls, "shed"] = self.rejected.get((ticket.cls, "shed"), 0) + 1
        retry = self.retry_after(tokens)
        self._refusals.append((self.clock(), ticket.cost))
        return Rejected(429, "shed", f"shed under load: this {ticket.cls} request waited "
                        f"{self.clock() - ticket.admitted_at:.1f}s in the queue without starting", retry)

    def _dequeue(self, ticket: Ticket) -> None:
        self.queued_tokens[ticket.cls] -= ticket.cost
        del self.queued[ticket.cls][ticket.key]

    # ---- measurement ----

    def _tick(self) -> None:
        """Closes a drain-rate interval once it is long enough; only saturated intervals measure capacity."""
        now = self.clock()
        if not self.backlogged():
            self._interval_saturated = False
        dt = now - self._interval_start
        if dt < self.RATE_INTERVAL_S:
            return
        if self._interval_saturated and self._interval_started_cost:
            sample = self._interval_started_cost / dt
            self.rate = sample if self.rate is None else 0.7 * self.rate + 0.3 * sample
        self._interval_start, self._interval_started_cost = now, 0
        self._interval_saturated = self.backlogged()

    def _observe_ttft(self, ttft: float) -> None:
        """AIMD: a window whose 90th percentile misses the target cuts the gain by 30%, a comfortable
        one (under 80% of it) adds 0.1."""
        self._ttfts.append(ttft)
        if len(self._ttfts) < self.AIMD_WINDOW:
            return
        p90 = sorted(self._ttfts)[int(0.9 * (len(self._ttfts) - 1))]
        slo = self.config.ttft_slo
        if p90 > slo:
            self.gain = max(self.MIN_GAIN, self.gain * 0.7)
        elif p90 < 0.8 * slo:
            self.gain = min(4.0, self.gain + 0.1)
        self._ttfts.clear()
