// Quantized KV cache rows (model/kv_cache_dtype.py): fp8 (e4m3 / e5m2) with a scale per KV head, int8 with a
// scale per token and KV head. Readers widen one cached row to fp32 in registers; writers quantize on the way in
// as the PyTorch reference does (x / scale, round half to even, saturate), but built with -ffast-math: a value
// within an ulp of a rounding boundary may land on the neighbouring code.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

enum class KVKind { kPlain, kFp8E4M3, kFp8E5M2, kInt8 };

inline KVKind kv_kind(const torch::Tensor& cache, const torch::Tensor& q) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn: return KVKind::kFp8E4M3;
    case torch::kFloat8_e5m2: return KVKind::kFp8E5M2;
    case torch::kChar: return KVKind::kInt8;
    default:
      TORCH_CHECK(cache.scalar_type() == q.scalar_type() || cache.scalar_type() == torch::kBFloat16,
                  "an unquantized cache must be in the model dtype or bfloat16");
      return KVKind::kPlain;
  }
}

// An fp8 code as fp32 by integer arithmetic the compiler vectorizes: the exponent rebiased to fp32's, the mantissa
// bits on top. Exact for normal values; subnormal codes (below 2^-6 (e4m3) or 2^-14 (e5m2) of the scale) become 0,
// as in the AVX-512 path.
template <KVKind K>
inline float fp8_to_float(uint8_t x) {
  constexpr int kMantissa = K == KVKind::kFp8E4M3 ? 3 : 2;
  constexpr uint32_t kRebias = K == KVKind::kFp8E4M3 ? 120 : 112;  // 127 - 7, 127 - 15
  constexpr uint32_t kExponentMask = K == KVKind::kFp8E4M3 ? 0x78 : 0x7C;
  const uint32_t magnitude = ((static_cast<uint32_t>(x & 0x7F) << (23 - kMantissa)) + (kRebias << 23));
  const uint32_t bits = (static_cast<uint32_t>(x & 0x80) << 24) | ((x & kExponentMask) ? magnitude : 0u);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Reads row (slot, head) of a quantized cache ([slots, KV, D] codes) as D floats.
struct QuantRowReader {
  KVKind kind;
  const uint8_t* codes;    // fp8 codes or int8 values
  const float* scales;     // [KV] (fp8) or [slots, KV] (int8)
  int64_t num_kv_heads;

  template <int D>
  inline void load(int64_t slot, int64_t head, float* __restrict__ out) const {
    const uint8_t* row = codes + (slot * num_kv_heads + head) * D;
    if (kind == KVKind::kInt8) {
      const float s = scales[slot * num_kv_heads + head];
      const int8_t* r = reinterpret_cast<const int8_t*>(row);
#pragma omp simd
      for (int i = 0; i < D; ++i) out[i] = static_cast<float>(r[i]) * s;
    } else if (kind == KVKind::kFp8E4M3) {
      const float s = scales[head];
#pragma omp simd
      for (int i = 0; i < D; ++i) out[i] = fp8_to_float<KVKind::kFp8E4M3>(row[i]) * s;
    } else {
      const float s = scales[head];
#pragma omp simd
      for (int i = 0; i < D; ++i) out[i] = fp8_to_float<KVKind::kFp8E5M2>(row[i]) * s;
    }
  }
};

inline QuantRowReader quant_reader(const torch::Tensor& cache, const c10::optional<torch::Tensor>& scale,
                                   KVKind kind) {
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == torch::kFloat && scale->is_contiguous(),
              "a quantized cache needs its float32 scales");
  const int64_t kv = cache.size(1);
  TORCH_CHECK(kind == KVKind::kInt8 ? scale->numel() == cache.size(0) * kv : scale->numel() == kv,
              "scales must be [slots, KV] for int8 and [KV] for fp8");
  return {kind, reinterpret_cast<const uint8_t*>(cache.data_ptr()), scale->data_ptr<float>(), kv};
}

// Quantizes n floats into one cache row; int8 also sets the row's scale (amax / 127, as the reference).
inline void quantize_row(KVKind kind, const float* x, int64_t n, uint8_t* dst, float* row_scale, float head_scale) {
  if (kind == KVKind::kInt8) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float s = std::max(amax * (1.f / 127.f), 1e-12f);
    *row_scale = s;
    const float inv = 1.f / s;
    int8_t* d = reinterpret_cast<int8_t*>(dst);
    for (int64_t i = 0; i < n; ++i) d[i] = static_cast<int8_t>(std::clamp(std::nearbyint(x[i] * inv), -127.f, 127.f));
    return;
  }
  const float inv = 1.f / head_scale;
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] * inv;
    if (kind == KVKind::kFp8E4M3) {
      dst[i] = c10::Float8_e4m3fn(std::clamp(v, -448.f, 448.f)).x;
    } else {
      dst[i] = c10::Float8_e5m2(std::clamp(v, -57344.f, 57344.f)).x;
    }
  }
}
