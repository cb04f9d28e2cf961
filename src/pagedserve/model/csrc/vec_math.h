// Vector math shared by the AVX-512 kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

// Masked scores and the initial running max of an online softmax: finite, since -ffast-math assumes no
// infinities. exp(kNegative - x) underflows to 0, so a first chunk's correction factor is exactly 0.
constexpr float kNegative = -1e30f;

// 2^t for t <= 0 as 2^n * p(f), |f| <= 1/2, with a degree-6 polynomial for 2^f (relative error ~2e-7).
static inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-125.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.535336188e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.339887440e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.618437357e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.550332471e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.402264791e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931472028e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// exp(x) for x <= 0 (scores minus their running max): 2^(x log2 e). Scalar expf per score was a third of decode
// attention.
static inline __m512 exp_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504089f)));
}

// 16 bf16 values widened to fp32 (a shift: bf16 is fp32's top half).
static inline __m512 bf16_to_f32(const uint16_t* src) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)src)), 16));
}

// The first four butterfly stages of Sylvester's Hadamard transform (unnormalized), inside the 16 lanes: lane i
// meets lane i ^ h and keeps the difference where bit h of i is set.
static inline __m512 hadamard16(__m512 v) {
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int h = 1; h < 16; h <<= 1) {
    const __m512i bit = _mm512_set1_epi32(h);
    const __m512 partner = _mm512_permutexvar_ps(_mm512_xor_si512(lane, bit), v);
    v = _mm512_mask_sub_ps(_mm512_add_ps(partner, v), _mm512_test_epi32_mask(lane, bit), partner, v);
  }
  return v;
}

// 16 x 16 dwords transposed in registers: r[i][j] -> r[j][i].
static inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c], 128-bit lane L: column 4L + c of rows i..i+3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x_even = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i x_odd = _mm512_shuffle_i32x4(u[c], u[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i y_even = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512i y_odd = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
    r[c] = _mm512_shuffle_i32x4(x_even, y_even, _MM_SHUFFLE(2, 0, 2, 0));
    r[8 + c] = _mm512_shuffle_i32x4(x_even, y_even, _MM_SHUFFLE(3, 1, 3, 1));
    r[4 + c] = _mm512_shuffle_i32x4(x_odd, y_odd, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_i32x4(x_odd, y_odd, _MM_SHUFFLE(3, 1, 3, 1));
  }
}
#endif
