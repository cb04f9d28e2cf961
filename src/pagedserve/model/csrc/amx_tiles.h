// What the AMX tile kernels share (quant_gemm_amx.cpp: bf16 tiles; quant_gemm_w8a8.cpp: int8 tiles): the
// process's permission for tile state, the one tile shape (8 tiles of 16 rows x 64 bytes), a 16 x 16 dword
// transpose and the epilogue that stores C (weight rows x activation rows) as y rows. PAGEDSERVE_AMX is set
// where the compiler targets AMX bf16 tiles and AVX-512.
#pragma once

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PAGEDSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "vec_math.h"

namespace pagedserve_amx {

using ::transpose16;

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands out the AMX tile state only on request, per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// Tiles 0-3: C (16 x 16 fp32) for rows 0-15 / 16-31 by columns 0-15 / 16-31; 4-5: A (16 rows x 32 bf16);
// 6-7: B (16 k pairs x 16 columns): every tile is 16 rows of 64 bytes.
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

// c[weight row][activation row] (32 x 32) into y rows (+ residual), bf16: transposed in registers 16 x 16
// at a time, 32 outputs of a row converted and stored at once.
inline void store_block(const float (*c)[32], int64_t rows, int64_t cols, uint16_t* y, const uint16_t* residual,
                 int64_t ld) {
  const __mmask32 keep = cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
  for (int64_t mh = 0; mh < 2 && mh * 16 < rows; ++mh) {
    __m512i lo[16], hi[16];  // weight rows 0-15 and 16-31
    for (int i = 0; i < 16; ++i) {
      lo[i] = _mm512_castps_si512(_mm512_load_ps(&c[i][mh * 16]));
      hi[i] = _mm512_castps_si512(_mm512_load_ps(&c[16 + i][mh * 16]));
    }
    transpose16(lo);
    transpose16(hi);
    for (int64_t i = 0; i < 16 && mh * 16 + i < rows; ++i) {
      const int64_t at = (mh * 16 + i) * ld;
      __m512 a = _mm512_castsi512_ps(lo[i]), b = _mm512_castsi512_ps(hi[i]);
      if (residual) {
        const __m512i r = _mm512_maskz_loadu_epi16(keep, residual + at);
        a = _mm512_add_ps(a, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(r)), 16)));
        b = _mm512_add_ps(b, _mm512_castsi512_ps(_mm512_slli_epi32(
                                 _mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(r, 1)), 16)));
      }
      _mm512_mask_storeu_epi16(y + at, keep, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a)));
    }
  }
}

}  // namespace pagedserve_amx
#endif
