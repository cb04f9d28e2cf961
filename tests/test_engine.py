"""Engine behaviour: seeds, stop strings, n > 1, abort, logprobs, detokenization and bad input."""
from __future__ import annotations

import itertools
import shutil

import pytest

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import default_model_path
from pagedserve.sampling_params import SamplingParams

PROMPT = "The three most important inventions in history are"


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_memory="48MiB")


def texts(outs) -> list[str]:
    return [o.outputs[0].text for o in outs]


def test_seed_gives_same_text_whatever_the_batch():
    # fp32: in bf16 the logits themselves shift with the batch shape (matmul blocking), which can flip a
    # draw that sits on a boundary; the sampler's draw depends only on (seed, position) either way.
    llm = LLM(dtype="float32", kv_cache_memory="16MiB")
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24)
    alone = texts(llm.generate([PROMPT], p))[0]
    assert texts(llm.generate([PROMPT], p))[0] == alone
    others = [SamplingParams(temperature=1.0, max_tokens=n) for n in (5, 30, 12)]
    batch = llm.generate(["Tell me a story.", PROMPT, "Why is the sky blue?", "Hello"],
                         [others[0], p, others[1], others[2]])
    assert batch[1].outputs[0].text == alone
    different_seed = texts(llm.generate([PROMPT], SamplingParams(temperature=1.0, top_p=0.95, seed=99, max_tokens=24)))
    assert different_seed[0] != alone


def test_stop_string_spanning_tokens_is_cut(llm):
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].outputs[0]
    pieces = [llm.tokenizer.decode([t]) for t in full.token_ids]
    # A stop string made of the end of one token and the start of the next, not found earlier in the text.
    stop = next(stop for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2
                if (stop := pieces[i][-2:] + pieces[i + 1][:2]) not in "".join(pieces[:i + 1])[:-2])
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop]))[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == full.text[:full.text.index(stop)]
    kept = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, stop=[stop],
                                                 include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == c.text + stop


def test_stop_token_ids_and_length(llm):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    full = llm.generate([PROMPT], greedy)[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 16
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id and out.token_ids == full.token_ids[:first + 1]


def test_n_samples_share_prompt_blocks(llm):
    engine = llm.engine
    bs, max_tokens = engine.kv.block_size, 12
    prompt = engine.tokenizer.encode(PROMPT * 5)  # two full blocks and a partial one
    engine.kv.reset_prefix_cache()
    assert engine.stats().blocks_used == 0
    engine.add_request("fork", prompt, SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=max_tokens,
                                                      ignore_eos=True))
    peak, final = 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
        peak = max(peak, engine.stats().blocks_used)
    assert final.finished and len(final.outputs) == 4 and [c.index for c in final.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == max_tokens for c in final.outputs)
    assert len({c.text for c in final.outputs}) > 1
    # The prompt's full blocks are held once; each sample holds its own copy of the partial prompt block and
    # the blocks its tokens fill. Seen between steps, the most KV a sample holds is the prompt and all its
    # tokens but the last two: the step that writes the next-to-last also samples the last and finishes.
    shared = len(prompt) // bs
    own = -(-(len(prompt) + max_tokens - 2) // bs) - shared
    assert (shared, own) == (2, 2) and peak == shared + 4 * own, (len(prompt), peak)
    assert engine.stats().blocks_used == 0


def test_logprobs(llm):
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())


def test_plain_greedy_takes_the_argmax_in_the_model_dtype(llm, monkeypatch):
    """Greedy rows with nothing to constrain or report skip the fp32 copy of their [rows, vocab] logits (the
    argmax of the model-dtype logits: the copy would hold the same values); a row asking for logprobs goes
    through the fp32 sampler. Both pick the same tokens."""
    runner = llm.engine.runner
    real, upcasts = runner.compute_logits, []

    def spy(hidden, upcast=True):
        upcasts.append(upcast)
        return real(hidden, upcast)

    monkeypatch.setattr(runner, "compute_logits", spy)
    prompts = [PROMPT, "Write a haiku about the sea.", "def fibonacci(n):", "Paris is the capital of"]

    def tokens(**extra) -> list[list[int]]:
        llm.engine.kv.reset_prefix_cache()  # the same prefill both times
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **extra))
        return [o.outputs[0].token_ids for o in outs]

    fast = tokens()
    assert upcasts and not any(upcasts)
    upcasts.clear()
    assert tokens(logprobs=1) == fast
    assert upcasts and all(upcasts)


def test_abort_frees_blocks_at_once(llm):
    engine = llm.engine
    engine.kv.reset_prefix_cache()
    engine.add_request("keep", PROMPT, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("drop", PROMPT * 8, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    used = engine.stats().blocks_used
    engine.abort_request("drop")
    assert engine.stats().blocks_used < used
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["keep"] and engine.stats().blocks_used == 0


def test_incremental_detokenizer_multibyte(llm):
    text = "naïve café — 日本語のテキスト 🙂🚀 done"
    ids = llm.tokenizer.encode(text)
    detok = IncrementalDetokenizer(llm.tokenizer, stop=[])
    seen = []
    for t in ids:
        detok.add_token(t)
        seen.append(detok.output_text(False))
    assert detok.text == text
    assert all("\ufffd" not in s for s in seen)
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))


@pytest.mark.parametrize("prompt, params, message", [
    ("", SamplingParams(), "empty"),
    ("hi " * 9000, SamplingParams(max_tokens=4), "maximum context length"),
    ([10**7], SamplingParams(), "token ids"),
    ("hi", SamplingParams(stop_token_ids=[10**7], min_tokens=1, max_tokens=2), "stop_token_ids"),
    ("hi", SamplingParams(seed=2**70), "seed"),
])
def test_bad_requests_raise_clear_errors(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}], params)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": -3}, "max_tokens"), ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"n": 0}, "n must"), ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_request_that_never_fits_fails_at_once():
    engine = LLMEngine(EngineConfig(kv_cache_memory="2MiB"))
    with pytest.raises(ValueError, match="KV"):
        engine.add_request("big", "hello " * 50, SamplingParams(max_tokens=500))
    assert not engine.has_unfinished_requests()


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLMEngine(EngineConfig(model="/nonexistent/model.gguf"))


def test_corrupt_and_truncated_gguf(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="GGUF"):
        LLMEngine(EngineConfig(model=str(garbage)))
    truncated = tmp_path / "truncated.gguf"
    with open(default_model_path(), "rb") as src, open(truncated, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.truncate(3 << 20)
    with pytest.raises(ValueError, match="GGUF"):
        LLMEngine(EngineConfig(model=str(truncated)))
