"""Measured step costs for the per-step decision whether proposals pay (the rule: proposer.py's docstring)."""
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

    def pays(self, batch: int, added_rows: int, extra_tokens: float) -> bool:
        """Whether a step over batch requests with added_rows proposals, expected to accept extra_tokens of
        them, yields more tokens per second than a plain decode step. Unmeasured: yes (and measure)."""
        self.steps += 1
        t_decode, t_verify = self.decode.predict(batch), self.verify.predict(batch + added_rows)
        measured = t_decode is not None and t_verify is not None
        decision = not measured or (batch + extra_tokens) * t_decode > batch * (t_verify + self.propose_s)
        if self.steps % (EXPLORE_EVERY if measured else WARM_UP_EVERY) == 0:
            decision = not decision  # one step the other way: its fit would otherwise go stale
        return decision
