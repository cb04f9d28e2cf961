"""The router's decision parts on their own: prefix index, policies, regions and residency."""
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.cluster.app import prefix_key
from pagedserve.cluster.cluster_config import ClusterConfig, ReplicaSpec
from pagedserve.cluster.policies import (
    LeastLoad,
    PrefixAffinity,
    RoundRobin,
    RoutingRequest,
    SessionAffinity,
    make_policy,
)
from pagedserve.cluster.prefix_index import PrefixIndex
from pagedserve.cluster.regions import RegionMap, allowed_by_residency, parse_residency
from pagedserve.cluster.replica import Replica


def replicas(n: int) -> list[Replica]:
    return [Replica(f"r{i}", f"http://r{i}", healthy=True) for i in range(n)]


def brute_force_match(inserted: list[tuple[str, str]], key: str) -> dict[str, int]:
    best: dict[str, int] = {}
    for text, replica in inserted:
        n = 0
        while n < min(len(text), len(key)) and text[n] == key[n]:
            n += 1
        if n:
            best[replica] = max(best.get(replica, 0), n)
    return best


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.text("abc", min_size=1, max_size=12), st.sampled_from(["r0", "r1", "r2"])),
                max_size=25),
       st.text("abc", max_size=14))
def test_match_equals_brute_force_without_eviction(inserted, key):
    index = PrefixIndex(max_size_per_replica=10**9)
    for text, replica in inserted:
        index.insert(text, replica)
    assert index.match(key) == brute_force_match(inserted, key)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text("ab", min_size=1, max_size=20), min_size=1, max_size=30), st.integers(5, 40))
def test_eviction_keeps_budget_and_most_recent(texts, budget):
    index = PrefixIndex(max_size_per_replica=budget)
    for text in texts:
        index.insert(text, "r0")
        assert index.size("r0") <= max(budget, len(text))
    last = texts[-1]
    if len(last) <= int(budget * 0.9):
        assert index.match(last)["r0"] == len(last)  # the newest entry is never evicted first
    # sizes stay consistent with the tree itself
    total, stack = 0, list(index.root.children.values())
    while stack:
        node = stack.pop()
        total += len(node.edge) if "r0" in node.last_used else 0
        stack.extend(node.children.values())
    assert total == index.size("r0")


def test_remove_replica_forgets_only_it():
    index = PrefixIndex()
    index.insert("system prompt A / question 1", "r0")
    index.insert("system prompt A / question 2", "r1")
    index.remove_replica("r0")
    assert index.match("system prompt A / question 1") == {"r1": len("system prompt A / question ")}
    assert index.size("r0") == 0


def test_per_replica_budget_overrides_the_default():
    index = PrefixIndex(max_size_per_replica=1000)
    index.budgets["small"] = 20
    for i in range(5):
        index.insert(f"{i} " + "x" * 15, "small")
        index.insert(f"{i} " + "x" * 15, "large")
    assert index.size("small") <= 20 and index.size("large") == 5 * 17


def test_token_id_keys():
    index = PrefixIndex()
    index.insert((1, 2, 3, 4), "r0")
    assert index.match((1, 2, 3, 9)) == {"r0": 3}
    assert index.match("abc") == {}


def test_prefix_affinity_follows_the_prefix_and_falls_back_to_load():
    policy = PrefixAffinity(cache_threshold=0.5, balance_abs=2, balance_rel=1.5)
    rs = replicas(3)
    tenant = "You are the support bot of tenant 7. " * 10
    first = policy.choose(RoutingRequest(tenant + "hi"), rs)
    assert first.reason == "no_match"
    policy.on_routed(RoutingRequest(tenant + "hi"), first.replica)
    for q in ("how are you", "what is up", "bye"):
        decision = policy.choose(RoutingRequest(tenant + q), rs)
        assert (decision.replica, decision.reason) == (first.replica, "prefix_match")
    first.replica.inflight_requests = 5  # gap 5 > 2 and 5 > 0 * 1.5: load wins over locality
    decision = policy.choose(RoutingRequest(tenant + "again"), rs)
    assert decision.reason == "imbalance" and decision.replica is not first.replica


def test_prefix_affinity_spreads_new_prefixes_by_cache_size():
    policy = PrefixAffinity()
    rs = replicas(4)
    chosen = []
    for tenant in range(4):
        req = RoutingRequest(f"tenant {tenant} " + "x" * 200)
        decision = policy.choose(req, rs)
        policy.on_routed(req, decision.replica)
        chosen.append(decision.replica.name)
    assert sorted(chosen) == ["r0", "r1", "r2", "r3"]


def test_round_robin_rotates_and_least_load_picks_idle():
    rs = replicas(3)
    rr = RoundRobin()
    assert [rr.choose(RoutingRequest(), rs).replica.name for _ in range(6)] == ["r0", "r1", "r2"] * 2
    rs[0].inflight_tokens, rs[1].inflight_tokens = 50, 10
    rs[2].inflight_tokens = 30
    assert LeastLoad().choose(RoutingRequest(), rs).replica.name == "r1"


def test_session_affinity_is_stable_and_moves_only_the_failed_replicas_sessions():
    policy = SessionAffinity()
    rs = replicas(4)
    before = {s: policy.choose(RoutingRequest(session=s), rs).replica.name for s in map(str, range(200))}
    assert len(set(before.values())) == 4
    survivors = [r for r in rs if r.name != "r2"]
    after = {s: policy.choose(RoutingRequest(session=s), survivors).replica.name for s in before}
    assert all(after[s] == before[s] for s in before if before[s] != "r2")


def test_regions_prefer_near_and_spill_when_saturated():
    regions = RegionMap({"eu": {"eu": 1, "us": 90}}, slack_ms=20, spill_inflight=2)
    eu, us = Replica("eu1", "u", region="eu"), Replica("us1", "u", region="us")
    assert regions.nearest("eu", [eu, us]) == [eu]
    assert regions.rtt("us", "eu") == 90  # the matrix is read both ways
    assert regions.rtt("ap", "us") == regions.default_rtt_ms
    eu2 = Replica("eu2", "u", region="eu", latency_ms=60.0)  # one slow probe does not exile a replica
    assert regions.nearest("eu", [eu, eu2, us]) == [eu, eu2]
    eu.inflight_requests = eu2.inflight_requests = 2
    assert regions.nearest("eu", [eu, eu2, us]) == [eu, eu2, us]
    us.latency_ms = 500.0  # measured latency counts: a slow region loses to the matrix's far one
    assert regions.region_latency("eu", [eu, us])["us"] == 590.0


def test_residency_is_a_subset_rule():
    eu = Replica("eu1", "u", tags=frozenset({"eu", "gdpr"}))
    assert allowed_by_residency(eu, parse_residency("EU"))
    assert allowed_by_residency(eu, parse_residency("eu, gdpr"))
    assert not allowed_by_residency(eu, parse_residency("us"))
    assert allowed_by_residency(Replica("x", "u"), parse_residency(None))


def test_chat_prefix_key_grows_with_the_conversation():
    turn1 = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    turn2 = turn1 + [{"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "user", "content": "more"}]
    k1, k2 = prefix_key("/v1/chat/completions", {"messages": turn1}), prefix_key("/v1/chat/completions",
                                                                                   {"messages": turn2})
    assert k2.startswith(k1) and "hello" in k2
    assert prefix_key("/v1/completions", {"prompt": [[5, 6], [7]]}) == (5, 6)
    assert prefix_key("/v1/completions", {"prompt": 3}) == ""


def test_config_parsing(tmp_path):
    spec = ReplicaSpec.parse("http://h:1/,name=a,region=eu-west,tags=eu:gdpr")
    assert (spec.url, spec.name, spec.region, spec.tags) == ("http://h:1", "a", "eu-west", ("eu", "gdpr"))
    with pytest.raises(ValueError, match="unknown replica option"):
        ReplicaSpec.parse("http://h:1,zone=x")
    path = tmp_path / "cluster.yaml"
    path.write_text("policy: least_load\nreplicas:\n  - url: http://a:1\n    region: eu\n    tags: [eu]\n"
                    "  - http://b:2,region=us\nrtt_ms: {eu: {us: 80}}\n")
    config = ClusterConfig.from_yaml(path).finalize()
    assert [r.name for r in config.replicas] == ["replica-0", "replica-1"]
    assert config.replicas[1].region == "us" and config.rtt_ms["eu"]["us"] == 80
    path.write_text("polcy: x\n")
    with pytest.raises(ValueError, match="unknown keys"):
        ClusterConfig.from_yaml(path)
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("random")


def test_random_index_workload_evicts_in_batches_and_keeps_hot_prefixes():
    """Eviction walks the whole tree, so it must run once per tenth of a budget inserted, not on every insert
    over the budget; LRU must drop old suffixes, never a prompt still in use; no node outlives its replicas."""
    budget = 10_000
    index = PrefixIndex(max_size_per_replica=budget)
    evicted_at: list[int] = []  # a replica's size when an eviction began
    evict = index._evict

    def counting_evict(replica: str, target: int) -> None:
        evicted_at.append(index.size(replica))
        evict(replica, target)
    index._evict = counting_evict
    rng = random.Random(0)
    prompts = ["".join(rng.choice("abcdefgh ") for _ in range(2000)) for _ in range(16)]
    grown = dict.fromkeys((f"r{i}" for i in range(4)), 0)
    evictions = dict.fromkeys(grown, 0)
    for i in range(2000):
        replica, prompt = f"r{i % 4}", prompts[i % 16]  # each replica serves four of the prompts
        key = f"{prompt}{i}:" + "".join(rng.choice("abcdefgh") for _ in range(20))
        matched = index.match(key)
        if i >= 16:  # the prompt is in use on its replica and nowhere else
            assert matched[replica] >= len(prompt)
            assert all(n < len(prompt) for r, n in matched.items() if r != replica)
        size, calls = index.size(replica), len(evicted_at)
        index.insert(key, replica)
        if len(evicted_at) > calls:
            evictions[replica] += 1
            grown[replica] += evicted_at[-1] - size
        else:
            grown[replica] += index.size(replica) - size
        assert index.size(replica) <= budget
        assert index.match(key)[replica] == len(key)  # the newest entry is never the one evicted
    for replica in grown:  # the first eviction takes a budget of growth, each later one 0.1 x budget (from 0.9 x)
        assert 3 <= evictions[replica] and (evictions[replica] - 1) * budget // 10 + budget < grown[replica], \
            (evictions, grown)
    # The tree holds exactly what the sizes say, and no node is left without a replica.
    sizes, stack = dict.fromkeys(grown, 0), list(index.root.children.values())
    while stack:
        node = stack.pop()
        assert node.last_used
        for replica in node.last_used:
            sizes[replica] += len(node.edge)
        stack.extend(node.children.values())
    assert sizes == {r: index.size(r) for r in sizes}
