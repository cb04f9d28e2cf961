"""Measured step costs for the per-step decision which proposals pay (the rule: proposer.py's docstring)."""
from __future__ import annotations

from dataclasses import dataclass

WEIGHT = 0.1  # of the latest step in the running fits: about the last 10-20 steps count
MIN_STEPS = 4  # observations a fit needs before it predicts
EXPLORE_EVERY = 32  # steps between forced opposite decisions, so that both fits stay fresh
WARM_UP_EVERY = 8  # the same while a fit cannot predict yet (a workload that always proposes measures no decode)


@dataclass(slots=True)
class LinearFit:
    """Exponentially weighted least squares of seconds = a + b * rows over recent forward passes."""
    steps: int = 0
    rows: float = 0.0
    seconds: float = 0.0
    rows_sq: float = 0.0
    rows_seconds: float = 0.0

    def add(self, rows: int, seconds: float) -> None:
        w = 1.0 if self.steps == 0 else WEIGHT
        self.steps += 1
        self.rows += w * (rows - self.rows)
        self.seconds += w * (seconds - self.seconds)
        self.rows_sq += w * (rows * rows - self.rows_sq)
        self.rows_seconds += w * (rows * seconds - self.rows_seconds)

    def predict(self, rows: int) -> float | None:
        if self.steps < MIN_STEPS:
            return None
        spread = self.rows_sq - self.rows ** 2
        if spread < 0.25:  # all steps about one size: the mean time is the best guess near it
            return self.seconds
        slope = max(0.0, (self.rows_seconds - self.rows * self.seconds) / spread)
        return max(0.0, self.seconds + slope * (rows - self.rows))


@dataclass(slots=True)
class StepCosts:
    decode: LinearFit  # forward passes of decode steps without proposals, by rows
    verify: LinearFit  # forward passes of decode steps verifying proposals, by rows (1 + k per request)
    propose_s: float = 0.0  # the proposer's own time per step (the draft model's k passes; ngram: microseconds)
    steps: int = 0

    @classmethod
    def new(cls) -> StepCosts:
        return cls(LinearFit(), LinearFit())

    def record(self, rows: int, seconds: float, verifying: bool) -> None:
        (self.verify if verifying else self.decode).add(rows, seconds)

    def record_proposal(self, seconds: float) -> None:
        self.propose_s += WEIGHT * (seconds - self.propose_s)

    def choose(self, batch: int, candidates: list[tuple[int, float]]) -> int:
        """How many of the candidates (each proposing request's added rows and expected accepted tokens, the most
        tokens per row first) to verify in a step over batch requests: the count whose step yields the most tokens
        per second, 0 where a plain decode step yields more. Unmeasured: all of them (and measure). Every so often
        the other way (all or none), so that neither fit goes stale."""
        self.steps += 1
        t_decode = self.decode.predict(batch)
        measured = t_decode is not None
        best, best_rate, rows, extra = 0, batch / t_decode if measured and t_decode > 0 else 0.0, 0, 0.0
        for n, (added, expected) in enumerate(candidates, start=1):
            rows, extra = rows + added, extra + expected
            t_verify = self.verify.predict(batch + rows)
            if t_verify is None:
                measured = False
                break
            if (rate := (batch + extra) / max(t_verify + self.propose_s, 1e-9)) > best_rate:
                best, best_rate = n, rate
        chosen = best if measured else len(candidates)
        if self.steps % (EXPLORE_EVERY if measured else WARM_UP_EVERY) == 0:
            chosen = 0 if chosen else len(candidates)
        return chosen
