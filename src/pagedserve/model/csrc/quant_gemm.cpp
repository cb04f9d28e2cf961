// Matmuls over quantized weights, read as stored (GGUF Q4_0/Q4_1/Q8_0, our int8 and int4).
//
// Weights are planar: qweight [N, K] int8 (8 bits) or [N, K/2] uint8 (4 bits: in each 32-wide group, byte j
// holds k = j in its low nibble and k = j + 16 in its high one, as GGML stores them), scales [N, K/group]
// fp32 or fp16 (quant_params.h) and, for asymmetric weights (4 bits, or 8 bits in groups of 32 or more: GGUF
// Q5_1 / Q5_K), mins [N, K/group] alike: w = scale * q + min.
// Groups are multiples of 32, or 16 for 8 bits (GGUF Q6_K's sub-blocks: each 32-block then has a scale per half).
//
// Small M (decode) is bandwidth-bound: each weight byte is read once and multiplied in integers against the
// activations quantized per 32 to int16 (AVX2 madd_epi16), with the exact float sum of each 32 for the min
// term. int8 activations (llama.cpp's Q8_0, maddubs) cost the default model +1.2% perplexity against the fp32
// product of the same weights; int16 ones are within rounding of it. Large M goes through quant_dequantize
// and a float GEMM (the crossover is chosen in quant_linear.py by measurement).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "quant_params.h"

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block; group sizes are multiples of it
constexpr int64_t kPrefetchRows = 4;

enum Path : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Activations quantized per 32: int16 values, their scale, and the exact float sum of the block.
constexpr float kActivationMax = 32767.f;

struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  QuantizedRows out{std::vector<int16_t>(m * k), std::vector<float>(m * blocks), std::vector<float>(m * blocks)};
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t rb = begin; rb < end; ++rb) {
      const int64_t row = rb / blocks, b = rb % blocks, base = row * k + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        v[i] = bf16 ? bf16_bits_to_float(xb[base + i]) : xf[base + i];
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float d = amax / kActivationMax, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        out.q[base + i] = static_cast<int16_t>(std::clamp(std::nearbyint(v[i] * inv), -kActivationMax, kActivationMax));
      }
      out.scale[rb] = d;
      out.sum[rb] = sum;
    }
  });
  return out;
}

// Integer dot product of one 32-block of weights with one of activations.
inline int32_t dot_block_scalar(const uint8_t* w, const int16_t* x, int64_t bits) {
  int32_t s = 0;
  if (bits == 4) {
    for (int i = 0; i < 16; ++i) s += (w[i] & 0xF) * x[i] + (w[i] >> 4) * x[i + 16];
  } else {
    const int8_t* ws = reinterpret_cast<const int8_t*>(w);
    for (int i = 0; i < kBlock; ++i) s += ws[i] * x[i];
  }
  return s;
}

#if defined(__AVX2__)
// 32 weights widened to int16 in k order (two vectors of 16): unsigned nibbles or signed int8.
struct Weights16 {
  __m256i lo, hi;
};

inline Weights16 load_weights(const uint8_t* w, int64_t bits) {
  if (bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)};
  }
  const __m128i* p = reinterpret_cast<const __m128i*>(w);
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(p)), _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1))};
}

// 8 int32 partial sums of w . x over one block (|w| <= 128, |x| <= 32767: pair sums fit in int32).
inline __m256i dot_block_avx2(const Weights16& w, const int16_t* x) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, _mm256_loadu_si256(xv)),
                          _mm256_madd_epi16(w.hi, _mm256_loadu_si256(xv + 1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A weight row widened to int16 once (into an L1-resident buffer), whatever the number of activation rows.
inline void widen_row(const uint8_t* wrow, int64_t bits, int64_t blocks, int16_t* out) {
  const int64_t block_bytes = bits == 4 ? kBlock / 2 : kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    const Weights16 w = load_weights(wrow + b * block_bytes, bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kBlock), w.lo);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + b * kBlock + 16), w.hi);
  }
}

// One widened weight row against MR activation rows, accumulators in registers. Groups outer, blocks inner:
// no division per block.
template <int MR>
inline void rows_avx2(const int16_t* wrow, const float* srow, int64_t groups, int64_t per_group,
                      const QuantizedRows& xq, int64_t r0, int64_t k, float* out) {
  const int64_t blocks = k / kBlock;
  __m256 acc[MR];
  const float* sx[MR];
  const int16_t* xr[MR];
  for (int i = 0; i < MR; ++i) {
    acc[i] = _mm256_setzero_ps();
    sx[i] = xq.scale.data() + (r0 + i) * blocks;
    xr[i] = xq.q.data() + (r0 + i) * k;
  }
  for (int64_t g = 0, b = 0; g < groups; ++g) {
    const float sw = srow[g];
    for (int64_t e = b + per_group; b < e; ++b) {
      const __m256i* wv = reinterpret_cast<const __m256i*>(wrow + b * kBlock);
      const Weights16 w{_mm256_loadu_si256(wv), _mm256_loadu_si256(wv + 1)};
      for (int i = 0; i < MR; ++i) {
        const __m256i d = dot_block_avx2(w, xr[i] + b * kBlock);
        acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(sw * sx[i][b]), _mm256_cvtepi32_ps(d), acc[i]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) out[i] = hsum(acc[i]);
}

// The same with a scale per 16 weights (8 bits, group 16): each half of a block is scaled on its own.
template <int MR>
inline void rows_avx2_g16(const int16_t* wrow, const float* srow, const QuantizedRows& xq, int64_t r0, int64_t k,
                          float* out) {
  const int64_t blocks = k / kBlock;
  __m256 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i* wv = reinterpret_cast<const __m256i*>(wrow + b * kBlock);
    const __m256i lo = _mm256_loadu_si256(wv), hi = _mm256_loadu_si256(wv + 1);
    for (int i = 0; i < MR; ++i) {
      const __m256i* xv = reinterpret_cast<const __m256i*>(xq.q.data() + (r0 + i) * k + b * kBlock);
      const float sx = xq.scale[(r0 + i) * blocks + b];
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(srow[2 * b] * sx),
                               _mm256_cvtepi32_ps(_mm256_madd_epi16(lo, _mm256_loadu_si256(xv))), acc[i]);
      acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(srow[2 * b + 1] * sx),
                               _mm256_cvtepi32_ps(_mm256_madd_epi16(hi, _mm256_loadu_si256(xv + 1))), acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i] = hsum(acc[i]);
}
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
// The AVX-512 VNNI path widens weights in registers (no row buffer) and multiplies two 32-blocks per step with
// vpdpwssd (int16 pairs into int32). Its activations are stored pair-interleaved: for blocks 2p and 2p + 1,
// [2p: k 0-15][2p+1: k 0-15] then [2p: k 16-31][2p+1: k 16-31], the order in which one 32-byte load of two 4-bit
// blocks unpacks (low nibbles, then high nibbles). The int32 sums then hold block 2p in lanes 0-7 and block
// 2p + 1 in lanes 8-15, so one float multiply-add scales both. An odd last block stays in k order.
void interleave_pairs(const int16_t* src, int16_t* dst, int64_t blocks) {
  for (int64_t p = 0; p + 1 < blocks; p += 2) {
    const int16_t* a = src + p * kBlock;
    const int16_t* b = a + kBlock;
    int16_t* d = dst + p * kBlock;
    std::memcpy(d, a, 32);
    std::memcpy(d + 16, b, 32);
    std::memcpy(d + 32, a + 16, 32);
    std::memcpy(d + 48, b + 16, 32);
  }
  if (blocks % 2) std::memcpy(dst + (blocks - 1) * kBlock, src + (blocks - 1) * kBlock, kBlock * 2);
}

struct Pair16 {
  __m512i a, b;  // the pair's k 0-15 halves and k 16-31 halves, as int16
};

inline Pair16 load_pair(const uint8_t* w, int64_t bits) {
  if (bits == 4) {
    const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
    const __m512i nibble = _mm512_set1_epi16(0x0F);
    return {_mm512_and_si512(v, nibble), _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble)};
  }
  const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  const __m512i w1 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kBlock)));
  return {_mm512_shuffle_i64x2(w0, w1, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_i64x2(w0, w1, _MM_SHUFFLE(3, 2, 3, 2))};
}

inline __m512i load_single(const uint8_t* w, int64_t bits) {  // one block in k order
  if (bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(high, low));
  }
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
}

// [s0 x 8, s1 x 8] from the first two floats of v.
inline __m512 spread2(__m128 v) {
  return _mm512_permutexvar_ps(_mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(v));
}

// Weight scales of blocks b and b + 1 per half block: [b lo, b hi, b+1 lo, b+1 hi]. G is the group size when
// it is 16 or 32, else 0: then group_of maps a block to its group.
template <int G>
inline __m128 pair_scales(const float* srow, int64_t b, const int32_t* group_of) {
  if constexpr (G == 16) return _mm_loadu_ps(srow + 2 * b);
  if constexpr (G == 32) {
    const __m128 v = _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(srow + b)));
    return _mm_unpacklo_ps(v, v);
  }
  const float s0 = srow[group_of[b]], s1 = srow[group_of[b + 1]];
  return _mm_setr_ps(s0, s0, s1, s1);
}

template <int G>
inline __m128 single_scales(const float* srow, int64_t b, const int32_t* group_of) {  // [lo, hi, -, -]
  if constexpr (G == 16) return _mm_setr_ps(srow[2 * b], srow[2 * b + 1], 0.f, 0.f);
  return _mm_set1_ps(G == 32 ? srow[b] : srow[group_of[b]]);
}

// One weight row against MR activation rows (pair-interleaved, see interleave_pairs).
template <int MR, int G>
inline void rows_avx512(const uint8_t* wrow, int64_t bits, const float* srow, const int32_t* group_of,
                        const int16_t* xq, const float* sx, int64_t r0, int64_t k, float* out) {
  const int64_t blocks = k / kBlock, block_bytes = bits == 4 ? kBlock / 2 : kBlock;
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  const __m512i lanes_lo = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i lanes_hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    const Pair16 w = load_pair(wrow + b * block_bytes, bits);
    const __m128 s4 = pair_scales<G>(srow, b, group_of);
    for (int i = 0; i < MR; ++i) {
      const int16_t* x = xq + (r0 + i) * k + b * kBlock;
      const __m512i xa = _mm512_loadu_si512(x), xb = _mm512_loadu_si512(x + 32);
      const __m128 sxp = _mm_castpd_ps(_mm_load1_pd(reinterpret_cast<const double*>(sx + (r0 + i) * blocks + b)));
      const __m128 scale = _mm_mul_ps(s4, _mm_shuffle_ps(sxp, sxp, _MM_SHUFFLE(1, 1, 0, 0)));
      const __m512 sa = _mm512_permutexvar_ps(lanes_lo, _mm512_castps128_ps512(scale));
      if constexpr (G == 16) {  // each half block has its own scale
        const __m512 sb = _mm512_permutexvar_ps(lanes_hi, _mm512_castps128_ps512(scale));
        const __m512i da = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w.a, xa);
        const __m512i db = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w.b, xb);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(da), sa, acc[i]);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(db), sb, acc[i]);
      } else {
        const __m512i d = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(_mm512_setzero_si512(), w.a, xa), w.b, xb);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), sa, acc[i]);
      }
    }
  }
  if (b < blocks) {
    const __m512i w = load_single(wrow + b * block_bytes, bits);
    const __m512 sw = spread2(single_scales<G>(srow, b, group_of));
    for (int i = 0; i < MR; ++i) {
      const __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w,
                                            _mm512_loadu_si512(xq + (r0 + i) * k + b * kBlock));
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, _mm512_set1_ps(sx[(r0 + i) * blocks + b])),
                               acc[i]);
    }
  }
  for (int i = 0; i < MR; ++i) out[i] = _mm512_reduce_add_ps(acc[i]);
}

template <int G>
inline void tile_avx512(int64_t mr, const uint8_t* wrow, int64_t bits, const float* srow, const int32_t* group_of,
                        const int16_t* xq, const float* sx, int64_t r0, int64_t k, float* out) {
  switch (mr) {
    case 4: rows_avx512<4, G>(wrow, bits, srow, group_of, xq, sx, r0, k, out); break;
    case 3: rows_avx512<3, G>(wrow, bits, srow, group_of, xq, sx, r0, k, out); break;
    case 2: rows_avx512<2, G>(wrow, bits, srow, group_of, xq, sx, r0, k, out); break;
    default: rows_avx512<1, G>(wrow, bits, srow, group_of, xq, sx, r0, k, out);
  }
}
#endif

// sum over groups of min * (sum of the activations in the group): the asymmetric part of a 4-bit product.
// A plain dot product over the groups, which the compiler vectorizes (-ffast-math allows the reassociation).
inline float min_term(const float* mrow, const float* xgroup, int64_t groups) {
  float total = 0.f;
  for (int64_t g = 0; g < groups; ++g) total += mrow[g] * xgroup[g];
  return total;
}

void check_weights(const torch::Tensor& qweight, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                   int64_t bits, int64_t group, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(k % kBlock == 0 && (group % kBlock == 0 || (group == 16 && bits == 8)) && k % group == 0,
              "K must be a multiple of 32 and the group too (or 16, with 8 bits)");
  TORCH_CHECK(qweight.is_contiguous(), "qweight must be contiguous");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? k / 2 : k), "qweight width does not match K");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? torch::kUInt8 : torch::kInt8), "qweight dtype does not match bits");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == qweight.size(0) && scales.size(1) == k / group,
              "scales must be [N, K/group]");
  TORCH_CHECK(!mins || group % kBlock == 0, "mins need groups of 32 or more");
  group_params(scales, mins);  // dtypes and layout
}

}  // namespace

std::vector<int64_t> quant_paths() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return {kScalar, kAvx2, kAvx512};
#elif defined(__AVX2__)
  return {kScalar, kAvx2};
#else
  return {kScalar};
#endif
}

// y[M, N] = x[M, K] @ W^T (+ residual), x fp32 or bf16 (y and residual in x's dtype). path: 0 scalar, 1 AVX2,
// 2 AVX-512 VNNI. The residual is added as each output is stored: one pass and one op fewer per layer.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t bits, int64_t group, int64_t path,
                           c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  check_weights(qweight, scales, mins, bits, group, k);
  const auto paths = quant_paths();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "kernel path ", path,
              " is not built for this CPU");
  const QuantizedRows xq = quantize_rows(x);
  const int64_t blocks = k / kBlock, per_group = std::max<int64_t>(1, group / kBlock), row_bytes = qweight.size(1);
  const int64_t block_bytes = bits == 4 ? kBlock / 2 : kBlock;
  const uint8_t* wq = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const GroupParams params = group_params(scales, mins);
  const bool has_mins = mins.has_value();
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == x.scalar_type() &&
                residual->dim() == 2 && residual->size(0) == m && residual->size(1) == n,
                "residual must be a contiguous [M, N] in x's dtype");
  }
  auto out = torch::empty({m, n}, x.options());
  float* yf = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* yb = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  const float* rf = residual && !bf16 ? residual->data_ptr<float>() : nullptr;
  const uint16_t* rb = residual && bf16 ? reinterpret_cast<const uint16_t*>(residual->data_ptr()) : nullptr;
  // Rows per task: enough weight bytes that waking a thread pays for itself.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, row_bytes));
  const int64_t groups = k / group;
  std::vector<float> xgroup(has_mins ? m * groups : 0);  // activation sums per weight group, for the min term
  for (int64_t r = 0; has_mins && r < m; ++r) {
    for (int64_t b = 0; b < blocks; ++b) xgroup[r * groups + b / per_group] += xq.sum[r * blocks + b];
  }
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  std::vector<int16_t> paired(path == kAvx512 ? m * k : 0);
  std::vector<int32_t> group_of(path == kAvx512 ? blocks : 0);
  if (path == kAvx512) {
    for (int64_t r = 0; r < m; ++r) interleave_pairs(xq.q.data() + r * k, paired.data() + r * k, blocks);
    for (int64_t b = 0; b < blocks; ++b) group_of[b] = static_cast<int32_t>(b / per_group);
  }
#endif
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    float part[4];
    std::vector<int16_t> widened(path == kAvx2 ? k : 0);
    std::vector<float> widened_params(2 * groups);
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* wrow = wq + row * row_bytes;
      const float* srow;
      const float* mrow;
      params.row(row, widened_params.data(), srow, mrow);
#if defined(__AVX2__)
      if (path == kAvx2) widen_row(wrow, bits, blocks, widened.data());
#endif
      for (int64_t r0 = 0; r0 < m; r0 += 4) {
        const int64_t mr = std::min<int64_t>(4, m - r0);
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
        if (path == kAvx512) {
          if (r0 == 0 && row + kPrefetchRows < end) {  // a row's bytes, a few rows ahead
            for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch(reinterpret_cast<const char*>(wrow + kPrefetchRows * row_bytes + o), _MM_HINT_T0);
          }
          const float* sx = xq.scale.data();
          if (group == 16) tile_avx512<16>(mr, wrow, bits, srow, nullptr, paired.data(), sx, r0, k, part);
          else if (group == 32) tile_avx512<32>(mr, wrow, bits, srow, nullptr, paired.data(), sx, r0, k, part);
          else tile_avx512<0>(mr, wrow, bits, srow, group_of.data(), paired.data(), sx, r0, k, part);
        }
#endif
#if defined(__AVX2__)
        if (path == kAvx2) {
          const int16_t* wr = widened.data();
          if (group == 16) {
            switch (mr) {
              case 4: rows_avx2_g16<4>(wr, srow, xq, r0, k, part); break;
              case 3: rows_avx2_g16<3>(wr, srow, xq, r0, k, part); break;
              case 2: rows_avx2_g16<2>(wr, srow, xq, r0, k, part); break;
              default: rows_avx2_g16<1>(wr, srow, xq, r0, k, part);
            }
          } else {
            switch (mr) {
            case 4: rows_avx2<4>(wr, srow, groups, per_group, xq, r0, k, part); break;
            case 3: rows_avx2<3>(wr, srow, groups, per_group, xq, r0, k, part); break;
            case 2: rows_avx2<2>(wr, srow, groups, per_group, xq, r0, k, part); break;
            default: rows_avx2<1>(wr, srow, groups, per_group, xq, r0, k, part);
            }
          }
        }
#endif
        if (path == kScalar) {
          for (int64_t i = 0; i < mr; ++i) {
            const int16_t* xr = xq.q.data() + (r0 + i) * k;
            const float* sx = xq.scale.data() + (r0 + i) * blocks;
            float acc = 0.f;
            for (int64_t b = 0; b < blocks; ++b) {
              if (group == 16) {  // 8 bits, a scale per half block
                const int8_t* w = reinterpret_cast<const int8_t*>(wrow + b * block_bytes);
                int32_t lo = 0, hi = 0;
                for (int j = 0; j < 16; ++j) {
                  lo += w[j] * xr[b * kBlock + j];
                  hi += w[j + 16] * xr[b * kBlock + j + 16];
                }
                acc += sx[b] * (srow[2 * b] * static_cast<float>(lo) + srow[2 * b + 1] * static_cast<float>(hi));
                continue;
              }
              acc += srow[b / per_group] * sx[b] *
                     static_cast<float>(dot_block_scalar(wrow + b * block_bytes, xr + b * kBlock, bits));
            }
            part[i] = acc;
          }
        }
        for (int64_t i = 0; i < mr; ++i) {
          const float shift = mrow ? min_term(mrow, xgroup.data() + (r0 + i) * groups, groups) : 0.f;
          const int64_t at = (r0 + i) * n + row;
          if (bf16) {
            yb[at] = float_to_bf16_bits(part[i] + shift + (rb ? bf16_bits_to_float(rb[at]) : 0.f));
          } else {
            yf[at] = part[i] + shift + (rf ? rf[at] : 0.f);
          }
        }
      }
    }
  });
  return out;
}

// The weights as a float matrix [N, K] in dtype (fp32 or bf16): the large-M path and the reference.
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                               int64_t bits, int64_t group, c10::ScalarType dtype) {
  const int64_t n = qweight.size(0), k = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  check_weights(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "dtype must be fp32 or bf16");
  auto out = torch::empty({n, k}, qweight.options().dtype(dtype));
  const uint8_t* wq = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const GroupParams params = group_params(scales, mins);
  const int64_t row_bytes = qweight.size(1), groups = k / group;
  const int64_t per_group = std::max<int64_t>(1, group / kBlock), block_bytes = bits == 4 ? kBlock / 2 : kBlock;
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 14) / k), [&](int64_t begin, int64_t end) {
    std::vector<float> values(k), widened_params(2 * groups);
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* w = wq + row * row_bytes;
      const float* ws;
      const float* wm;
      params.row(row, widened_params.data(), ws, wm);
      for (int64_t b = 0; b < k / kBlock; ++b) {
        const int64_t g = b / per_group;
        const float sw = ws[g], mw = wm ? wm[g] : 0.f;
        const uint8_t* wb = w + b * block_bytes;
        float* v = values.data() + b * kBlock;
        if (group == 16) {  // 8 bits, a scale per half block
          const int8_t* q = reinterpret_cast<const int8_t*>(wb);
          const float* half = ws + 2 * b;
          for (int j = 0; j < kBlock; ++j) v[j] = half[j / 16] * static_cast<float>(q[j]);
          continue;
        }
#if defined(__AVX2__)
        const Weights16 q = load_weights(wb, bits);
        const __m256 scale = _mm256_set1_ps(sw), shift = _mm256_set1_ps(mw);
        const __m128i parts[4] = {_mm256_castsi256_si128(q.lo), _mm256_extracti128_si256(q.lo, 1),
                                  _mm256_castsi256_si128(q.hi), _mm256_extracti128_si256(q.hi, 1)};
        for (int j = 0; j < 4; ++j) {
          const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(parts[j]));
          _mm256_storeu_ps(v + 8 * j, _mm256_fmadd_ps(scale, f, shift));
        }
        continue;
#endif
        if (bits == 4) {
          for (int j = 0; j < 16; ++j) {
            v[j] = sw * static_cast<float>(wb[j] & 0xF) + mw;
            v[j + 16] = sw * static_cast<float>(wb[j] >> 4) + mw;
          }
        } else {
          const int8_t* q = reinterpret_cast<const int8_t*>(wb);
          for (int j = 0; j < kBlock; ++j) v[j] = sw * static_cast<float>(q[j]) + mw;
        }
      }
      if (dtype == torch::kFloat) {
        std::memcpy(out.data_ptr<float>() + row * k, values.data(), sizeof(float) * k);
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + row * k;
        for (int64_t i = 0; i < k; ++i) o[i] = float_to_bf16_bits(values[i]);
      }
    }
  });
  return out;
}
