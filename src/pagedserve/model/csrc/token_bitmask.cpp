// Grammar masks applied to the sampler's fp32 logits in place: one pass over the packed bitmask (bit j of
// word w allows token 32 w + j), touching only the logits of tokens a grammar forbids. PyTorch's version
// unpacks the bits into a [R, V] bool tensor and gathers and scatters the rows: several passes over memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

void apply_token_bitmask(torch::Tensor logits, torch::Tensor rows, torch::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
              "logits must be [B, V] float32 with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(), "rows must be [R] int64");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous() &&
                  bitmask.size(0) == rows.size(0), "bitmask must be [R, W] int32, a row per entry of rows");
  const int64_t vocab = logits.size(1), words = bitmask.size(1), ld = logits.stride(0), n = rows.size(0);
  const int64_t batch = logits.size(0);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < batch, "row out of range");
  const uint32_t* masks = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* row = base + row_ids[r] * ld;
      const uint32_t* m = masks + r * words;
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        const uint32_t word = m[w];
        if (word == 0xFFFFFFFFu) continue;  // all allowed: the common case in free text spans
        const int64_t lo = w * 32, hi = std::min<int64_t>(lo + 32, vocab);
        for (int64_t t = lo; t < hi; ++t)
          if (!((word >> (t - lo)) & 1u)) row[t] = kNegInf;
      }
      for (int64_t t = words * 32; t < vocab; ++t) row[t] = kNegInf;  // beyond the mask: never allowed
    }
  });
}
