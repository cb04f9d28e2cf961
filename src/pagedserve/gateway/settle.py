"""Stage 5, settle and trace: real tokens and cost replace the estimates reserved at admission (zero when
nothing was served), and the request's trace is written."""
from __future__ import annotations

from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.call import Call
from pagedserve.gateway.gateway_config import GatewayConfig, Target
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.tracing import TraceSink


class Settlement:
    def __init__(self, config: GatewayConfig, budgets: BudgetKeeper, limiter: RateLimiter, traces: TraceSink):
        self.config = config
        self.budgets = budgets
        self.limiter = limiter
        self.traces = traces

    async def settle(self, call: Call, target: Target | None, usage: dict) -> None:
        trace = call.trace
        trace.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        trace.completion_tokens = int(usage.get("completion_tokens") or 0)
        trace.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if target is not None:
            price = self.config.target_price(target)
            trace.provider, trace.upstream_model = target.provider, price.name
            trace.cost_usd = round(price.cost(trace.prompt_tokens, trace.completion_tokens, trace.cached_tokens), 9)
        if call.hold is not None:
            await self.budgets.settle(call.hold, trace.cost_usd)
            call.hold = None
        await self.limiter.settle(call.key, call.tokens_estimate, trace.prompt_tokens + trace.completion_tokens)

    async def finish(self, call: Call, target: Target | None, usage: dict, status: int = 200,
                     error: str | None = None) -> None:
        await self.settle(call, target, usage)
        call.trace.finish(status, error)
        self.traces.write(call.trace)

    def stream_usage(self, call: Call, usage: dict | None, chunks: int) -> dict:
        """A stream's usage; when the provider sent none, the prompt estimate and one token per chunk."""
        prompt = call.tokens_estimate - call.request.completion_limit(self.config.default_max_tokens)
        return usage or {"prompt_tokens": prompt, "completion_tokens": chunks}
