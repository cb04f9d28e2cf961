"""Speculative decoding (engine/spec_decode/): the config, the n-gram proposer, and greedy output identical to
the engine without speculation (fp32, itself token-identical to transformers: test_engine_reference.py) in
every scheduling regime, with the rejected proposals' KV rolled back."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.cli import build_parser
from pagedserve.config import EngineConfig
from pagedserve.engine.spec_decode.ngram import NgramIndex, NgramProposer
from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from pagedserve.speculative_config import SpeculativeConfig

# The static rule (vLLM's disable_by_batch_size) in every engine here: which steps propose must not depend on how
# loaded this machine is, as the measured rule's does (its own test feeds it timings).
STATIC = {"disable_by_batch_size": 64}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4, **STATIC}
CONTEXT = ("The quick brown fox jumps over the lazy dog. Alice went to the market to buy apples, pears and "
           "oranges, and then she walked home along the river, where she met Bob who was fishing for trout.")
QUOTING = [f"Repeat the text exactly.\nText: {CONTEXT}\nRepeated text: {CONTEXT[:40]}",
           f"Context: {CONTEXT}\nQuestion: Where did Alice go and what did she buy?\nAnswer: Alice went to the",
           "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"]
OPEN = ["Once upon a time", "List three prime numbers:"]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


# -- config ------------------------------------------------------------------------------------

def test_config_parses_vllm_json():
    spec = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 3, 4, 4)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert SpeculativeConfig.parse(str(spec)) == spec  # what a cluster launcher passes on
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(("value", "error"), [
    ("{nope", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    ('{"method": "medusa", "num_speculative_tokens": 2}', "not supported"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "must not exceed"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}', "unknown speculative config key"),
])
def test_config_refuses_bad_values(value, error):
    with pytest.raises((ValueError, TypeError), match=error):
        SpeculativeConfig.parse(value)


def test_cluster_replica_argv_parses():
    # cluster up passes its engine settings on as serve flags: a dict (a YAML file) goes as JSON, not Python's
    # repr, and store_true flags go without a value
    from pagedserve.cluster.launcher import engine_flags, serve_command

    config = EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
                          enable_lora=True, enable_prefix_caching=False, kv_cache_dtype="int8",
                          max_prefill_tokens_beside_decodes=128)
    argv = serve_command("127.0.0.1", 8000, engine_flags(config))
    args = build_parser().parse_args(argv[argv.index("serve"):])
    config.speculative_config = SpeculativeConfig("ngram", 3, prompt_lookup_min=4, prompt_lookup_max=4)
    assert EngineConfig.from_args(args) == config


def test_cli_flag_on_generate_and_serve(capsys):
    for command in (["generate", "--prompt", "x"], ["serve"]):
        args = build_parser().parse_args([*command, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'])
        assert EngineConfig.from_args(args).speculative_config == SpeculativeConfig("ngram", 2)
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--speculative-config", '{"method": "ngram"}'])
        assert "needs 'num_speculative_tokens'" in capsys.readouterr().err


# -- n-gram proposer ---------------------------------------------------------------------------

def test_ngram_proposes_the_continuation_of_the_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=1, prompt_lookup_max=3))
    tokens, index = [1, 2, 3, 4, 5, 9, 2, 3, 7, 8, 1, 2, 3], NgramIndex()
    # [1, 2, 3] was last followed by 4, 5, 9; the shorter [2, 3] more recently by 7, 8, but longer matches win
    assert proposer.propose(tokens, index, 3) == [4, 5, 9]
    tokens.append(7)  # the index grows by the new tokens only: [3, 7] was followed by 8
    assert proposer.propose(tokens, index, 2) == [8, 1]
    assert proposer.propose([5, 6, 7], NgramIndex(), 3) == []  # nothing repeats
    assert NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_min=2)).propose([1, 2, 3, 1], NgramIndex(), 3) == []


# -- greedy verification in the engine ---------------------------------------------------------

def check_kv_after_each_step(llm: LLM) -> None:
    """After every step: each running request holds blocks for its computed tokens only (rejected proposals'
    blocks were given back), and every block in the prefix cache holds computed tokens of the sequence."""
    engine, step = llm.engine, llm.engine.step
    bs = engine.kv.block_size

    def checked():
        outs = step()
        for req in engine.scheduler.running:
            table = engine.kv.block_table(req.request_id)
            assert len(table) == -(-req.num_computed_tokens // bs), req.request_id
            for i, b in enumerate(table):
                block = engine.kv.blocks[b]
                if block.token_ids is not None:
                    assert (i + 1) * bs <= req.num_computed_tokens
                    assert block.token_ids == tuple(req.all_token_ids[i * bs:(i + 1) * bs])
        return outs

    engine.step = checked


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def base_llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="32MiB")


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", speculative_config=NGRAM)
    check_kv_after_each_step(llm)
    return llm


@pytest.fixture(scope="module")
def expected(base_llm) -> list[list[int]]:
    return token_ids(base_llm.generate(QUOTING + OPEN, GREEDY))


def test_greedy_identical_and_prefix_hits(expected, spec_llm):
    llm = spec_llm
    assert token_ids(llm.generate(QUOTING + OPEN, GREEDY)) == expected
    stats = llm.engine.spec_stats.copy()
    assert stats.num_accepted_tokens > 20 and stats.acceptance_lengths[4] > 0  # whole runs of 4 accepted
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some rejected (the open prompts)
    before = llm.engine.stats().prefix_cache_hit_tokens
    assert token_ids(llm.generate(QUOTING + OPEN, GREEDY)) == expected
    assert llm.engine.stats().prefix_cache_hit_tokens - before > 100
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


@pytest.mark.slow  # two more engines (13 s); the fast suite keeps greedy identity with prefix hits and stops
@pytest.mark.parametrize("engine_args", [
    pytest.param({"max_num_batched_tokens": 24}, id="chunked-prefill"),  # proposals cut to the token budget too
    pytest.param({"kv_cache_memory": str(9 * 16 * 30 * 2 * 192 * 4)}, id="preemption"),  # 9 blocks
])
def test_greedy_identical_under_pressure(engine_args, expected):
    llm = LLM(dtype="float32", **{"kv_cache_memory": "32MiB", **engine_args}, speculative_config=NGRAM)
    check_kv_after_each_step(llm)
    assert token_ids(llm.generate(QUOTING + OPEN, GREEDY)) == expected
    assert llm.engine.spec_stats.num_accepted_tokens > 0
    if "max_num_batched_tokens" not in engine_args:
        assert llm.engine.stats().num_preemptions > 0


def step_sizes(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], list[int]]:
    """The output's token ids and how many each step added."""
    llm.engine.add_request("steps", prompt, params)
    sizes, total = [], 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            sizes.append(len(out.outputs[0].token_ids) - total)
            total += sizes[-1]
            ids = out.outputs[0].token_ids
    return ids, sizes


def test_stops_inside_an_accepted_run_are_exact(base_llm, spec_llm):
    base, llm = base_llm, spec_llm
    full, sizes = step_sizes(llm, QUOTING[0], GREEDY)
    assert full == token_ids(base.generate(QUOTING[0], GREEDY))[0]
    ends = [sum(sizes[:i + 1]) for i in range(len(sizes))]
    run = next(i for i, n in enumerate(sizes) if n >= 3 and i > 0)
    inside = ends[run - 1] + 1  # a cut after the second token of a multi-token step
    for params in [SamplingParams(temperature=0, max_tokens=inside, ignore_eos=True),
                   SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[full[inside - 1]]),
                   SamplingParams(temperature=0, max_tokens=32, stop=[llm.tokenizer.decode(full[inside - 2:inside])])]:
        want, got = base.generate(QUOTING[0], params)[0].outputs[0], llm.generate(QUOTING[0], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason)
        assert len(got.token_ids) <= inside


# -- sampled requests ------------------------------------------------------------------------------

def test_seeded_sampling_draws_the_same_tokens_as_without_speculation(base_llm, spec_llm):
    # Each position is sampled from the target's distribution with the uniform of (seed, output position), so a
    # seeded request draws exactly what it draws without speculation (fp32: the logits match too), penalties,
    # top-k/top-p/min-p, logprobs and output constraints included, and again on a second run.
    base, llm = base_llm, spec_llm
    accepted = llm.engine.spec_stats.num_accepted_tokens
    params = [SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                             presence_penalty=0.2, frequency_penalty=0.1, seed=s, max_tokens=16, logprobs=2)
              for s in range(2)]
    params.append(SamplingParams(temperature=0.5, seed=7, max_tokens=16, min_tokens=12))
    params.append(SamplingParams(temperature=0, max_tokens=16,
                                 guided_decoding=GuidedDecodingParams(regex="(The quick brown fox[a-z ]*\\.)+")))
    prompts = [QUOTING[0], QUOTING[1], QUOTING[0], QUOTING[0]]
    want = base.generate(prompts, params)
    for _ in range(2):
        got = llm.generate(prompts, params)
        assert token_ids(got) == token_ids(want)
        for g, w in zip(got, want):
            if w.outputs[0].logprobs is not None:
                assert [list(e) for e in g.outputs[0].logprobs] == [list(e) for e in w.outputs[0].logprobs]
                assert [e[t].logprob for e, t in zip(g.outputs[0].logprobs, g.outputs[0].token_ids)] == pytest.approx(
                    [e[t].logprob for e, t in zip(w.outputs[0].logprobs, w.outputs[0].token_ids)], abs=1e-4)
    assert got[3].outputs[0].text.startswith("The quick brown fox")
    assert llm.engine.spec_stats.num_accepted_tokens - accepted > 10


@pytest.mark.slow
def test_next_tokens_distribution_matches_without_speculation():
    # Two independent samples (different seeds) of the 2nd and 3rd tokens after a prompt that quotes its context:
    # with speculation the 2nd is a verified proposal (accepted with p(x), else drawn from the residual) and the
    # 3rd often the bonus token. A chi-square test of homogeneity over the (2nd, 3rd) pairs.
    draws, n = 1600, 16
    spec = {**NGRAM, "num_speculative_tokens": 2, "disable_by_batch_size": 1 << 20}
    counts = []
    for config, offset in [(None, 0), (spec, 10**6)]:
        # room for every running sequence's own blocks: proposals that do not fit are dropped, not verified
        llm = LLM(kv_cache_memory="256MiB", max_num_seqs=128, speculative_config=config)
        params = [SamplingParams(n=n, temperature=1.2, top_k=20, seed=offset + s, max_tokens=3, ignore_eos=True)
                  for s in range(draws // n)]
        outs = llm.generate([QUOTING[0].rstrip()] * len(params), params)  # "... the lazy": " dog" is proposed
        pairs = [tuple(c.token_ids[1:3]) for o in outs for c in o.outputs]
        counts.append({p: pairs.count(p) for p in set(pairs)})
        if config is not None:
            stats = llm.engine.spec_stats
            assert stats.num_draft_tokens >= draws // 4 and stats.num_accepted_tokens >= draws // 10
    common = [p for p in counts[0] if counts[0][p] + counts[1].get(p, 0) >= 10]
    table = [[c.get(p, 0) for p in common] + [draws - sum(c.get(p, 0) for p in common)] for c in counts]
    assert len(common) >= 4
    assert chi_square_pvalue(table) > 1e-3


def chi_square_pvalue(table: list[list[int]]) -> float:
    """Pearson's test of homogeneity of the rows of a contingency table (scipy's chi2_contingency, by hand)."""
    import torch

    observed = torch.tensor(table, dtype=torch.float64)
    expected = observed.sum(1, keepdim=True) * observed.sum(0, keepdim=True) / observed.sum()
    statistic = ((observed - expected) ** 2 / expected).sum()
    df = (observed.shape[0] - 1) * (observed.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))


def test_chi_square_by_hand_matches_the_textbook():
    # 2 x 3 table: expected 15, 20, 25 per row, statistic 16/3 with 2 degrees of freedom, p = exp(-8/3)
    assert chi_square_pvalue([[10, 20, 30], [20, 20, 20]]) == pytest.approx(0.069483, rel=1e-4)


def test_metrics_follow_vllm_names():
    from prometheus_client import CollectorRegistry, generate_latest

    from pagedserve.engine.spec_decode.stats import SpecDecodeStats
    from pagedserve.engine.stats import EngineStats
    from pagedserve.server.metrics import EngineStatsCollector

    spec = SpecDecodeStats("ngram")
    for proposed, accepted in [(4, 4), (4, 0), (3, 1), (4, 4)]:
        spec.record(proposed, accepted)
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (4, 15, 9)
    assert spec.acceptance_lengths == [1, 1, 0, 0, 2] and spec.mean_acceptance_length == 1 + 9 / 4
    registry = CollectorRegistry()
    stats = EngineStats(0, 0, 10, 0, 0, 0, 0, 0, 0, 0, spec_decode=spec)
    registry.register(EngineStatsCollector(lambda: stats, "m"))
    text = generate_latest(registry).decode()
    labels = 'method="ngram",model_name="m"'
    for line in [f"pagedserve_spec_decode_num_drafts_total{{{labels}}} 4.0",
                 f"pagedserve_spec_decode_num_draft_tokens_total{{{labels}}} 15.0",
                 f"pagedserve_spec_decode_num_accepted_tokens_total{{{labels}}} 9.0",
                 f'pagedserve_spec_decode_acceptance_length_bucket{{le="1.0",{labels}}} 2.0',
                 f'pagedserve_spec_decode_acceptance_length_bucket{{le="+Inf",{labels}}} 4.0',
                 f"pagedserve_spec_decode_acceptance_length_sum{{{labels}}} 9.0"]:
        assert line in text, line
    per_pos = {int(line.split('position="')[1].split('"')[0]): float(line.rsplit(" ", 1)[1])
               for line in text.splitlines() if line.startswith("pagedserve_spec_decode_num_accepted_tokens_per_pos_total")}
    assert per_pos == {0: 3.0, 1: 2.0, 2: 2.0, 3: 2.0}  # drafts accepting 4, 0, 1, 4: prefixes of the draft
    assert sum(per_pos.values()) == spec.num_accepted_tokens


def test_suffix_proposals_follow_frequent_continuations_and_other_requests():
    from pagedserve.engine.spec_decode.suffix import SuffixProposer

    config = SpeculativeConfig("suffix", 4, suffix_decoding_max_tree_depth=8, suffix_decoding_max_cached_requests=2,
                               suffix_decoding_min_token_prob=0.4)
    proposer = SuffixProposer(config)
    tokens = [5, 1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 1, 2, 3, 4, 7, 1, 2]
    state = proposer.new_state()
    # [1, 2] was followed by 3, 4 each time, then by 9, 8 or 7 (1/3 each, under min probability 0.4)
    assert proposer.propose(tokens, state, 4) == [3, 4]
    tokens += [3, 4, 7, 1]  # grows incrementally: [3, 4, 7, 1] was followed by 2, 3, 4, 7 (once: probability 1)
    assert proposer.propose(tokens, state, 4) == [2, 3, 4, 7]
    assert proposer.propose([6, 60, 61], proposer.new_state(), 4) == []
    proposer.finished([60, 61, 62, 63, 64])  # another request's output is looked up too
    assert proposer.propose([6, 60, 61], proposer.new_state(), 4) == [62, 63, 64]
    proposer.finished([1])
    proposer.finished([2])  # the oldest output leaves the bounded cache, and its substrings with it
    assert proposer.propose([6, 60, 61], proposer.new_state(), 4) == []
    assert proposer.shared.find([60]) is None


@pytest.mark.slow
def test_suffix_method_greedy_identical(expected):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB",
              speculative_config={"method": "suffix", "num_speculative_tokens": 4, **STATIC})
    check_kv_after_each_step(llm)
    prompts, want = [QUOTING[1], QUOTING[2], OPEN[0]], [expected[1], expected[2], expected[3]]
    assert token_ids(llm.generate(prompts, GREEDY)) == want
    first = llm.engine.spec_stats.copy()
    assert first.num_accepted_tokens > 10
    assert token_ids(llm.generate(prompts, GREEDY)) == want  # now also from the shared trie
    assert llm.engine.spec_stats.num_accepted_tokens - first.num_accepted_tokens > first.num_accepted_tokens


@pytest.mark.slow
def test_lora_requests_verify_under_their_adapter(tmp_path, hf_model):
    from tests.lora_support import lora, make_adapters

    adapters = make_adapters(hf_model, tmp_path)
    loras = [lora(adapters, "all16"), None, lora(adapters, "attn8")]
    prompts = [QUOTING[0], QUOTING[0], QUOTING[2]]
    base = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True)
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True, speculative_config=NGRAM)
    want = token_ids(base.generate(prompts, GREEDY, lora_request=loras))
    assert want[0] != want[1]  # the adapter changes the output, so the identity below means something
    assert token_ids(llm.generate(prompts, GREEDY, lora_request=loras)) == want
    assert llm.engine.spec_stats.num_accepted_tokens > 0


def same_model_draft() -> dict:
    from pagedserve.model.loader import default_model_path

    # a draft as large as the target never pays (the measured rule would stop it): the static rule keeps it on
    return {"method": "draft_model", "model": str(default_model_path()), "num_speculative_tokens": 3,
            "draft_kv_cache_memory": "16MiB", "disable_by_batch_size": 64}


@pytest.fixture(scope="module")
def small_draft(hf_model, tmp_path_factory) -> str:
    """A smaller model sharing the tokenizer: the target's first 24 of 30 layers, as an HF folder."""
    import copy

    from transformers import AutoTokenizer

    from pagedserve.model.loader import default_model_path

    model = copy.deepcopy(hf_model)
    model.model.layers = model.model.layers[:24]
    model.config.num_hidden_layers = 24
    folder = tmp_path_factory.mktemp("draft")
    model.save_pretrained(folder)
    path = default_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    return str(folder)


@pytest.mark.slow
def test_draft_model_of_the_same_model_accepts_everything_greedy(expected):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", speculative_config=same_model_draft())
    prompts, want = [QUOTING[1], OPEN[0]], [expected[1], expected[3]]
    assert token_ids(llm.generate(prompts, GREEDY)) == want
    stats = llm.engine.spec_stats
    assert stats.num_drafts > 10 and stats.acceptance_rate > 0.95
    assert llm.engine.proposer.method.kv.num_free_blocks == llm.engine.proposer.method.kv.num_blocks  # all released


@pytest.mark.slow
def test_draft_model_caches_prefixes_of_the_targets_tokens_only(expected, small_draft):
    """The draft's pool caches prefixes: the same prompts again start their shadows from cached blocks, and every
    hashed block holds the target's tokens (a rejected proposal's KV is never found by another request)."""
    spec = {**same_model_draft(), "model": small_draft}  # a smaller draft: many proposals are rejected
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", speculative_config=spec)
    draft = llm.engine.proposer.method
    prompts, want = [QUOTING[1], OPEN[0]], [expected[1], expected[3]]
    outs = llm.generate(prompts, GREEDY)
    assert token_ids(outs) == want and draft.kv.hit_tokens == 0
    stats = llm.engine.spec_stats
    assert stats.num_draft_tokens > stats.num_accepted_tokens > 0  # some proposals rejected
    assert token_ids(llm.generate(prompts, GREEDY)) == want
    bs = draft.kv.block_size
    assert draft.kv.hit_tokens >= sum((len(o.prompt_token_ids) - 1) // bs * bs for o in outs)
    sequences = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    target_blocks = {tuple(seq[i:i + bs]) for seq in sequences for i in range(0, len(seq) - bs + 1, bs)}
    hashed = [b.token_ids for b in draft.kv.blocks if b.token_ids is not None]
    assert hashed and all(tokens in target_blocks for tokens in hashed)


@pytest.mark.slow
def test_draft_model_sampled_drafts(base_llm, monkeypatch):
    # The draft samples from q processed as the target's p (penalties, top-k/top-p, bans, grammar mask), so a
    # draft of the same model has q == p up to rounding and min(1, p/q) accepts nearly every proposal; greedy
    # (point-mass) drafts are accepted only at p(argmax). Seeded runs repeat, and the logprobs are the target's.
    from pagedserve.engine.spec_decode import draft_model

    llm = LLM(dtype="float32", kv_cache_memory="32MiB",
              speculative_config={**same_model_draft(), "min_acceptance_rate": 0.0})
    params = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, repetition_penalty=1.1, seed=s, max_tokens=24,
                             min_tokens=24, logprobs=2) for s in range(3)]
    params.append(SamplingParams(temperature=1.0, seed=3, max_tokens=24, guided_decoding=GuidedDecodingParams(
        regex="(Alice|Bob) (went|walked) to the (market|river|house)[a-z ,]*\\.")))
    prompts = [OPEN[0], OPEN[1], QUOTING[1], QUOTING[1]]
    first = llm.generate(prompts, params)
    assert token_ids(llm.generate(prompts, params)) == token_ids(first)
    sampled = llm.engine.spec_stats.copy()
    assert sampled.acceptance_rate > 0.9
    assert first[3].outputs[0].text.startswith(("Alice", "Bob"))
    for out in first[:3]:  # each returned logprob is the target's, as the plain engine scores that sequence
        ids = out.outputs[0].token_ids
        scored = base_llm.generate({"prompt_token_ids": out.prompt_token_ids + ids},
                                   SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
        got = [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, ids)]
        assert got == pytest.approx([scored[len(out.prompt_token_ids) + i][t].logprob for i, t in enumerate(ids)],
                                    abs=1e-3)
    monkeypatch.setattr(draft_model, "draft_sample", lambda logits, batch: (logits.argmax(dim=-1), None))
    llm.generate(prompts[:3], params[:3])
    greedy = llm.engine.spec_stats
    greedy_rate = (greedy.num_accepted_tokens - sampled.num_accepted_tokens) / (
        greedy.num_draft_tokens - sampled.num_draft_tokens)
    assert greedy_rate < sampled.acceptance_rate - 0.2


@pytest.mark.slow
def test_draft_model_next_tokens_distribution_matches_without_speculation(small_draft):
    # As the ngram test above, with a smaller draft that samples at temperature 0.8: the 2nd token is a sampled
    # proposal (accepted with min(1, p/q), else drawn from max(0, p - q)), the 3rd the bonus token or a correction
    draws, n = 960, 16
    spec = {"method": "draft_model", "model": small_draft, "num_speculative_tokens": 2, "min_acceptance_rate": 0.0,
            "draft_kv_cache_memory": "64MiB", "disable_by_batch_size": 1 << 20}
    counts = []
    for config, offset in [(None, 0), (spec, 10**6)]:
        llm = LLM(kv_cache_memory="128MiB", max_num_seqs=64, speculative_config=config)
        params = [SamplingParams(n=n, temperature=0.8, seed=offset + s, max_tokens=3, ignore_eos=True)
                  for s in range(draws // n)]
        outs = llm.generate(["The capital of France is"] * len(params), params)
        pairs = [tuple(c.token_ids[1:3]) for o in outs for c in o.outputs]
        counts.append({p: pairs.count(p) for p in set(pairs)})
        if config is not None:
            stats = llm.engine.spec_stats
            rejected = stats.num_draft_tokens - stats.num_accepted_tokens
            assert stats.num_accepted_tokens >= draws // 10 and rejected >= draws // 10  # both paths taken
    common = [p for p in counts[0] if counts[0][p] + counts[1].get(p, 0) >= 10]
    table = [[c.get(p, 0) for p in common] + [draws - sum(c.get(p, 0) for p in common)] for c in counts]
    assert len(common) >= 4
    assert chi_square_pvalue(table) > 1e-3


def test_cost_model_proposes_while_measured_steps_say_it_pays():
    from pagedserve.engine.spec_decode.cost import EXPLORE_EVERY, StepCosts

    costs = StepCosts.new()
    assert costs.pays(64, 256, 0.0)  # nothing measured yet: propose, and measure
    for rows in (1, 2, 4, 8, 16, 32, 64):  # weight-bound up to 8 rows, then 0.5 ms a row
        costs.record(rows, 0.010 + 0.0005 * max(0, rows - 8), verifying=False)
    for rows in (5, 10, 20, 40, 80, 160, 320):  # verification chunks: 2 ms more (the Python layers)
        costs.record(rows, 0.012 + 0.0005 * max(0, rows - 8), verifying=True)
    # k = 4 at about 50% acceptance (1 accepted proposal in 4): one stream and 4 pay, 64 do not (rows x 5)
    assert [costs.pays(1, 4, 1.0), costs.pays(4, 16, 4.0), costs.pays(64, 256, 64.0)] == [True, True, False]
    costs.propose_s = 0.1  # a draft model slower than the step it saves
    assert not costs.pays(1, 4, 1.0)
    assert [costs.pays(1, 4, 1.0) for _ in range(EXPLORE_EVERY)].count(True) == 1  # the explored step
    spec = SpeculativeConfig("ngram", 2)
    assert spec.disable_by_batch_size is None and "disable_by_batch_size" not in str(spec)


def test_draft_model_needs_a_model():
    with pytest.raises(ValueError, match='needs "model"'):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})


@pytest.mark.slow  # three engines per KV dtype (fp8 calibrates at start-up)
@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_decode_side_of_disaggregation_with_quantized_kv(kv_cache_dtype):
    # A decode replica imports the prompt's KV and the prefill worker's first token, then speculates over its
    # quantized KV (rejected proposals' slots are rewritten later: int8's per-token scales go with them, fp8's
    # are per head): greedy output as one engine without speculation, same KV dtype
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    def engine(spec: dict | None = None) -> LLMEngine:
        return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype=kv_cache_dtype,
                                      speculative_config=spec))

    def run(e: LLMEngine, rid: str) -> list[int]:
        done = None
        while e.has_unfinished_requests():
            done = next((o for o in e.step() if o.request_id == rid and o.finished), done)
        return done.outputs[0].token_ids

    prefill, decode = engine(), engine(NGRAM)
    ids = prefill.tokenizer.encode(QUOTING[0])
    prefill.add_request("whole", ids, GREEDY)
    want = run(prefill, "whole")
    lease = prefill.kv_transfer.lease(ids)
    count = len(lease.block_ids)
    assert decode.kv_transfer.import_blocks(ids, 0, prefill.kv_transfer.export(lease.lease_id, 0), count) == count
    decode.add_request("resumed", ids, GREEDY, output_token_ids=want[:1], hold=True)
    decode.release_held("resumed")
    assert run(decode, "resumed") == want
    assert decode.kv.hit_tokens >= count * 16 and decode.spec_stats.num_accepted_tokens > 10
