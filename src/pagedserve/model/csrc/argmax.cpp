// Greedy decoding's argmax over each row of logits (fp32 or bf16): the first index of the row's largest value, or
// of its first NaN, as torch.max(dim=-1) returns it. PyTorch's CPU reduction with indices runs at about one element
// per cycle; a batch of 64 rows over Gemma's 262,144-token vocabulary took 12-17 ms of a ~130 ms decode step. Here
// each 16-lane vector keeps its lanes' running maximum and where it was first seen, so a row is read once at
// memory speed.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// By its bits: the extension builds with -ffast-math, under which std::isnan may fold to false.
inline bool is_nan(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return (u & 0x7FFFFFFFu) > 0x7F800000u;
}

inline float load_float(const float* p) { return *p; }
inline float load_float(const uint16_t* p) {
  const uint32_t u = static_cast<uint32_t>(*p) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The row's answer from `from` on, given the best (value, index) before it (index -1: none yet).
template <typename T>
int64_t scalar_tail(const T* row, int64_t from, int64_t n, float best, int64_t at) {
  for (int64_t i = from; i < n; ++i) {
    const float v = load_float(row + i);
    if (is_nan(v)) return i;
    if (at < 0 || v > best) best = v, at = i;
  }
  return at;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    const __m512i step = _mm512_set1_epi32(16);
    __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 best = load16(row);
    __m512i where = idx;
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      idx = _mm512_add_epi32(idx, step);
      const __m512 v = load16(row + i);
      if (_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)) break;  // a NaN: the scalar tail finds it
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);  // strictly greater: the first stays
      best = _mm512_mask_mov_ps(best, gt, v);
      where = _mm512_mask_mov_epi32(where, gt, idx);
    }
    float lanes[16];
    int32_t at[16];
    _mm512_storeu_ps(lanes, best);
    _mm512_storeu_si512(at, where);
    float top = lanes[0];
    int64_t top_at = at[0];
    for (int l = 0; l < 16; ++l) {
      if (is_nan(lanes[l])) return scalar_tail(row, 0, n, 0.f, -1);  // the first vector held a NaN
      if (lanes[l] > top || (lanes[l] == top && at[l] < top_at)) top = lanes[l], top_at = at[l];
    }
    return scalar_tail(row, i, n, top, top_at);
  }
#endif
  return scalar_tail(row, 0, n, 0.f, -1);
}

template <typename T>
void argmax_rows(const T* base, int64_t rows, int64_t n, int64_t ld, int64_t* out) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) out[r] = row_argmax(base + r * ld, n);
  });
}

}  // namespace

torch::Tensor greedy_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.stride(1) == 1,
              "logits must be [B, V] with contiguous rows");
  const int64_t rows = logits.size(0), n = logits.size(1), ld = logits.stride(0);
  auto out = torch::empty({rows}, torch::kInt64);
  if (logits.scalar_type() == torch::kFloat32) {
    argmax_rows(logits.data_ptr<float>(), rows, n, ld, out.data_ptr<int64_t>());
  } else {
    TORCH_CHECK(logits.scalar_type() == torch::kBFloat16, "logits must be float32 or bfloat16");
    argmax_rows(reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>()), rows, n, ld,
                out.data_ptr<int64_t>());
  }
  return out;
}
