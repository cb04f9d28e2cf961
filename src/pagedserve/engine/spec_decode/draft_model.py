"""Draft-model proposals: a smaller model sharing the target's tokenizer proposes k tokens, with its own paged KV
pool, runner and block tables.

Each running request has a shadow request in the draft's pool. Before proposing, the shadow keeps the longest
prefix of its computed tokens that the target's sequence still has (the accepted proposals; the rejected ones'
blocks go back), then computes the rest (the target's new tokens) in one chunk per request and draws the first
proposal; k - 1 decode steps draw the others. All shadows of a step go through each forward pass together. The
draft's pool caches prefixes as the target's does: a new shadow starts from the longest cached prefix of its
prompt, and a shadow's full blocks are hashed only once they hold the target's tokens (at the next sync), so a
proposal's KV is never found by another request.

A shadow carries its request's sampling parameters, seed and output, and a copy of its grammar matcher fed the
proposals, so each proposal is drawn as the target's sampler would draw it (penalties, bias, grammar mask,
bans, temperature, top-k/top-p/min-p) from the draft's logits. Greedy requests propose the argmax, a point mass
(verifier.py's rule); sampled ones draw x ~ q and keep q for speculative sampling (rejection.py).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.config import parse_size
from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.request import Request
from pagedserve.engine.sampler import SamplingBatch
from pagedserve.engine.spec_decode.rejection import draft_sample
from pagedserve.engine.structured_output import GrammarMask
from pagedserve.model.kv_cache_dtype import resolve_kv_format
from pagedserve.model.loader import load_model
from pagedserve.model.models import family
from pagedserve.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class DraftState:
    synced: int = 0  # the target's tokens at the last proposal: the shadow holds them, then its proposals
    probs: torch.Tensor | None = None  # [k, V]: q of each sampled proposal, None for greedy ones


class DraftModelProposer:
    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, block_size: int, vocab_size: int,
                 max_num_seqs: int) -> None:
        loaded = load_model(config.model, "none")
        if loaded.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {loaded.config.vocab_size} tokens, the target's "
                             f"{vocab_size}: a draft model must share the target's tokenizer")
        model = family(loaded.config.family).model_class()(loaded.config, loaded.weights.pop("rope_freqs", None))
        model.load_weights(loaded.weights)
        model.to(dtype).eval()
        fmt = resolve_kv_format("auto", dtype)
        num_blocks = parse_size(config.draft_kv_cache_memory) // ModelRunner.bytes_per_block(loaded.config, fmt,
                                                                                             block_size)
        self.kv = KVCacheManager(num_blocks, block_size)
        self.runner = ModelRunner(model, loaded.config, fmt, num_blocks, block_size, max_num_seqs=max_num_seqs)
        self.shadows: dict[str, Request] = {}

    def new_state(self) -> DraftState:
        return DraftState()

    def finished(self, output_token_ids: list[int]) -> None:
        """Nothing is learnt from other requests; their shadows go in release()."""

    def release(self, running: set[str]) -> None:
        """Frees the shadows of requests no longer running (finished, aborted or preempted)."""
        for rid in [rid for rid in self.shadows if rid not in running]:
            del self.shadows[rid]
            self.kv.free(rid)

    @torch.inference_mode()
    def propose_all(self, items: list[tuple[Request, DraftState, int]],
                    grammar_mask: Callable[[list[Request]], GrammarMask | None]) -> list[list[int]]:
        """Up to k draft tokens for each (request, state, k); a sampled request's q go to its state."""
        proposals: list[list[int]] = [[] for _ in items]
        qs: list[list[torch.Tensor]] = [[] for _ in items]
        active = []
        for i, (req, state, k) in enumerate(items):
            shadow = self._sync(req, state)
            new = shadow.request_id not in self.kv.req_blocks
            cached = self.kv.find_cached_prefix(shadow) if new else []
            hit = len(cached) * self.kv.block_size
            if new:
                self.kv.record_prefix_query(shadow.num_prompt_tokens, hit)
            if self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens - hit + k, cached):
                shadow.num_computed_tokens += hit
                active.append((i, shadow, k))
        for j in range(max((k for _, _, k in active), default=0)):
            active = [(i, shadow, k) for i, shadow, k in active if k > j]
            if not active:
                break
            scheduled = [(shadow, shadow.num_tokens - shadow.num_computed_tokens) for _, shadow, _ in active]
            batch = self.runner.prepare(scheduled, self.kv.req_blocks)
            hidden = self.runner.execute(batch)
            logits = self.runner.compute_logits(hidden[batch.sample_rows])
            rows = batch.sample_reqs  # decodes come first
            tokens, q = draft_sample(logits, SamplingBatch.build(rows, logits.shape[1], grammar_mask(rows)))
            at = {id(shadow): r for r, shadow in enumerate(rows)}
            going = []
            for (i, shadow, k), (_, n) in zip(active, scheduled):
                r = at[id(shadow)]
                token = int(tokens[r])
                shadow.num_computed_tokens += n
                shadow.append_token(token)
                proposals[i].append(token)
                if q is not None and not shadow.params.greedy:
                    qs[i].append(q[r])
                if shadow.matcher is None or shadow.matcher.consume_token(token) and not (
                        shadow.matcher.get_error() or shadow.matcher.is_stopped()):
                    going.append((i, shadow, k))  # a grammar that ended (or failed) takes no more proposals
            active = going
        for i, (req, state, _) in enumerate(items):
            state.probs = torch.stack(qs[i]) if qs[i] else None
            if req.request_id in self.shadows:
                self.shadows[req.request_id].matcher = None
        return proposals

    def _sync(self, req: Request, state: DraftState) -> Request:
        """The request's shadow, holding the target's tokens; its computed tokens cut back to the prefix both
        share (the target's tokens before the last proposal never change: only the proposals are compared)."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = self.shadows[req.request_id] = Request(req.request_id, req.prompt_token_ids, req.params, 0.0,
                                                            req.seed, eos_token_ids=req.eos_token_ids)
            shadow.logprobs = shadow.prompt_logprobs = None  # the draft's own are never wanted
        same = min(state.synced, shadow.num_computed_tokens)
        limit = min(shadow.num_computed_tokens, req.num_tokens - 1)
        while same < limit and shadow.all_token_ids[same] == req.all_token_ids[same]:
            same += 1
        shadow.all_token_ids = list(req.all_token_ids)
        shadow.output_token_ids = list(req.output_token_ids)
        shadow.num_computed_tokens = same
        shadow.matcher = req.matcher.deep_copy() if req.matcher is not None else None
        state.synced = req.num_tokens
        if shadow.request_id in self.kv.req_blocks:  # only the target's own tokens are hashed, never a proposal
            self.kv.cache_full_blocks(shadow)
        self.kv.trim(shadow)
        return shadow
