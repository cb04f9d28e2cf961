"""Stage 5, settle and trace: real tokens and cost replace the worst case reserved at admission (zero when
nothing was served), and the request's trace is written. Usage the provider did not report (or reported in
a shape that is not OpenAI's) is charged at the admission bound, never at zero."""
from __future__ import annotations

import logging

from pagedserve.gateway.budget import BudgetKeeper, usd
from pagedserve.gateway.call import Call
from pagedserve.gateway.gateway_config import GatewayConfig, Target
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.store import NANO, to_nano
from pagedserve.gateway.tracing import TraceSink

log = logging.getLogger(__name__)


def usage_counts(usage) -> tuple[int, int, int] | None:
    """(prompt, completion, cached) tokens of an OpenAI usage object; None when it is missing or malformed."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    counts = (usage.get("prompt_tokens"), usage.get("completion_tokens"), cached or 0)
    if not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c < 1 << 40 for c in counts):
        return None
    return counts


class Settlement:
    def __init__(self, config: GatewayConfig, budgets: BudgetKeeper, limiter: RateLimiter, traces: TraceSink):
        self.config = config
        self.budgets = budgets
        self.limiter = limiter
        self.traces = traces

    async def settle(self, call: Call, target: Target | None, usage: dict | None) -> None:
        trace = call.trace
        if target is not None:
            counts = usage_counts(usage)
            if counts is None:
                counts = (call.prompt_bound, call.tokens_estimate - call.prompt_bound, 0)
                trace.budget_note = "the provider reported no usable usage: charged the admission bound"
            trace.prompt_tokens, trace.completion_tokens, trace.cached_tokens = counts
            price = self.config.target_price(target)
            trace.provider, trace.upstream_model = target.provider, price.name
            trace.cost_usd = round(price.cost(*counts), 9)
            self._check_bound(call)
        if call.hold is not None:
            await self.budgets.settle(call.hold, trace.cost_usd)
            call.hold = None
        await self.limiter.settle(call.key, call.tokens_estimate, trace.prompt_tokens + trace.completion_tokens)

    @staticmethod
    def _check_bound(call: Call) -> None:
        """Says so in the trace when real usage passed what admission reserved (a bound that did not hold)."""
        trace, used = call.trace, call.trace.prompt_tokens + call.trace.completion_tokens
        over = []
        if used > call.tokens_estimate:
            over.append(f"{used} tokens used, {call.tokens_estimate} reserved")
        if call.hold is not None and to_nano(trace.cost_usd) > call.hold.reserved:
            over.append(f"cost {usd(trace.cost_usd)}, {usd(call.hold.reserved / NANO)} reserved")
        if over:
            trace.budget_note = "actual usage exceeded the reservation: " + "; ".join(over)
            log.warning("request %s: %s", trace.trace_id, trace.budget_note)

    async def finish(self, call: Call, target: Target | None, usage: dict | None, status: int = 200,
                     error: str | None = None) -> None:
        await self.settle(call, target, usage)
        call.trace.finish(status, error)
        self.traces.write(call.trace)

    @staticmethod
    def stream_usage(call: Call, usage: dict | None, chunks: int) -> dict:
        """A stream's usage; when the provider sent none, the prompt bound and one token per chunk."""
        return usage if usage_counts(usage) else {"prompt_tokens": call.prompt_bound, "completion_tokens": chunks}
