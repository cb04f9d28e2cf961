"""Owns the model and the KV pool; turns a scheduled batch into tensors and runs one forward pass."""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from pagedserve.engine.kv_cache import KVCacheGroup, held, kv_cache_groups
from pagedserve.engine.request import Request
from pagedserve.model.attention import AttentionMetadata, PrefillSpan
from pagedserve.model.kv_cache_dtype import KVFormat, LayerKVCache, hadamard, resolve_kv_format
from pagedserve.model.kv_int4 import KeyTails
from pagedserve.model.lora import LoRAAdapter, LoRABatch, LoRASlots
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.sliding_window import HybridMetadata, WindowMetadata, window_metadata


@dataclass(slots=True)
class BatchInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: list[int]  # row of the last computed token of each request that samples this step
    sample_reqs: list[Request]
    prompt_rows: list[tuple[Request, int, int]]  # (request, first row, rows) whose next prompt token is scored
    lora: LoRABatch | None = None  # rows per adapter; None when no request of the step has one


class ModelRunner:
    """The KV pool is one storage per place in a KV cache group (engine/kv_cache.py): a model whose layers all
    attend to everything is one group, each layer its own storage; a hybrid one (Gemma 3) has groups of a few
    layers, and each layer reads and writes the storage of its place in its group through its group's block
    tables, so one block id holds as many layers' KV as a group has, whichever group it serves."""

    def __init__(self, model: torch.nn.Module, config: ModelConfig, kv_format: KVFormat, num_blocks: int,
                 block_size: int, use_kernel: bool = True, calibration_ids: list[int] | None = None,
                 max_num_seqs: int = 64, max_loras: int = 0) -> None:
        model.use_fast_path(use_kernel)
        self.model = model
        self.use_kernel = use_kernel
        self.block_size = block_size
        self.kv_format = kv_format
        self.groups = kv_cache_groups(config.layer_windows)
        if len(self.groups) > 1 and kv_format.int4:
            raise ValueError("kv_cache_dtype int4 is not supported for models with sliding-window layers yet (its "
                             "key tails follow one block table per sequence); supported: bfloat16, float32, fp8, "
                             "fp8_e5m2, int8")
        self.group_of_layer = [0] * config.num_hidden_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.lora_slots = LoRASlots(config, max_loras, model.norm.weight.dtype) if max_loras else None
        # int4: a running sequence's partly written block keeps its keys in a bf16 tail until it fills
        self.tails = KeyTails(num_blocks, block_size, max_num_seqs) if kv_format.int4 else None
        heads, d = config.num_key_value_heads, config.head_dim
        self.storage = [LayerKVCache(kv_format, num_blocks * block_size, heads, d, block_size, self.tails)
                        for _ in self.groups[0].layers]
        self.kv_caches = [self.storage[0]] * config.num_hidden_layers
        for group in self.groups:
            for place, layer in enumerate(group.layers):
                self.kv_caches[layer] = (self.storage[place] if len(self.groups) == 1
                                         else sharing(self.storage[place], kv_format, heads, d, block_size))
        if kv_format.per_head_scale or kv_format.int4:
            self._calibrate(config, (calibration_ids or list(range(1, 257)))[:config.max_position_embeddings])

    @staticmethod
    def bytes_per_block(config: ModelConfig, kv_format: KVFormat, block_size: int) -> int:
        """A block id's bytes: one block of each layer of a KV cache group."""
        layers = len(kv_cache_groups(config.layer_windows)[0].layers)
        return layers * kv_format.block_bytes(block_size, config.num_key_value_heads, config.head_dim)

    @staticmethod
    def fixed_bytes(config: ModelConfig, kv_format: KVFormat, block_size: int, max_num_seqs: int) -> int:
        """What the pool holds beside its blocks: int4's bf16 key tails, one per running sequence."""
        if not kv_format.int4:
            return 0
        return config.num_hidden_layers * max_num_seqs * block_size * config.num_key_value_heads * config.head_dim * 2

    @torch.inference_mode()
    def _calibrate(self, config: ModelConfig, token_ids: list[int]) -> None:
        """One prefill of token_ids into a scratch cache in the model dtype. fp8: each layer's scales come from
        the largest |K| (in the Hadamard basis fp8 stores them in) and |V| per KV head it produced; int4: each
        layer's key offsets from the mean key."""
        scratch_fmt = resolve_kv_format("auto", self.model.norm.weight.dtype)
        n, bs = len(token_ids), self.block_size
        num_blocks = -(-n // bs)
        scratch = [LayerKVCache(scratch_fmt, num_blocks * bs, config.num_key_value_heads, config.head_dim)
                   for _ in range(config.num_hidden_layers)]
        table = list(range(num_blocks))
        # The scratch cache is in the model dtype: no int4 key tails to plan (its blocks are not the pool's).
        meta = self._metadata([(0, n, [table] * len(self.groups))], 0, plan_tails=False)
        self.model(torch.tensor(token_ids, dtype=torch.long), torch.arange(n, dtype=torch.long), scratch, meta, bs)
        for layer, s in zip(self.kv_caches, scratch):
            if self.kv_format.int4:
                layer.set_key_offset(s.k[:n].float().mean(dim=0))
                continue
            keys = s.k[:n].float()
            if self.kv_format.rotates_keys(config.head_dim):  # the keys fp8 will hold are in the Hadamard basis
                keys = hadamard(keys)
            layer.set_head_scales(keys.abs().amax(dim=(0, 2)), s.v[:n].float().abs().amax(dim=(0, 2)))

    def prepare(self, scheduled: list[tuple[Request, int]], block_tables: dict[str, list[list[int]]]) -> BatchInputs:
        """block_tables: each request's table per KV cache group (KVCacheManager.req_blocks)."""
        decodes = [(r, n) for r, n in scheduled if n == 1]
        prefills = [(r, n) for r, n in scheduled if n != 1]
        ids: list[int] = []
        positions: list[int] = []
        sample_rows, sample_reqs, prompt_rows = [], [], []
        lora_rows: dict[int, tuple[LoRAAdapter, list[range]]] = {}
        for req, n in decodes + prefills:
            start, first = len(ids), req.num_computed_tokens
            tokens = req.all_token_ids + req.spec_token_ids if req.spec_token_ids else req.all_token_ids
            ids += tokens[first:first + n]
            if req.lora is not None:
                part = lora_rows.setdefault(id(req.lora), (self.adapter_part(req.lora), []))
                part[1].append(range(start, start + n))
            positions += range(first, first + n)
            if first + n == req.num_tokens_with_spec:  # proposals: their rows end at sample_rows' (spec_decode/)
                sample_rows.append(start + n - 1)
                sample_reqs.append(req)
            scored = min(first + n, req.num_prompt_tokens - 1) - first  # positions whose next token is prompt
            if req.prompt_logprobs is not None and scored > 0:
                prompt_rows.append((req, start, scored))
        rows = [(r.num_computed_tokens, n, block_tables[r.request_id]) for r, n in decodes + prefills]
        return BatchInputs(torch.tensor(ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long),
                           self._metadata(rows, len(decodes)), sample_rows, sample_reqs, prompt_rows,
                           self.lora_slots.batch(list(lora_rows.values())) if lora_rows else None)

    def adapter_part(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """The weights of adapter this runner applies: all of them here, this rank's part under tensor
        parallelism (distributed/executor.py)."""
        return adapter

    def _metadata(self, rows: list[tuple[int, int, list[list[int]]]], num_decodes: int,
                  plan_tails: bool = True) -> AttentionMetadata | HybridMetadata:
        """rows: (first position, tokens, tables per group) per request, decodes first."""
        metas = [self._group_metadata([(first, n, tables[g]) for first, n, tables in rows], num_decodes, group,
                                      plan_tails) for g, group in enumerate(self.groups)]
        return metas[0] if len(metas) == 1 else HybridMetadata(metas, self.group_of_layer)

    def _group_metadata(self, rows: list[tuple[int, int, list[int]]], num_decodes: int, group: KVCacheGroup,
                        plan_tails: bool) -> AttentionMetadata | WindowMetadata:
        bs = self.block_size
        slots = [table[p // bs] * bs + p % bs for first, n, table in rows for p in range(first, first + n)]
        if group.window is not None:
            return window_metadata(rows, num_decodes, slots, group.window, bs)
        spans, start = [], 0
        for i, (first, n, table) in enumerate(rows):
            if i >= num_decodes:
                spans.append(PrefillSpan(start, n, first, torch.tensor(table[:-(-(first + n) // bs)], dtype=torch.long)))
            start += n
        meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long), num_decodes,
                                 *self._decode_tables(rows[:num_decodes]), spans, self.use_kernel)
        if self.tails is not None and plan_tails:
            meta.key_plan = self.tails.plan(slots)
        if spans:
            meta.prefill_spans = torch.tensor([[p.start, p.num_tokens, p.context_len] for p in spans], dtype=torch.long)
            meta.prefill_tables = torch.nn.utils.rnn.pad_sequence([p.block_table for p in spans], batch_first=True)
        return meta

    @staticmethod
    def _decode_tables(decodes: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        if not decodes:
            return torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        tables = [table for _, _, table in decodes]
        width = max(len(t) for t in tables)
        padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
        return padded, torch.tensor([first + 1 for first, _, _ in decodes], dtype=torch.long)

    @torch.inference_mode()
    def execute(self, batch: BatchInputs) -> torch.Tensor:
        """Runs the forward pass; returns the hidden states of every row."""
        return self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta, self.block_size, batch.lora)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        return self.model.compute_logits(hidden, upcast)

    def block_tensors(self, layer: LayerKVCache) -> list[tuple[torch.Tensor, int]]:
        """What a block holds in one layer, each with its rows per block: K and V, and their per-token scales
        (int8) or parameters (int4: per slot for values, per block for keys). Per-head scales (fp8) come from the
        same calibration on every worker, so they do not travel."""
        bs = self.block_size
        if self.kv_format.int4:
            return [(layer.k, bs), (layer.v, bs), (layer.k_scale, 1), (layer.v_scale, bs)]
        scales = [layer.k_scale, layer.v_scale] if self.kv_format.per_token_scale else []
        return [(t, bs) for t in [layer.k, layer.v, *scales]]

    @staticmethod
    def _rows(block_ids: list[int] | torch.Tensor, per_block: int) -> torch.Tensor:
        ids = torch.as_tensor(block_ids, dtype=torch.long)
        return (ids[:, None] * per_block + torch.arange(per_block)).flatten()

    @torch.inference_mode()
    def export_blocks(self, positions: list[tuple[int, ...]], out: torch.Tensor | None = None) -> memoryview:
        """The KV of these block positions (each KV cache group's block there, engine/kv_cache.py) as stored
        (quantized blocks at their quantized size), layer by layer, each layer's from its group's blocks; a
        sliding group's NULL_BLOCK travels as zeros. A view of the one buffer they were gathered into (a copy into
        bytes would cost as much again), out when given (uint8, of export_size bytes: a shared-memory segment).
        Only full blocks travel, so int4 keys are never in a tail."""
        out = self._payload(len(positions), out)
        self.gather_blocks(positions, out)
        return memoryview(out.numpy())

    def _payload(self, num_blocks: int, out: torch.Tensor | None) -> torch.Tensor:
        size = self.export_size(num_blocks)
        if out is None:
            return torch.empty(size, dtype=torch.uint8)
        if out.dtype != torch.uint8 or out.numel() != size:
            raise ValueError(f"an export of {num_blocks} blocks takes {size} bytes, not {out.numel()}")
        return out

    def gather_blocks(self, positions: list[tuple[int, ...]], out: torch.Tensor | None = None) -> list[torch.Tensor]:
        """What export_blocks sends, as one tensor per layer and block tensor ([positions x rows per block,
        heads, ...]); written one after another into out (uint8) when given."""
        ids, offset, pieces = self._group_ids(positions), 0, []
        for layer, group in zip(self.kv_caches, self.group_of_layer, strict=True):
            null = ids[group] < 0
            for t, per_block in self.block_tensors(layer):  # gathered straight into the payload: no concatenation
                rows = self._rows(ids[group].clamp(min=0), per_block)
                shape = (len(rows), *t.shape[1:])
                if out is None:
                    piece = torch.index_select(t, 0, rows)
                else:
                    size = t.element_size() * int(t[0].numel()) * len(rows)
                    piece = out[offset:offset + size].view(t.dtype).view(shape)
                    torch.index_select(t, 0, rows, out=piece)
                    offset += size
                if null.any():  # zeros, not whatever KV the given-back block holds now
                    piece.view(torch.uint8).view(len(positions), -1)[null] = 0
                pieces.append(piece)
        return pieces

    def export_size(self, num_blocks: int) -> int:
        return sum(t.element_size() * math.prod(self.wire_shape(t)) * per_block * num_blocks
                   for layer in self.kv_caches for t, per_block in self.block_tensors(layer))

    def wire_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """A row of block tensor t as a payload holds it: [KV heads, ...] (all of the model's, whoever stores them)."""
        return tuple(t.shape[1:])

    @torch.inference_mode()
    def import_blocks(self, positions: list[tuple[int, ...]], data: bytes | memoryview, num_blocks: int,
                      first: int = 0) -> None:
        """Writes block positions first..first+len(positions) of the num_blocks export_blocks put in data into
        these (each group's block; none where a sliding group's is NULL_BLOCK)."""
        if self.tails is not None:
            self.tails.release(held(positions))
        self.scatter_blocks(positions, self._pieces(data, num_blocks), first)

    def _pieces(self, data: bytes | memoryview, num_blocks: int) -> list[torch.Tensor]:
        """A payload of num_blocks positions as the pieces gather_blocks made (views, no copy)."""
        if len(data) != self.export_size(num_blocks):
            raise ValueError(f"KV data of {len(data)} bytes for {num_blocks} blocks; expected "
                             f"{self.export_size(num_blocks)} (another model, block size or KV format?)")
        with warnings.catch_warnings():  # read only, never written: no writable copy needed
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            raw, offset = torch.frombuffer(data, dtype=torch.uint8), 0
        pieces = []
        for layer in self.kv_caches:
            for t, per_block in self.block_tensors(layer):
                shape = self.wire_shape(t)
                size = t.element_size() * math.prod(shape) * per_block * num_blocks
                pieces.append(raw[offset:offset + size].view(stored(t.dtype)).view(per_block * num_blocks, *shape))
                offset += size
        return pieces

    def scatter_blocks(self, positions: list[tuple[int, ...]], pieces: list[torch.Tensor], first: int = 0) -> None:
        """Writes block positions first..first+len(positions) of pieces (gather_blocks' layout) into these."""
        ids, pieces = self._group_ids(positions), iter(pieces)
        for layer, group in zip(self.kv_caches, self.group_of_layer, strict=True):
            kept = (ids[group] >= 0).nonzero().flatten()
            for t, per_block in self.block_tensors(layer):
                rows = self._rows(ids[group][kept], per_block)
                piece = next(pieces).view(stored(t.dtype))
                chunk = piece.view(-1, per_block, *t.shape[1:])[first + kept].flatten(0, 1)
                t.view(stored(t.dtype)).index_copy_(0, rows, chunk)

    def _group_ids(self, positions: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Per KV cache group, its block id at each position."""
        ids = torch.tensor(positions, dtype=torch.long).reshape(len(positions), len(self.groups))
        return list(ids.T)

    def fork_tails(self, copies: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
        """int4: the key tails of copies' partly written source blocks, and the new ones of their copies."""
        return [self.tails.fork(src, dst) for src, dst in copies] if self.tails is not None else []

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]], tails: list[tuple[int, int] | None] | None = None) -> None:
        """tails: fork_tails(copies) as rank 0 made them, on a tensor-parallel worker."""
        tails = self.fork_tails(copies) if tails is None else tails
        for layer in self.storage:
            for src, dst in copies:
                layer.copy_block(src, dst, self.block_size)
            for pair in filter(None, tails):
                layer.copy_tail(*pair)


def sharing(storage: LayerKVCache, fmt: KVFormat, num_kv_heads: int, head_dim: int, block_size: int) -> LayerKVCache:
    """A layer's cache over another's blocks (its place in a KV cache group): K, V and their per-token scales are
    the storage's; per-layer calibration (fp8's head scales) stays its own."""
    layer = LayerKVCache(fmt, 0, num_kv_heads, head_dim, block_size)
    layer.k, layer.v = storage.k, storage.v
    if fmt.per_token_scale:
        layer.k_scale, layer.v_scale = storage.k_scale, storage.v_scale
    return layer


def stored(dtype: torch.dtype) -> torch.dtype:
    """The dtype to copy a KV tensor's bytes as: CPU index_copy_ has no fp8 kernel."""
    return torch.uint8 if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else dtype
