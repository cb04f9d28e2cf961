#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, c10::optional<torch::Tensor> k_tail,
                                     c10::optional<torch::Tensor> tail_of_block);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                    torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads);
void rope_and_cache_int4(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor k_params, torch::Tensor v_params, torch::Tensor k_tail,
                         torch::Tensor slot_mapping, torch::Tensor key_rows, torch::Tensor completions,
                         int64_t block_size, int64_t num_heads, int64_t num_kv_heads);

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

bool prefill_attention_available();
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, torch::Tensor spans,
                       torch::Tensor block_tables, int64_t block_size, double scale, torch::Tensor out,
                       c10::optional<torch::Tensor> k_tail, c10::optional<torch::Tensor> tail_of_block);

void lora_sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor index, torch::Tensor seg_starts, torch::Tensor seg_slots,
               torch::Tensor a, torch::Tensor b);

void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask);

void register_decode_stack(py::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_stack(m);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_tail") = py::none(),
        py::arg("tail_of_block") = py::none());
  m.def("prefill_attention_available", &prefill_attention_available, "whether this CPU build has prefill_attention");
  m.def("prefill_attention", &prefill_attention, "causal bf16 attention of all prefill spans over the paged KV pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("spans"),
        py::arg("block_tables"), py::arg("block_size"), py::arg("scale"), py::arg("out"),
        py::arg("k_tail") = py::none(), py::arg("tail_of_block") = py::none());
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] bf16 projection");
  m.def("quant_paths", &quant_paths, "quantized-matmul paths built for this CPU (0 scalar, 1 AVX2, 2 AVX-512 VNNI)");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ residual) over planar int8/int4 weights, activations quantized per 32",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group"),
        py::arg("path"), py::arg("residual") = py::none());
  m.def("quant_amx_available", &quant_amx_available, "whether this build and process can run AMX tiles");
  m.def("quant_linear_amx", &quant_linear_amx, "bf16 x @ W^T (+ residual) over planar weights on AMX tiles",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group"),
        py::arg("residual") = py::none());
  m.def("quant_dequantize", &quant_dequantize, "planar int8/int4 weights as a float matrix");
  m.def("lora_sgmv", &lora_sgmv, "y[rows] += x[rows] @ A^T @ B of each row's adapter slot (batched LoRA)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "mask fp32 logits rows in place by packed grammar bitmasks");
  m.def("rope_and_cache", &rope_and_cache, "rotate q and k in place and write k, v into the paged caches");
  m.def("rope_and_cache_int4", &rope_and_cache_int4, "rotate q and k in place and write k, v into an int4 pool");
}
