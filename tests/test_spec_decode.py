"""Speculative decoding (engine/spec_decode/): the config, the n-gram proposer, and greedy output identical to
the engine without speculation (fp32, itself token-identical to transformers: test_engine_reference.py) in
every scheduling regime, with the rejected proposals' KV rolled back."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.cli import build_parser
from pagedserve.config import EngineConfig
from pagedserve.engine.spec_decode.ngram import NgramIndex, NgramProposer
from pagedserve.sampling_params import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
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
def expected() -> list[list[int]]:
    return token_ids(LLM(dtype="float32", kv_cache_memory="32MiB").generate(QUOTING + OPEN, GREEDY))


def test_greedy_identical_and_prefix_hits(expected):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", speculative_config=NGRAM)
    check_kv_after_each_step(llm)
    assert token_ids(llm.generate(QUOTING + OPEN, GREEDY)) == expected
    stats = llm.engine.spec_stats
    assert stats.num_accepted_tokens > 20 and stats.acceptance_lengths[4] > 0  # whole runs of 4 accepted
    assert stats.num_draft_tokens > stats.num_accepted_tokens  # and some rejected (the open prompts)
    before = llm.engine.stats().prefix_cache_hit_tokens
    assert token_ids(llm.generate(QUOTING + OPEN, GREEDY)) == expected
    assert llm.engine.stats().prefix_cache_hit_tokens - before > 100
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


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


def test_stops_inside_an_accepted_run_are_exact():
    base = LLM(dtype="float32", kv_cache_memory="16MiB")
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", speculative_config=NGRAM)
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
