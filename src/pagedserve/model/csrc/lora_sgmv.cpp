// Batched LoRA (Punica's SGMV on a CPU): y[rows] += (x[rows] @ A_s^T) @ B_s for every segment of rows served by
// adapter slot s, in one call per projection. Decode-sized segments (a few rows) run a fused shrink/expand per
// row straight from the slot buffers, fp32 accumulation, no temporaries; long segments (prefill chunks) go to
// ATen's GEMMs, where the per-call overhead is paid back.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGemmRows = 16;  // segments at least this long use at::mm

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
  std::vector<int64_t> small_rows;  // (position in index, segment) of rows in short segments
  for (int64_t g = 0; g < segs; ++g) {
    const int64_t s = slot_of[g], n = starts[g + 1] - starts[g];
    TORCH_CHECK(s >= 0 && s < slots && n >= 0, "segment slot out of range");
    for (int64_t p = starts[g]; p < starts[g + 1]; ++p)
      TORCH_CHECK(idx[p] >= 0 && idx[p] < y.size(0), "row out of range");
    if (n >= kGemmRows) {
      auto rows = index.slice(0, starts[g], starts[g + 1]);
      auto delta = at::mm(at::mm(x.index_select(0, rows), a[s].t()), b[s]);
      y.index_add_(0, rows, delta);
    } else {
      for (int64_t p = starts[g]; p < starts[g + 1]; ++p) {
        small_rows.push_back(p);
        small_rows.push_back(g);
      }
    }
  }
  const int64_t num_small = static_cast<int64_t>(small_rows.size()) / 2;
  auto run = [&](auto zero) {
    using scalar_t = decltype(zero);
    const scalar_t *xp = x.data_ptr<scalar_t>(), *ap = a.data_ptr<scalar_t>(), *bp = b.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, rank * (in + out)));
    at::parallel_for(0, num_small, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> shrunk(rank), xf(in), acc(out);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t row = idx[small_rows[2 * i]], s = slot_of[small_rows[2 * i + 1]];
        row_delta<scalar_t>(xp + row * x.stride(0), ap + s * rank * in, bp + s * rank * out, in, rank, out,
                            yp + row * y.stride(0), shrunk.data(), xf.data(), acc.data());
      }
    });
  };
  if (x.scalar_type() == torch::kBFloat16)
    run(at::BFloat16(0.f));
  else
    run(0.f);
}
