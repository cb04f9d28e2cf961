// Batch-sized matmuls over quantized weights (quant_gemm.cpp's planar layout) on AMX bf16 tiles.
//
// A decode batch is bound by the weights' bytes and by the tiles, where the integer kernel loses to a float
// GEMM, but dequantizing the whole matrix to bf16 first (then oneDNN) writes and re-reads twice the bytes of
// the bf16 model. Here each thread takes 32 weight rows at a time, dequantizes them into a small bf16 panel
// and multiplies it with TDPBF16PS against every 32 activation rows: the quantized bytes are read once per
// call, and nothing of the size of the weights is written. The next panel is dequantized a row at a time
// between the tile instructions of this one (the AVX-512 work overlaps the tile unit) and its bytes are
// prefetched a panel ahead. The weights are the tiles' A operand (rows of k, as they dequantize) and the
// activations the B operand (k pairs interleaved, prepared once per call), so C holds y transposed. Every
// panel re-reads all of x, so prefill-sized calls go to a dequantized float GEMM instead (quant_linear.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "quant_params.h"

namespace {

#ifdef PAGEDSERVE_AMX
using pagedserve_amx::amx_permitted;
using pagedserve_amx::configure_tiles;
using pagedserve_amx::store_block;
using pagedserve_amx::transpose16;

constexpr int64_t kBlock = 32;     // k per tile step and per quantization block
constexpr int64_t kPanelRows = 32;  // weight rows per panel: two A tiles of 16 rows
constexpr int64_t kTileBytes = 1024;
constexpr int64_t kChunk = 256;     // k per L1-resident chunk of the panel

// One 32-block of a weight row as 32 bf16 in k order. 4 bits: the 16 possible values of the block, computed
// in fp32 and rounded once, are a table that vpermw indexes with the nibbles.
inline __m512i dequantize_block(const uint8_t* w, int64_t bits, float scale_lo, float scale_hi, float min) {
  if (bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), nibble), _mm_and_si128(packed, nibble));
    const __m512 levels = _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_ps(scale_lo), _mm512_set1_ps(min));
    const __m256i table = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(levels));
    return _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(q), _mm512_castsi256_si512(table));
  }
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16))));
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, _mm512_set1_ps(scale_hi), _mm512_set1_ps(min)),
                                                       _mm512_fmadd_ps(lo, _mm512_set1_ps(scale_lo), _mm512_set1_ps(min))));
}

// x [m_pad, K] bf16 as B tiles: for each k-block and 16 rows, 16 k pairs x 16 rows (VNNI order).
void pack_activations(const uint16_t* x, int64_t m, int64_t m_begin, int64_t m_end, int64_t k, uint16_t* out) {
  const int64_t blocks = k / kBlock;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += 16) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        r[i] = m0 + i < m ? _mm512_loadu_si512(x + (m0 + i) * k + b * kBlock) : _mm512_setzero_si512();
      }
      transpose16(r);
      uint16_t* tile = out + ((m0 / 16) * blocks + b) * (kTileBytes / 2);
      for (int j = 0; j < 16; ++j) _mm512_store_si512(tile + j * 32, r[j]);
    }
  }
}

struct Weights {
  const uint8_t* q;
  GroupParams params;
  int64_t n, k, bits, group, row_bytes;
};

// Weight row `row` dequantized into out [K] bf16 (zeros past N); params_buf holds 2 * groups floats.
void build_row(const Weights& w, int64_t row, uint16_t* out, float* params_buf) {
  const int64_t blocks = w.k / kBlock, groups = w.k / w.group, block_bytes = w.bits == 4 ? kBlock / 2 : kBlock;
  if (row >= w.n) {
    std::memset(out, 0, w.k * 2);
    return;
  }
  const uint8_t* q = w.q + row * w.row_bytes;
  const float* s;
  const float* mn;
  w.params.row(row, params_buf, s, mn);
  if (w.group == 16) {  // 8 bits, a scale per half block
    for (int64_t b = 0; b < blocks; ++b) {
      _mm512_storeu_si512(out + b * kBlock, dequantize_block(q + b * block_bytes, w.bits, s[2 * b], s[2 * b + 1], 0.f));
    }
    return;
  }
  const int64_t per_group = w.group / kBlock;
  for (int64_t g = 0, b = 0; g < groups; ++g) {  // groups outer: no division per block
    const float scale = s[g], min = mn ? mn[g] : 0.f;
    for (const int64_t e = b + per_group; b < e; ++b) {
      _mm512_storeu_si512(out + b * kBlock, dequantize_block(q + b * block_bytes, w.bits, scale, scale, min));
    }
  }
}

// Builds panel after panel, a few rows at a time, so the dequantizing (AVX-512) runs between the previous
// panel's tile instructions instead of before them; and prefetches the bytes of the panel after into L2.
class PanelPipe {
 public:
  PanelPipe(const Weights& w, int64_t end_row) : w_(w), end_row_(end_row), params_(2 * w.params.groups) {}

  // Starts building the panel at row n0 into `panel`, over `steps` calls of advance().
  void start(int64_t n0, uint16_t* panel, int64_t steps) {
    n0_ = n0;
    panel_ = panel;
    built_ = step_ = 0;
    steps_ = std::max<int64_t>(steps, 1);
    const int64_t ahead = std::min(end_row_, n0 + kPanelRows);
    prefetch_ = reinterpret_cast<const char*>(w_.q + ahead * w_.row_bytes);
    prefetch_end_ = reinterpret_cast<const char*>(w_.q + std::min(end_row_, ahead + kPanelRows) * w_.row_bytes);
    prefetch_lines_ = (prefetch_end_ - prefetch_ + 64 * steps_ - 1) / (64 * steps_);
  }

  void advance() {
    ++step_;
    for (const int64_t want = (kPanelRows * step_ + steps_ - 1) / steps_; built_ < want && built_ < kPanelRows; ++built_) {
      build_row(w_, n0_ + built_, panel_ + built_ * w_.k, params_.data());
    }
    for (int64_t l = 0; l < prefetch_lines_ && prefetch_ < prefetch_end_; ++l, prefetch_ += 64) {
      _mm_prefetch(prefetch_, _MM_HINT_T1);
    }
  }

  void finish() {
    while (built_ < kPanelRows) build_row(w_, n0_ + built_, panel_ + built_ * w_.k, params_.data()), ++built_;
  }

 private:
  const Weights& w_;
  int64_t end_row_, n0_ = 0, built_ = 0, step_ = 0, steps_ = 1, prefetch_lines_ = 0;
  uint16_t* panel_ = nullptr;
  const char* prefetch_ = nullptr;
  const char* prefetch_end_ = nullptr;
  std::vector<float> params_;  // a row's scales and mins widened to fp32 (fp16 storage)
};

#endif

}  // namespace

bool quant_amx_available() {
#ifdef PAGEDSERVE_AMX
  return amx_permitted();
#else
  return false;
#endif
}

// y[M, N] = x[M, K] @ W^T (+ residual), x bf16. Weights as quant_linear takes them.
torch::Tensor quant_linear_amx(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                               c10::optional<torch::Tensor> mins, int64_t bits, int64_t group,
                               c10::optional<torch::Tensor> residual) {
#ifdef PAGEDSERVE_AMX
  TORCH_CHECK(quant_amx_available(), "AMX is not available to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x must be a bf16 [M, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(k % kBlock == 0 && (group % kBlock == 0 || (group == 16 && bits == 8)) && k % group == 0,
              "K must be a multiple of 32 and the group too (or 16, with 8 bits)");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous() && qweight.size(1) == (bits == 4 ? k / 2 : k),
              "qweight must be a contiguous [N, K (/2 for 4 bits)]");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.size(1) == k / group, "scales must be [N, K/group]");
  TORCH_CHECK(!mins || group % kBlock == 0, "mins need groups of 32 or more");
  if (residual) {
    TORCH_CHECK(residual->is_contiguous() && residual->scalar_type() == torch::kBFloat16 && residual->dim() == 2 &&
                residual->size(0) == m && residual->size(1) == n, "residual must be a contiguous bf16 [M, N]");
  }
  // Activations as B tiles, padded with zero rows to whole 32-row blocks.
  const int64_t m_pad = (m + 31) / 32 * 32, blocks = k / kBlock;
  const torch::Tensor xc = x.contiguous();
  const torch::Tensor packed = torch::empty({m_pad * k + 32}, x.options());  // not zeroed: every byte is written
  uint16_t* xt = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(packed.data_ptr()) + 63) & ~uintptr_t(63));
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  at::parallel_for(0, m_pad / 16, 4, [&](int64_t begin, int64_t end) {
    pack_activations(xp, m, begin * 16, end * 16, k, xt);
  });
  const uint16_t* rp = residual ? reinterpret_cast<const uint16_t*>(residual->data_ptr()) : nullptr;
  auto out = torch::empty({m, n}, x.options());
  uint16_t* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const Weights w{reinterpret_cast<const uint8_t*>(qweight.data_ptr()), group_params(scales, mins), n, k, bits, group,
                  qweight.size(1)};
  const int64_t panels = (n + kPanelRows - 1) / kPanelRows;
  // k in chunks of kChunk: a chunk of the panel (16 KiB) stays in L1 while every activation block passes it;
  // the C tiles of each activation block wait in `acc` between chunks. The next panel is built meanwhile.
  const int64_t chunk_blocks = kChunk / kBlock, m_blocks = m_pad / 32;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    std::vector<uint16_t> panels_storage(2 * kPanelRows * k);
    uint16_t* panel_buf[2] = {panels_storage.data(), panels_storage.data() + kPanelRows * k};
    std::vector<float> acc_storage(m_blocks * 1024 + 16);
    float* acc = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(acc_storage.data()) + 63) & ~uintptr_t(63));
    alignas(64) float c[32][32];  // c[weight row][activation row]
    PanelPipe pipe(w, std::min(n, end * kPanelRows));
    pipe.start(begin * kPanelRows, panel_buf[0], 1);
    pipe.advance();  // the whole first panel at once, and the second's bytes on their way
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelRows, cols = std::min<int64_t>(kPanelRows, n - n0);
      const uint16_t* panel = panel_buf[(p - begin) & 1];
      const bool has_next = p + 1 < end;
      if (has_next) pipe.start(n0 + kPanelRows, panel_buf[(p + 1 - begin) & 1], m_blocks * blocks);
      for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
        const int64_t b1 = std::min(blocks, b0 + chunk_blocks);
        const bool first = b0 == 0, last = b1 == blocks;
        for (int64_t mb = 0; mb < m_blocks; ++mb) {
          float* a = acc + mb * 1024;  // this block's C tiles: [32 weight rows][32 activation rows]
          if (first) {
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
          } else {
            _tile_loadd(0, a, 128);
            _tile_loadd(1, a + 16, 128);
            _tile_loadd(2, a + 512, 128);
            _tile_loadd(3, a + 528, 128);
          }
          const uint16_t* x0 = xt + 2 * mb * blocks * (kTileBytes / 2);
          const uint16_t* x1 = x0 + blocks * (kTileBytes / 2);
          for (int64_t b = b0; b < b1; ++b) {
            _tile_loadd(4, panel + b * kBlock, k * 2);
            _tile_loadd(5, panel + 16 * k + b * kBlock, k * 2);
            _tile_loadd(6, x0 + b * (kTileBytes / 2), 64);
            _tile_loadd(7, x1 + b * (kTileBytes / 2), 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            if (has_next) pipe.advance();
          }
          float* dst = last ? &c[0][0] : a;
          _tile_stored(0, dst, 128);
          _tile_stored(1, dst + 16, 128);
          _tile_stored(2, dst + 512, 128);
          _tile_stored(3, dst + 528, 128);
          if (last) {
            const int64_t m0 = mb * 32;
            store_block(c, std::min<int64_t>(32, m - m0), cols, yp + m0 * n + n0, rp ? rp + m0 * n + n0 : nullptr, n);
          }
        }
      }
      if (has_next) pipe.finish();
    }
    _tile_release();
  });
  return out;
#else
  TORCH_CHECK(false, "this build has no AMX kernels");
#endif
}
