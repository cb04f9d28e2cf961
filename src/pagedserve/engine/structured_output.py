"""Grammar-constrained decoding with llguidance.

A constraint (SamplingParams.guided_decoding) is compiled once per distinct spec into a template
matcher, on a background thread, and cached; each request gets a cheap copy of its template. Every
step fills one token bitmask for all constrained rows of the batch (in parallel, in llguidance's own
threads) and the sampler masks their logits; a batch without constrained rows does no work here.
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import llguidance
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark

from pagedserve.engine.request import Request
from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.tokenizer import Tokenizer
from pagedserve.sampling_params import GuidedDecodingParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # distinct compiled specs kept
BIT_SHIFTS = torch.arange(32, dtype=torch.int32)
# Compact JSON (no free whitespace): a small model cannot pad an object with newlines forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True)
class GrammarMask:
    rows: torch.Tensor  # [R] long: batch rows that are constrained
    bits: torch.Tensor  # [R, ceil(V / 32)] int32: bit j of word w allows token 32 w + j

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """The mask unpacked, [R, V] bool (the PyTorch path; the C++ kernel reads the bits)."""
        return ((self.bits.unsqueeze(-1) >> BIT_SHIFTS) & 1).bool().view(len(self.rows), -1)[:, :vocab_size]


def grammar_source(spec: GuidedDecodingParams) -> str:
    """The llguidance grammar for a spec (not yet checked: building the matcher does that)."""
    kind, text = spec.key
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(llguidance.regex_to_lark(text, use_ascii="d"))  # \d: 0-9
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    lark = gbnf_to_lark(text) if "::=" in text else text
    return llguidance.LLMatcher.grammar_from_lark(lark)


class GrammarCompiler:
    """Thread-safe: the server compiles (and so validates) a spec before it reaches the engine thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._executor: llguidance.LLExecutor | None = None
        self.compile_seconds: list[float] = []  # per compiled (not cached) spec, for benchmarks and logs
        self.mask_seconds = 0.0  # total time filling step bitmasks, and the steps that had constrained rows
        self.mask_steps = 0

    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.4 s for a 49k vocabulary), on first use
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self.tokenizer.eos_token_ids)
            return self._ll_tokenizer

    def compile(self, spec: GuidedDecodingParams) -> llguidance.LLMatcher:
        """The template matcher of a spec, from the cache or compiled now; ValueError if the spec is invalid."""
        key = spec.key
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        t0 = time.perf_counter()
        try:  # whatever building a grammar from this input raises (llguidance, the GBNF converter) is the input's
            source = grammar_source(spec)
            matcher = llguidance.LLMatcher(self.ll_tokenizer(), source, log_level=0)
        except Exception as exc:  # noqa: BLE001 (reported to the client as a 400, not swallowed)
            raise ValueError(f"invalid {key[0]} constraint: {type(exc).__name__}: {exc}") from None
        if matcher.is_error():
            raise ValueError(f"invalid {key[0]} constraint: {matcher.get_error()}")
        elapsed = time.perf_counter() - t0
        self.compile_seconds.append(elapsed)
        logger.debug("compiled a %s constraint in %.1f ms", key[0], elapsed * 1e3)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher

    def submit(self, spec: GuidedDecodingParams) -> concurrent.futures.Future:
        """Compiles off the calling thread; a cached spec comes back as a finished future."""
        with self._lock:
            cached = self._cache.get(spec.key)
        if cached is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(cached)
            return done
        return self._pool.submit(self.compile, spec)

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
    """Feeds a sampled token to the request's matcher; returns a finish reason when the grammar ends it."""
    if req.matcher.consume_token(token):
        return "stop" if req.matcher.is_stopped() else None
    logger.error("request %s: token %d rejected by its grammar: %s", req.request_id, token, req.matcher.get_error())
    return "abort"
