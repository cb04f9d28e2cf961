"""vLLM v1-style token-budget scheduler: no prefill or decode phases, just closing each request's gap.

Each request has num_computed_tokens and a target (num_tokens). Each step hands out up to
max_num_batched_tokens across up to max_num_seqs requests: running requests first, in priority
order, then waiting ones. That one rule gives chunked prefill, prefix caching and mixed batches.
When blocks run out, the least important, newest running request is preempted by recompute.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, tokens to compute)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[tuple[int, float, int, Request]] = []  # heap: (priority, arrival, tiebreak, req)
        self.running: list[Request] = []
        self.num_preemptions = 0
        self._tiebreak = itertools.count()

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
        budget = self.max_num_batched_tokens
        self.running.sort(key=lambda r: (r.priority, r.arrival_time))
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate_or_preempt(req, num_new, out):
                break  # req itself was the least important: nothing after it can run either
            out.scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _allocate_or_preempt(self, req: Request, num_new: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(req, num_new):
            victim = self.running.pop()
            self.preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0][3]
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached, budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break
            heapq.heappop(self.waiting)
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_cached
                self.kv.record_prefix_query(req.num_prompt_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new

    def preempt(self, req: Request) -> None:
        """Recompute later: drop the KV (its full blocks stay in the prefix cache) and requeue."""
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
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
