"""Gateway state on both stores (SQLite and a real redis-server): keys, token buckets, daily budgets with
time-zone resets, source versions; atomic under concurrency, and spend that survives a restart."""
from __future__ import annotations

import asyncio
import uuid
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest
from gateway_support import redis_server

from pagedserve.gateway.auth import hash_key, mint_key
from pagedserve.gateway.budget import BudgetExceeded, BudgetKeeper
from pagedserve.gateway.gateway_config import BudgetConfig, GatewayConfig
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.store import NANO, Bucket, RedisStore, SQLiteStore


class Clock:
    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    process, url = redis_server(tmp_path_factory.mktemp("redis"))
    with process:
        yield url


def make_store(kind: str, tmp_path, request, clock=None):
    if kind == "sqlite":
        return SQLiteStore(tmp_path / "gw.db", **({"clock": clock} if clock else {}))
    return RedisStore(request.getfixturevalue("redis_url"), prefix=f"t{uuid.uuid4().hex[:8]}:")


@pytest.fixture(params=["sqlite", "redis"])
def kind(request):
    return request.param


def run(coro):
    return asyncio.run(coro)


def test_keys_are_stored_hashed_and_revocable(kind, tmp_path, request):
    async def scenario():
        store = make_store(kind, tmp_path, request)
        token, key = mint_key("alice", team="hr", models=["hr-assistant"], rpm=5)
        await store.put_key(key)
        assert key.key_hash == hash_key(token) and token not in key.key_hash
        found = await store.key_by_hash(hash_key(token))
        assert found.user == "alice" and found.team == "hr" and found.active and found.allows("hr-assistant")
        assert not found.allows("other")
        assert await store.key_by_hash(hash_key(token + "x")) is None
        assert [k.key_id for k in await store.list_keys()] == [key.key_id]
        assert await store.revoke_key(key.key_id)
        assert not (await store.key_by_hash(hash_key(token))).active
        assert not await store.revoke_key("nope")
        await store.close()
    run(scenario())


def test_token_bucket_denies_then_refills(tmp_path):
    clock = Clock(1000.0)
    store = SQLiteStore(tmp_path / "gw.db", clock=clock)
    bucket = Bucket("k:rpm", capacity=3, cost=1)
    results = [run(store.take([bucket])) for _ in range(4)]
    assert [r.allowed for r in results] == [True, True, True, False]
    assert results[3].retry_after_s == pytest.approx(20.0)  # 3 per minute: one every 20 s
    clock.now += 19.0
    assert not run(store.take([bucket])).allowed
    clock.now += 1.5
    assert run(store.take([bucket])).allowed


def test_take_is_all_or_nothing(kind, tmp_path, request):
    async def scenario():
        store = make_store(kind, tmp_path, request)
        requests, tokens = Bucket("k:rpm", 10, 1), Bucket("k:tpm", 100, 80)
        assert (await store.take([requests, tokens])).allowed
        denied = await store.take([requests, tokens])  # tokens short: the request must not be counted either
        assert not denied.allowed and denied.levels[0] == pytest.approx(9, abs=0.1)
        await store.close()
    run(scenario())


@pytest.mark.parametrize("instances", [2])
def test_many_instances_enforce_one_limit(kind, tmp_path, request, instances):
    """50 concurrent requests through N store clients against rpm=10: exactly 10 pass, not 10 * N."""
    async def scenario():
        if kind == "redis":
            url, prefix = request.getfixturevalue("redis_url"), f"t{uuid.uuid4().hex[:8]}:"
            stores = [RedisStore(url, prefix=prefix) for _ in range(instances)]
        else:
            stores = [SQLiteStore(tmp_path / "shared.db") for _ in range(instances)]
        bucket = Bucket("k:rpm", capacity=10, cost=1)

        async def take(i):
            store = stores[i % instances]
            if kind == "sqlite":  # separate connections from separate threads, as separate processes would
                return (await asyncio.to_thread(asyncio.run, store.take([bucket]))).allowed
            return (await store.take([bucket])).allowed
        allowed = await asyncio.gather(*(take(i) for i in range(50)))
        assert sum(allowed) == 10
        for store in stores:
            await store.close()
    run(scenario())


def test_rate_limiter_headers_and_retry_after(kind, tmp_path, request):
    async def scenario():
        limiter = RateLimiter(make_store(kind, tmp_path, request))
        _, key = mint_key("bob", rpm=2, tpm=1000)
        first = await limiter.admit(key, 300)
        assert first.allowed and first.headers["x-ratelimit-limit-requests"] == "2"
        assert first.headers["x-ratelimit-remaining-requests"] == "1"
        assert first.headers["x-ratelimit-remaining-tokens"] == "700"
        await limiter.settle(key, 300, 100)  # used less than estimated: 200 tokens come back
        second = await limiter.admit(key, 300)
        assert second.allowed and 599 <= int(second.headers["x-ratelimit-remaining-tokens"]) <= 602
        third = await limiter.admit(key, 10)
        assert not third.allowed and int(third.headers["retry-after"]) >= 1 and "rate limit" in third.message
        too_big = await limiter.admit(key, 5000)
        assert not too_big.allowed and too_big.retry_after_s is None and "1000 tokens per minute" in too_big.message
    run(scenario())


def test_budget_reserve_settle_and_limits(kind, tmp_path, request):
    async def scenario():
        store = make_store(kind, tmp_path, request)
        keeper = BudgetKeeper(store, ZoneInfo("Europe/Berlin"), BudgetConfig(user_daily_usd=2.0))
        _, key = mint_key("carol", daily_budget_usd=1.0)
        hold = await keeper.reserve(key, 0.5)
        assert hold.spent_before == [0.0, 0.0] and hold.limits == [1.0, 2.0]
        await keeper.settle(hold, 0.25)  # real cost was lower: the difference comes back
        rows = {r["scope"]: r["spend_usd"] for r in await keeper.usage(keeper.day())}
        assert rows == {f"key:{key.key_id}": 0.25, "user:carol": 0.25}
        with pytest.raises(BudgetExceeded, match=r"key .* exhausted: spent \$0.25 of \$1.00"):
            await keeper.reserve(key, 0.8)
        _, other_key = mint_key("carol")  # same user, another key: the user's $2 still binds
        await keeper.settle(await keeper.reserve(other_key, 1.7), 1.7)
        with pytest.raises(BudgetExceeded, match=r"user carol is exhausted: spent \$1.95 of \$2.00.*resets at"):
            await keeper.reserve(other_key, 0.1)
        await store.close()
    run(scenario())


def test_budget_resets_at_midnight_of_the_configured_zone(kind, tmp_path, request):
    berlin = ZoneInfo("Europe/Berlin")
    clock = Clock(datetime(2026, 3, 28, 23, 59, 30, tzinfo=berlin).timestamp())  # the night before DST starts

    async def scenario():
        keeper = BudgetKeeper(make_store(kind, tmp_path, request), berlin, BudgetConfig(user_daily_usd=1.0), clock)
        _, key = mint_key("dave")
        await keeper.settle(await keeper.reserve(key, 1.0), 1.0)
        assert keeper.day() == "2026-03-28"
        with pytest.raises(BudgetExceeded, match="resets at 2026-03-29 00:00 CET"):
            await keeper.reserve(key, 0.01)
        clock.now += 60  # 00:00:30 in Berlin; still 23:00:30 UTC of the 28th
        assert keeper.day() == "2026-03-29"
        await keeper.reserve(key, 0.5)
        assert keeper.resets_at().isoformat() == "2026-03-30T00:00:00+02:00"  # a 23-hour day
    run(scenario())


def test_money_is_exact_integer_nanodollars(kind, tmp_path, request):
    async def scenario():
        keeper = BudgetKeeper(make_store(kind, tmp_path, request), ZoneInfo("UTC"), BudgetConfig(user_daily_usd=1.0))
        _, key = mint_key("erin")
        for _ in range(1000):
            await keeper.settle(await keeper.reserve(key, 0.0), 0.000123)
        rows = {r["scope"]: r["spend_usd"] for r in await keeper.usage()}
        assert rows["user:erin"] * NANO == pytest.approx(123_000_000, abs=0)
    run(scenario())


def test_source_versions_bump(kind, tmp_path, request):
    async def scenario():
        store = make_store(kind, tmp_path, request)
        assert await store.source_versions(["hr-policy"]) == {"hr-policy": "0"}
        assert await store.bump_source("hr-policy") == "1"
        assert await store.bump_source("hr-policy") == "2"
        assert await store.bump_source("hr-policy", "2026-05-01") == "2026-05-01"
        assert await store.source_versions(["hr-policy", "wiki"]) == {"hr-policy": "2026-05-01", "wiki": "0"}
        assert (await store.list_sources())["hr-policy"]["version"] == "2026-05-01"
        await store.close()
    run(scenario())


def test_sqlite_spend_survives_a_restart(tmp_path):
    async def scenario():
        keeper = BudgetKeeper(SQLiteStore(tmp_path / "gw.db"), ZoneInfo("UTC"), BudgetConfig(user_daily_usd=2.0))
        _, key = mint_key("frank")
        await keeper.settle(await keeper.reserve(key, 0.1), 0.4)
        await keeper.store.close()
        reopened = BudgetKeeper(SQLiteStore(tmp_path / "gw.db"), ZoneInfo("UTC"), BudgetConfig(user_daily_usd=2.0))
        hold = await reopened.reserve(key, 0.1)
        assert hold.spent_before == [pytest.approx(0.4), pytest.approx(0.4)]
    run(scenario())


def test_config_is_checked_at_load():
    base = {"providers": {"p": {"base_url": "http://x/v1/", "models": {"small": {"name": "m", "input": 1.0}}}},
            "routes": {"r": {"small": ["p/small"]}}}
    config = GatewayConfig.from_dict(base)
    assert config.providers["p"].base_url == "http://x/v1" and config.providers["p"].timeout_s == 20.0
    assert config.target_price(config.routes["r"].small[0]).cost(1_000_000, 0) == 1.0
    for broken, message in [({"routes": {"r": {"small": ["q/small"]}}}, "unknown provider 'q'"),
                            ({"routes": {"r": {"small": ["p/large"]}}}, "has no model 'large'"),
                            ({"routes": {"r": {"small": ["p"]}}}, "must be 'provider/model'"),
                            ({"timezone": "Mars/Olympus"}, "Mars"),
                            ({"routes": {}}, "at least one route")]:
        with pytest.raises((ValueError, KeyError), match=message):
            GatewayConfig.from_dict({**base, **broken})
