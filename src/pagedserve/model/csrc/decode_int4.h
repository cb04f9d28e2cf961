// int4 KV decode on AVX-512 (included by paged_attention.cpp inside its AVX-512 BF16 section, after
// bf16_to_f32 and vec_math.h). See model/kv_int4.py for the layout.
#pragma once

// int4 (KIVI) decode, 16-token blocks. Codes are read in nibble order: of each 32 channels, a vector of the 16
// low nibbles (even channels) and one of the 16 high nibbles (odd channels); q, the key parameters and the value
// accumulators are kept deinterleaved the same way, so no code is shuffled. A quantized block's per-channel key
// scales fold into q (q.k = (q * s).code + q.m, m = -zero * s); a value's per-token scale rides on its probability
// and its minimum on a running sum of probabilities times minimums, added to every channel at the end.
struct Int4Head {
  const uint8_t* k;            // this head's first key codes (slot 0)
  const uint8_t* v;
  const uint8_t* k_params;     // block 0's scale codes then zero points (two a byte), this head
  const uint8_t* v_params;     // slot 0's (scale code, zero point), this head
  const uint16_t* tail;        // bf16 tail row 0, this head
  const int32_t* tail_of_block;
  int64_t code_row;            // bytes between slots' codes
  int64_t k_params_stride;     // bytes between blocks' key parameters
  int64_t v_params_stride;     // bytes between slots' value parameters
  int64_t tail_row;            // halves between tail rows
};

static inline void deinterleave(__m512 x0, __m512 x1, __m512& even, __m512& odd) {
  const __m512i ie = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
  even = _mm512_permutex2var_ps(x0, ie, x1);
  odd = _mm512_permutex2var_ps(x0, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), x1);
}

static inline void nibbles(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(w, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
}

// 16 scale codes as their scales.
static inline __m512 scales16(const uint8_t* codes, const float* table) {
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))), table, 4);
}

template <int D, int G>
static void attend_int4(const uint16_t* q, const Int4Head& h, const int64_t* table, int64_t len, uint16_t* out,
                        float scale) {
  constexpr int C = D / 32;  // 32-channel chunks: one even and one odd vector each
  __m512 qe[G][C], qo[G][C], ae[G][C], ao[G][C];
  float m[G], l[G], pm[G];
  const float* scale_of = scale_code_table();
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < C; ++c) {
      deinterleave(bf16_to_f32(q + g * D + c * 32), bf16_to_f32(q + g * D + c * 32 + 16), qe[g][c], qo[g][c]);
      ae[g][c] = ao[g][c] = _mm512_setzero_ps();
    }
    m[g] = kNegative;
    l[g] = pm[g] = 0.f;
  }
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, len - t0), block = table[t0 / 16], slot0 = block * 16;
    const int32_t tail = h.tail_of_block[block];
    alignas(64) float sc[G][16];
    if (tail >= 0) {  // a partly written block: its keys in bf16
      for (int64_t j = 0; j < n; ++j) {
        const uint16_t* k = h.tail + (tail * 16 + j) * h.tail_row;
        for (int g = 0; g < G; ++g) {
          __m512 d = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) {
            __m512 ke, ko;
            deinterleave(bf16_to_f32(k + c * 32), bf16_to_f32(k + c * 32 + 16), ke, ko);
            d = _mm512_fmadd_ps(qe[g][c], ke, _mm512_fmadd_ps(qo[g][c], ko, d));
          }
          sc[g][j] = _mm512_reduce_add_ps(d);
        }
      }
    } else {
      const uint8_t* kp = h.k_params + block * h.k_params_stride;
      __m512 se[C], so[C], me[C], mo[C];
      for (int c = 0; c < C; ++c) {
        deinterleave(scales16(kp + c * 32, scale_of), scales16(kp + c * 32 + 16, scale_of), se[c], so[c]);
        nibbles(kp + D + c * 16, me[c], mo[c]);  // zero points, even and odd channels
        me[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), me[c]), se[c]);
        mo[c] = _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), mo[c]), so[c]);
      }
      __m512 qse[G][C], qso[G][C];
      float bias[G];
      for (int g = 0; g < G; ++g) {
        __m512 b = _mm512_setzero_ps();
        for (int c = 0; c < C; ++c) {
          qse[g][c] = _mm512_mul_ps(qe[g][c], se[c]);
          qso[g][c] = _mm512_mul_ps(qo[g][c], so[c]);
          b = _mm512_fmadd_ps(qe[g][c], me[c], _mm512_fmadd_ps(qo[g][c], mo[c], b));
        }
        bias[g] = _mm512_reduce_add_ps(b);
      }
      for (int64_t j = 0; j < n; ++j) {
        const uint8_t* k = h.k + (slot0 + j) * h.code_row;
        __m512 lo[C], hi[C];
        for (int c = 0; c < C; ++c) nibbles(k + c * 16, lo[c], hi[c]);
        for (int g = 0; g < G; ++g) {
          __m512 d = _mm512_setzero_ps();
          for (int c = 0; c < C; ++c) d = _mm512_fmadd_ps(qse[g][c], lo[c], _mm512_fmadd_ps(qso[g][c], hi[c], d));
          sc[g][j] = _mm512_reduce_add_ps(d) + bias[g];
        }
      }
    }
    const __mmask16 live = static_cast<__mmask16>((1u << n) - 1);
    alignas(64) float p[G][16];
    for (int g = 0; g < G; ++g) {
      const __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(kNegative), live, _mm512_loadu_ps(sc[g]), _mm512_set1_ps(scale));
      const float mx = std::max(m[g], _mm512_reduce_max_ps(s));
      const float correction = std::exp(m[g] - mx);  // 0 on the first block (m = kNegative)
      const __m512 e = _mm512_maskz_mov_ps(live, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
      l[g] = l[g] * correction + _mm512_reduce_add_ps(e);
      m[g] = mx;
      _mm512_store_ps(p[g], e);
      const __m512 cv = _mm512_set1_ps(correction);
      pm[g] *= correction;
      for (int c = 0; c < C; ++c) {
        ae[g][c] = _mm512_mul_ps(ae[g][c], cv);
        ao[g][c] = _mm512_mul_ps(ao[g][c], cv);
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      const uint8_t* v = h.v + (slot0 + j) * h.code_row;
      const uint8_t* vp = h.v_params + (slot0 + j) * h.v_params_stride;
      const float vs = scale_of[vp[0]], vm = -static_cast<float>(vp[1]) * vs;
      __m512 lo[C], hi[C];
      for (int c = 0; c < C; ++c) nibbles(v + c * 16, lo[c], hi[c]);
      for (int g = 0; g < G; ++g) {
        const __m512 ps = _mm512_set1_ps(p[g][j] * vs);
        pm[g] += p[g][j] * vm;
        for (int c = 0; c < C; ++c) {
          ae[g][c] = _mm512_fmadd_ps(ps, lo[c], ae[g][c]);
          ao[g][c] = _mm512_fmadd_ps(ps, hi[c], ao[g][c]);
        }
      }
    }
  }
  const __m512i i0 = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i i1 = _mm512_add_epi32(i0, _mm512_set1_epi32(8));
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.f / l[g]), bias = _mm512_set1_ps(pm[g]);
    for (int c = 0; c < C; ++c) {
      const __m512 x0 = _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(ae[g][c], i0, ao[g][c]), bias), inv);
      const __m512 x1 = _mm512_mul_ps(_mm512_add_ps(_mm512_permutex2var_ps(ae[g][c], i1, ao[g][c]), bias), inv);
      _mm256_storeu_si256((__m256i*)(out + g * D + c * 32), (__m256i)_mm512_cvtneps_pbh(x0));
      _mm256_storeu_si256((__m256i*)(out + g * D + c * 32 + 16), (__m256i)_mm512_cvtneps_pbh(x1));
    }
  }
}

template <int D>
static bool attend_int4_group(int64_t group, const uint16_t* q, const Int4Head& h, const int64_t* table, int64_t len,
                              uint16_t* out, float scale) {
  switch (group) {
    case 1: attend_int4<D, 1>(q, h, table, len, out, scale); return true;
    case 2: attend_int4<D, 2>(q, h, table, len, out, scale); return true;
    case 3: attend_int4<D, 3>(q, h, table, len, out, scale); return true;
    case 4: attend_int4<D, 4>(q, h, table, len, out, scale); return true;
    default: return false;
  }
}

static inline Int4Head int4_head(const QuantRowReader& k, const QuantRowReader& v, int64_t kvh, int64_t d) {
  const int64_t kv = k.num_kv_heads;
  return {k.codes + kvh * d / 2, v.codes + kvh * d / 2, k.int4.params + kvh * d * 3 / 2, v.int4.params + kvh * 2,
          k.int4.tail + kvh * d, k.int4.tail_of_block, kv * d / 2, kv * d * 3 / 2, kv * 2, kv * d};
}
