#include <torch/extension.h>

#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_decode_stack(m);
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("block_size"), py::arg("scale"), py::arg("k_tail") = py::none(),
        py::arg("tail_of_block") = py::none(), py::arg("window") = 0);
  m.def("prefill_attention_paths", &prefill_attention_paths,
        "prefill attention paths built for this CPU (1 portable, 2 AVX-512 BF16, 3 AMX, 4 AMX emulated)");
  m.def("prefill_attention", &prefill_attention, "causal bf16 attention of all prefill spans over the paged KV pool",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("k_scale"), py::arg("v_scale"), py::arg("spans"),
        py::arg("block_tables"), py::arg("block_size"), py::arg("scale"), py::arg("out"),
        py::arg("k_tail") = py::none(), py::arg("tail_of_block") = py::none(), py::arg("path") = -1,
        py::arg("window") = 0);
  m.def("rms_norm", &rms_norm, "RMSNorm of bf16 rows");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of a fused [gate | up] bf16 projection");
  m.def("gemma_rms_norm", &gemma_rms_norm, "Gemma's RMSNorm of bf16 rows by 1 + w (fp32), optionally + residual",
        py::arg("x"), py::arg("scale"), py::arg("eps"), py::arg("residual") = py::none());
  m.def("gemma_qk_norm", &gemma_qk_norm, "Gemma's RMSNorm of each q and k head of a fused bf16 qkv, in place");
  m.def("gelu_tanh_and_mul", &gelu_tanh_and_mul, "gelu_tanh(gate) * up of a fused [gate | up] bf16 projection");
  m.def("quant_paths", &quant_paths, "quantized-matmul paths built for this CPU (0 scalar, 1 AVX2, 2 AVX-512 VNNI)");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ residual) over planar int8/int4 weights, activations quantized per 32",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group"),
        py::arg("path"), py::arg("residual") = py::none());
  m.def("quant_amx_available", &quant_amx_available, "whether this build and process can run AMX tiles");
  m.def("quant_linear_amx", &quant_linear_amx, "bf16 x @ W^T (+ residual) over planar weights on AMX tiles",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("bits"), py::arg("group"),
        py::arg("residual") = py::none());
  m.def("quant_w8a8_available", &quant_w8a8_available, "whether this build and process can run AMX int8 tiles");
  m.def("quant_linear_w8a8", &quant_linear_w8a8,
        "bf16 x @ W^T (+ residual) over per-channel int8 weights, x turned and quantized per token (AMX int8 tiles)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("hadamard"), py::arg("residual") = py::none());
  m.def("quant_dequantize", &quant_dequantize, "planar int8/int4 weights as a float matrix");
  m.def("lora_sgmv", &lora_sgmv, "y[rows] += x[rows] @ A^T @ B of each row's adapter slot (batched LoRA)");
  m.def("greedy_argmax", &greedy_argmax, "first index of each row's largest value (or first NaN), fp32 or bf16");
  m.def("apply_token_bitmask", &apply_token_bitmask, "mask fp32 logits rows in place by packed grammar bitmasks");
  m.def("rope_and_cache", &rope_and_cache, "rotate q and k in place and write k, v into the paged caches");
  m.def("rope_and_cache_int4", &rope_and_cache_int4, "rotate q and k in place and write k, v into an int4 pool");
}
