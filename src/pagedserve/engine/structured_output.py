"""Grammar-constrained decoding with llguidance.

A constraint (SamplingParams.guided_decoding) is checked against GrammarLimits, turned into llguidance's grammar
and compiled into a matcher on a small thread pool, off the engine's step thread; each step fills one token
bitmask for all constrained rows of the batch (in llguidance's own threads) and the sampler masks their logits.

Every request gets a matcher of its own, compiled for it (about a millisecond). llguidance's copies of a matcher
share one lexer, which grows with each mask computed on any of them, so a compiled matcher kept for reuse would
hold memory that grows unseen. What the cache keeps, bounded in bytes, is each spec's verdict: its checked
grammar text, or the reason it was refused, so a repeated spec skips the checks and a refused one is refused at
once. A grammar that still hits one of llguidance's run-time limits ends its request with finish_reason `length`:
the output so far is a valid prefix, cut.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedserve.config import EngineConfig, parse_size
from pagedserve.engine.request import Request
from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.tokenizer import Tokenizer
from pagedserve.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
# Compact JSON (no free whitespace): a small model cannot pad an object with newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
REPEAT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# In a Lark grammar: a string, a /regex/ with its flags, a comment, or an inline JSON schema.
LARK_PART = re.compile(r'"(?:\\.|[^"\\])*"|/(?![/*])((?:\\.|[^/\\\n])+)/[a-z]*|(?://|#)[^\n]*|%json\b')
LARK_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # x ~ 3, x ~ 3..5
LARK_NAME = re.compile(r"[A-Za-z_][\w.-]*")
LARK_SHAPE = set("x()|*+?{},0123456789")


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """What one constraint may ask of the grammar engine; past a limit it is refused (a 400 on the server)."""
    max_choices: int = 1000  # alternatives in all: guided_choice strings, enum values, anyOf/oneOf branches
    max_schema_values: int = 10_000  # JSON values (objects, arrays, scalars) in its schemas
    max_schema_depth: int = 64  # nesting of objects and arrays (llguidance's JSON reader stops at 128)
    max_properties: int = 1000  # properties of one object (compile time grows with their square)
    max_regex_size: int = 10_000  # characters of its regexes with counted repetitions unrolled
    max_grammar_bytes: int = 65_536  # a Lark or GBNF grammar's text
    compile_timeout: float = 10.0  # seconds the server waits for a new spec's checks and compile
    cache_bytes: int = 64 << 20  # verdicts kept: checked grammar texts and refusals
    threads: int = 4  # the compile pool: one slow compile leaves the others free
    # llguidance's own limits, below its defaults (1M, 200k): the fuel for building a lexeme's regex (measured
    # here at about 150 bytes and 0.6 us a unit: the default let one pattern take 150 MB) and for one mask step
    lexer_fuel: int = 200_000
    step_lexer_fuel: int = 100_000

    @classmethod
    def from_config(cls, config: EngineConfig) -> GrammarLimits:
        return cls(max_choices=config.max_guided_choices, compile_timeout=config.grammar_compile_timeout,
                   cache_bytes=parse_size(config.grammar_cache_memory))


@dataclass(slots=True)
class GrammarMask:
    rows: torch.Tensor  # [R] long: batch rows that are constrained
    bits: torch.Tensor  # [R, ceil(V / 32)] int32: bit j of word w allows token 32 w + j

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """The mask unpacked, [R, V] bool (the PyTorch path; the C++ kernel reads the bits)."""
        return ((self.bits.unsqueeze(-1) >> BIT_SHIFTS) & 1).bool().view(len(self.rows), -1)[:, :vocab_size]


def regex_size(pattern: str) -> int:
    """Characters of a regex with its counted repetitions unrolled: (a{1000}){1000} is a million. llguidance's
    lexer spends time and memory in proportion to it ({n} is not free there, while *, + and classes are)."""
    groups = [[0, 0]]  # per open group: its size so far, and the size of its last element
    at = 0
    while at < len(pattern):
        char, top = pattern[at], groups[-1]
        if char == "{" and (m := REPEAT.match(pattern, at)):
            count = int(m[2]) if m[2] else int(m[1])
            top[0] += top[1] * (count - 1)
            top[1] *= count
            at = m.end()
            continue
        at += 1
        if char in "*+?^$|":  # quantifiers and anchors add nothing; an alternative adds its own size
            top[1] = 0
            continue
        if char == "(":
            groups.append([0, 0])
            continue
        size = 1
        if char == ")" and len(groups) > 1:
            size = groups.pop()[0]
        elif char == "\\":  # an escape; \p{...}, \x{...} and \u{...} take braces
            braced = pattern[at:at + 1] in ("p", "P", "x", "u", "U") and pattern[at + 1:at + 2] == "{"
            at = (pattern.find("}", at) + 1 or len(pattern)) if braced else at + 1
        elif char == "[":
            at = _class_end(pattern, at)
        groups[-1][0] += size
        groups[-1][1] = size
    return sum(size for size, _ in groups)


def _class_end(pattern: str, at: int) -> int:
    """The index after the `]` closing the class that opens just before `at` (classes nest in Rust's syntax)."""
    depth = 1
    if pattern[at:at + 1] == "^":
        at += 1
    if pattern[at:at + 1] == "]":
        at += 1
    while at < len(pattern) and depth:
        char = pattern[at]
        at += 2 if char == "\\" else 1
        depth += (char == "[") - (char == "]")
    return at


class _Tally:
    """What one constraint adds up to, against its limits; ValueError with the reason at the first one passed."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.choices = self.regex = self.values = 0

    def add_choices(self, count: int) -> None:
        self.choices += count
        if self.choices > self.limits.max_choices:
            raise ValueError(f"more than {self.limits.max_choices} alternatives (guided_choice strings, enum values "
                             "and anyOf/oneOf branches together; --max-guided-choices)")

    def add_regex(self, pattern: str) -> None:
        self.regex += regex_size(pattern)
        if self.regex > self.limits.max_regex_size:
            raise ValueError(f"its regexes unroll to {self.regex} characters, more than {self.limits.max_regex_size} "
                             "(counted repetitions such as (a{100}){100} multiply); simplify the pattern")

    def add_schema(self, schema: object) -> None:
        """Walks a JSON schema without recursion (it may nest as deep as the request allows)."""
        limits, stack = self.limits, [(schema, 1)]
        while stack:
            node, depth = stack.pop()
            self.values += 1
            if self.values > limits.max_schema_values:
                raise ValueError(f"the JSON schema has more than {limits.max_schema_values} values")
            if depth > limits.max_schema_depth:
                raise ValueError(f"the JSON schema nests deeper than {limits.max_schema_depth} levels")
            if isinstance(node, list):
                stack += [(value, depth + 1) for value in node]
            if not isinstance(node, dict):
                continue
            for key in ("enum", "anyOf", "oneOf"):
                if isinstance(node.get(key), list):
                    self.add_choices(len(node[key]))
            if isinstance(node.get("pattern"), str):
                self.add_regex(node["pattern"])
            for key in ("properties", "patternProperties"):
                if isinstance(node.get(key), dict) and len(node[key]) > limits.max_properties:
                    raise ValueError(f"an object of the JSON schema has more than {limits.max_properties} {key}")
            if isinstance(node.get("patternProperties"), dict):
                for pattern in node["patternProperties"]:
                    self.add_regex(pattern)
            stack += [(value, depth + 1) for value in node.values()]

    def add_lark(self, lark: str) -> None:
        """A Lark grammar: its /regexes/ and inline %json schemas, and what its counted repetitions (x{m,n},
        x~m..n, expanded by llguidance into rules or lexemes) unroll it by, each string, regex or name one
        element."""
        shape, at = [], 0
        while m := LARK_PART.search(lark, at):
            shape.append(lark[at:m.start()])
            at = m.end()
            if m[1] is not None:
                self.add_regex(m[1])
            elif m[0] == "%json":
                try:
                    schema, at = json.JSONDecoder().raw_decode(lark, len(lark) - len(lark[at:].lstrip()))
                except (json.JSONDecodeError, RecursionError):
                    continue  # not JSON: llguidance says where
                self.add_schema(schema)
            shape.append(" " if m[0].startswith(("//", "#")) else " x ")
        shape.append(lark[at:])
        text = LARK_TILDE.sub(lambda t: f"{{{t[1]},{t[2] or t[1]}}}", "".join(shape))
        text = "".join(c for c in LARK_NAME.sub("x", text).replace("[", "(").replace("]", ")") if c in LARK_SHAPE)
        added = regex_size(text) - regex_size(REPEAT.sub("", text))
        if added > self.limits.max_regex_size:
            raise ValueError(f"its counted repetitions (x{{m,n}}, x~m..n) unroll the grammar by more than "
                             f"{self.limits.max_regex_size} elements")


def check_spec(spec: GuidedDecodingParams, limits: GrammarLimits) -> str:
    """The llguidance grammar of a spec that stays within limits (its validity is checked by compiling it)."""
    kind, text = spec.key
    tally = _Tally(limits)
    if kind == "json":
        schema = json.loads(text)
        tally.add_schema(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        tally.add_regex(text)
        return llguidance.LLMatcher.grammar_from_regex(llguidance.regex_to_lark(text, use_ascii="d"))  # \d: 0-9
    if kind == "choice":
        choices = json.loads(text)
        tally.add_choices(len(choices))
        # One lexeme (a terminal), not a rule with an alternative per string: the Earley parser allows 2000
        # items in a row and compiles big alternations slowly; the lexer takes 100,000 strings in half a second.
        return llguidance.LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(map(json.dumps, choices)))
    if len(text.encode()) > limits.max_grammar_bytes:
        raise ValueError(f"the grammar is longer than {limits.max_grammar_bytes} bytes")
    lark = gbnf_to_lark(text) if "::=" in text else text
    tally.add_lark(lark)
    return llguidance.LLMatcher.grammar_from_lark(lark)


def one_line(error: str) -> str:
    """llguidance's message as one short line: no grammar excerpt after it, no backtrace of a panic; a regex
    parse error keeps its closing `error: ...` line, which says what is wrong."""
    lines = error.strip().splitlines() or [""]
    line = lines[0] + "".join(" " + rest.removeprefix("error: ") for rest in lines[1:] if rest.startswith("error: "))
    if line.startswith("panic"):
        return "the grammar engine cannot handle this constraint (too large or complex)"
    if line in ("NoExtension", "NoExtensionBias"):  # llguidance's stop reason when nothing can be generated
        return "no output can satisfy it (e.g. a $ref that only refers to itself)"
    line = re.sub(r"^at \d+\(\d+\): ", "", line)  # a position in our grammar text, not in the client's
    return line if len(line) <= 300 else line[:297] + "..."


@dataclass(slots=True)
class _Verdict:
    source: str | None  # the checked llguidance grammar, or None: refused
    error: str | None
    nbytes: int


class GrammarCompiler:
    """Thread-safe: the server checks a spec (check()) before the engine thread compiles its requests' matchers
    (submit())."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, limits: GrammarLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.limits = limits or GrammarLimits()
        # verbose_errors off: llguidance's default puts the grammar and parser state (megabytes) in its errors
        self._ll_limits = llguidance.LLParserLimits(initial_lexer_fuel=self.limits.lexer_fuel,
                                                    step_lexer_fuel=self.limits.step_lexer_fuel, verbose_errors=False)
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._verdicts: OrderedDict[tuple[str, str], _Verdict] = OrderedDict()
        self._verdict_bytes = 0
        self._checking: dict[tuple[str, str], concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(self.limits.threads, thread_name_prefix="grammar")
        self._executor: llguidance.LLExecutor | None = None
        self._eos_mask = sum(1 << token for token in set(tokenizer.eos_token_ids))  # a mask allowing EOS alone
        self.compiles = 0  # matchers compiled, and the seconds they took (checks included)
        self.compile_seconds = 0.0
        self.mask_seconds = 0.0  # total time filling step bitmasks, and the steps that had constrained rows
        self.mask_steps = 0

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.4 s for a 49k vocabulary), on first use
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.tokenizer.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: GuidedDecodingParams) -> llguidance.LLMatcher:
        """A new matcher for one request; ValueError with a one-line reason if the spec is refused."""
        start = time.perf_counter()
        verdict = self._verdict(spec)
        if verdict is not None and verdict.error is not None:
            raise ValueError(_invalid(spec, verdict.error))
        tokenizer = self.ll_tokenizer()
        try:
            source = verdict.source if verdict is not None else check_spec(spec, self.limits)
            matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=self._ll_limits)
            error = matcher.get_error() or self._first_mask_error(matcher.deep_copy())
        except ValueError as exc:  # our limits, and llguidance's objections to the input
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 (whatever building a grammar from this input raises is the input's)
            error = f"{type(exc).__name__}: {exc}"
        if error:
            self.refuse(spec, one_line(error))
            raise ValueError(_invalid(spec, one_line(error)))
        self._remember(spec, _Verdict(source, None, len(spec.key[1]) + len(source)))
        elapsed = time.perf_counter() - start
        self.compiles += 1
        self.compile_seconds += elapsed
        logger.debug("compiled a %s constraint in %.1f ms", spec.key[0], elapsed * 1e3)
        return matcher

    def _first_mask_error(self, probe: llguidance.LLMatcher) -> str:
        """Computes the first mask here rather than on the step thread (it builds the first lexemes), and says
        what failed at once: a $ref loop, a lexeme past its fuel. llguidance answers a failed mask with EOS
        alone; where the grammar cannot end yet, feeding that EOS brings out the error."""
        mask = probe.compute_bitmask()
        if not probe.get_error() and not probe.is_accepting() and int.from_bytes(mask, "little") == self._eos_mask:
            probe.consume_token(self.tokenizer.eos_token_ids[0])
            return probe.get_error() or "no output can satisfy it"
        return probe.get_error()

    def check(self, spec: GuidedDecodingParams) -> concurrent.futures.Future:
        """Whether a spec compiles, settled once per spec off the calling thread: the future fails with a
        ValueError if the spec is refused. Concurrent checks of one spec share one compile."""
        with self._lock:
            verdict = self._verdict_locked(spec.key)
            if verdict is None:
                if spec.key not in self._checking:
                    self._checking[spec.key] = self._pool.submit(self._check, spec)
                return self._checking[spec.key]
        return _settled(ValueError(_invalid(spec, verdict.error)) if verdict.error is not None else None)

    def _check(self, spec: GuidedDecodingParams) -> None:
        try:
            self.compile(spec)  # the verdict is remembered; the matcher is not needed
        finally:
            with self._lock:
                del self._checking[spec.key]

    def submit(self, spec: GuidedDecodingParams) -> concurrent.futures.Future:
        """A request's matcher, compiled off the calling thread; a refused spec fails at once."""
        verdict = self._verdict(spec)
        if verdict is not None and verdict.error is not None:
            return _settled(ValueError(_invalid(spec, verdict.error)))
        return self._pool.submit(self.compile, spec)

    def refuse(self, spec: GuidedDecodingParams, reason: str) -> None:
        """Remembers a spec as refused (e.g. after its compile outlasted the server's timeout)."""
        logger.debug("refused a %s constraint: %s", spec.key[0], reason)  # the server logs the 400 it answers
        self._remember(spec, _Verdict(None, reason, len(spec.key[1]) + len(reason)))

    def cached_bytes(self) -> int:
        """What the verdicts kept take (their texts' lengths), at most limits.cache_bytes."""
        with self._lock:
            return self._verdict_bytes

    def _verdict(self, spec: GuidedDecodingParams) -> _Verdict | None:
        with self._lock:
            return self._verdict_locked(spec.key)

    def _verdict_locked(self, key: tuple[str, str]) -> _Verdict | None:
        verdict = self._verdicts.get(key)
        if verdict is not None:
            self._verdicts.move_to_end(key)
        return verdict

    def _remember(self, spec: GuidedDecodingParams, verdict: _Verdict) -> None:
        """Least recently used verdicts go first once their bytes pass the budget; a refusal is not overturned
        by a compile that finishes after it (one that outlasted its timeout)."""
        with self._lock:
            if spec.key in self._verdicts or verdict.nbytes > self.limits.cache_bytes:
                return
            self._verdicts[spec.key] = verdict
            self._verdict_bytes += verdict.nbytes
            while self._verdict_bytes > self.limits.cache_bytes:
                self._verdict_bytes -= self._verdicts.popitem(last=False)[1].nbytes

    def fill_mask(self, reqs: list[Request]) -> GrammarMask | None:
        """One bitmask for every constrained row of the batch, unpacked to a boolean [R, V] mask."""
        rows = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if not rows:
            return None
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        start = time.perf_counter()
        bits = torch.empty(len(rows), self.words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr([(reqs[i].matcher, k) for k, i in enumerate(rows)],
                                               bits.data_ptr(), self.words * 4, len(rows))
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        return GrammarMask(torch.tensor(rows, dtype=torch.long), bits)


def _invalid(spec: GuidedDecodingParams, reason: str) -> str:
    return f"invalid {spec.key[0]} constraint: {reason}"


def _settled(error: BaseException | None) -> concurrent.futures.Future:
    """A finished future: failed with error, or done."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(None)
    return future


def apply_mask(logits: torch.Tensor, mask: GrammarMask, use_kernel: bool = True) -> None:
    """Keeps only the tokens each constrained row's grammar allows, in place."""
    kernels = cpu_kernels() if use_kernel and logits.dtype == torch.float32 and logits.stride(1) == 1 else None
    if kernels is not None:
        kernels.apply_token_bitmask(logits, mask.rows, mask.bits)
    else:
        logits[mask.rows] = logits[mask.rows].masked_fill(~mask.allowed(logits.shape[1]), float("-inf"))


def restore_dead_rows(logits: torch.Tensor, mask: GrammarMask, masked: torch.Tensor) -> None:
    """Where bans (min_tokens, stop token ids) removed every token a grammar allows, the grammar wins:
    masked holds the constrained rows as they were before the bans."""
    dead = torch.isneginf(logits[mask.rows]).all(dim=1)
    if bool(dead.any()):
        logits[mask.rows[dead]] = masked[dead]


def advance(req: Request, token: int) -> str | None:
    """Feeds a sampled token to the request's matcher; returns a finish reason when the grammar ends it. A
    matcher that hit one of llguidance's run-time limits (its last mask then allowed only EOS) rejects the
    token, or takes it and stops unfinished: the output so far is a valid prefix, so the request ends as if
    out of tokens, never with a `stop` that would claim it complete."""
    matcher = req.matcher
    if matcher.consume_token(token) and not matcher.get_error():
        if not matcher.is_stopped():
            return None
        if matcher.is_accepting():
            return "stop"
    logger.warning("request %s: its grammar hit a limit of the grammar engine, output cut: %s",
                   req.request_id, one_line(req.matcher.get_error()))
    return "length"
