// Decode attention over the paged KV pool: one query token per sequence, K/V read in place
// through the block table, so each cached token is read exactly once (no gather copy).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kv_quant.h"

// Widen one row to float; the bf16 case is a plain shift so the compiler vectorizes it.
template <typename scalar_t, int D>
static inline void to_float(const scalar_t* __restrict__ src, float* __restrict__ dst) {
  for (int i = 0; i < D; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<at::BFloat16, 64>(const at::BFloat16* __restrict__ src, float* __restrict__ dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int i = 0; i < 64; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <>
inline void to_float<at::BFloat16, 128>(const at::BFloat16* __restrict__ src, float* __restrict__ dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int i = 0; i < 128; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <>
inline void to_float<at::BFloat16, 256>(const at::BFloat16* __restrict__ src, float* __restrict__ dst) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int i = 0; i < 256; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <int D>
static inline float dot(const float* __restrict__ a, const float* __restrict__ b) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < D; ++i) s += a[i] * b[i];
  return s;
}

// Reads row (slot, head) of an unquantized cache ([slots, KV, D]) as D floats.
template <typename cache_t>
struct PlainRowReader {
  const cache_t* cache;
  int64_t num_kv_heads;

  template <int D>
  inline void load(int64_t slot, int64_t head, float* __restrict__ out) const {
    to_float<cache_t, D>(cache + (slot * num_kv_heads + head) * D, out);
  }
};

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, block_size, max_blocks, q_row_stride;
  float scale;
  int64_t window;  // > 0: each query sees only the last `window` of its tokens (a sliding-window layer)
};

// The first token a query over len tokens sees.
static inline int64_t first_visible(int64_t len, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, len - window) : 0;
}

// One (sequence, kv head) pair: its `group` query heads attend over `len` cached tokens.
template <typename scalar_t, typename Reader, int D>
static void attend_one(const scalar_t* q, const Reader& k_cache, const Reader& v_cache, const int64_t* table,
                       int64_t len, scalar_t* out, int64_t seq, int64_t kvh, const Shape& s,
                       std::vector<float>& scores) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  alignas(64) float qf[8][D];
  alignas(64) float acc[8][D];
  alignas(64) float row[D];
  // Tokens before the window's first are never read: the cache may have given their blocks back.
  const int64_t first = first_visible(len, s.window);
  table += first / s.block_size;
  const int64_t skip = first / s.block_size * s.block_size, lo = first - skip;
  len -= skip;
  scores.assign(group * len, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    to_float<scalar_t, D>(q + seq * s.q_row_stride + (kvh * group + g) * D, qf[g]);
    for (int i = 0; i < D; ++i) qf[g][i] *= s.scale;
  }
  for (int64_t t = lo; t < len; ++t) {
    const int64_t slot = table[t / s.block_size] * s.block_size + t % s.block_size;
    k_cache.template load<D>(slot, kvh, row);
    for (int64_t g = 0; g < group; ++g) scores[g * len + t] = dot<D>(qf[g], row);
  }
  for (int64_t g = 0; g < group; ++g) {
    float* sg = scores.data() + g * len;
    const float mx = *std::max_element(sg + lo, sg + len);
    float sum = 0.f;
    for (int64_t t = lo; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
    const float inv = 1.f / sum;
    for (int64_t t = lo; t < len; ++t) sg[t] *= inv;
    std::fill(acc[g], acc[g] + D, 0.f);
  }
  for (int64_t t = lo; t < len; ++t) {
    const int64_t slot = table[t / s.block_size] * s.block_size + t % s.block_size;
    v_cache.template load<D>(slot, kvh, row);
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * len + t];
#pragma omp simd
      for (int i = 0; i < D; ++i) acc[g][i] += p * row[i];
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    scalar_t* o = out + (seq * s.num_heads + kvh * group + g) * D;
    for (int i = 0; i < D; ++i) o[i] = static_cast<scalar_t>(acc[g][i]);
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include "vec_math.h"
#define PAGEDSERVE_BF16_DECODE 1

// fp8 e4m3 codes (16-bit lanes) as bf16 bits: the exponent rebiased (7 -> 127), the 3 mantissa bits on top of
// bf16's 7. Exact for normal values; the subnormal codes (below 2^-6 of the scale) become 0.
static inline __m512i e4m3_to_bf16_bits(__m512i x) {
  const __m512i sign = _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8);
  const __m512i mag = _mm512_add_epi16(_mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x7F)), 4),
                                       _mm512_set1_epi16(120 << 7));
  return _mm512_maskz_mov_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x78)), _mm512_or_si512(sign, mag));
}

static inline __m256i e4m3_to_bf16_bits(__m256i x) {
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8);
  const __m256i mag = _mm256_add_epi16(_mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x7F)), 4),
                                       _mm256_set1_epi16(120 << 7));
  return _mm256_maskz_mov_epi16(_mm256_test_epi16_mask(x, _mm256_set1_epi16(0x78)), _mm256_or_si256(sign, mag));
}

// 32 cached values (unscaled) as bf16: exact for every format, since int8 and fp8 fit bf16's 8-bit mantissa.
template <KVKind K>
static inline __m512bh load_bf16x32(const uint8_t* row) {
  if constexpr (K == KVKind::kPlain) {
    return (__m512bh)_mm512_loadu_si512(row);
  } else {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
    if constexpr (K == KVKind::kInt8) {
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(b)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(b, 1)));
      return _mm512_cvtne2ps_pbh(hi, lo);
    } else if constexpr (K == KVKind::kFp8E5M2) {  // e5m2 is the top byte of an fp16
      const __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(b), 8);
      return _mm512_cvtne2ps_pbh(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)),
                                 _mm512_cvtph_ps(_mm512_castsi512_si256(h)));
    } else {
      return (__m512bh)e4m3_to_bf16_bits(_mm512_cvtepu8_epi16(b));
    }
  }
}

// 16 cached values (unscaled) as fp32.
template <KVKind K>
static inline __m512 load_f32x16(const uint8_t* row) {
  if constexpr (K == KVKind::kPlain) {
    return bf16_to_f32(reinterpret_cast<const uint16_t*>(row));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
    if constexpr (K == KVKind::kInt8) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
    } else if constexpr (K == KVKind::kFp8E5M2) {
      return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    } else {
      const __m256i bits = e4m3_to_bf16_bits(_mm256_cvtepu8_epi16(b));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
    }
  }
}

// One KV head's view of the pool for the decode kernel: byte pointers at the head's first row, and its scales
// (int8: scale codes per slot, a stride of num_kv_heads; fp8: the head's one scale; bf16: none).
struct HeadView {
  const uint8_t* k;
  const uint8_t* v;
  const float* k_scale;
  const float* v_scale;
  const uint8_t* k_codes;
  const uint8_t* v_codes;
  int64_t row_bytes;     // between consecutive slots
  bool first_head;       // a sequence's first KV head: it pulls the whole rows (every head's) toward L2
  int64_t scale_stride;  // int8: between consecutive slots' scales
};

// One (sequence, kv head) pair in one pass (flash-decoding's online softmax), a 16-token block at a time:
// q.k by AVX-512 BF16 dot products straight from the cache (quantized rows widened to bf16 in registers, their
// scales applied to the fp32 scores and probabilities), fp32 softmax and accumulation.
// Tokens before first (a sliding window's) are masked, and blocks wholly before it never read.
template <int D, int G, KVKind K>
static void attend_bf16(const uint16_t* q, const HeadView& hv, const int64_t* table, int64_t len, uint16_t* out,
                        int64_t block_size, float scale, int64_t first) {
  constexpr int C = D / 32;  // bf16 vectors per row
  constexpr int F = D / 16;  // fp32 vectors per row
  constexpr int64_t kElem = K == KVKind::kPlain ? 2 : 1;
  constexpr bool kPerToken = K == KVKind::kInt8;
  constexpr bool kPerHead = K == KVKind::kFp8E4M3 || K == KVKind::kFp8E5M2;
  if constexpr (kPerHead) scale *= hv.k_scale[0];
  const float* scale_of = scale_code_table();
  __m512bh qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
  __m512 acc[G][F];
  float m[G], l[G];
  for (int g = 0; g < G; ++g) {
    m[g] = kNegative;
    l[g] = 0.f;
    for (int f = 0; f < F; ++f) acc[g][f] = _mm512_setzero_ps();
  }
  alignas(64) float p[G][16];
  // 16-token chunks never straddle a block when block_size is a multiple of 16; otherwise go token by token.
  const bool whole = block_size % 16 == 0;
  table += first / block_size;
  len -= first / block_size * block_size;
  const int64_t lo = first % block_size;  // the first visible token in the shifted table
  auto slot = [&](int64_t t) { return table[t / block_size] * block_size + t % block_size; };
  for (int64_t t0 = lo / 16 * 16; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0);
    const int64_t j0 = std::max<int64_t>(0, lo - t0);
    const int64_t base = whole ? slot(t0) : 0;
    if (whole && t0 + 16 < len) {  // blocks are scattered in the pool: fetch the next one while this one computes
      const int64_t next = slot(t0 + 16), rows = std::min<int64_t>(16, len - t0 - 16);
      if (hv.first_head) {
        const char* k0 = reinterpret_cast<const char*>(hv.k + next * hv.row_bytes);
        const char* v0 = reinterpret_cast<const char*>(hv.v + next * hv.row_bytes);
        for (int64_t o = 0; o < rows * hv.row_bytes; o += 64) {
          _mm_prefetch(k0 + o, _MM_HINT_T1);
          _mm_prefetch(v0 + o, _MM_HINT_T1);
        }
      }
      for (int64_t j = 0; j < rows; ++j)
        for (int64_t c = 0; c < D * kElem; c += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(hv.k + (next + j) * hv.row_bytes) + c, _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(hv.v + (next + j) * hv.row_bytes) + c, _MM_HINT_T0);
        }
    }
    alignas(64) float sc[G][16];
    alignas(64) float v_scale[16];
    for (int64_t j = 0; j < j0; ++j)
      for (int g = 0; g < G; ++g) sc[g][j] = 0.f;
    for (int64_t j = j0; j < n; ++j) {
      const int64_t sl = whole ? base + j : slot(t0 + j);
      const uint8_t* k = hv.k + sl * hv.row_bytes;
      __m512bh kv[C];
      for (int c = 0; c < C; ++c) kv[c] = load_bf16x32<K>(k + c * 32 * kElem);
      const float ks = kPerToken ? scale_of[hv.k_codes[sl * hv.scale_stride]] : 1.f;
      if constexpr (kPerToken) v_scale[j] = scale_of[hv.v_codes[sl * hv.scale_stride]];
      for (int g = 0; g < G; ++g) {
        __m512 d = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) d = _mm512_dpbf16_ps(d, qv[g][c], kv[c]);
        sc[g][j] = _mm512_reduce_add_ps(d) * ks;
      }
    }
    const __mmask16 live = static_cast<__mmask16>(((1u << n) - 1) & ~((1u << j0) - 1));
    for (int g = 0; g < G; ++g) {
      const __m512 s =
          _mm512_mask_mul_ps(_mm512_set1_ps(kNegative), live, _mm512_loadu_ps(sc[g]), _mm512_set1_ps(scale));
      const float mx = std::max(m[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(m[g] - mx);  // 0 on the first chunk (m = kNegative)
      const __m512 e = exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(mx)));
      const __m512 pe = _mm512_maskz_mov_ps(live, e);
      l[g] = l[g] * correction + _mm512_reduce_add_ps(pe);
      m[g] = mx;
      // Per-token value scales ride on the probabilities: sum p_j s_j v_j.
      _mm512_store_ps(p[g], kPerToken ? _mm512_mul_ps(pe, _mm512_maskz_loadu_ps(live, v_scale)) : pe);
      const __m512 cv = _mm512_set1_ps(correction);
      for (int f = 0; f < F; ++f) acc[g][f] = _mm512_mul_ps(acc[g][f], cv);
    }
    for (int64_t j = j0; j < n; ++j) {
      const uint8_t* v = hv.v + (whole ? base + j : slot(t0 + j)) * hv.row_bytes;
      __m512 vf[F];
      for (int f = 0; f < F; ++f) vf[f] = load_f32x16<K>(v + f * 16 * kElem);
      for (int g = 0; g < G; ++g) {
        const __m512 pj = _mm512_set1_ps(p[g][j]);
        for (int f = 0; f < F; ++f) acc[g][f] = _mm512_fmadd_ps(pj, vf[f], acc[g][f]);
      }
    }
  }
  const float v_head = kPerHead ? hv.v_scale[0] : 1.f;
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(v_head / l[g]);
    for (int f = 0; f < F; ++f) {
      // Round to nearest even into bf16 (AVX512_BF16's conversion does exactly that).
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][f], inv));
      _mm256_storeu_si256((__m256i*)(out + g * D + f * 16), (__m256i)h);
    }
  }
}

// Dispatches on the group size (query heads per KV head) so the per-head arrays live in registers.
template <int D, KVKind K>
static bool attend_bf16_group(int64_t group, const uint16_t* q, const HeadView& hv, const int64_t* table, int64_t len,
                              uint16_t* out, int64_t block_size, float scale, int64_t first) {
  switch (group) {
    case 1: attend_bf16<D, 1, K>(q, hv, table, len, out, block_size, scale, first); return true;
    case 2: attend_bf16<D, 2, K>(q, hv, table, len, out, block_size, scale, first); return true;
    case 3: attend_bf16<D, 3, K>(q, hv, table, len, out, block_size, scale, first); return true;
    case 4: attend_bf16<D, 4, K>(q, hv, table, len, out, block_size, scale, first); return true;
    case 8: attend_bf16<D, 8, K>(q, hv, table, len, out, block_size, scale, first); return true;
    default: return false;
  }
}

template <int D>
static bool attend_bf16_any(KVKind kind, int64_t group, const uint16_t* q, const HeadView& hv, const int64_t* table,
                            int64_t len, uint16_t* out, int64_t block_size, float scale, int64_t first) {
  switch (kind) {
    case KVKind::kPlain: return attend_bf16_group<D, KVKind::kPlain>(group, q, hv, table, len, out, block_size, scale, first);
    case KVKind::kInt8: return attend_bf16_group<D, KVKind::kInt8>(group, q, hv, table, len, out, block_size, scale, first);
    case KVKind::kFp8E4M3:
      return attend_bf16_group<D, KVKind::kFp8E4M3>(group, q, hv, table, len, out, block_size, scale, first);
    case KVKind::kFp8E5M2:
      return attend_bf16_group<D, KVKind::kFp8E5M2>(group, q, hv, table, len, out, block_size, scale, first);
    case KVKind::kInt4: return false;
  }
  return false;
}

#include "decode_int4.h"
#endif

#ifdef PAGEDSERVE_BF16_DECODE
static inline KVKind bf16_view_kind(const PlainRowReader<at::BFloat16>&) { return KVKind::kPlain; }
static inline KVKind bf16_view_kind(const QuantRowReader& r) { return r.kind; }

static inline HeadView head_view(const PlainRowReader<at::BFloat16>& k, const PlainRowReader<at::BFloat16>& v,
                                 int64_t kvh, int64_t d) {
  return {reinterpret_cast<const uint8_t*>(k.cache + kvh * d), reinterpret_cast<const uint8_t*>(v.cache + kvh * d),
          nullptr, nullptr, nullptr, nullptr, k.num_kv_heads * d * 2, kvh == 0, 0};
}

static inline HeadView head_view(const QuantRowReader& k, const QuantRowReader& v, int64_t kvh, int64_t d) {
  const bool per_token = k.kind == KVKind::kInt8;
  return {k.codes + kvh * d, v.codes + kvh * d, per_token ? nullptr : k.scales + kvh,
          per_token ? nullptr : v.scales + kvh, per_token ? k.row_scales + kvh : nullptr,
          per_token ? v.row_scales + kvh : nullptr, k.num_kv_heads * d, kvh == 0, per_token ? k.num_kv_heads : 0};
}
#endif

template <typename scalar_t, typename Reader, int D>
static void decode(const scalar_t* q, const Reader& k_cache, const Reader& v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, scalar_t* out, const Shape& s) {
  // Small batches run on one thread: waking the pool costs more than the work.
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t work_per_item = std::max<int64_t>(1, s.max_blocks * s.block_size * D * (group + 1));
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / work_per_item);
  at::parallel_for(0, s.num_seqs * s.num_kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t seq = idx / s.num_kv_heads, kvh = idx % s.num_kv_heads;
#ifdef PAGEDSERVE_BF16_DECODE
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> && std::is_same_v<Reader, QuantRowReader> && D <= 128) {
        if (k_cache.kind == KVKind::kInt4 && s.block_size == 16 &&
            attend_int4_group<D>(group, reinterpret_cast<const uint16_t*>(q + seq * s.q_row_stride + kvh * group * D),
                                 int4_head(k_cache, v_cache, kvh, D), block_tables + seq * s.max_blocks,
                                 context_lens[seq], reinterpret_cast<uint16_t*>(out + (seq * s.num_heads + kvh * group) * D),
                                 s.scale))
          continue;
      }
      if constexpr (std::is_same_v<scalar_t, at::BFloat16> &&
                    (std::is_same_v<Reader, PlainRowReader<at::BFloat16>> || std::is_same_v<Reader, QuantRowReader>)) {
        if (attend_bf16_any<D>(bf16_view_kind(k_cache), group,
                               reinterpret_cast<const uint16_t*>(q + seq * s.q_row_stride + kvh * group * D),
                               head_view(k_cache, v_cache, kvh, D), block_tables + seq * s.max_blocks,
                               context_lens[seq], reinterpret_cast<uint16_t*>(out + (seq * s.num_heads + kvh * group) * D),
                               s.block_size, s.scale, first_visible(context_lens[seq], s.window)))
          continue;
      }
#endif
      attend_one<scalar_t, Reader, D>(q, k_cache, v_cache, block_tables + seq * s.max_blocks, context_lens[seq], out, seq,
                              kvh, s, scores);
    }
  });
}

// q: [B, H, D], rows may be strided (a slice of the fused qkv); k_cache, v_cache: [slots, KV, D] in the model
// dtype, bfloat16, fp8 or int8 with k_scale / v_scale ([KV] float32 for fp8, [slots, KV] uint8 scale codes for int8);
// block_tables: [B, max_blocks] int64; context_lens: [B] int64 (tokens to attend, the current one included).
// int4: uint8 caches [slots, KV, D / 2], k_scale / v_scale its uint8 parameters, k_tail and tail_of_block the
// partial blocks' keys (kv_quant.h); 16-token blocks of bf16 queries take attend_int4, others are read row by row.
// window > 0: each query sees only its last `window` tokens (a sliding-window layer; the table's blocks before them
// may be freed). Returns [B, H, D]. D is 64, 128 or 256; at most 8 query heads per KV head.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, c10::optional<torch::Tensor> k_tail,
                                     c10::optional<torch::Tensor> tail_of_block, int64_t window) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches must share a format");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row [H, D] must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  const int64_t head_dim = q.size(2);
  TORCH_CHECK(head_dim == 64 || head_dim == 128 || head_dim == 256, "head_dim must be 64, 128 or 256");
  const KVKind kind = kv_kind(k_cache, q);
  TORCH_CHECK(window == 0 || kind != KVKind::kInt4, "int4 KV has no sliding window");
  TORCH_CHECK(k_cache.size(2) * (kind == KVKind::kInt4 ? 2 : 1) == head_dim, "cache rows must be head_dim wide");
  TORCH_CHECK(q.size(1) / k_cache.size(1) <= 8, "at most 8 query heads per KV head");
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto out = torch::empty({q.size(0), q.size(1), head_dim}, q.options());
  const int64_t kv = k_cache.size(1);
  Shape s{q.size(0), q.size(1), kv, block_size, bt.size(1), q.stride(0), static_cast<float>(scale), window};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    auto run = [&](const auto& kr, const auto& vr) {
      using Reader = std::decay_t<decltype(kr)>;
      if (head_dim == 64)
        decode<scalar_t, Reader, 64>(q.data_ptr<scalar_t>(), kr, vr, bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(),
                                     out.data_ptr<scalar_t>(), s);
      else if (head_dim == 128)
        decode<scalar_t, Reader, 128>(q.data_ptr<scalar_t>(), kr, vr, bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(),
                                      out.data_ptr<scalar_t>(), s);
      else
        decode<scalar_t, Reader, 256>(q.data_ptr<scalar_t>(), kr, vr, bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(),
                                      out.data_ptr<scalar_t>(), s);
    };
    if (kind != KVKind::kPlain) {
      const auto [kr, vr] = quant_readers(kind, k_cache, v_cache, k_scale, v_scale, k_tail, tail_of_block, block_size);
      run(kr, vr);
    } else if (k_cache.scalar_type() == q.scalar_type()) {
      run(PlainRowReader<scalar_t>{k_cache.data_ptr<scalar_t>(), kv}, PlainRowReader<scalar_t>{v_cache.data_ptr<scalar_t>(), kv});
    } else {  // a bfloat16 cache under a wider model dtype
      run(PlainRowReader<at::BFloat16>{k_cache.data_ptr<at::BFloat16>(), kv},
          PlainRowReader<at::BFloat16>{v_cache.data_ptr<at::BFloat16>(), kv});
    }
  });
  return out;
}
