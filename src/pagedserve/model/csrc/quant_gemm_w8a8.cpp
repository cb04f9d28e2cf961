// W8A8 on AMX int8 tiles: `--quantization int8` where the CPU has them (model/quant_linear.py).
//
// The bf16 tile kernel (quant_gemm_amx.cpp) spends most of a batch's time turning weights into bf16 panels,
// and its tiles do 16 x 16 x 32 multiply-adds each. Per-channel int8 weights need no such step: they are the
// tiles' A operand as stored (16 rows of 64 k), and TDPBSSD does 16 x 16 x 64 per instruction. Activations are
// quantized per token to int8 at run time, after a Hadamard transform over each 64 channels (QuaRot): a few
// channels dwarf the rest of a token (int8 per token without it cost the default model +3% perplexity, with it
// +0.35%, as int8 weights alone). The weights were quantized in the same basis (quant.py), so the transform
// cancels in x.W^T. Each output is scaled once, by its channel's and its token's scale, as it is stored.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "vec_math.h"

#if defined(PAGEDSERVE_AMX) && defined(__AMX_INT8__)
#define PAGEDSERVE_W8A8 1
#endif

namespace {

#ifdef PAGEDSERVE_W8A8
using pagedserve_amx::configure_tiles;
using pagedserve_amx::store_block;
using pagedserve_amx::transpose16;

constexpr int64_t kK = 64;        // k per tile step, and the Hadamard transform's width
constexpr int64_t kRows = 32;     // weight rows per panel: 2 x 16-row A tiles
constexpr int64_t kMBlock = 32;   // activation rows per pass: 2 x 16-row B tiles
constexpr int64_t kMSuper = 256;  // activation rows whose packed tiles stay in L2 while every panel passes

// 64 values in 4 registers times Sylvester's orthonormal Hadamard matrix (the transform quant.py's turn() does).
inline void hadamard64(__m512 v[4]) {
  for (int r = 0; r < 4; ++r) v[r] = hadamard16(v[r]);
  const __m512 norm = _mm512_set1_ps(0.125f);  // 1 / sqrt(64)
  const __m512 a = _mm512_add_ps(v[0], v[1]), b = _mm512_sub_ps(v[0], v[1]);
  const __m512 c = _mm512_add_ps(v[2], v[3]), d = _mm512_sub_ps(v[2], v[3]);
  v[0] = _mm512_mul_ps(_mm512_add_ps(a, c), norm);
  v[1] = _mm512_mul_ps(_mm512_add_ps(b, d), norm);
  v[2] = _mm512_mul_ps(_mm512_sub_ps(a, c), norm);
  v[3] = _mm512_mul_ps(_mm512_sub_ps(b, d), norm);
}

// One token (K a multiple of 64), turned when `turn`, as int8 with one scale (amax / 127, round half to even)
// into q. buf holds K floats. Returns the scale (0 for a zero token).
float quantize_token(const uint16_t* x, int64_t k, bool turn, float* buf, int8_t* q) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += kK) {
    __m512 v[4];
    for (int r = 0; r < 4; ++r) v[r] = bf16_to_f32(x + i + 16 * r);
    if (turn) hadamard64(v);
    for (int r = 0; r < 4; ++r) {
      _mm512_storeu_ps(buf + i + 16 * r, v[r]);
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[r]));
    }
  }
  const float top = _mm512_reduce_max_ps(amax);
  const __m512 inv = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
  const __m512i lim = _mm512_set1_epi32(127);
  for (int64_t i = 0; i < k; i += 16) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(buf + i), inv));  // nearest even (MXCSR default)
    v = _mm512_max_epi32(_mm512_min_epi32(v, lim), _mm512_sub_epi32(_mm512_setzero_si512(), lim));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i), _mm512_cvtepi32_epi8(v));
  }
  return top / 127.f;
}

// 16 quantized rows (q: [16][K]) into their B tiles, [16 quads][16 rows][4 bytes] per 64 k (VNNI order): each
// 16 x 16 block of quads transposed in registers.
void pack_rows(const int8_t* q, int64_t k, int8_t* tiles) {
  for (int64_t s = 0; s < k / kK; ++s) {
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(q + i * k + s * kK);
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_store_si512(tiles + s * 1024 + j * 64, r[j]);
  }
}
#endif

}  // namespace

bool quant_w8a8_available() {
#ifdef PAGEDSERVE_W8A8
  return pagedserve_amx::amx_permitted();
#else
  return false;
#endif
}

// y[M, N] = x[M, K] @ W^T (+ residual), x bf16; W int8 [N, K] with one fp32 scale per row ([N, 1]), quantized
// in the basis that `hadamard` (64, or 0 for none) names; K % 64 == 0.
torch::Tensor quant_linear_w8a8(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales, int64_t hadamard,
                                c10::optional<torch::Tensor> residual) {
#ifdef PAGEDSERVE_W8A8
  TORCH_CHECK(quant_w8a8_available(), "AMX int8 tiles are not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be a bf16 [M, K]");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(k % kK == 0, "K must be a multiple of 64");
  TORCH_CHECK(hadamard == 0 || hadamard == kK, "hadamard must be 0 or 64");
  TORCH_CHECK(qweight.scalar_type() == torch::kInt8 && qweight.dim() == 2 && qweight.is_contiguous() &&
              qweight.size(1) == k, "qweight must be a contiguous int8 [N, K]");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == n,
              "scales must be fp32 [N, 1] (one per output channel)");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == torch::kBFloat16 && residual->dim() == 2 &&
                residual->size(0) == m && residual->size(1) == n, "residual must be a contiguous bf16 [M, N]");
  }
  const torch::Tensor xc = x.contiguous();
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  // Activations as B tiles, zero rows padding M to whole passes.
  const int64_t m_pad = (m + kMBlock - 1) / kMBlock * kMBlock, k_steps = k / kK;
  const torch::Tensor packed_storage = torch::empty({m_pad * k + 64}, x.options().dtype(torch::kChar));
  int8_t* packed = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(packed_storage.data_ptr()) + 63) & ~uintptr_t(63));
  std::vector<float> token_scale(m_pad, 0.f);
  at::parallel_for(0, m_pad / 16, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(k);
    std::vector<int8_t> q(16 * k);
    for (int64_t g = begin; g < end; ++g) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t r = g * 16 + i;
        if (r < m) {
          token_scale[r] = quantize_token(xp + r * k, k, hadamard != 0, buf.data(), q.data() + i * k);
        } else {
          std::fill(q.begin() + i * k, q.begin() + (i + 1) * k, 0);
        }
      }
      pack_rows(q.data(), k, packed + g * k_steps * 1024);
    }
  });
  const int8_t* wq = reinterpret_cast<const int8_t*>(qweight.data_ptr());
  const float* ws = scales.data_ptr<float>();
  const uint16_t* rp = residual ? reinterpret_cast<const uint16_t*>(residual->data_ptr()) : nullptr;
  auto out = torch::empty({m, n}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t panels = (n + kRows - 1) / kRows;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<int8_t> tail;  // the last panel's rows, zero-padded to 32, when N is not a multiple of 32
    alignas(64) int32_t c[kRows][kMBlock];  // c[weight row][activation row]
    alignas(64) float f[kRows][kMBlock];
    for (int64_t m0 = 0; m0 < m_pad; m0 += kMSuper) {
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kRows, rows = std::min(kRows, n - n0);
        const int8_t* panel = wq + n0 * k;
        if (rows < kRows) {
          tail.assign(kRows * k, 0);
          std::memcpy(tail.data(), panel, rows * k);
          panel = tail.data();
        }
        // The next panel's rows, a 64-byte column of each per k step of the first pass, on their way to L2.
        const int64_t next_rows = p + 1 < end ? std::min(kRows, n - n0 - kRows) : 0;
        const char* next = reinterpret_cast<const char*>(wq + (n0 + kRows) * k);
        alignas(64) float wscale[kRows] = {};
        std::copy(ws + n0, ws + n0 + rows, wscale);
        // C of pass mb waits in c until the next pass's tile instructions are issued: its scaling and store (AVX-512)
        // then run while the tiles work.
        const auto finish = [&](int64_t mb) {
          const __m512 ts0 = _mm512_loadu_ps(token_scale.data() + mb * kMBlock);
          const __m512 ts1 = _mm512_loadu_ps(token_scale.data() + mb * kMBlock + 16);
          for (int64_t i = 0; i < kRows; ++i) {
            const __m512 w = _mm512_set1_ps(wscale[i]);
            _mm512_store_ps(&f[i][0], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&c[i][0])), _mm512_mul_ps(w, ts0)));
            _mm512_store_ps(&f[i][16], _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_load_si512(&c[i][16])), _mm512_mul_ps(w, ts1)));
          }
          const int64_t r0 = mb * kMBlock;
          if (r0 < m) {
            store_block(f, std::min<int64_t>(kMBlock, m - r0), rows, yp + r0 * n + n0, rp ? rp + r0 * n + n0 : nullptr, n);
          }
        };
        int64_t pending = -1;
        for (int64_t mb = m0 / kMBlock; mb < std::min(m_pad, m0 + kMSuper) / kMBlock; ++mb) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          const int8_t* x0 = packed + 2 * mb * k_steps * 1024;
          const int8_t* x1 = x0 + k_steps * 1024;
          // Each operand is loaded for the next step as soon as this step's last use of its tile is issued, so
          // the loads overlap the multiplies that remain instead of waiting between steps.
          _tile_loadd(4, panel, k);
          _tile_loadd(5, panel + 16 * k, k);
          _tile_loadd(6, x0, 64);
          _tile_loadd(7, x1, 64);
          for (int64_t s = 0; s < k_steps; ++s) {
            const bool more = s + 1 < k_steps;
            _tile_dpbssd(0, 4, 6);
            _tile_dpbssd(2, 5, 6);
            if (more) _tile_loadd(6, x0 + (s + 1) * 1024, 64);
            _tile_dpbssd(1, 4, 7);
            if (more) _tile_loadd(4, panel + (s + 1) * kK, k);
            _tile_dpbssd(3, 5, 7);
            if (more) {
              _tile_loadd(5, panel + 16 * k + (s + 1) * kK, k);
              _tile_loadd(7, x1 + (s + 1) * 1024, 64);
            }
            if (mb * kMBlock == m0)
              for (int64_t r = 0; r < next_rows; ++r) _mm_prefetch(next + r * k + s * kK, _MM_HINT_T1);
          }
          if (pending >= 0) finish(pending);
          _tile_stored(0, &c[0][0], 128);
          _tile_stored(1, &c[0][16], 128);
          _tile_stored(2, &c[16][0], 128);
          _tile_stored(3, &c[16][16], 128);
          pending = mb;
        }
        finish(pending);
      }
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "this build has no AMX int8 kernels");
#endif
}
