// The extension's operations, as the files that define them export them: declared once for bindings.cpp and
// for the C++ callers that chain them (decode_stack.cpp).
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, c10::optional<torch::Tensor> k_tail,
                                     c10::optional<torch::Tensor> tail_of_block, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
torch::Tensor gemma_rms_norm(torch::Tensor x, torch::Tensor scale, double eps, c10::optional<torch::Tensor> residual);
void gemma_qk_norm(torch::Tensor qkv, torch::Tensor q_scale, torch::Tensor k_scale, int64_t num_heads,
                   int64_t num_kv_heads, double eps);
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up);
void rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                    torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads);
void rope_and_cache_int4(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor k_params, torch::Tensor v_params, torch::Tensor k_tail,
                         torch::Tensor k_offset, torch::Tensor slot_mapping, torch::Tensor key_rows,
                         torch::Tensor completions, int64_t block_size, int64_t num_heads, int64_t num_kv_heads);

std::vector<int64_t> quant_paths();
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t bits, int64_t group, int64_t path,
                           c10::optional<torch::Tensor> residual);
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                               int64_t bits, int64_t group, c10::ScalarType dtype);
bool quant_amx_available();
torch::Tensor quant_linear_amx(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                               c10::optional<torch::Tensor> mins, int64_t bits, int64_t group,
                               c10::optional<torch::Tensor> residual);
bool quant_w8a8_available();
torch::Tensor quant_linear_w8a8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t hadamard,
                                c10::optional<torch::Tensor> residual);

std::vector<int64_t> prefill_attention_paths();
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, torch::Tensor spans,
                       torch::Tensor block_tables, int64_t block_size, double scale, torch::Tensor out,
                       c10::optional<torch::Tensor> k_tail, c10::optional<torch::Tensor> tail_of_block, int64_t path,
                       int64_t window);

void lora_sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor index, torch::Tensor seg_starts, torch::Tensor seg_slots,
               torch::Tensor a, torch::Tensor b);

void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);
torch::Tensor greedy_argmax(torch::Tensor logits);

void register_decode_stack(py::module& m);
