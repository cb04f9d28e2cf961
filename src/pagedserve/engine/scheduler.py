"""vLLM v1-style token-budget scheduler: no prefill or decode phases, just closing each request's gap.

Each request has num_computed_tokens and a target (num_tokens). Each step hands out up to
max_num_batched_tokens across up to max_num_seqs requests: running requests first, in priority
order, then waiting ones. That one rule gives chunked prefill, prefix caching and mixed batches.

A step that carries decodes may give prefill chunks at most `max_prefill_tokens_beside_decodes` of its
budget: a step's time grows with its tokens, and every running decode waits for the whole step, so a
1,024-token prompt in one chunk would stall them all for its prefill (736 ms on 2 cores). Steps without
decodes still give prefill the whole budget, so a burst of prompts runs at full prefill throughput.

Preemption is by recompute. Victims are chosen by priority first (never a more important request for a
less important one), then by cost: the fewest computed tokens, which are the cheapest to redo. A request
already preempted `protect_after` times is taken last, so one unlucky request does not thrash. Two
reasons preempt: a running request needs blocks that are not there (kv_pressure), or a waiting request
is strictly more important than a running one and cannot start without its slot or blocks (priority).
"""
from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass, field

from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    preempted: list[tuple[Request, str]] = field(default_factory=list)  # (victim, reason)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 protect_after: int = 3, priority_preemption_delay: float = 0.5, max_loras: int = 4,
                 max_prefill_tokens_beside_decodes: int | None = None) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.protect_after = protect_after
        self.priority_preemption_delay = priority_preemption_delay
        self.max_loras = max_loras
        self.max_prefill_tokens_beside_decodes = max_prefill_tokens_beside_decodes
        self.waiting: list[tuple[int, float, int, Request]] = []  # heap: (priority, arrival, tiebreak, req)
        self.running: list[Request] = []
        self.preemptions: dict[str, int] = {"kv_pressure": 0, "priority": 0}
        self._tiebreak = itertools.count()
        self._budget = 0  # tokens left in the step being scheduled
        self._prefill_budget = 0  # of which prefill chunks may still take

    @property
    def num_preemptions(self) -> int:
        return sum(self.preemptions.values())

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING if req.num_preemptions == 0 else RequestStatus.PREEMPTED
        heapq.heappush(self.waiting, (req.priority, req.arrival_time, next(self._tiebreak), req))

    def add_running(self, req: Request) -> None:
        """A forked child starts running at once: its prompt KV is shared with its parent."""
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        self._preempt_for_waiting(out)
        cap = self.max_prefill_tokens_beside_decodes
        has_decodes = any(_is_decode(r) for r in self.running)
        self._prefill_budget = self._budget if cap is None or not has_decodes else cap
        for req in list(self.running):
            if self._budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this step
                continue
            if _is_decode(req):
                num_new = self._num_new_with_spec(req)
            else:
                num_new = min(req.num_tokens - req.num_computed_tokens, self._budget, self._prefill_budget)
                if num_new == 0:  # a prefill past this step's prefill share: next step
                    continue
            if self._allocate_or_preempt(req, num_new, out):
                out.scheduled.append((req, num_new))
                self._budget -= num_new
                self._prefill_budget -= 0 if _is_decode(req) else num_new
        if not any(reason == "kv_pressure" for _, reason in out.preempted):
            self._schedule_waiting(out)
        return out

    def _num_new_with_spec(self, req: Request) -> int:
        """Tokens to compute for a running request: its proposals too where the budget and the free blocks hold
        them, else as many as fit (none at all rather than preempt another request for them)."""
        num_new = min(req.num_tokens_with_spec - req.num_computed_tokens, self._budget)
        del req.spec_token_ids[max(0, req.num_computed_tokens + num_new - req.num_tokens):]
        if req.spec_token_ids and not self.kv.allocate_slots(req, num_new):
            num_new -= len(req.spec_token_ids)
            req.spec_token_ids.clear()
        return num_new

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates req's slots, preempting running requests no more important than req (req itself
        included) until they fit. False when req itself was preempted."""
        while not self.kv.allocate_slots(req, num_new):
            victim = self._cheapest([r for r in self.running if r.priority >= req.priority])
            self._preempt(victim, "kv_pressure", out)
            if victim is req:
                return False
        return True

    def _preempt_for_waiting(self, out: SchedulerOutput) -> None:
        """Makes room for the most important waiting request by preempting strictly less important ones,
        once it has waited priority_preemption_delay seconds: under load a seat or blocks usually free up
        sooner than that, and a preemption throws away the victim's computed tokens."""
        if not self.waiting:
            return
        head = self.waiting[0][3]
        if time.monotonic() - head.arrival_time < self.priority_preemption_delay:
            return
        need = -(-min(head.num_tokens, self.max_num_batched_tokens) // self.kv.block_size)
        while len(self.running) >= self.max_num_seqs or self.kv.num_free_blocks < need:
            victim = self._cheapest([r for r in self.running if r.priority > head.priority])
            if victim is None:
                return
            self._preempt(victim, "priority", out)

    def _cheapest(self, candidates: list[Request]) -> Request | None:
        """Least important first, then protected last, then the fewest tokens to recompute."""
        return max(candidates, default=None, key=lambda r: (
            r.priority, r.num_preemptions < self.protect_after, -r.num_computed_tokens, r.arrival_time))

    def _preempt(self, req: Request, reason: str, out: SchedulerOutput) -> None:
        """Preempts a running request, taking it out of this step if it was already scheduled."""
        for j, (scheduled, n) in enumerate(out.scheduled):
            if scheduled is req:
                del out.scheduled[j]
                self._budget += n
                self._prefill_budget += 0 if _is_decode(req) else n
                break
        self.running.remove(req)
        self.preempt(req, reason)
        out.preempted.append((req, reason))

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        adapters = {id(r.lora) for r in self.running if r.lora is not None}
        deferred = []  # waiting for an adapter slot (max_loras): passed over, not blocking those behind
        while self.waiting and min(self._budget, self._prefill_budget) > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0][3]
            if req.lora is not None and id(req.lora) not in adapters and len(adapters) >= self.max_loras:
                deferred.append(heapq.heappop(self.waiting))
                continue
            if deferred and time.monotonic() - deferred[0][3].arrival_time > self.priority_preemption_delay:
                break  # a deferred adapter has waited long enough: let the running ones drain instead of starving it
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, self._budget, self._prefill_budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break
            heapq.heappop(self.waiting)
            if req.lora is not None:
                adapters.add(id(req.lora))
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
                self.kv.record_prefix_query(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            self._budget -= num_new
            self._prefill_budget -= num_new
        for entry in deferred:
            heapq.heappush(self.waiting, entry)

    def preempt(self, req: Request, reason: str = "kv_pressure") -> None:
        """Recompute later: drop the KV (its full blocks stay in the prefix cache) and requeue."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.spec_token_ids.clear()
        req.num_preemptions += 1
        self.preemptions[reason] += 1
        self.add(req)

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request wherever it is and free its blocks at once."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting = [w for w in self.waiting if w[3] is not req]
            heapq.heapify(self.waiting)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)


def _is_decode(req: Request) -> bool:
    """A request whose prompt (and any recomputed output) is all in the cache: one new token a step."""
    return req.num_tokens - req.num_computed_tokens <= 1 and req.num_computed_tokens > 0
