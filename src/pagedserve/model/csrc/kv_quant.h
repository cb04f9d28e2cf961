// Quantized KV cache rows (model/kv_cache_dtype.py): fp8 (e4m3 / e5m2) with a scale per KV head, int8 with a
// scale per token and KV head, int4 (model/kv_int4.py) with keys per channel across a full block (a partial
// block's keys read from their bf16 tail) and values per token, each with a scale code on a log grid and a 4-bit
// zero point. Readers widen one cached row to fp32 in registers; writers quantize on the way in
// as the PyTorch reference does (x / scale, round half to even, saturate), but built with -ffast-math: a value
// within an ulp of a rounding boundary may land on the neighbouring code.
#pragma once
#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

enum class KVKind { kPlain, kFp8E4M3, kFp8E5M2, kInt8, kInt4 };

inline KVKind kv_kind(const torch::Tensor& cache, const torch::Tensor& q) {
  switch (cache.scalar_type()) {
    case torch::kFloat8_e4m3fn: return KVKind::kFp8E4M3;
    case torch::kFloat8_e5m2: return KVKind::kFp8E5M2;
    case torch::kChar: return KVKind::kInt8;
    case torch::kByte: return KVKind::kInt4;
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

// 8-bit scale codes (model/scale_codes.py) of int8 rows and int4 groups: code u is 2^(kTop - u / kSteps).
constexpr int kScaleSteps = 12, kScaleTopLog2 = 9;

inline const float* scale_code_table() {
  static const auto table = [] {
    std::array<float, 256> t{};
    for (int u = 0; u < 256; ++u) t[u] = static_cast<float>(std::exp2(kScaleTopLog2 - u / double(kScaleSteps)));
    return t;
  }();
  return table.data();
}

// The code of a positive scale: the nearest, or the smallest scale at least as large when round_up.
inline uint8_t scale_code(float s, bool round_up) {
  const float steps = kScaleSteps * (kScaleTopLog2 - std::log2(s));
  return static_cast<uint8_t>(std::clamp(round_up ? std::floor(steps) : std::nearbyint(steps), 0.f, 255.f));
}

// int4: how one side (K or V) of the pool is laid out; see model/kv_int4.py.
struct Int4Layout {
  const uint8_t* params = nullptr;          // keys [blocks, KV, D + D / 2] (scale codes, then zero points two a
                                            // byte), values [slots, KV, 2] (scale code, zero point)
  const uint16_t* tail = nullptr;           // keys: bf16 [tails * block_size, KV, D], partial blocks' keys
  const int32_t* tail_of_block = nullptr;   // keys: [blocks], -1 where the block's keys are quantized
  int64_t block_size = 0;
  bool keys = false;
};

// Reads row (slot, head) of a quantized cache ([slots, KV, D] codes; int4: [slots, KV, D / 2]) as D floats.
struct QuantRowReader {
  KVKind kind;
  const uint8_t* codes;    // fp8 codes, int8 values or int4 pairs (low nibble first)
  const float* scales;     // fp8: [KV]
  const uint8_t* row_scales;  // int8: [slots, KV] scale codes
  int64_t num_kv_heads;
  Int4Layout int4;

  template <int D>
  inline void load_int4(int64_t slot, int64_t head, float* __restrict__ out) const {
    const uint8_t* row = codes + (slot * num_kv_heads + head) * (D / 2);
    const float* table = scale_code_table();
    if (!int4.keys) {
      const uint8_t* p = int4.params + (slot * num_kv_heads + head) * 2;
      const float s = table[p[0]], m = -static_cast<float>(p[1]) * s;
#pragma omp simd
      for (int i = 0; i < D / 2; ++i) {
        out[2 * i] = static_cast<float>(row[i] & 15) * s + m;
        out[2 * i + 1] = static_cast<float>(row[i] >> 4) * s + m;
      }
      return;
    }
    const int64_t block = slot / int4.block_size;
    const int32_t tail = int4.tail_of_block[block];
    if (tail >= 0) {
      const uint16_t* r = int4.tail + ((tail * int4.block_size + slot % int4.block_size) * num_kv_heads + head) * D;
      uint32_t* o = reinterpret_cast<uint32_t*>(out);
      for (int i = 0; i < D; ++i) o[i] = static_cast<uint32_t>(r[i]) << 16;
      return;
    }
    const uint8_t* s = int4.params + (block * num_kv_heads + head) * (D + D / 2);
    const uint8_t* z = s + D;
    for (int i = 0; i < D / 2; ++i) {
      out[2 * i] = static_cast<float>((row[i] & 15) - (z[i] & 15)) * table[s[2 * i]];
      out[2 * i + 1] = static_cast<float>((row[i] >> 4) - (z[i] >> 4)) * table[s[2 * i + 1]];
    }
  }

  template <int D>
  inline void load(int64_t slot, int64_t head, float* __restrict__ out) const {
    if (kind == KVKind::kInt4) return load_int4<D>(slot, head, out);
    const uint8_t* row = codes + (slot * num_kv_heads + head) * D;
    if (kind == KVKind::kInt8) {
      const float s = scale_code_table()[row_scales[slot * num_kv_heads + head]];
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
  const int64_t kv = cache.size(1);
  const auto* codes = reinterpret_cast<const uint8_t*>(cache.data_ptr());
  if (kind == KVKind::kInt8) {
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == torch::kByte && scale->is_contiguous() &&
                    scale->numel() == cache.size(0) * kv,
                "an int8 cache needs its scale codes, uint8 [slots, KV]");
    return {kind, codes, nullptr, scale->data_ptr<uint8_t>(), kv, {}};
  }
  TORCH_CHECK(scale.has_value() && scale->scalar_type() == torch::kFloat && scale->is_contiguous() &&
                  scale->numel() == kv,
              "an fp8 cache needs its float32 scales, [KV]");
  return {kind, codes, scale->data_ptr<float>(), nullptr, kv, {}};
}

// int4 readers: k_params [blocks, KV, D + D / 2] and v_params [slots, KV, 2] uint8, k_tail bf16 [tails * block_size, KV,
// D], tail_of_block int32 [blocks].
inline std::pair<QuantRowReader, QuantRowReader> int4_readers(
    const torch::Tensor& k_cache, const torch::Tensor& v_cache, const c10::optional<torch::Tensor>& k_params,
    const c10::optional<torch::Tensor>& v_params, const c10::optional<torch::Tensor>& k_tail,
    const c10::optional<torch::Tensor>& tail_of_block, int64_t block_size) {
  TORCH_CHECK(k_params.has_value() && v_params.has_value() && k_tail.has_value() && tail_of_block.has_value(),
              "an int4 cache needs its key and value parameters, key tails and tail_of_block");
  const int64_t slots = k_cache.size(0), kv = k_cache.size(1), d = k_cache.size(2) * 2;
  TORCH_CHECK(block_size > 0 && slots % block_size == 0, "int4: slots must be whole blocks");
  const int64_t blocks = slots / block_size;
  TORCH_CHECK(k_params->scalar_type() == torch::kByte && v_params->scalar_type() == torch::kByte &&
                  k_params->is_contiguous() && v_params->is_contiguous() && k_params->numel() == blocks * kv * d * 3 / 2 &&
                  v_params->numel() == slots * kv * 2,
              "int4 parameters must be contiguous uint8 [blocks, KV, D * 3/2] (keys) and [slots, KV, 2] (values)");
  TORCH_CHECK(k_tail->scalar_type() == torch::kBFloat16 && k_tail->is_contiguous() &&
                  k_tail->numel() % (block_size * kv * d) == 0,
              "int4 key tails must be contiguous bf16 [tails * block_size, KV, D]");
  TORCH_CHECK(tail_of_block->scalar_type() == torch::kInt && tail_of_block->is_contiguous() &&
                  tail_of_block->numel() == blocks,
              "tail_of_block must be int32 [blocks]");
  const uint8_t* kp = k_params->data_ptr<uint8_t>();
  const uint8_t* vp = v_params->data_ptr<uint8_t>();
  const auto* tail = reinterpret_cast<const uint16_t*>(k_tail->data_ptr());
  const int32_t* tob = tail_of_block->data_ptr<int32_t>();
  return {QuantRowReader{KVKind::kInt4, reinterpret_cast<const uint8_t*>(k_cache.data_ptr()), nullptr, nullptr, kv,
                         {kp, tail, tob, block_size, true}},
          QuantRowReader{KVKind::kInt4, reinterpret_cast<const uint8_t*>(v_cache.data_ptr()), nullptr, nullptr, kv,
                         {vp, nullptr, nullptr, block_size, false}}};
}

// The readers of a quantized pool, whichever its format.
inline std::pair<QuantRowReader, QuantRowReader> quant_readers(
    KVKind kind, const torch::Tensor& k_cache, const torch::Tensor& v_cache, const c10::optional<torch::Tensor>& k_scale,
    const c10::optional<torch::Tensor>& v_scale, const c10::optional<torch::Tensor>& k_tail,
    const c10::optional<torch::Tensor>& tail_of_block, int64_t block_size) {
  if (kind == KVKind::kInt4) return int4_readers(k_cache, v_cache, k_scale, v_scale, k_tail, tail_of_block, block_size);
  return {quant_reader(k_cache, k_scale, kind), quant_reader(v_cache, v_scale, kind)};
}

// int4 asymmetric codes of n floats (model/kv_int4.py quantize): x / scale + zero rounded into 0..15, from the
// scale the code rounds to (what readers use). Returns the codes in out[0..n), the scale code and zero point.
inline void int4_codes(const float* x, int64_t n, int64_t stride, uint8_t* out, uint8_t* code, uint8_t* zero) {
  float lo = x[0], hi = x[0];
  for (int64_t i = 1; i < n; ++i) {
    lo = std::min(lo, x[i * stride]);
    hi = std::max(hi, x[i * stride]);
  }
  float s = std::max((hi - lo) / 15.f, 1e-30f);
  const float z = std::clamp(std::nearbyint(-lo / s), 0.f, 15.f);
  if (z < 15.f) s = std::max(s, hi / (15.f - z));  // the range reaches from 0 when it does not hold it
  if (z > 0.f) s = std::max(s, -lo / z);
  *code = scale_code(s, false);
  *zero = static_cast<uint8_t>(z);
  const float inv = 1.f / scale_code_table()[*code];
  for (int64_t i = 0; i < n; ++i)
    out[i] = static_cast<uint8_t>(std::clamp(std::nearbyint(x[i * stride] * inv + z), 0.f, 15.f));
}

// Quantizes n floats into one cache row; int8 also sets the row's scale code (amax / 127 rounded up, as the
// reference).
inline void quantize_row(KVKind kind, const float* x, int64_t n, uint8_t* dst, uint8_t* row_scale, float head_scale) {
  if (kind == KVKind::kInt8) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    *row_scale = scale_code(std::max(amax / 127.f, 1e-30f), true);
    const float inv = 1.f / scale_code_table()[*row_scale];
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
