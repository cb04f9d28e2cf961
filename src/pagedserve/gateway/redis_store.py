"""RedisStore: gateway state shared by many instances. Every check-and-update is one Lua script, so N
instances enforce one limit, not N."""
from __future__ import annotations

import json
import time

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.store_types import Bucket, ReserveResult, TakeResult

# KEYS: bucket keys. ARGV: capacity, rate, cost for each bucket. Uses the Redis clock so instances agree.
TAKE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local levels, wait = {}, 0
for i, key in ipairs(KEYS) do
  local cap, rate, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local s = redis.call('HMGET', key, 'level', 'ts')
  local level = math.min(cap, (tonumber(s[1]) or cap) + math.max(0, now - (tonumber(s[2]) or now)) * rate)
  levels[i] = level
  if level < cost then wait = math.max(wait, (cost - level) / rate) end
end
local out = {wait == 0 and 1 or 0, tostring(wait)}
for i, key in ipairs(KEYS) do
  local cap, rate, cost = tonumber(ARGV[3*i-2]), tonumber(ARGV[3*i-1]), tonumber(ARGV[3*i])
  local level = levels[i]
  if wait == 0 then level = level - cost end
  redis.call('HSET', key, 'level', tostring(level), 'ts', tostring(now))
  redis.call('EXPIRE', key, math.ceil((cap - level) / rate) + 60)
  out[#out + 1] = tostring(level)
end
return out
"""

# KEYS[1]: bucket key. ARGV: capacity, rate, amount (negative charges more).
GIVE_BACK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cap, rate, amount = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local s = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = math.min(cap, (tonumber(s[1]) or cap) + math.max(0, now - (tonumber(s[2]) or now)) * rate)
level = math.min(cap, level + amount)
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('EXPIRE', KEYS[1], math.ceil((cap - level) / rate) + 60)
return tostring(level)
"""

# KEYS: the day's spend hash, its holds hash. ARGV: amount, ttl, then scope and limit pairs (limit -1: none).
# Returns {allowed, failed index, spent..., held...}; the stored strings go back untouched (Lua's tostring
# would print a large integer as 1e+15).
RESERVE_LUA = """
local amount = tonumber(ARGV[1])
local spent, held, failed = {}, {}, -1
for i = 3, #ARGV, 2 do
  local s = redis.call('HGET', KEYS[1], ARGV[i]) or '0'
  local h = redis.call('HGET', KEYS[2], ARGV[i]) or '0'
  spent[#spent + 1], held[#held + 1] = s, h
  local limit = tonumber(ARGV[i + 1])
  if failed < 0 and limit >= 0 and tonumber(s) + tonumber(h) + amount > limit then failed = (i - 3) / 2 end
end
for _, h in ipairs(held) do spent[#spent + 1] = h end
if failed >= 0 then return {0, failed, unpack(spent)} end
for i = 3, #ARGV, 2 do redis.call('HINCRBY', KEYS[2], ARGV[i], ARGV[1]) end
redis.call('EXPIRE', KEYS[2], 2 * 86400)
return {1, 0, unpack(spent)}
"""

# KEYS[1]: the sources hash. ARGV: name, explicit version or '', now.
BUMP_LUA = """
local current = redis.call('HGET', KEYS[1], ARGV[1])
local version = ARGV[2]
if version == '' then
  local n = current and tonumber(cjson.decode(current)['version'])
  version = n and tostring(math.floor(n) + 1) or '1'
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({version = version, updated_at = tonumber(ARGV[3])}))
return version
"""

# KEYS: sources, the source's hashes, its records; ARGV: source, now, #puts, (name, hash, record)*, names to delete.
# The version moves on only when a stored hash really changed or a document really went.
INDEX_APPLY_LUA = """
local n = tonumber(ARGV[3])
local i = 4
local changed = 0
for _ = 1, n do
  if redis.call('HGET', KEYS[2], ARGV[i]) ~= ARGV[i + 1] then
    redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
    changed = changed + 1
  end
  i = i + 3
end
for j = i, #ARGV do
  changed = changed + redis.call('HDEL', KEYS[2], ARGV[j])
  redis.call('HDEL', KEYS[3], ARGV[j])
end
local current = redis.call('HGET', KEYS[1], ARGV[1])
local version = current and cjson.decode(current)['version']
if changed == 0 and version then
  return version
end
local v = version and tonumber(version)
version = v and tostring(math.floor(v) + 1) or '1'
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode({version = version, updated_at = tonumber(ARGV[2])}))
return version
"""

# KEYS[1]: the lease. ARGV: owner, ttl in ms. Taken (or renewed) when free or already the owner's; Redis expires it.
LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS[1]: the lease. ARGV: owner. Only the owner's own lease is freed (one that expired may be another's now).
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisStore:
    SPEND_TTL_S = 400 * 86400  # usage history kept for reports

    def __init__(self, url: str, prefix: str = "pagedserve:gw:"):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError, TimeoutError

        # A pooled connection goes stale when Redis restarts: the first command on it fails. One retry on a
        # fresh connection rides over that; a Redis that is really down still fails closed (503) at once.
        self.redis = aioredis.from_url(url, decode_responses=True, retry=Retry(NoBackoff(), 1),
                                       retry_on_error=[ConnectionError, TimeoutError])
        self.p = prefix
        self._take = self.redis.register_script(TAKE_LUA)
        self._give_back = self.redis.register_script(GIVE_BACK_LUA)
        self._reserve = self.redis.register_script(RESERVE_LUA)
        self._bump = self.redis.register_script(BUMP_LUA)
        self._index_apply = self.redis.register_script(INDEX_APPLY_LUA)
        self._lease = self.redis.register_script(LEASE_LUA)
        self._release = self.redis.register_script(RELEASE_LUA)

    async def close(self) -> None:
        await self.redis.aclose()

    async def persistence_warning(self) -> str | None:
        """What is lost if this Redis restarts: without RDB snapshots or an AOF, every key and all spend."""
        from redis.exceptions import ResponseError

        try:
            save = (await self.redis.config_get("save")).get("save", "")
            aof = (await self.redis.config_get("appendonly")).get("appendonly", "no")
        except ResponseError as e:  # managed Redis often disables CONFIG
            return f"could not check the shared Redis store's persistence ({e}); make sure it has RDB or AOF on"
        if not save.strip() and aof != "yes":
            return ("the shared Redis store has no persistence (save \"\", appendonly no): a restart of Redis "
                    "loses every API key, rate-limit bucket and day's spend; enable AOF (appendonly yes) or RDB")
        return None

    async def put_key(self, key: ApiKey) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self.p + "keys", key.key_id, json.dumps(key.to_dict()))
            pipe.hset(self.p + "key_hashes", key.key_hash, key.key_id)
            await pipe.execute()

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        key_id = await self.redis.hget(self.p + "key_hashes", key_hash)
        data = key_id and await self.redis.hget(self.p + "keys", key_id)
        return ApiKey(**json.loads(data)) if data else None

    async def revoke_key(self, key_id: str) -> bool:
        data = await self.redis.hget(self.p + "keys", key_id)
        if not data:
            return False
        record = json.loads(data)
        record["revoked_at"] = record["revoked_at"] or time.time()
        await self.redis.hset(self.p + "keys", key_id, json.dumps(record))
        return True

    async def list_keys(self) -> list[ApiKey]:
        rows = await self.redis.hgetall(self.p + "keys")
        return sorted((ApiKey(**json.loads(v)) for v in rows.values()), key=lambda k: k.created_at)

    async def take(self, buckets: list[Bucket]) -> TakeResult:
        args = [x for b in buckets for x in (b.capacity, b.rate, b.cost)]
        out = await self._take(keys=[self.p + "bucket:" + b.name for b in buckets], args=args)
        return TakeResult(bool(int(out[0])), float(out[1]), [float(x) for x in out[2:]])

    async def give_back(self, bucket: Bucket, amount: float) -> None:
        await self._give_back(keys=[self.p + "bucket:" + bucket.name], args=[bucket.capacity, bucket.rate, amount])

    async def reserve(self, day: str, scopes: list[str], limits: list[int | None], amount: int) -> ReserveResult:
        args = [amount, self.SPEND_TTL_S]
        for scope, limit in zip(scopes, limits):
            args += [scope, -1 if limit is None else limit]
        out = await self._reserve(keys=[self.p + "spend:" + day, self.p + "held:" + day], args=args)
        values = [int(x) for x in out[2:]]
        spent, held = values[:len(scopes)], values[len(scopes):]
        if int(out[0]):
            return ReserveResult(True, spent, held)
        return ReserveResult(False, spent, held, int(out[1]))

    async def settle(self, day: str, scopes: list[str], reserved: int, actual: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for scope in scopes:
                pipe.hincrby(self.p + "held:" + day, scope, -reserved)
                pipe.hincrby(self.p + "spend:" + day, scope, actual)
            pipe.expire(self.p + "spend:" + day, self.SPEND_TTL_S)
            await pipe.execute()

    async def add_spend(self, day: str, scopes: list[str], amount: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            for scope in scopes:
                pipe.hincrby(self.p + "spend:" + day, scope, amount)
            pipe.expire(self.p + "spend:" + day, self.SPEND_TTL_S)
            await pipe.execute()

    async def usage(self, day: str | None = None) -> list[tuple[str, str, int]]:
        if day:
            days = [day]
        else:
            days = [k.removeprefix(self.p + "spend:") async for k in self.redis.scan_iter(self.p + "spend:*")]
        rows = []
        for d in sorted(days, reverse=True):
            rows += [(d, scope, int(n)) for scope, n in sorted((await self.redis.hgetall(self.p + "spend:" + d)).items())]
        return rows

    async def source_versions(self, names: list[str]) -> dict[str, str]:
        if not names:
            return {}
        values = await self.redis.hmget(self.p + "sources", names)
        return {n: json.loads(v)["version"] if v else "0" for n, v in zip(names, values)}

    async def bump_source(self, name: str, version: str | None = None) -> str:
        return await self._bump(keys=[self.p + "sources"], args=[name, version or "", time.time()])

    async def list_sources(self) -> dict[str, dict]:
        rows = await self.redis.hgetall(self.p + "sources")
        return {n: json.loads(v) for n, v in sorted(rows.items())}

    async def index_manifest(self, source: str) -> dict[str, str]:
        return await self.redis.hgetall(f"{self.p}index_hash:{source}")

    async def index_records(self, source: str, names: list[str] | None = None) -> dict[str, str]:
        key = f"{self.p}index_doc:{source}"
        if names is None:
            return await self.redis.hgetall(key)
        if not names:
            return {}
        return {n: r for n, r in zip(names, await self.redis.hmget(key, names)) if r is not None}

    async def index_apply(self, source: str, put: dict[str, tuple[str, str]], remove: list[str]) -> str:
        args: list = [source, time.time(), len(put)]
        for name, (content_hash, record) in put.items():
            args += [name, content_hash, record]
        keys = [self.p + "sources", f"{self.p}index_hash:{source}", f"{self.p}index_doc:{source}"]
        return await self._index_apply(keys=keys, args=args + list(remove))

    async def lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Takes (or renews) the named lease for `owner` when it is free, expired or already theirs (leases.py)."""
        return bool(await self._lease(keys=[f"{self.p}lease:{name}"], args=[owner, max(1, int(ttl_s * 1000))]))

    async def release(self, name: str, owner: str) -> None:
        await self._release(keys=[f"{self.p}lease:{name}"], args=[owner])

    async def indexed_sources(self) -> dict[str, int]:
        counts = {}
        async for key in self.redis.scan_iter(self.p + "index_hash:*"):
            counts[key.removeprefix(self.p + "index_hash:")] = await self.redis.hlen(key)
        return {s: n for s, n in sorted(counts.items()) if n}
