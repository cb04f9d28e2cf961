// Vector math shared by the AVX-512 kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

// Masked scores and the initial running max of an online softmax: finite, since -ffast-math assumes no
// infinities. exp(kNegative - x) underflows to 0, so a first chunk's correction factor is exactly 0.
constexpr float kNegative = -1e30f;

// exp(x) for x <= 0 (scores minus their running max): 2^(x log2 e) as 2^n * p(f), |f| <= 1/2, with a
// degree-6 polynomial for 2^f (relative error ~2e-7). Scalar expf per score was a third of decode attention.
static inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.44269504089f));
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
#endif
