"""Grammar-constrained decoding in the engine (llguidance): every constrained output obeys its constraint,
in batches that mix constrained and free requests, with n > 1, seeds, stop strings, preemption and prefix hits."""
from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedserve import LLM
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from tests.structured_schemas import SCHEMAS

QUESTIONS = ["Give me an example record as JSON.", "Describe your favourite thing in JSON."]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="96MiB", max_model_len=1024, max_num_seqs=128)


def chat(llm: LLM, question: str) -> str:
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}])


def guided(max_tokens: int = 160, **kw) -> SamplingParams:
    spec = {k: kw.pop(k) for k in ("json", "json_object", "regex", "choice", "grammar") if k in kw}
    return SamplingParams(max_tokens=max_tokens, guided_decoding=GuidedDecodingParams(**spec), **kw)


@pytest.mark.slow  # 26 s: every schema of the suite decoded; make test keeps the single-schema checks
def test_every_schema_output_validates_in_a_batch_mixed_with_free_requests(llm):
    """22 schemas x 2 prompts, greedy and seeded samples with n = 2, beside unconstrained requests."""
    prompts, params, expect = [], [], []
    for name, schema in SCHEMAS.items():
        for q, question in enumerate(QUESTIONS):
            prompts.append(chat(llm, f"{question} ({name.replace('_', ' ')})"))
            params.append(guided(json=schema, temperature=0) if q == 0 else
                          guided(json=schema, temperature=0.8, seed=len(prompts), n=2))
            expect.append(schema)
    free_prompts = [chat(llm, "Tell me about the sea."), "The capital of France is"]
    free = SamplingParams(temperature=0, max_tokens=24)
    outs = llm.generate(prompts + free_prompts, params + [free] * 2)
    stopped = 0
    for out, schema in zip(outs, expect):
        for c in out.outputs:
            if c.finish_reason == "length":  # a model may run out of tokens; then the output is cut, said so
                continue
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), schema)
            stopped += 1
    assert stopped >= 0.9 * 3 * len(SCHEMAS), f"only {stopped} outputs completed their schema"
    alone = llm.generate(free_prompts, free)
    assert [o.outputs[0].token_ids for o in outs[-2:]] == [o.outputs[0].token_ids for o in alone]


def test_regex_choice_and_grammars(llm):
    prompt = chat(llm, "Answer briefly.")
    specs = [
        ({"regex": r"\d{3}-[a-z]{2,5}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        ({"regex": r"(yes|no), because [a-z ]{5,20}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{5,20}\.", t)),
        ({"choice": ["Paris", "Berlin", "New York, \"NYC\""]}, lambda t: t in {"Paris", "Berlin", "New York, \"NYC\""}),
        ({"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
         lambda t: re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", t)),
        ({"grammar": 'root ::= "x=" digit digit? ";"\ndigit ::= [0-9]'}, lambda t: re.fullmatch(r"x=[0-9]{1,2};", t)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ]
    for temperature in (0.0, 1.0):
        outs = llm.generate([prompt] * len(specs), [guided(max_tokens=96, temperature=temperature, seed=7, **s)
                                                    for s, _ in specs])
        for (spec, check), out in zip(specs, outs):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and check(c.text), (spec, c.text, c.finish_reason)


def test_offline_checks_each_spec_once_then_compiles_a_matcher_per_request(llm):
    before = llm.engine.grammars.compiles
    spec = {"regex": r"[a-z]{1,8} [0-9]{1,4}"}  # seen by no other test: its check is not remembered yet
    outs = llm.generate(["a", "b", "c", "d"], guided(max_tokens=16, **spec))
    assert all(re.fullmatch(r"[a-z]{1,8} [0-9]{1,4}", o.outputs[0].text) for o in outs)
    assert llm.engine.grammars.compiles - before == 1 + 4


def test_seeds_stop_strings_and_length(llm):
    prompt = chat(llm, "Invent a person.")
    params = guided(json=SCHEMAS["person"], temperature=0.9, seed=123)
    first, second = llm.generate([prompt, prompt], [params, params])
    assert first.outputs[0].text == second.outputs[0].text
    # A stop string ends the output where it appears, even inside the JSON.
    cut = llm.generate(prompt, guided(json=SCHEMAS["person"], temperature=0, stop=['"age"']))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == '"age"' and '"age"' not in cut.text
    # max_tokens before the grammar completes: finish_reason says length.
    short = llm.generate(prompt, guided(max_tokens=4, json=SCHEMAS["nested"], temperature=0))[0].outputs[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)


@pytest.mark.slow  # three engines over the same batch
def test_preemption_and_prefix_hits_give_the_same_outputs():
    """A pool so small that the batch preempts, and a second pass served from the prefix cache, produce the
    same constrained outputs as a roomy pool."""
    def run(memory: str, passes: int) -> tuple[list[list[str]], object]:
        engine_llm = LLM(config=EngineConfig(dtype="float32", kv_cache_memory=memory, max_model_len=512,
                                             enable_prefix_caching=True))
        prompts = [chat(engine_llm, f"Make up item number {i} as JSON, please, with care.") for i in range(6)]
        params = [guided(json=SCHEMAS["mixed_required"], temperature=0.7, seed=i, max_tokens=64) for i in range(6)]
        results = [[o.outputs[0].text for o in engine_llm.generate(prompts, params)] for _ in range(passes)]
        return results, engine_llm.engine.stats()

    roomy, _ = run("64MiB", 1)
    tight, stats = run("8MiB", 2)
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert tight == [roomy[0], roomy[0]]


def test_a_new_schema_compiles_off_the_step_thread_without_stalling_the_batch():
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", max_model_len=512))
    compile_real = engine.grammars.compile
    release, threads = threading.Event(), []

    def slow_compile(spec):
        threads.append(threading.current_thread().name)
        assert release.wait(60)
        return compile_real(spec)

    engine.grammars.compile = slow_compile
    engine.add_request("free", "Once upon a time", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    engine.add_request("json", "A person:", guided(json=SCHEMAS["person"], temperature=0))
    assert engine.pending, "the request waits for its grammar instead of blocking add_request"
    done: dict[str, str] = {}
    while "free" not in done:  # the free request runs to the end while the grammar is still compiling
        done.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    assert engine.pending and threads and threads[0].startswith("grammar")
    release.set()
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(done["json"]), SCHEMAS["person"])
    # The next request with the spec compiles a matcher of its own (copies of one share a lexer that grows
    # with every mask), off the step thread too; its checks are not repeated.
    engine.grammars.compile = compile_real
    checked, compiles = engine.grammars.cached_bytes(), engine.grammars.compiles
    engine.add_request("again", "Another person:", guided(json=SCHEMAS["person"], temperature=0))
    assert engine.pending
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    jsonschema.validate(json.loads(done["again"]), SCHEMAS["person"])
    assert engine.grammars.compiles == compiles + 1 and engine.grammars.cached_bytes() == checked


@pytest.mark.parametrize("spec, message", [
    ({"json": {"type": "array", "uniqueItems": True}}, "Unimplemented"),
    ({"json": {"type": "strng"}}, "strng"),
    ({"regex": "(ab"}, "regex"),
    ({"grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"json": {"type": "string", "pattern": "(?=x)y"}}, "look"),
    # issue #36: past the limits, refused before anything is built
    ({"json": {"type": "string", "pattern": "^(a{1000}){1000}$"}}, "unroll to 1000000 characters"),
    ({"regex": r"(\d{100}){101}"}, "unroll to 10100 characters"),
    ({"grammar": 'start: ("a"{1000}){1000}'}, "counted repetitions"),
    ({"grammar": "root ::= [a-z]{1000000}"}, "counted repetitions"),
    ({"choice": [str(i) for i in range(1001)]}, "more than 1000 alternatives"),
    ({"json": {"anyOf": [{"const": i} for i in range(600)], "enum": list(range(401))}}, "more than 1000 alternatives"),
    ({"json": {"type": "object", "properties": {f"p{i}": {} for i in range(1001)}}}, "more than 1000 properties"),
    ({"json": {"type": "array", "items": {"type": "integer", "examples": [1] * 10_001}}}, "more than 10000 values"),
    ({"json": json.loads('{"items": ' * 70 + "{}" + "}" * 70)}, "deeper than 64 levels"),
    ({"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(9000))}, "longer than 65536 bytes"),
    # and past llguidance's own, found by compiling and computing the first mask
    ({"json": {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}},
     "no output can satisfy it"),
    ({"json": {"type": "integer", "minimum": 10**30}}, "not JSON serializable"),
])
def test_invalid_constraints_are_refused_with_the_reason(llm, spec, message):
    """One short line, without llguidance's grammar dump or a panic's backtrace; a spec once refused is refused
    again at once, without compiling."""
    for attempt in range(2):
        compiles = llm.engine.grammars.compiles
        with pytest.raises(ValueError, match=re.escape(message)) as refused:
            llm.generate("Hi", guided(**spec))
        reason = str(refused.value)
        assert "\n" not in reason and len(reason) < 400 and not re.search("panic|backtrace|<state>", reason)
        assert llm.engine.grammars.compiles == compiles
    assert llm.generate("Hi", SamplingParams(max_tokens=2))[0].finished  # the engine keeps serving


def test_a_runtime_limit_ends_the_request_with_length_and_a_valid_prefix(llm):
    """A grammar that passes its checks and first mask but hits one of llguidance's limits later (here its
    Earley parser's 2000 items in a row, on the token after the first) ends with `length`, its output a prefix
    of a valid one: never `abort`, nor a `stop` that would claim it complete."""
    words = [f"w{i}" for i in range(2500)]
    out = llm.generate(chat(llm, "Pick a word."), guided(grammar="start: " + " | ".join(f'"{w}"' for w in words),
                                                          temperature=0, max_tokens=16))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) < 16
    assert any(w.startswith(out.text) for w in words), out.text


def test_regex_size_unrolls_counted_repetitions():
    from pagedserve.engine.structured_output import regex_size

    sizes = {"abc": 3, "(ab){3}": 6, "(a{1000}){1000}": 10**6, r"\d{3}-\d{4}": 8, r"\p{Lu}{4}": 4, "(a|bc){2}": 6,
             "[a-z]{5}": 5, r"[\]\[a]{2}": 2, "[[a-z]&&[^x]]{10}": 10, "(?:ab)+x*": 4, "a{2,5}b{3,}": 8, "{x}": 3}
    assert {p: regex_size(p) for p in sizes} == sizes


def test_the_verdict_cache_is_bounded_in_bytes(llm):
    """The cache keeps checked grammar texts and refusals, least recently used first out past its budget."""
    from pagedserve.engine.structured_output import GrammarCompiler, GrammarLimits

    compiler = GrammarCompiler(llm.tokenizer, llm.engine.grammars.vocab_size, GrammarLimits(cache_bytes=4096))
    specs = [GuidedDecodingParams(json={"type": "object", "properties": {f"field_{i}": {"type": "integer"}}})
             for i in range(40)]
    for spec in specs:
        compiler.compile(spec)
        assert compiler.cached_bytes() <= 4096
    assert 4096 - 400 < compiler.cached_bytes()  # full, less at most one entry
    compiles = compiler.compiles
    compiler.check(specs[-1]).result()  # the latest is still known: nothing compiles
    assert compiler.compiles == compiles
    compiler.check(specs[0]).result()  # the first was evicted: checked again
    assert compiler.compiles == compiles + 1


def test_guided_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        GuidedDecodingParams()
    with pytest.raises(ValueError, match="non-empty"):
        GuidedDecodingParams(choice=[])


@pytest.mark.parametrize("vocab", [49152, 1000, 37])
def test_bitmask_kernel_matches_the_torch_path(vocab):
    """The C++ mask (bits read in place) and the PyTorch one (bits unpacked) agree, on some rows of a batch."""
    from pagedserve.engine.structured_output import GrammarMask, apply_mask
    from pagedserve.model.kernels import cpu_kernels, kernels_expected

    if cpu_kernels() is None:
        assert not kernels_expected()
        pytest.skip("no C++ kernels on this machine")
    gen = torch.Generator().manual_seed(vocab)
    words = (vocab + 31) // 32
    bits = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=gen)
    bits[1] = -1  # every token allowed
    bits[2, : words // 2] = 0  # a forbidden stretch
    mask = GrammarMask(torch.tensor([0, 2, 4]), bits)
    logits = torch.randn(5, vocab, generator=gen)
    fast, slow = logits.clone(), logits.clone()
    apply_mask(fast, mask)
    apply_mask(slow, mask, use_kernel=False)
    assert torch.equal(fast, slow)
    assert torch.equal(fast[[1, 3]], logits[[1, 3]]) and torch.equal(fast[2], logits[2])
    assert torch.isneginf(fast[4, : 32 * (words // 2)]).all()
    allowed = mask.allowed(vocab)
    assert torch.equal(torch.isneginf(fast[[0, 2, 4]]), ~allowed)
