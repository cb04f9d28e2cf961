"""The synchronous engine: add requests, call step() in a loop, read RequestOutputs."""
from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagedserve.config import EngineConfig, parse_size
from pagedserve.distributed.executor import ParallelModelRunner, Workers, check_parallel
from pagedserve.engine.calibration import CALIBRATION_TEXT
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.kv_cache import KVCacheGroup, KVCacheManager, kv_cache_groups
from pagedserve.engine.kv_transfer import KVTransfer
from pagedserve.engine.lora_manager import LoRAManager
from pagedserve.engine.model_runner import BatchInputs, ModelRunner
from pagedserve.engine.request import Request, RequestStatus, takes_output_from_elsewhere
from pagedserve.engine.request_group import Pending, RequestGroup
from pagedserve.engine.sampler import SamplerOutput, SamplingBatch, sample_hidden, score_tokens
from pagedserve.engine.scheduler import Scheduler
from pagedserve.engine.spec_decode.proposer import Proposer
from pagedserve.engine.spec_decode.stats import SpecDecodeStats
from pagedserve.engine.spec_decode.verifier import roll_back, verify
from pagedserve.engine.stats import EngineStats
from pagedserve.engine.structured_output import GrammarCompiler, GrammarLimits, advance
from pagedserve.lora_request import LoRARequest
from pagedserve.model.checkpoints import checkpoint_kernel
from pagedserve.model.kv_cache_dtype import resolve_kv_format
from pagedserve.model.loader import is_gguf, load_model
from pagedserve.model.lora import LoRAAdapter
from pagedserve.model.models import family
from pagedserve.model.quant import QUANTIZATIONS
from pagedserve.model.quant_linear import (
    quant_kernel,
    quantized_bytes,
    resolve_quantization,
    w8a8_basis,
)
from pagedserve.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.speculative_config import SpeculativeConfig

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str) -> torch.dtype:
    """`auto`: bf16 where oneDNN runs it natively (AVX-512, AVX-512 BF16, AMX: a decode step about 2x faster
    than fp32), else fp32 (on an AVX2-only CPU a 64x576x1536 bf16 matmul is ~8x slower than fp32)."""
    if name != "auto":
        return DTYPES[name]
    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, or the template itself when it names no file but reads as Jinja."""
    path = Path(value)
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template")


def _attach_matcher(req: Request, template: Any) -> None:
    req.matcher = template.deep_copy()


def _attach_lora(req: Request, adapter: LoRAAdapter) -> None:
    """The request runs under adapter; its KV is cached under the adapter's identity, never shared."""
    req.lora = adapter
    req.cache_salt = adapter.cache_key if req.cache_salt is None else f"{req.cache_salt}|{adapter.cache_key}"


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.dtype = resolve_dtype(config.dtype)
        t0 = time.perf_counter()
        if config.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {config.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        self.quantization = resolve_quantization(config.quantization, is_gguf(config.model), self.dtype)
        loaded = load_model(config.model, self.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        if config.chat_template is not None:
            self.tokenizer.chat_template = read_chat_template(config.chat_template)
        self.model_name = loaded.config.name
        self.eos_token_ids = loaded.config.eos_token_ids or self.tokenizer.eos_token_ids
        self.family = family(loaded.config.family)
        model = self.family.model_class()(loaded.config, loaded.weights.pop("rope_freqs", None))
        checkpoint = {"quantization": loaded.checkpoint_scheme, "quant_kernel": checkpoint_kernel(loaded.weights, self.dtype)}
        model.load_weights(loaded.weights)
        if self.quantization in ("int8", "int4"):
            model.quantize_linears(self.quantization, hadamard=w8a8_basis(self.quantization, self.dtype))
        model.to(self.dtype).eval()
        # tensor parallelism: the workers start and this process keeps rank 0's part of the model
        check_parallel(config)
        self.workers = Workers(config, model) if config.tensor_parallel_size > 1 else None
        self.weight_bytes = quantized_bytes(model)
        self.weights_info = {"dtype": str(self.dtype).removeprefix("torch."), "quantization": self.quantization,
                             "quant_kernel": quant_kernel(self.quantization, self.dtype),
                             "weight_bytes": self.weight_bytes}
        if loaded.checkpoint_scheme != "none":  # a quantized checkpoint runs as stored (model/checkpoints/)
            self.weights_info |= checkpoint
        self.kv_format = resolve_kv_format(config.kv_cache_dtype, self.dtype)
        self.spec_config = SpeculativeConfig.parse(config.speculative_config)
        if self.spec_config is not None and self.kv_format.int4:
            raise ValueError("speculative decoding is not supported with --kv-cache-dtype int4 (a block's keys are "
                             "quantized as it fills, rejected proposals' keys included); supported: every other")
        self.proposer = (Proposer(self.spec_config, self.dtype, config.block_size, loaded.config.vocab_size,
                                  config.max_num_seqs) if self.spec_config is not None else None)
        self.spec_stats = SpecDecodeStats(self.spec_config.method) if self.spec_config is not None else None
        pool_bytes = parse_size(config.kv_cache_memory) - ModelRunner.fixed_bytes(
            loaded.config, self.kv_format, config.block_size, config.max_num_seqs)
        num_blocks = pool_bytes // ModelRunner.bytes_per_block(loaded.config, self.kv_format, config.block_size)
        if num_blocks < 1:
            tails = " beside int4's key tails (one per --max-num-seqs seat)" if self.kv_format.int4 else ""
            raise ValueError(f"--kv-cache-memory {config.kv_cache_memory} holds not even one KV block{tails}")
        groups = kv_cache_groups(loaded.config.layer_windows)
        self.max_model_len = self._fit_context(self._one_request_tokens(num_blocks, groups))
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                 [g.window for g in groups])
        runner_cls = ModelRunner if self.workers is None else partial(ParallelModelRunner, self.workers)
        self.runner = runner_cls(model, loaded.config, self.kv_format, num_blocks, config.block_size,
                                  use_kernel=config.attention_backend == "cpp",
                                  calibration_ids=self.tokenizer.encode(CALIBRATION_TEXT),
                                  max_num_seqs=config.max_num_seqs,
                                  max_loras=config.max_loras if config.enable_lora else 0)
        if self.runner.tails is not None:  # a freed, partly written block gives back its int4 key tail
            self.kv.on_release = self.runner.tails.release
        self.weights_info.update(kv_cache_dtype=self.kv_format.name, kv_cache_blocks=num_blocks,
                                 kv_cache_tokens=num_blocks * config.block_size, kv_cache_groups=len(groups),
                                 kv_cache_sliding_groups=sum(g.window is not None for g in groups))
        self.kv_transfer = KVTransfer(self.kv, self.runner)  # leases and imports of KV blocks (disaggregation)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preemption_protect_after, config.priority_preemption_delay,
                                   config.max_loras, config.max_prefill_tokens_beside_decodes or None)
        self.grammars = GrammarCompiler(self.tokenizer, loaded.config.vocab_size, GrammarLimits.from_config(config))
        self.loras = (LoRAManager(loaded.config, self.dtype, config.max_lora_rank, config.max_cpu_loras)
                      if config.enable_lora else None)
        self.pending: list[Pending] = []  # requests waiting for their grammar or adapter, prepared off this thread
        self.held: dict[str, Request] = {}  # requests whose prompt's KV is on its way (add_request(hold=True))
        self.groups: dict[str, RequestGroup] = {}
        self.seqs: dict[str, tuple[RequestGroup, int]] = {}
        self.rng = random.Random(config.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        logger.info("loaded %s (%s, quantization %s, weights %.1f MB resident) in %.1fs: %d KV blocks of %d "
                    "tokens in %s (%d tokens), max_model_len %d", self.model_name, self.dtype, self.weights_info["quantization"],
                    self.weight_bytes / 1e6, time.perf_counter() - t0, num_blocks, config.block_size,
                    self.kv_format.name, num_blocks * config.block_size, self.max_model_len)

    def _one_request_tokens(self, num_blocks: int, groups: list[KVCacheGroup]) -> int:
        """The longest sequence the pool holds alone: every full group holds all its blocks, each sliding group
        at most its window and one step's chunk."""
        bs = self.config.block_size
        full = sum(g.window is None for g in groups)
        sliding = [-(-(g.window + self.config.max_num_batched_tokens) // bs) + 1 for g in groups if g.window is not None]
        if not sliding:
            return num_blocks * bs
        short = min(num_blocks // len(groups), min(sliding))  # short enough for the sliding groups to hold all
        if not full:
            return self.model_config.max_position_embeddings if num_blocks >= sum(sliding) else short * bs
        return max(short, (num_blocks - sum(sliding)) // full) * bs

    def _fit_context(self, pool_tokens: int) -> int:
        """The context length: the model's (or the configured cap), but never more than the KV pool holds,
        so that any request the context admits can run (as vLLM caps it, with a warning)."""
        model_len = self.model_config.max_position_embeddings
        wanted = min(self.config.max_model_len or model_len, model_len)
        self.context_note = ""
        if wanted <= pool_tokens:
            return wanted
        self.context_note = " (all the KV pool holds; raise --kv-cache-memory for more)"
        logger.warning("the KV pool (--kv-cache-memory %s) holds %d tokens, fewer than max_model_len %d: "
                       "capping max_model_len to %d; raise --kv-cache-memory for longer contexts",
                       self.config.kv_cache_memory, pool_tokens, wanted, pool_tokens)
        return pool_tokens

    # -- requests ------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None,
                    output_token_ids: list[int] | None = None, hold: bool = False) -> RequestOutput | None:
        """output_token_ids: tokens already generated for this request elsewhere (a disaggregated request's
        first token, sampled by its prefill worker): the request goes on after them, and the output they make
        (finished, if one of them ends it) is returned at once. hold: the request waits outside the scheduler
        until release_held(request_id), while its prompt's KV blocks are still on their way."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_request is not None and self.loras is None:
            raise ValueError("this engine does not serve LoRA adapters (enable_lora / --enable-lora)")
        text, ids = (None, list(prompt)) if isinstance(prompt, list) else (prompt, self.tokenizer.encode(prompt))
        params = self._validated(ids, params)
        if output_token_ids is not None:
            self._check_resumable(ids, params, output_token_ids)
        waits = []
        if params.guided_decoding is not None:
            waits.append((self.grammars.submit(params.guided_decoding), _attach_matcher))
        if lora_request is not None:
            waits.append((self.loras.submit(lora_request), _attach_lora))
        for future, _ in waits:
            if future.done():
                future.result()  # what failed at once (an invalid spec) raises here, before the request exists
        seed = params.seed if params.seed is not None else self.rng.getrandbits(63)
        group = RequestGroup(request_id, text, ids)
        self.groups[request_id] = group
        req = Request(request_id, ids, params, time.monotonic(), seed, priority, cache_salt=cache_salt,
                      eos_token_ids=self.eos_token_ids, pending_children=params.n - 1, held=hold)
        self.prompt_tokens_total += len(ids)
        self._register_seq(group, req)
        for token in output_token_ids or []:
            if not req.is_finished:
                self._accept(group, req, 0, token)
        if req.is_finished:
            return self._output(group)
        if all(future.done() for future, _ in waits):
            for future, attach in waits:
                attach(req, future.result())
            self._schedule(req)
        else:  # prepared off this thread: the request joins the scheduler once all is ready
            self.pending.append(Pending(group, req, waits))
        return self._output(group) if output_token_ids else None

    def _check_resumable(self, ids: list[int], params: SamplingParams, output_token_ids: list[int]) -> None:
        """Output generated elsewhere is taken for a plain single sample only: what it lacks here (its logprobs,
        a grammar's state, siblings) would be wrong."""
        if not takes_output_from_elsewhere(params):
            raise ValueError("output generated elsewhere is taken only for n=1 without logprobs, prompt_logprobs "
                             "or guided decoding")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in output_token_ids):
            raise ValueError(f"output token ids must be in [0, {vocab})")
        if len(output_token_ids) > params.max_tokens:
            raise ValueError(f"{len(output_token_ids)} output tokens given; max_tokens is {params.max_tokens}")

    def _schedule(self, req: Request) -> None:
        """Into the scheduler, or set aside while it is held."""
        if req.held:
            self.held[req.request_id] = req
        else:
            self.scheduler.add(req)

    def release_held(self, request_id: str) -> None:
        """A held request may run now (its prompt's KV arrived, or will be recomputed); no-op once it is gone."""
        req = self.held.pop(request_id, None)
        if req is not None:
            req.held = False
            self.scheduler.add(req)
        elif (seq := self.seqs.get(request_id)) is not None:  # still waiting for its adapter
            seq[0].seqs[seq[1]].held = False

    def _validated(self, ids: list[int], params: SamplingParams) -> SamplingParams:
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be in [0, {vocab})")
        if any(t >= vocab for t in params.logit_bias or ()):
            raise ValueError(f"logit_bias token ids must be in [0, {vocab})")
        if params.seed is not None and not -2**63 <= params.seed < 2**63:
            raise ValueError("seed must fit in a signed 64-bit integer")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                             f"{self.max_model_len} tokens{self.context_note}, including the output")
        if params.max_tokens is None:
            params = replace(params, max_tokens=self.max_model_len - len(ids))
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"this model's maximum context length is {self.max_model_len} tokens{self.context_note}, "
                             f"but {total} were requested ({len(ids)} in the prompt, {params.max_tokens} to "
                             "generate)")
        return params

    def _register_seq(self, group: RequestGroup, req: Request) -> None:
        p = req.params
        group.seqs.append(req)
        group.detoks.append(IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens,
                                                   p.include_stop_str_in_output))
        self.seqs[req.request_id] = (group, len(group.seqs) - 1)

    def _add_seq(self, group: RequestGroup, req: Request, running: bool = False) -> None:
        self._register_seq(group, req)
        if running:
            self.scheduler.add_running(req)
        else:
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is None:
            return
        self.pending = [p for p in self.pending if p.group is not group]
        for seq in group.seqs:
            if not seq.is_finished:
                seq.finish_reason = "abort"
                self.scheduler.finish(seq)
            self.seqs.pop(seq.request_id, None)
            self.held.pop(seq.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.pending)

    def _admit_pending(self) -> list[RequestOutput]:
        """Schedules requests whose grammar and adapter are ready; fails those whose spec did not compile or
        whose adapter did not load. With nothing else to run, waits briefly rather than spinning."""
        if not self.scheduler.has_unfinished():
            concurrent.futures.wait([f for p in self.pending for f, _ in p.waits], timeout=0.05,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        failed, still = [], []
        for p in self.pending:
            error = next((f.exception() for f, _ in p.waits if f.done() and f.exception() is not None), None)
            if error is not None:
                failed.append(self._fail(p.group, str(error)))
            elif not all(f.done() for f, _ in p.waits):
                still.append(p)
            else:
                for future, attach in p.waits:
                    attach(p.req, future.result())
                self._schedule(p.req)
        self.pending = still
        return failed

    def _fail(self, group: RequestGroup, error: str) -> RequestOutput:
        self.groups.pop(group.request_id, None)
        for seq in group.seqs:
            seq.status, seq.finish_reason = RequestStatus.FINISHED, "abort"
            self.seqs.pop(seq.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, [], True, error=error)

    def stats(self) -> EngineStats:
        kv = self.kv.stats()
        adapters, nbytes = self.loras.resident() if self.loras is not None else (0, 0)
        return EngineStats(len(self.scheduler.running), self.scheduler.num_waiting, kv.blocks_total, kv.blocks_used,
                           kv.blocks_cached, kv.hit_tokens, kv.query_tokens, self.scheduler.num_preemptions,
                           self.prompt_tokens_total, self.generation_tokens_total,
                           dict(self.scheduler.preemptions), lora_adapters=adapters, lora_bytes=nbytes,
                           lora_loads=self.loras.loads if self.loras is not None else 0,
                           lora_evictions=self.loras.evictions if self.loras is not None else 0,
                           kv_leases=len(self.kv_transfer.leases), kv_leased_blocks=self.kv_transfer.pinned_blocks,
                           spec_decode=self.spec_stats.copy() if self.spec_stats is not None else None,
                           **self._expert_load())

    def _expert_load(self) -> dict:
        """Tokens per expert and load imbalance of a mixture-of-experts model; nothing for a dense one."""
        counts_of = getattr(self.runner.model, "expert_tokens", None)
        if counts_of is None:
            return {}
        counts = counts_of().double()  # [sparse layers, experts]
        mean = counts.mean(dim=1).clamp_min(1e-9)
        return {"expert_tokens": counts.sum(dim=0).long().tolist(),
                "expert_load_imbalance": float((counts.amax(dim=1) / mean).mean()) if counts.sum() else 0.0}

    # -- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        failed = self._admit_pending() if self.pending else []
        sched = self.scheduler.schedule()
        if not sched.scheduled:
            return failed
        batch = self.runner.prepare(sched.scheduled, self.kv.req_blocks)
        start = time.perf_counter()
        hidden = self.runner.execute(batch)
        if self.proposer is not None:
            self.proposer.record_step(sched.scheduled, time.perf_counter() - start)
        if batch.prompt_rows:
            self._score_prompts(batch, hidden)
        for req, n in sched.scheduled:
            req.num_computed_tokens += n
            if not req.spec_token_ids:  # else once its proposals are verified (spec_decode/verifier.py)
                self.kv.cache_full_blocks(req)
        rows, reqs = self._fork_children(batch.sample_rows, batch.sample_reqs)
        if not reqs:
            return failed
        touched: dict[str, RequestGroup] = {}
        if any(r.spec_token_ids for r in reqs):
            verify(reqs, rows, hidden, self.runner.compute_logits, self.grammars.fill_mask,
                   lambda seqs, out: self._process(seqs, out, touched))
            roll_back(reqs, self.kv, self.spec_stats)
        else:
            params = SamplingBatch.build(reqs, self.model_config.vocab_size, self.grammars.fill_mask(reqs))
            self._process(reqs, sample_hidden(hidden[rows], self.runner.compute_logits, params), touched)
        if self.proposer is not None:
            self.proposer.propose(reqs, self.scheduler.running, self.grammars.fill_mask)
        return failed + [self._output(g) for g in touched.values()]

    def _score_prompts(self, batch: BatchInputs, hidden: torch.Tensor) -> None:
        """Prompt logprobs of this step's prompt positions; a recomputed position (after preemption) is
        not scored twice. Logits are made a slice of rows at a time: a whole chunk's would be 2048 x vocab."""
        for req, row, rows in batch.prompt_rows:
            first = req.num_computed_tokens  # before this step's tokens are counted
            for at in range(0, rows, 256):
                take = min(256, rows - at)
                targets = req.all_token_ids[first + at + 1:first + at + 1 + take]
                if first + at + take < len(req.prompt_logprobs):
                    continue
                logits = self.runner.compute_logits(hidden[row + at:row + at + take])
                out = score_tokens(logits, torch.tensor(targets), req.params.prompt_logprobs)
                lp = _logprob_lists(out)
                for i, target in enumerate(targets):
                    if first + at + i + 1 == len(req.prompt_logprobs):
                        req.prompt_logprobs.append(self._logprob_entry(target, i, lp, req.params.prompt_logprobs))

    def _fork_children(self, rows: list[int], reqs: list[Request]) -> tuple[list[int], list[Request]]:
        """A request with n > 1 forks its siblings once its prompt is computed; they share its blocks."""
        out_rows, out_reqs = list(rows), list(reqs)
        for row, req in zip(rows, reqs):
            while req.pending_children:
                group, _ = self.seqs[req.request_id]
                index = req.params.n - req.pending_children
                req.pending_children -= 1
                child = Request(f"{req.request_id}#{index}", req.prompt_token_ids, req.params, req.arrival_time,
                                hash((req.seed, index)) & (2**63 - 1), req.priority, parent_id=req.request_id,
                                index=index, cache_salt=req.cache_salt, eos_token_ids=req.eos_token_ids,
                                matcher=req.matcher.deep_copy() if req.matcher is not None else None, lora=req.lora)
                forked = self.kv.fork(req, child.request_id)
                if forked is None:  # no block for the copy-on-write tail: recompute (mostly prefix-cache hits)
                    self._add_seq(group, child)
                    continue
                self.runner.copy_blocks(forked.copies)
                child.num_computed_tokens = req.num_computed_tokens
                self._add_seq(group, child, running=True)
                out_rows.append(row)
                out_reqs.append(child)
        return out_rows, out_reqs

    def _process(self, reqs: list[Request], out: SamplerOutput, touched: dict[str, RequestGroup]) -> None:
        tokens = out.token_ids.tolist()
        lp = _logprob_lists(out)
        for i, (req, token) in enumerate(zip(reqs, tokens)):
            group, index = self.seqs[req.request_id]
            self.generation_tokens_total += 1
            if req.logprobs is not None:
                req.logprobs.append(self._logprob_entry(token, i, lp, req.params.logprobs))
            self._accept(group, req, index, token)
            touched[group.request_id] = group

    def _accept(self, group: RequestGroup, req: Request, index: int, token: int) -> None:
        """A sampled token joins the sequence: detokenized, checked against stops, grammar and length."""
        req.append_token(token)
        stop_str = group.detoks[index].add_token(token)
        self._check_finished(req, token, stop_str, advance(req, token) if req.matcher is not None else None)

    def _check_finished(self, req: Request, token: int, stop_str: str | None, grammar_end: str | None) -> None:
        p = req.params
        if grammar_end == "length":  # the grammar engine hit a limit: the output so far is a valid prefix, cut
            req.finish_reason = "length"
        elif stop_str is not None:
            req.finish_reason, req.stop_reason = "stop", stop_str
        elif req.num_output_tokens >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)):
            req.finish_reason = "stop"
            req.stop_reason = token if token in p.stop_token_ids else None
        elif grammar_end is not None:  # the grammar is complete and admits no further token
            req.finish_reason = "stop"
        elif req.num_output_tokens >= req.max_tokens:
            req.finish_reason = "length"
        if req.finish_reason is not None:
            self.scheduler.finish(req)

    def _logprob_entry(self, token: int, i: int, lp: dict, k: int) -> dict[int, Logprob]:
        entry = {token: Logprob(lp["sampled"][i], lp["ranks"][i], self.tokenizer.decode([token], False))}
        for rank, (tid, value) in enumerate(zip(lp["top_ids"][i][:k], lp["top_lps"][i][:k]), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, rank, self.tokenizer.decode([tid], False))
        return entry

    def _output(self, group: RequestGroup) -> RequestOutput:
        finished = group.finished
        outputs = []
        for seq, detok in sorted(zip(group.seqs, group.detoks), key=lambda sd: sd[0].index):
            outputs.append(CompletionOutput(seq.index, detok.output_text(seq.is_finished), list(seq.output_token_ids),
                                            seq.logprobs, seq.finish_reason, seq.stop_reason))
        if finished:
            self.groups.pop(group.request_id, None)
            for seq in group.seqs:
                self.seqs.pop(seq.request_id, None)
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outputs, finished,
                             group.seqs[0].num_cached_tokens, prompt_logprobs=group.seqs[0].prompt_logprobs)


def _logprob_lists(out: SamplerOutput) -> dict:
    if out.logprobs is None:
        return {}
    return {
        "sampled": out.logprobs.tolist(),
        "ranks": out.ranks.tolist(),
        "top_ids": out.top_ids.tolist() if out.top_ids is not None else [[] for _ in out.logprobs],
        "top_lps": out.top_logprobs.tolist() if out.top_logprobs is not None else [[] for _ in out.logprobs],
    }
