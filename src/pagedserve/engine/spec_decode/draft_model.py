"""Draft-model proposals: a smaller model sharing the target's tokenizer proposes k tokens greedily, with its own
paged KV pool, runner and block tables.

Each running request has a shadow request in the draft's pool. Before proposing, the shadow keeps the longest
prefix of its computed tokens that the target's sequence still has (the accepted proposals; the rejected ones'
blocks go back), then computes the rest (the target's new tokens) in one chunk per request and draws the first
proposal; k - 1 decode steps draw the others. All shadows of a step go through each forward pass together.
Greedy proposals are a point mass q, so the verifier's rule keeps the target's distribution exactly
(verifier.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import parse_size
from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.request import Request
from pagedserve.model.kv_cache_dtype import resolve_kv_format
from pagedserve.model.loader import load_model
from pagedserve.model.models import family
from pagedserve.sampling_params import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class DraftState:
    synced: int = 0  # the target's tokens at the last proposal: the shadow holds them, then its proposals


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
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
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
    def propose_all(self, items: list[tuple[Request, DraftState, int]]) -> list[list[int]]:
        """Up to k greedy draft tokens for each (request, state, k)."""
        proposals: list[list[int]] = [[] for _ in items]
        active = []
        for i, (req, _, k) in enumerate(items):
            shadow = self._sync(req, items[i][1])
            if self.kv.allocate_slots(shadow, shadow.num_tokens - shadow.num_computed_tokens + k):
                active.append((i, shadow, k))
        for j in range(max((k for _, _, k in active), default=0)):
            active = [(i, shadow, k) for i, shadow, k in active if k > j]
            scheduled = [(shadow, shadow.num_tokens - shadow.num_computed_tokens) for _, shadow, _ in active]
            batch = self.runner.prepare(scheduled, self.kv.req_blocks)
            hidden = self.runner.execute(batch)
            tokens = self.runner.compute_logits(hidden[batch.sample_rows]).argmax(dim=-1).tolist()
            drawn = {id(shadow): token for shadow, token in zip(batch.sample_reqs, tokens)}  # decodes come first
            for (i, shadow, _), (_, n) in zip(active, scheduled):
                shadow.num_computed_tokens += n
                shadow.append_token(drawn[id(shadow)])
                proposals[i].append(drawn[id(shadow)])
        return proposals

    def _sync(self, req: Request, state: DraftState) -> Request:
        """The request's shadow, holding the target's tokens; its computed tokens cut back to the prefix both
        share (the target's tokens before the last proposal never change: only the proposals are compared)."""
        shadow = self.shadows.get(req.request_id)
        if shadow is None:
            shadow = self.shadows[req.request_id] = Request(req.request_id, list(req.all_token_ids),
                                                            SamplingParams(max_tokens=1), 0.0, 0)
        same = min(state.synced, shadow.num_computed_tokens)
        limit = min(shadow.num_computed_tokens, req.num_tokens - 1)
        while same < limit and shadow.all_token_ids[same] == req.all_token_ids[same]:
            same += 1
        shadow.all_token_ids = list(req.all_token_ids)
        shadow.num_computed_tokens = same
        state.synced = req.num_tokens
        self.kv.trim(shadow)
        return shadow
