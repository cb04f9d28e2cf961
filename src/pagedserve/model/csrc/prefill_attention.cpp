// Causal prefill attention over the paged KV pool for bf16 queries: every prefill span of a step (fresh prompts and
// chunked continuations over cached prefixes alike) in one call, flash-attention style, for every KV format.
//
// Two phases per call. First each (span, KV head) has its keys and values read once through the block table, in
// place from the pool (a quantized row dequantized in registers and rounded to bf16, as the reference reads it),
// into 32-key blocks laid out for the dot products: keys as pairs of dimensions across the block's keys, values as
// pairs of keys across the dimensions. That is O(tokens) work; the attention itself is O(tokens^2), and every
// 16-query tile of the span then reads the same blocks from L2 instead of transposing them again. Then each task (16
// query tokens of one span and KV head, all the query heads of its group) walks the key blocks up to its causal
// limit with an online softmax: blocks past the diagonal are never visited, the diagonal one is masked per row, and
// no score matrix is kept. Tasks are taken largest first from a shared counter (a causal span's last tiles cost
// many times its first ones).
//
// Paths (prefill_attention_paths(), PAGEDSERVE_PREFILL_ATTENTION in model/attention.py):
// - amx: q.k and p.v on AMX bf16 tiles (16 rows x 32 keys per block), softmax in AVX-512; Intel CPUs with AMX,
//   chosen at run time when the kernel was built for them and Linux grants the tile state.
// - avx512: vdpbf16ps, 4 query rows x 32 keys per step in registers (fp32 accumulation).
// - portable: fp32 multiply-adds in plain C++ loops the compiler vectorizes (AVX2, AVX-512F): CPUs without BF16.
// - amx-emulated: the amx path's code over tiles emulated in C++ (tests of its layouts on CPUs without tiles).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "kv_quant.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_PREFILL_BF16 1
#include "vec_math.h"
#endif

namespace {

enum Path : int64_t { kPortable = 1, kAvx512 = 2, kAmx = 3, kAmxEmulated = 4 };

constexpr int64_t kQ = 16;   // query tokens per task
constexpr int64_t kKB = 32;  // keys per block
constexpr int64_t kPackBudget = 32 << 20;  // bytes of packed keys and values per batch of (span, KV head) groups
constexpr float kLog2e = 1.44269504089f;

struct Span {
  int64_t start, num_tokens, context_len;
  const int64_t* table;
};

struct Shape {
  int64_t heads, kv_heads, group, block_size, q_stride;
  float c;  // softmax scale times log2(e): probabilities are 2^(c (s - max))
  int64_t window;  // > 0: each query sees only its last `window` keys (a sliding-window layer)
};

// One span's keys and values for one KV head, packed (see pack_bf16 / pack_f32).
struct Group {
  int64_t span, head, blocks;
  uint8_t* packed;
};

struct Task {
  int64_t group, q0, cost;
};

inline uint16_t round_bf16(float f) {  // round to nearest even, as PyTorch's conversion (finite inputs)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline float widen_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// 2^t for t <= 0 in plain C++ that vectorizes: 2^n times a degree-6 polynomial of the fraction.
inline float exp2_nonpositive_scalar(float t) {
  t = std::max(t, -125.f);
  const float n = std::floor(t + 0.5f), f = t - n;
  float p = 1.535336188e-4f;
  p = p * f + 1.339887440e-3f;
  p = p * f + 9.618437357e-3f;
  p = p * f + 5.550332471e-2f;
  p = p * f + 2.402264791e-1f;
  p = p * f + 6.931472028e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

// The pool as the kernel reads it: bf16 rows in place, or quantized rows through their readers.
struct Source {
  const uint16_t* k;
  const uint16_t* v;
  const QuantRowReader* kq;
  const QuantRowReader* vq;
  int64_t kv_heads;

  // Row (slot, head) of the keys or values as D bf16: a pointer into the pool, or dequantized into stage.
  template <int D>
  const uint16_t* row(bool value, int64_t slot, int64_t head, uint16_t* stage) const {
    if (kq == nullptr) return (value ? v : k) + (slot * kv_heads + head) * D;
    alignas(64) float f[D];
    (value ? vq : kq)->template load<D>(slot, head, f);
    for (int i = 0; i < D; ++i) stage[i] = round_bf16(f[i]);
    return stage;
  }
};

template <int D>
constexpr int64_t block_bytes(bool bf16) {
  return bf16 ? kKB * D * 4 : kKB * D * 8;  // keys and values, bf16 or fp32
}

inline void block_slots(const Span& sp, int64_t block, int64_t block_size, int64_t keys, int64_t* slots, int64_t& n) {
  const int64_t k0 = block * kKB;
  n = std::min(kKB, keys - k0);
  for (int64_t j = 0; j < n; ++j) slots[j] = sp.table[(k0 + j) / block_size] * block_size + (k0 + j) % block_size;
}

// fp32 block: kt [D][32] (dimension d of the 32 keys), then v [32][D]; keys past n are zero.
template <int D>
void pack_f32(const Source& src, int64_t head, const int64_t* slots, int64_t n, float* kt) {
  float* v = kt + D * kKB;
  alignas(64) uint16_t stage[D];
  for (int64_t j = 0; j < kKB; ++j) {
    if (j >= n) {
      for (int d = 0; d < D; ++d) kt[d * kKB + j] = v[j * D + d] = 0.f;
      continue;
    }
    const uint16_t* k = src.row<D>(false, slots[j], head, stage);
    for (int d = 0; d < D; ++d) kt[d * kKB + j] = widen_bf16(k[d]);
    const uint16_t* vr = src.row<D>(true, slots[j], head, stage);
    for (int d = 0; d < D; ++d) v[j * D + d] = widen_bf16(vr[d]);
  }
}

// Rows of one task: token i of the tile and query head g of the group are row i * group + g. Rows are in causal
// order: each sees the keys from its first up to its limit, and neither decreases along the rows.
struct Rows {
  int64_t n = 0, padded = 0;
  std::vector<int64_t> limit, first;
  std::vector<float> m, l_storage, o_storage;
  float* o = nullptr;  // [padded][D], 64-byte aligned
  float* l = nullptr;  // [padded][16]: each row's sum of probabilities in 16 partial sums, 64-byte aligned

  void reset(int64_t rows, int64_t pad_to, int64_t d) {
    n = rows;
    padded = (rows + pad_to - 1) / pad_to * pad_to;
    limit.assign(padded, 0);  // padding rows see nothing
    first.assign(padded, 0);
    m.assign(padded + 4, -1e30f);  // read four rows at a time
    l_storage.assign(padded * 16 + 16, 0.f);
    o_storage.assign(padded * d + 16, 0.f);
    o = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(o_storage.data()) + 63) & ~uintptr_t(63));
    l = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(l_storage.data()) + 63) & ~uintptr_t(63));
  }

  // The first row that sees a key of the block starting at k0.
  int64_t first_live(int64_t k0) const {
    return std::lower_bound(limit.begin(), limit.begin() + n, k0 + 1) - limit.begin();
  }
};

// Task setup shared by the paths: rows, limits and the query pointer of each row.
inline void task_rows(const Task& t, const Span& sp, const Group& g, const Shape& s, const uint16_t* q, int64_t d,
                      int64_t pad_to, Rows& rows, std::vector<const uint16_t*>& qrow) {
  const int64_t nq = std::min(kQ, sp.num_tokens - t.q0), n = nq * s.group;
  rows.reset(n, pad_to, d);
  qrow.resize(n);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t h = 0; h < s.group; ++h) {
      rows.limit[i * s.group + h] = sp.context_len + t.q0 + i + 1;
      rows.first[i * s.group + h] = s.window > 0 ? std::max<int64_t>(0, rows.limit[i * s.group + h] - s.window) : 0;
      qrow[i * s.group + h] = q + (sp.start + t.q0 + i) * s.q_stride + (g.head * s.group + h) * d;
    }
}

// out rows = o / l, rounded to bf16.
template <int D>
void store_rows(const Task& t, const Span& sp, const Group& g, const Shape& s, const Rows& rows, uint16_t* out) {
  for (int64_t r = 0; r < rows.n; ++r) {
    const int64_t i = r / s.group, h = g.head * s.group + r % s.group;
    uint16_t* dst = out + ((sp.start + t.q0 + i) * s.heads + h) * D;
    float sum = 0.f;
    for (int i = 0; i < 16; ++i) sum += rows.l[r * 16 + i];
    const float inv = 1.f / sum;
    for (int d = 0; d < D; ++d) dst[d] = round_bf16(rows.o[r * D + d] * inv);
  }
}

// The portable path's vectors: GCC / Clang vector extensions as wide as the target's registers (16 floats with
// AVX-512, 8 with AVX2; narrower ones only cost speed).
#if defined(__AVX512F__)
constexpr int kW = 16;
#else
constexpr int kW = 8;
#endif
typedef float fvec __attribute__((vector_size(kW * 4)));
typedef int32_t ivec __attribute__((vector_size(kW * 4)));
constexpr int kKV = kKB / kW;  // vectors per block of keys

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void storev(float* p, fvec v) { std::memcpy(p, &v, sizeof(v)); }

// 2^t for t <= 0, lane by lane: 2^n times a degree-4 polynomial of the fraction (relative error 4e-6).
inline fvec exp2_probability_v(fvec t) {
  t = t < -125.f ? fvec{} - 125.f : t;
  const ivec n = __builtin_convertvector(t - 0.5f, ivec);  // truncation toward zero: t rounded (t <= 0)
  const fvec f = t - __builtin_convertvector(n, fvec);
  fvec p = f * 9.676037098e-3f + 5.592203565e-2f;
  p = p * f + 2.402210736e-1f;
  p = p * f + 6.931210340e-1f;
  p = p * f + 1.000000075f;
  const ivec bits = (n + 127) << 23;
  fvec scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// R rows against one fp32 block: q.k into registers, the softmax row by row, o = o * corr + p.v.
template <int D, int R>
inline void rows_portable(const float* q, Rows& rows, int64_t r0, const float* kt, int64_t k0, float c) {
  const float* v = kt + D * kKB;
  fvec s[R][kKV];
  for (int r = 0; r < R; ++r)
    for (int x = 0; x < kKV; ++x) s[r][x] = fvec{};
  for (int d = 0; d < D; ++d) {
    fvec k[kKV];
    for (int x = 0; x < kKV; ++x) k[x] = loadv(kt + d * kKB + x * kW);
    for (int r = 0; r < R; ++r) {
      const float qd = q[(r0 + r) * D + d];
      for (int x = 0; x < kKV; ++x) s[r][x] += qd * k[x];
    }
  }
  alignas(64) float p[R][kKB];
  float corr[R];
  ivec lane;
  for (int i = 0; i < kW; ++i) lane[i] = i;
  for (int r = 0; r < R; ++r) {
    const int64_t row = r0 + r;
    const int32_t visible = static_cast<int32_t>(std::clamp<int64_t>(rows.limit[row] - k0, 0, kKB));
    const int32_t hidden = static_cast<int32_t>(std::clamp<int64_t>(rows.first[row] - k0, 0, kKB));
    if (visible <= hidden) {
      corr[r] = 1.f;
      std::fill(p[r], p[r] + kKB, 0.f);
      continue;
    }
    ivec live[kKV];
    fvec top = fvec{} - 1e30f;
    for (int x = 0; x < kKV; ++x) {
      live[x] = (lane + x * kW < visible) & (lane + x * kW >= hidden);
      s[r][x] = live[x] ? s[r][x] : fvec{} - 1e30f;
      top = top > s[r][x] ? top : s[r][x];
    }
    float& m = rows.m[row];
    float mx = m;
    for (int i = 0; i < kW; ++i) mx = std::max(mx, top[i]);
    corr[r] = exp2_nonpositive_scalar((m - mx) * c);
    m = mx;
    fvec sum = fvec{};
    for (int x = 0; x < kKV; ++x) {
      const fvec e = live[x] ? exp2_probability_v(s[r][x] * c - mx * c) : fvec{};
      sum += e;
      storev(p[r] + x * kW, e);
    }
    float total = 0.f;
    for (int i = 0; i < kW; ++i) total += sum[i];
    rows.l[row * 16] = rows.l[row * 16] * corr[r] + total;
  }
  for (int f = 0; f < D / kW; ++f) {
    fvec acc[R];
    for (int r = 0; r < R; ++r) acc[r] = loadv(rows.o + (r0 + r) * D + kW * f) * corr[r];
    for (int j = 0; j < kKB; ++j) {
      const fvec vv = loadv(v + j * D + kW * f);
      for (int r = 0; r < R; ++r) acc[r] += p[r][j] * vv;
    }
    for (int r = 0; r < R; ++r) storev(rows.o + (r0 + r) * D + kW * f, acc[r]);
  }
}

template <int D>
void task_portable(const Task& t, const Span& sp, const Group& g, const Shape& s, const uint16_t* q, uint16_t* out,
                   Rows& rows, std::vector<const uint16_t*>& qrow, std::vector<float>& qf) {
  task_rows(t, sp, g, s, q, D, 1, rows, qrow);
  qf.resize(rows.n * D);
  for (int64_t r = 0; r < rows.n; ++r)
    for (int d = 0; d < D; ++d) qf[r * D + d] = widen_bf16(qrow[r][d]);
  const int64_t keys = rows.limit[rows.n - 1], blocks = (keys + kKB - 1) / kKB;
  for (int64_t b = rows.first[0] / kKB; b < blocks; ++b) {
    const int64_t k0 = b * kKB;
    const float* kt = reinterpret_cast<const float*>(g.packed + b * block_bytes<D>(false));
    int64_t r = rows.first_live(k0);
    for (; r + 4 <= rows.n; r += 4) rows_portable<D, 4>(qf.data(), rows, r, kt, k0, s.c);
    for (; r < rows.n; ++r) rows_portable<D, 1>(qf.data(), rows, r, kt, k0, s.c);
  }
  store_rows<D>(t, sp, g, s, rows, out);
}

#ifdef PAGEDSERVE_PREFILL_BF16
// bf16 block: kt [D/2][32] u32 (dimensions 2i, 2i+1 of each of the 32 keys), then vp [16][D] u32 (dimension d of keys
// 2p and 2p+1). The AVX-512 kernel broadcasts a query pair against kt and a probability pair against vp; as tiles, kt
// is q.k's B operand (16 dimension pairs x 16 keys, a row stride of 128 bytes) and vp is p.v's (16 key pairs x 16
// dimensions, a row stride of 4 D bytes).
template <int D>
void pack_bf16(const Source& src, int64_t head, const int64_t* slots, int64_t n, uint32_t* kt) {
  uint32_t* vp = kt + D / 2 * kKB;
  alignas(64) static const uint16_t zero[D] = {};
  alignas(64) uint16_t stage[2][kKB][D];
  const uint16_t* k[kKB];
  const uint16_t* v[kKB];
  for (int64_t j = 0; j < kKB; ++j) {
    k[j] = j < n ? src.row<D>(false, slots[j], head, stage[0][j]) : zero;
    v[j] = j < n ? src.row<D>(true, slots[j], head, stage[1][j]) : zero;
  }
  for (int j0 = 0; j0 < kKB; j0 += 16)
    for (int i0 = 0; i0 < D / 2; i0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(k[j0 + j] + 2 * i0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (i0 + i) * kKB + j0, r[i]);
    }
  // Two value rows interleaved: out[2d] = a[d], out[2d + 1] = b[d], 16 dimensions per vector.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int p = 0; p < kKB / 2; ++p)
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(v[2 * p] + c * 32);
      const __m512i b = _mm512_loadu_si512(v[2 * p + 1] + c * 32);
      _mm512_store_si512(vp + p * D + c * 32, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(vp + p * D + c * 32 + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// 2^t for t <= 0 to the precision bf16 probabilities need: degree 4 for 2^f, |f| <= 1/2 (relative error 4e-6).
inline __m512 exp2_probability(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(9.676037098e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.592203565e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402210736e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931210340e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000075f));
  return _mm512_scalef_ps(p, n);
}

// Lanes 4r..4r+3 of the result: the largest of a[r]'s 16 lanes (four rows' horizontal maxima in one pass).
inline __m512 rowmax4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 x = _mm512_max_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 y = _mm512_max_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
  __m512 z = _mm512_max_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                           _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  z = _mm512_max_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm512_max_ps(z, _mm512_permute_ps(z, _MM_SHUFFLE(2, 3, 0, 1)));
}

// Lane group r (lanes 4r..4r+3) of v in all 16 lanes.
inline __m512 group_lane(__m512 v, int r) { return _mm512_permutexvar_ps(_mm512_set1_epi32(4 * r), v); }

// The online softmax's update of R rows (R <= 4) by their scores against one block (s[r][0]: keys 0-15, s[r][1]:
// 16-31). Row r0 + r sees the block's keys from first[r0 + r] - k0 to limit[r0 + r] - k0 (all of them unless
// `diagonal`: on the causal diagonal or a window's edge). Sets p[r] to the
// probabilities as 32 bf16 in key order and corr[r] to the factor the row's output so far is to be scaled by; the
// running maxima (m, one per row) and sums (l, 16 lanes per row, added up at the end) are updated in place.
template <int R>
inline void softmax_rows(__m512 (&s)[R][2], const Rows& rows, int64_t r0, int64_t k0, bool diagonal, float c,
                         float* m, float* l, uint32_t (*p)[kKB / 2], __m512 (&corr)[R]) {
  __mmask16 keep[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    keep[r][0] = keep[r][1] = 0xFFFF;
    if (diagonal) {
      const int64_t visible = std::clamp<int64_t>(rows.limit[r0 + r] - k0, 0, kKB);
      const int64_t hidden = std::clamp<int64_t>(rows.first[r0 + r] - k0, 0, kKB);
      const __mmask32 below = visible >= kKB ? ~__mmask32(0) : (__mmask32(1) << visible) - 1;
      const __mmask32 k = below & ~(hidden >= kKB ? ~__mmask32(0) : (__mmask32(1) << hidden) - 1);
      keep[r][0] = static_cast<__mmask16>(k);
      keep[r][1] = static_cast<__mmask16>(k >> 16);
      s[r][0] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegative), keep[r][0], s[r][0]);
      s[r][1] = _mm512_mask_mov_ps(_mm512_set1_ps(kNegative), keep[r][1], s[r][1]);
    }
  }
  __m512 top[4];
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r) top[r] = r < R ? _mm512_max_ps(s[r][0], s[r][1]) : _mm512_set1_ps(kNegative);
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512 before = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(m + r0)));
  const __m512 after = _mm512_max_ps(before, rowmax4(top[0], top[1], top[2], top[3]));
  const __m512 factor = exp2_probability(_mm512_mul_ps(_mm512_sub_ps(before, after), _mm512_set1_ps(c)));
  const __m512i gather = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
  _mm_mask_storeu_ps(m + r0, static_cast<__mmask8>((1 << R) - 1),
                     _mm512_castps512_ps128(_mm512_permutexvar_ps(gather, after)));
  const __m512 cv = _mm512_set1_ps(c);
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    corr[r] = group_lane(factor, r);
    const __m512 shift = _mm512_mul_ps(group_lane(after, r), cv);
    __m512 e0 = exp2_probability(_mm512_fmsub_ps(s[r][0], cv, shift));
    __m512 e1 = exp2_probability(_mm512_fmsub_ps(s[r][1], cv, shift));
    if (diagonal) {  // masked keys (and rows that see none of the block) add nothing
      e0 = _mm512_maskz_mov_ps(keep[r][0], e0);
      e1 = _mm512_maskz_mov_ps(keep[r][1], e1);
    }
    float* lr = l + (r0 + r) * 16;
    _mm512_store_ps(lr, _mm512_fmadd_ps(_mm512_load_ps(lr), corr[r], _mm512_add_ps(e0, e1)));
    _mm512_store_si512(p[r], reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e1, e0)));
  }
}

// R rows (R <= 4) against one block: q.k into registers, the softmax, then o = o * corr + p.v four output vectors at
// a time (o rows in the task's buffer, L1-resident).
template <int D, int R>
inline void rows_avx512(const uint16_t* const* q, Rows& rows, int64_t r0, const uint32_t* kt, int64_t k0, float c) {
  const uint32_t* vp = kt + D / 2 * kKB;
  __m512 s[R][2];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    const __m512bh k0v = reinterpret_cast<__m512bh>(_mm512_load_si512(kt + i * kKB));
    const __m512bh k1v = reinterpret_cast<__m512bh>(_mm512_load_si512(kt + i * kKB + 16));
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      uint32_t pair;
      std::memcpy(&pair, q[r] + 2 * i, 4);
      const __m512bh qb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
      s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0v);
      s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1v);
    }
  }
  alignas(64) uint32_t p[R][kKB / 2];
  __m512 corr[R];
  // Limits and firsts grow along the rows: the first row's limit is the smallest, the last row's first the largest.
  const bool diagonal = rows.limit[r0] < k0 + kKB || rows.first[r0 + R - 1] > k0;
  softmax_rows<R>(s, rows, r0, k0, diagonal, c, rows.m.data(), rows.l, p, corr);
  asm volatile("" : : "r"(p) : "memory");  // p is read back by broadcasts from memory, not shuffled out of registers
  for (int f0 = 0; f0 < D / 16; f0 += 4) {
    __m512 acc[R][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f)
        acc[r][f] = _mm512_mul_ps(_mm512_load_ps(rows.o + (r0 + r) * D + 16 * (f0 + f)), corr[r]);
#pragma GCC unroll 2
    for (int pp = 0; pp < kKB / 2; ++pp) {
      __m512bh vv[4];
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f) vv[f] = reinterpret_cast<__m512bh>(_mm512_load_si512(vp + pp * D + 16 * (f0 + f)));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m512bh pb = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(p[r][pp])));
#pragma GCC unroll 4
        for (int f = 0; f < 4; ++f) acc[r][f] = _mm512_dpbf16_ps(acc[r][f], pb, vv[f]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int f = 0; f < 4; ++f) _mm512_store_ps(rows.o + (r0 + r) * D + 16 * (f0 + f), acc[r][f]);
  }
}

template <int D>
void task_avx512(const Task& t, const Span& sp, const Group& g, const Shape& s, const uint16_t* q, uint16_t* out,
                 Rows& rows, std::vector<const uint16_t*>& qrow) {
  task_rows(t, sp, g, s, q, D, 1, rows, qrow);
  const int64_t keys = rows.limit[rows.n - 1], blocks = (keys + kKB - 1) / kKB;
  for (int64_t b = rows.first[0] / kKB; b < blocks; ++b) {
    const int64_t k0 = b * kKB;
    const uint32_t* kt = reinterpret_cast<const uint32_t*>(g.packed + b * block_bytes<D>(true));
    int64_t r = rows.first_live(k0);
    for (; r + 4 <= rows.n; r += 4) rows_avx512<D, 4>(qrow.data() + r, rows, r, kt, k0, s.c);
    switch (rows.n - r) {
      case 3: rows_avx512<D, 3>(qrow.data() + r, rows, r, kt, k0, s.c); break;
      case 2: rows_avx512<D, 2>(qrow.data() + r, rows, r, kt, k0, s.c); break;
      case 1: rows_avx512<D, 1>(qrow.data() + r, rows, r, kt, k0, s.c); break;
      default: break;
    }
  }
  store_rows<D>(t, sp, g, s, rows, out);
}

// AMX's tile instructions on 8 tiles of 16 rows x 64 bytes, in plain C++: the amx path's code run where there are no
// tiles, so that its operand layouts are tested on every CPU with AVX-512 BF16.
struct EmulatedTiles {
  alignas(64) uint8_t t[8][16][64];

  void configure() {}
  void release() {}
  template <int T>
  void zero() { std::memset(t[T], 0, sizeof(t[T])); }
  template <int T>
  void load(const void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(t[T][r], static_cast<const uint8_t*>(p) + r * stride, 64);
  }
  template <int T>
  void store(void* p, int64_t stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<uint8_t*>(p) + r * stride, t[T][r], 64);
  }
  // TDPBF16PS: C[m][n] += sum over k of A[m][2k] B[k][2n] + A[m][2k + 1] B[k][2n + 1] (bf16 products, fp32 sums).
  template <int C, int A, int B>
  void dpbf16() {
    for (int m = 0; m < 16; ++m)
      for (int n = 0; n < 16; ++n) {
        float acc;
        std::memcpy(&acc, t[C][m] + 4 * n, 4);
        for (int k = 0; k < 16; ++k) {
          uint16_t a[2], b[2];
          std::memcpy(a, t[A][m] + 4 * k, 4);
          std::memcpy(b, t[B][k] + 4 * n, 4);
          acc += widen_bf16(a[0]) * widen_bf16(b[0]) + widen_bf16(a[1]) * widen_bf16(b[1]);
        }
        std::memcpy(t[C][m] + 4 * n, &acc, 4);
      }
  }
};

#ifdef PAGEDSERVE_AMX
struct AmxTiles {
  void configure() { pagedserve_amx::configure_tiles(); }
  void release() { _tile_release(); }
  template <int T>
  void zero() { _tile_zero(T); }
  template <int T>
  void load(const void* p, int64_t stride) { _tile_loadd(T, p, stride); }
  template <int T>
  void store(void* p, int64_t stride) { _tile_stored(T, p, stride); }
  template <int C, int A, int B>
  void dpbf16() { _tile_dpbf16ps(C, A, B); }
};
#endif

// Per thread: the task's queries as 16-row A tiles and the buffers tiles are stored to between instructions.
struct TileBuffers {
  std::vector<uint16_t> q_storage;
  uint16_t* q = nullptr;                 // [padded rows][D] bf16
  alignas(64) float s[16][kKB];          // q.k of 16 rows
  alignas(64) uint32_t p[16][kKB / 2];   // their probabilities, bf16 pairs: p.v's A tile
  alignas(64) float pv[16][64];          // p.v of 16 rows x 64 dimensions (4 C tiles)
  __m512 corr[16];                       // the factor each row's output so far is scaled by
};

// The task on tiles: per key block and 16 rows, tiles 0-1 take q.k (keys 0-15 and 16-31; A = the rows' queries, 32
// dimensions per step, B = kt), AVX-512 the softmax, then tiles 0-3 take p.v 64 output dimensions at a time (A = p in
// tile 4, B = vp) and AVX-512 folds them into o: o = o * corr + p.v.
template <int D, typename Tiles>
void task_tiles(const Task& t, const Span& sp, const Group& g, const Shape& s, const uint16_t* q, uint16_t* out,
                Rows& rows, std::vector<const uint16_t*>& qrow, Tiles& tiles, TileBuffers& buf) {
  task_rows(t, sp, g, s, q, D, 16, rows, qrow);
  buf.q_storage.assign(rows.padded * D + 32, 0);
  buf.q = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(buf.q_storage.data()) + 63) & ~uintptr_t(63));
  for (int64_t r = 0; r < rows.n; ++r) std::memcpy(buf.q + r * D, qrow[r], D * 2);
  const int64_t keys = rows.limit[rows.n - 1], blocks = (keys + kKB - 1) / kKB;
  for (int64_t b = rows.first[0] / kKB; b < blocks; ++b) {
    const int64_t k0 = b * kKB;
    const uint32_t* kt = reinterpret_cast<const uint32_t*>(g.packed + b * block_bytes<D>(true));
    const uint32_t* vp = kt + D / 2 * kKB;
    for (int64_t r0 = rows.first_live(k0) / 16 * 16; r0 < rows.n; r0 += 16) {
      tiles.template zero<0>();
      tiles.template zero<1>();
      for (int ks = 0; ks < D / 32; ++ks) {
        tiles.template load<4>(buf.q + r0 * D + ks * 32, D * 2);
        tiles.template load<6>(kt + ks * 16 * kKB, kKB * 4);
        tiles.template load<7>(kt + ks * 16 * kKB + 16, kKB * 4);
        tiles.template dpbf16<0, 4, 6>();
        tiles.template dpbf16<1, 4, 7>();
      }
      tiles.template store<0>(&buf.s[0][0], kKB * 4);
      tiles.template store<1>(&buf.s[0][16], kKB * 4);
      for (int g4 = 0; g4 < 16; g4 += 4) {
        __m512 sc[4][2];
        for (int r = 0; r < 4; ++r) {
          sc[r][0] = _mm512_load_ps(buf.s[g4 + r]);
          sc[r][1] = _mm512_load_ps(buf.s[g4 + r] + 16);
        }
        const bool diagonal =
            rows.limit[r0 + g4] < k0 + kKB || r0 + g4 + 4 > rows.n || rows.first[r0 + g4 + 3] > k0;
        softmax_rows<4>(sc, rows, r0 + g4, k0, diagonal, s.c, rows.m.data(), rows.l, &buf.p[g4],
                        *reinterpret_cast<__m512(*)[4]>(&buf.corr[g4]));
      }
      tiles.template load<4>(&buf.p[0][0], kKB * 2);
      for (int c0 = 0; c0 < D / 16; c0 += 4) {
        tiles.template zero<0>();
        tiles.template zero<1>();
        tiles.template zero<2>();
        tiles.template zero<3>();
        tiles.template load<6>(vp + (c0 + 0) * 16, D * 4);
        tiles.template dpbf16<0, 4, 6>();
        tiles.template load<7>(vp + (c0 + 1) * 16, D * 4);
        tiles.template dpbf16<1, 4, 7>();
        tiles.template load<6>(vp + (c0 + 2) * 16, D * 4);
        tiles.template dpbf16<2, 4, 6>();
        tiles.template load<7>(vp + (c0 + 3) * 16, D * 4);
        tiles.template dpbf16<3, 4, 7>();
        tiles.template store<0>(&buf.pv[0][0], 256);
        tiles.template store<1>(&buf.pv[0][16], 256);
        tiles.template store<2>(&buf.pv[0][32], 256);
        tiles.template store<3>(&buf.pv[0][48], 256);
        for (int rr = 0; rr < 16; ++rr) {
          float* o = rows.o + (r0 + rr) * D + 16 * c0;
          for (int f = 0; f < 4; ++f)
            _mm512_store_ps(o + 16 * f,
                            _mm512_fmadd_ps(_mm512_load_ps(o + 16 * f), buf.corr[rr], _mm512_load_ps(buf.pv[rr] + 16 * f)));
        }
      }
    }
  }
  store_rows<D>(t, sp, g, s, rows, out);
}
#endif  // PAGEDSERVE_PREFILL_BF16

bool amx_ready() {
#ifdef PAGEDSERVE_AMX
  return pagedserve_amx::amx_permitted();
#else
  return false;
#endif
}

template <int D>
void pack_group_block(int64_t path, const Source& src, const Span& sp, const Group& g, int64_t block, int64_t block_size) {
  int64_t slots[kKB], n;
  block_slots(sp, block, block_size, sp.context_len + sp.num_tokens, slots, n);
  uint8_t* dst = g.packed + block * block_bytes<D>(path != kPortable);
  if (path == kPortable) {
    pack_f32<D>(src, g.head, slots, n, reinterpret_cast<float*>(dst));
    return;
  }
#ifdef PAGEDSERVE_PREFILL_BF16
  pack_bf16<D>(src, g.head, slots, n, reinterpret_cast<uint32_t*>(dst));
#endif
}

// One batch of groups: pack their blocks, then run their tasks, largest first, on every thread.
template <int D>
void run_batch(int64_t path, const Source& src, const std::vector<Span>& spans, std::vector<Group>& groups,
               const Shape& s, const uint16_t* q, uint16_t* out) {
  const bool bf16 = path != kPortable;
  int64_t bytes = 0;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (group, block)
  for (int64_t i = 0; i < static_cast<int64_t>(groups.size()); ++i) {
    bytes += groups[i].blocks * block_bytes<D>(bf16);
    for (int64_t b = 0; b < groups[i].blocks; ++b) blocks.emplace_back(i, b);
  }
  const torch::Tensor storage = torch::empty({bytes + 64}, torch::kUInt8);
  uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(storage.data_ptr()) + 63) & ~uintptr_t(63));
  for (auto& g : groups) {
    g.packed = base;
    base += g.blocks * block_bytes<D>(bf16);
  }
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Group& g = groups[blocks[i].first];
      pack_group_block<D>(path, src, spans[g.span], g, blocks[i].second, s.block_size);
    }
  });
  std::vector<Task> tasks;
  int64_t total = 0;
  for (int64_t i = 0; i < static_cast<int64_t>(groups.size()); ++i) {
    const Span& sp = spans[groups[i].span];
    for (int64_t q0 = 0; q0 < sp.num_tokens; q0 += kQ) {
      const int64_t nq = std::min(kQ, sp.num_tokens - q0);
      tasks.push_back({i, q0, nq * s.group * (sp.context_len + q0 + nq + kKB)});
      total += tasks.back().cost;
    }
  }
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  // Small calls stay on this thread: waking the pool costs more than they do.
  const int64_t threads = total < (1 << 15) ? 1 : std::min<int64_t>(at::get_num_threads(), tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Rows rows;
    std::vector<const uint16_t*> qrow;
    std::vector<float> qf;
#ifdef PAGEDSERVE_PREFILL_BF16
    EmulatedTiles emulated;
    TileBuffers buf;
#ifdef PAGEDSERVE_AMX
    AmxTiles amx;
    if (path == kAmx) amx.configure();
#endif
#endif
    for (int64_t worker = begin; worker < end; ++worker) {
      for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++) {
        const Task& t = tasks[i];
        const Group& g = groups[t.group];
        const Span& sp = spans[g.span];
        if (path == kPortable) {
          task_portable<D>(t, sp, g, s, q, out, rows, qrow, qf);
          continue;
        }
#ifdef PAGEDSERVE_PREFILL_BF16
        if (path == kAvx512) {
          task_avx512<D>(t, sp, g, s, q, out, rows, qrow);
        } else if (path == kAmxEmulated) {
          task_tiles<D>(t, sp, g, s, q, out, rows, qrow, emulated, buf);
        } else {
#ifdef PAGEDSERVE_AMX
          task_tiles<D>(t, sp, g, s, q, out, rows, qrow, amx, buf);
#endif
        }
#endif
      }
    }
#if defined(PAGEDSERVE_PREFILL_BF16) && defined(PAGEDSERVE_AMX)
    if (path == kAmx) amx.release();
#endif
  });
}

}  // namespace

std::vector<int64_t> prefill_attention_paths() {
  std::vector<int64_t> paths{kPortable};
#ifdef PAGEDSERVE_PREFILL_BF16
  paths.push_back(kAvx512);
  paths.push_back(kAmxEmulated);
#endif
  if (amx_ready()) paths.push_back(kAmx);
  return paths;
}

// q: [T, H, D] bf16 (rows may be strided, each [H, D] contiguous); k_cache, v_cache: [slots, KV, D], bf16 or fp8 /
// int8 / int4 with their scales (kv_quant.h), holding every span's keys, this step's included; spans: [S, 3] int64 rows
// (first row in q, new tokens, tokens already cached); block_tables: [S, max_blocks] int64. Writes the spans' rows
// of out ([T, H, D], contiguous). path: a Path, or -1 for the fastest this CPU runs. window > 0: each query sees
// only its last `window` keys (a sliding-window layer).
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, torch::Tensor spans,
                       torch::Tensor block_tables, int64_t block_size, double scale, torch::Tensor out,
                       c10::optional<torch::Tensor> k_tail, c10::optional<torch::Tensor> tail_of_block, int64_t path,
                       int64_t window) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "prefill_attention is for bfloat16");
  const KVKind kind = kv_kind(k_cache, q);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches must share a format");
  TORCH_CHECK(kind != KVKind::kPlain || k_cache.scalar_type() == torch::kBFloat16, "an unquantized cache must be bf16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "caches and out must be contiguous");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row [H, D] must be contiguous");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64 && spans.dim() == 2 &&
              spans.size(1) == 3 && block_tables.dim() == 2 && block_tables.size(0) == spans.size(0),
              "spans must be int64 [S, 3] and block_tables int64 [S, max_blocks]");
  const int64_t d = q.size(2), num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128 || d == 256, "head_dim must be 64, 128 or 256");
  TORCH_CHECK(window >= 0, "window must be 0 (none) or positive");
  TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(k_cache.size(2) * (kind == KVKind::kInt4 ? 2 : 1) == d, "cache rows must be head_dim wide");
  TORCH_CHECK(out.sizes() == q.sizes(), "out must be shaped like q");
  const auto built = prefill_attention_paths();
  if (path < 0) path = amx_ready() ? kAmx : built.size() > 1 ? kAvx512 : kPortable;
  TORCH_CHECK(std::find(built.begin(), built.end(), path) != built.end(), "prefill attention path ", path,
              " is not built for this CPU");
  QuantRowReader kr{}, vr{};
  Source src{reinterpret_cast<const uint16_t*>(k_cache.data_ptr()), reinterpret_cast<const uint16_t*>(v_cache.data_ptr()),
             nullptr, nullptr, num_kv_heads};
  if (kind != KVKind::kPlain) {
    std::tie(kr, vr) = quant_readers(kind, k_cache, v_cache, k_scale, v_scale, k_tail, tail_of_block, block_size);
    src.kq = &kr;
    src.vq = &vr;
  }
  const auto sp_t = spans.contiguous();
  const auto bt = block_tables.contiguous();
  const int64_t* sv = sp_t.data_ptr<int64_t>();
  const int64_t slots = k_cache.size(0), total_rows = q.size(0);
  std::vector<Span> sp;
  for (int64_t i = 0; i < sp_t.size(0); ++i) {
    const Span x{sv[3 * i], sv[3 * i + 1], sv[3 * i + 2], bt.data_ptr<int64_t>() + i * bt.size(1)};
    TORCH_CHECK(x.start >= 0 && x.num_tokens >= 0 && x.context_len >= 0 && x.start + x.num_tokens <= total_rows,
                "span ", i, " is out of range");
    const int64_t keys = x.context_len + x.num_tokens;
    TORCH_CHECK(keys <= bt.size(1) * block_size, "span ", i, "'s block table is too short");
    for (int64_t b = 0; b < (keys + block_size - 1) / block_size; ++b)
      TORCH_CHECK(x.table[b] >= 0 && (x.table[b] + 1) * block_size <= slots, "span ", i, " names a block outside the pool");
    sp.push_back(x);
  }
  const Shape shape{num_heads, num_kv_heads, num_heads / num_kv_heads, block_size, q.stride(0),
                    static_cast<float>(scale) * kLog2e, window};
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t per_block = (path == kPortable ? 2 : 1) * kKB * d * 4;
  std::vector<Group> batch;
  int64_t batch_bytes = 0;
  const auto flush = [&] {
    if (batch.empty()) return;
    if (d == 64) run_batch<64>(path, src, sp, batch, shape, qp, op);
    else if (d == 128) run_batch<128>(path, src, sp, batch, shape, qp, op);
    else run_batch<256>(path, src, sp, batch, shape, qp, op);
    batch.clear();
    batch_bytes = 0;
  };
  for (int64_t i = 0; i < static_cast<int64_t>(sp.size()); ++i) {
    if (sp[i].num_tokens == 0) continue;
    const int64_t blocks = (sp[i].context_len + sp[i].num_tokens + kKB - 1) / kKB;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      if (batch_bytes > 0 && batch_bytes + blocks * per_block > kPackBudget) flush();
      batch.push_back({i, h, blocks, nullptr});
      batch_bytes += blocks * per_block;
    }
  }
  flush();
}
