// Per-group scales and mins of quantized weights (quant_gemm.cpp's planar layout), stored as fp32 (our int8
// and int4, and the K-quants, whose scales are products) or as fp16 (GGUF's own Q4_0 / Q4_1 / Q8_0 scales,
// kept as stored: each 32-block of 4 bits streams 20 bytes instead of 24). Kernels read a row at a time as fp32.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#if defined(__F16C__)
#include <immintrin.h>
#endif

// n fp16 values widened to fp32: 8 at a time with F16C (a row's conversion must cost little beside its blocks).
inline void widen_half(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct GroupParams {
  const float* scales32 = nullptr;
  const float* mins32 = nullptr;
  const c10::Half* scales16 = nullptr;
  const c10::Half* mins16 = nullptr;
  int64_t groups = 0;

  // Row r's scales and mins (nullptr when the format has none) as fp32: pointers into the tensors, or fp16
  // values widened into buf, which holds 2 * groups floats.
  void row(int64_t r, float* buf, const float*& s, const float*& m) const {
    if (scales32) {
      s = scales32 + r * groups;
      m = mins32 ? mins32 + r * groups : nullptr;
      return;
    }
    widen_half(scales16 + r * groups, buf, groups);
    s = buf;
    m = nullptr;
    if (mins16) {
      widen_half(mins16 + r * groups, buf + groups, groups);
      m = buf + groups;
    }
  }
};

// Checks what every kernel needs of scales [N, groups] and mins (like scales, or none): one float dtype, fp32
// or fp16, contiguous.
inline GroupParams group_params(const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins) {
  const auto dtype = scales.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kHalf) && scales.dim() == 2 && scales.is_contiguous(),
              "scales must be a contiguous fp32 or fp16 [N, K/group]");
  TORCH_CHECK(!mins || (mins->scalar_type() == dtype && mins->sizes() == scales.sizes() && mins->is_contiguous()),
              "mins must be like scales (same dtype and shape)");
  GroupParams p;
  p.groups = scales.size(1);
  if (dtype == torch::kFloat) {
    p.scales32 = scales.data_ptr<float>();
    p.mins32 = mins ? mins->data_ptr<float>() : nullptr;
  } else {
    p.scales16 = scales.data_ptr<c10::Half>();
    p.mins16 = mins ? mins->data_ptr<c10::Half>() : nullptr;
  }
  return p;
}
