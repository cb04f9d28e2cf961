// Batched LoRA (Punica's SGMV on a CPU): y[rows] += (x[rows] @ A_s^T) @ B_s for every segment of rows served by
// adapter slot s, in one call per projection. Segments run in tasks of up to 16 rows, fused shrink/expand straight
// from the slot buffers with fp32 accumulation, 4 rows at a time on AVX-512 so that every weight vector loaded
// serves 4 rows; segments with enough rows x rank (prefill chunks, high ranks) go to ATen's GEMMs, where the
// per-call overhead is paid back.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// A segment of rows x rank >= this goes to at::mm (~70 us a call, then far faster per row; measured crossover ~4k)
constexpr int64_t kGemmWork = 4096;
constexpr int64_t kTileRows = 16;  // rows of one segment per parallel task

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
void row_delta(const T* x, const T* a, const T* b, int64_t in, int64_t rank, int64_t out, T* y, float* shrunk,
               float* xf, float* acc) {
#pragma omp simd
  for (int64_t i = 0; i < in; ++i) xf[i] = widen(x[i]);
  for (int64_t r = 0; r < rank; ++r) {
    const T* ar = a + r * in;
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < in; ++i) s += xf[i] * widen(ar[i]);
    shrunk[r] = s;
  }
  std::fill(acc, acc + out, 0.f);
  for (int64_t r = 0; r < rank; ++r) {
    const float s = shrunk[r];
    if (s == 0.f) continue;  // padded ranks
    const T* br = b + r * out;
#pragma omp simd
    for (int64_t o = 0; o < out; ++o) acc[o] += s * widen(br[o]);
  }
  for (int64_t o = 0; o < out; ++o) y[o] = static_cast<T>(widen(y[o]) + acc[o]);
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, as static_cast<BFloat16> does
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i rounded = _mm512_add_epi32(
      bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

// Up to kTile rows of one adapter at once, so each A and B vector loaded serves every row of the tile; in and
// out multiples of 16. shrunk: [kTile][rank] scratch.
constexpr int kTile = 4;

template <typename T, int N>
void tile_delta(const T* const* x, const T* a, const T* b, int64_t in, int64_t rank, int64_t out, T* const* y,
                float* shrunk) {
  for (int64_t r0 = 0; r0 < rank; r0 += 4) {
    const int nr = static_cast<int>(std::min<int64_t>(4, rank - r0));
    __m512 acc[N][4];
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < 4; ++j) acc[n][j] = _mm512_setzero_ps();
    for (int64_t i = 0; i < in; i += 16) {
      __m512 xv[N];
      for (int n = 0; n < N; ++n) xv[n] = load16(x[n] + i);
      for (int j = 0; j < nr; ++j) {
        const __m512 av = load16(a + (r0 + j) * in + i);
        for (int n = 0; n < N; ++n) acc[n][j] = _mm512_fmadd_ps(xv[n], av, acc[n][j]);
      }
    }
    for (int n = 0; n < N; ++n)
      for (int j = 0; j < nr; ++j) shrunk[n * rank + r0 + j] = _mm512_reduce_add_ps(acc[n][j]);
  }
  for (int64_t o = 0; o < out; o += 16) {
    __m512 acc[N];
    for (int n = 0; n < N; ++n) acc[n] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m512 bv = load16(b + r * out + o);
      for (int n = 0; n < N; ++n) acc[n] = _mm512_fmadd_ps(_mm512_set1_ps(shrunk[n * rank + r]), bv, acc[n]);
    }
    for (int n = 0; n < N; ++n) store16(y[n] + o, _mm512_add_ps(load16(y[n] + o), acc[n]));
  }
}

template <typename T>
void tile_delta_any(int n, const T* const* x, const T* a, const T* b, int64_t in, int64_t rank, int64_t out,
                    T* const* y, float* shrunk) {
  switch (n) {
    case 1: tile_delta<T, 1>(x, a, b, in, rank, out, y, shrunk); break;
    case 2: tile_delta<T, 2>(x, a, b, in, rank, out, y, shrunk); break;
    case 3: tile_delta<T, 3>(x, a, b, in, rank, out, y, shrunk); break;
    default: tile_delta<T, 4>(x, a, b, in, rank, out, y, shrunk); break;
  }
}
#define PAGEDSERVE_LORA_TILES 1
#endif

}  // namespace

// y: [T, out], x: [T, in] (rows contiguous), same dtype (bf16 or fp32); index: int64 [n] rows of the batch, sorted
// by segment; seg_starts: int64 [G + 1] offsets into index; seg_slots: int64 [G]; a: [S, R, in] (A per slot,
// ranks zero-padded), b: [S, R, out] (B^T per slot, scaling folded in). Adds each row's adapter delta into y.
void lora_sgmv(torch::Tensor y, torch::Tensor x, torch::Tensor index, torch::Tensor seg_starts, torch::Tensor seg_slots,
               torch::Tensor a, torch::Tensor b) {
  TORCH_CHECK(y.scalar_type() == x.scalar_type() && a.scalar_type() == x.scalar_type() &&
                  b.scalar_type() == x.scalar_type(), "y, x and the slot buffers must share a dtype");
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kFloat, "bf16 or fp32");
  TORCH_CHECK(x.stride(1) == 1 && y.stride(1) == 1 && a.is_contiguous() && b.is_contiguous(), "rows must be contiguous");
  for (const auto* t : {&index, &seg_starts, &seg_slots})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "index, seg_starts, seg_slots: int64");
  const int64_t in = x.size(1), out = y.size(1), rank = a.size(1), slots = a.size(0), segs = seg_slots.size(0);
  TORCH_CHECK(a.size(2) == in && b.size(0) == slots && b.size(1) == rank && b.size(2) == out &&
                  seg_starts.size(0) == segs + 1, "shapes do not match");
  const int64_t *idx = index.data_ptr<int64_t>(), *starts = seg_starts.data_ptr<int64_t>(),
                *slot_of = seg_slots.data_ptr<int64_t>();
  TORCH_CHECK(segs == 0 || (starts[0] == 0 && starts[segs] == index.size(0)), "segments must cover index");
  // Tiles of up to kTileRows rows of one segment; segments with enough work (rows x rank) go to ATen's GEMMs.
  std::vector<int64_t> tiles;  // (first position in index, rows, slot)
  for (int64_t g = 0; g < segs; ++g) {
    const int64_t s = slot_of[g], n = starts[g + 1] - starts[g];
    TORCH_CHECK(s >= 0 && s < slots && n >= 0, "segment slot out of range");
    for (int64_t p = starts[g]; p < starts[g + 1]; ++p)
      TORCH_CHECK(idx[p] >= 0 && idx[p] < y.size(0), "row out of range");
    if (n * rank >= kGemmWork) {
      auto rows = index.slice(0, starts[g], starts[g + 1]);
      y.index_add_(0, rows, at::mm(at::mm(x.index_select(0, rows), a[s].t()), b[s]));
      continue;
    }
    for (int64_t p = starts[g]; p < starts[g + 1]; p += kTileRows) {
      tiles.push_back(p);
      tiles.push_back(std::min<int64_t>(kTileRows, starts[g + 1] - p));
      tiles.push_back(s);
    }
  }
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) / 3;
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *ap = a.data_ptr<scalar_t>(), *bp = b.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, kTileRows * rank * (in + out)));
    at::parallel_for(0, num_tiles, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> shrunk(kTileRows * rank), xf(in), acc(out);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t first = tiles[3 * t], n = tiles[3 * t + 1], s = tiles[3 * t + 2];
        const scalar_t *sa = ap + s * rank * in, *sb = bp + s * rank * out;
#ifdef PAGEDSERVE_LORA_TILES
        if (in % 16 == 0 && out % 16 == 0) {
          const scalar_t* xr[kTile];
          scalar_t* yr[kTile];
          for (int64_t done = 0; done < n; done += kTile) {
            const int m = static_cast<int>(std::min<int64_t>(kTile, n - done));
            for (int j = 0; j < m; ++j) {
              xr[j] = xp + idx[first + done + j] * x.stride(0);
              yr[j] = yp + idx[first + done + j] * y.stride(0);
            }
            tile_delta_any<scalar_t>(m, xr, sa, sb, in, rank, out, yr, shrunk.data());
          }
          continue;
        }
#endif
        for (int64_t j = 0; j < n; ++j) {
          const int64_t row = idx[first + j];
          row_delta<scalar_t>(xp + row * x.stride(0), sa, sb, in, rank, out, yp + row * y.stride(0), shrunk.data(),
                              xf.data(), acc.data());
        }
      }
    });
  };
  if (x.scalar_type() == torch::kBFloat16)
    run(at::BFloat16(0.f));
  else
    run(0.f);
}
