// Every decoder layer of a pure decode step in one call, for a model whose linears are quantized (gguf, int8,
// int4) and computed in bf16 with our kernels. The Python layers make about ten calls into the extension per
// layer (norms, linears, rope + cache write, attention, SiLU) plus the module machinery around them: at one
// sequence that overhead was ~1.7 of 7.4 ms per token (30 layers). Here the same kernels run in the same
// order on the same arguments, so the result is the one the Python layers give, bit for bit; decode_stack.py
// decides when a step qualifies (no LoRA, no prefill rows, no batch the Python layers would dequantize for).
#include <torch/extension.h>

#include <vector>

#include "ops.h"

namespace {

struct QuantLinear {
  torch::Tensor qweight, scales;
  c10::optional<torch::Tensor> mins;
  int64_t bits, group, hadamard;  // hadamard > 0: int8 weights in that basis, run W8A8 (quant_gemm_w8a8.cpp)
};

struct Layer {
  torch::Tensor input_norm, post_norm;
  QuantLinear qkv, o, gate_up, down;
};

// path: the integer kernel's path (quant_gemm.cpp); calls of amx_min_rows rows or more take the AMX tiles.
torch::Tensor linear(const torch::Tensor& x, const QuantLinear& w, c10::optional<torch::Tensor> residual, int64_t path,
                     int64_t amx_min_rows) {
  const torch::Tensor xc = x.contiguous();
  if (w.hadamard) return quant_linear_w8a8(xc, w.qweight, w.scales, w.hadamard, residual);
  if (xc.size(0) >= amx_min_rows) return quant_linear_amx(xc, w.qweight, w.scales, w.mins, w.bits, w.group, residual);
  return quant_linear(xc, w.qweight, w.scales, w.mins, w.bits, w.group, path, residual);
}

std::vector<QuantLinear> quant_linears(const std::vector<torch::Tensor>& qweights, const std::vector<torch::Tensor>& scales,
                                       const std::vector<c10::optional<torch::Tensor>>& mins,
                                       const std::vector<int64_t>& bits, const std::vector<int64_t>& groups,
                                       const std::vector<int64_t>& hadamards) {
  TORCH_CHECK(qweights.size() == 4 && scales.size() == 4 && mins.size() == 4 && bits.size() == 4 &&
              groups.size() == 4 && hadamards.size() == 4, "a layer has four linears: qkv, o, gate_up, down");
  std::vector<QuantLinear> l;
  for (int i = 0; i < 4; ++i) l.push_back({qweights[i], scales[i], mins[i], bits[i], groups[i], hadamards[i]});
  return l;
}

// A Gemma 3 layer: four (1 + w) norms around attention and the MLP, QK-norm, and its window (0: global).
struct GemmaLayer {
  torch::Tensor input_norm, post_attention_norm, pre_feedforward_norm, post_feedforward_norm, q_norm, k_norm;
  QuantLinear qkv, o, gate_up, down;
  int64_t window;
};

}  // namespace

class DecodeStack {
 public:
  // path: the integer kernel's path (quant_gemm.cpp); calls of amx_min_rows rows or more take the AMX tiles.
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t path,
              int64_t amx_min_rows)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        path_(path), amx_min_rows_(amx_min_rows) {}

  // One layer's norms and its four linears (qkv, o, gate_up, down), each as (qweight, scales, mins, bits, group,
  // hadamard).
  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, std::vector<torch::Tensor> qweights,
                 std::vector<torch::Tensor> scales, std::vector<c10::optional<torch::Tensor>> mins,
                 std::vector<int64_t> bits, std::vector<int64_t> groups, std::vector<int64_t> hadamards) {
    const auto l = quant_linears(qweights, scales, mins, bits, groups, hadamards);
    layers_.push_back({input_norm, post_norm, l[0], l[1], l[2], l[3]});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Tensor parallelism: this rank's layers hold its heads and MLP columns, and all_reduce (its collective, called
  // with the GIL forward holds) sums the o and down partial products before the residual joins, as
  // distributed/parallel_layers.py's RowParallelLinear does.
  void set_all_reduce(py::object all_reduce) { all_reduce_ = std::move(all_reduce); }

  // x [B, hidden] bf16 (the embeddings) -> the last layer's output; one KV cache (and its optional scales) per
  // layer. int4 KV: the step's key plan (key_rows, completions), each layer's key tails and key offsets, and the
  // tail of each block.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                        std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                        std::vector<c10::optional<torch::Tensor>> k_scales,
                        std::vector<c10::optional<torch::Tensor>> v_scales, c10::optional<torch::Tensor> key_rows,
                        c10::optional<torch::Tensor> completions, std::vector<c10::optional<torch::Tensor>> k_tails,
                        std::vector<c10::optional<torch::Tensor>> k_offsets,
                        c10::optional<torch::Tensor> tail_of_block) const {
    const size_t n = layers_.size();
    TORCH_CHECK(k_caches.size() == n && v_caches.size() == n && k_scales.size() == n && v_scales.size() == n &&
                k_tails.size() == n && k_offsets.size() == n, "one KV cache per layer");
    const bool int4 = key_rows.has_value();
    TORCH_CHECK(!int4 || (completions && tail_of_block), "int4 KV needs the key plan and the blocks' tails");
    const int64_t q_size = num_heads_ * head_dim_;
    for (size_t i = 0; i < n; ++i) {
      const Layer& layer = layers_[i];
      torch::Tensor qkv = linear(rms_norm(x, layer.input_norm, eps_), layer.qkv, c10::nullopt);
      if (int4) {
        TORCH_CHECK(k_scales[i] && v_scales[i] && k_tails[i] && k_offsets[i],
                    "int4 KV needs its parameters, key tails and key offsets");
        rope_and_cache_int4(qkv, cos, sin, k_caches[i], v_caches[i], *k_scales[i], *v_scales[i], *k_tails[i],
                            *k_offsets[i], slot_mapping, *key_rows, *completions, block_size, num_heads_, num_kv_heads_);
      } else {
        rope_and_cache(qkv, cos, sin, k_caches[i], v_caches[i], k_scales[i], v_scales[i], slot_mapping, num_heads_,
                       num_kv_heads_);
      }
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads_, head_dim_});
      const torch::Tensor o = paged_decode_attention(q, k_caches[i], v_caches[i], k_scales[i], v_scales[i],
                                                     block_tables, context_lens, block_size, scale_, k_tails[i],
                                                     int4 ? tail_of_block : c10::nullopt, 0);
      x = row_linear(o.flatten(1), layer.o, x);
      const torch::Tensor h = silu_and_mul(linear(rms_norm(x, layer.post_norm, eps_), layer.gate_up, c10::nullopt));
      x = row_linear(h, layer.down, x);
    }
    return x;
  }

 private:
  torch::Tensor linear(const torch::Tensor& x, const QuantLinear& w, c10::optional<torch::Tensor> residual) const {
    return ::linear(x, w, residual, path_, amx_min_rows_);
  }

  // residual + x w^T, summed over the ranks first when there are several
  torch::Tensor row_linear(const torch::Tensor& x, const QuantLinear& w, const torch::Tensor& residual) const {
    if (all_reduce_.is_none()) return linear(x, w, residual);
    return residual + all_reduce_(linear(x, w, c10::nullopt)).cast<torch::Tensor>();
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t path_, amx_min_rows_;
  std::vector<Layer> layers_;
  py::object all_reduce_ = py::none();
};

// Gemma 3's decoder layers (models/gemma3.py's kernel path, op for op): bf16 KV caches or fp8 / int8 (no int4: a
// hybrid cache refuses it). Each layer reads its KV cache group's slots and tables and its own RoPE tables (sliding
// layers: the local base).
class GemmaDecodeStack {
 public:
  GemmaDecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t path,
                   int64_t amx_min_rows)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        path_(path), amx_min_rows_(amx_min_rows) {}

  // norms: input, post-attention, pre-feedforward, post-feedforward, q, k (each 1 + w, float32); then the four
  // linears as DecodeStack takes them.
  void add_layer(std::vector<torch::Tensor> norms, int64_t window, std::vector<torch::Tensor> qweights,
                 std::vector<torch::Tensor> scales, std::vector<c10::optional<torch::Tensor>> mins,
                 std::vector<int64_t> bits, std::vector<int64_t> groups, std::vector<int64_t> hadamards) {
    TORCH_CHECK(norms.size() == 6, "a Gemma layer has six norms");
    const auto l = quant_linears(qweights, scales, mins, bits, groups, hadamards);
    layers_.push_back({norms[0], norms[1], norms[2], norms[3], norms[4], norms[5], l[0], l[1], l[2], l[3], window});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [B, hidden] bf16 (the scaled embeddings) -> the last layer's output. Per layer: its group's slot mapping,
  // block tables and context lengths (a sliding group's tables start at the window's first block) and its KV cache.
  torch::Tensor forward(torch::Tensor x, torch::Tensor cos_global, torch::Tensor sin_global, torch::Tensor cos_local,
                        torch::Tensor sin_local, std::vector<torch::Tensor> slot_mappings,
                        std::vector<torch::Tensor> block_tables, std::vector<torch::Tensor> context_lens,
                        int64_t block_size, std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches,
                        std::vector<c10::optional<torch::Tensor>> k_scales,
                        std::vector<c10::optional<torch::Tensor>> v_scales) const {
    const size_t n = layers_.size();
    TORCH_CHECK(slot_mappings.size() == n && block_tables.size() == n && context_lens.size() == n &&
                k_caches.size() == n && v_caches.size() == n && k_scales.size() == n && v_scales.size() == n,
                "one KV cache, slot mapping and block table per layer");
    const int64_t q_size = num_heads_ * head_dim_;
    for (size_t i = 0; i < n; ++i) {
      const GemmaLayer& layer = layers_[i];
      torch::Tensor qkv = linear(gemma_rms_norm(x, layer.input_norm, eps_, c10::nullopt), layer.qkv, c10::nullopt,
                                 path_, amx_min_rows_);
      gemma_qk_norm(qkv, layer.q_norm, layer.k_norm, num_heads_, num_kv_heads_, eps_);
      rope_and_cache(qkv, layer.window ? cos_local : cos_global, layer.window ? sin_local : sin_global, k_caches[i],
                     v_caches[i], k_scales[i], v_scales[i], slot_mappings[i], num_heads_, num_kv_heads_);
      const torch::Tensor q = qkv.narrow(1, 0, q_size).view({-1, num_heads_, head_dim_});
      const torch::Tensor o = paged_decode_attention(q, k_caches[i], v_caches[i], k_scales[i], v_scales[i],
                                                     block_tables[i], context_lens[i], block_size, scale_, c10::nullopt,
                                                     c10::nullopt, layer.window);
      const torch::Tensor a = linear(o.flatten(1), layer.o, c10::nullopt, path_, amx_min_rows_);
      x = gemma_rms_norm(a, layer.post_attention_norm, eps_, x);
      const torch::Tensor h = gelu_tanh_and_mul(linear(gemma_rms_norm(x, layer.pre_feedforward_norm, eps_, c10::nullopt),
                                                       layer.gate_up, c10::nullopt, path_, amx_min_rows_));
      x = gemma_rms_norm(linear(h, layer.down, c10::nullopt, path_, amx_min_rows_), layer.post_feedforward_norm, eps_, x);
    }
    return x;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  int64_t path_, amx_min_rows_;
  std::vector<GemmaLayer> layers_;
};

void register_decode_stack(py::module& m) {
  py::class_<GemmaDecodeStack>(m, "GemmaDecodeStack", "every Gemma 3 decoder layer of a pure decode step")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("path"),
           py::arg("amx_min_rows"))
      .def("add_layer", &GemmaDecodeStack::add_layer)
      .def("num_layers", &GemmaDecodeStack::num_layers)
      .def("forward", &GemmaDecodeStack::forward);
  py::class_<DecodeStack>(m, "DecodeStack", "every decoder layer of a pure decode step over quantized linears")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t>(), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("path"),
           py::arg("amx_min_rows"))
      .def("add_layer", &DecodeStack::add_layer)
      .def("set_all_reduce", &DecodeStack::set_all_reduce)
      .def("num_layers", &DecodeStack::num_layers)
      .def("forward", &DecodeStack::forward);
}
