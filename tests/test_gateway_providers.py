"""The per-provider circuit breaker's states (the end-to-end tests drive it through real 529s)."""
from __future__ import annotations

from gateway_support import wait_for

from pagedserve.gateway.gateway_config import BreakerConfig
from pagedserve.gateway.providers import CircuitBreaker


def test_breaker_opens_lets_one_probe_through_and_closes_on_success():
    breaker = CircuitBreaker(BreakerConfig(failure_threshold=2, reset_s=0.1))
    breaker.record(False)
    assert breaker.state == "closed" and breaker.allow()
    breaker.record(True)  # a success resets the count: failures must be consecutive
    breaker.record(False)
    assert breaker.state == "closed"
    breaker.record(False)
    assert breaker.state == "open" and not breaker.allow()
    wait_for(breaker.allow, 5, "the breaker to half-open")
    assert breaker.state == "half_open" and not breaker.allow()  # one probe at a time
    breaker.record(False)  # the probe failed: open again, for another reset_s
    assert breaker.state == "open" and not breaker.allow()
    wait_for(breaker.allow, 5, "the second probe")
    breaker.release()  # a probe whose client went away decides nothing ...
    assert breaker.allow()  # ... and the next request may probe instead
    breaker.record(True)
    assert breaker.state == "closed" and breaker.failures == 0 and breaker.allow() and breaker.allow()
