// Decode attention over the paged KV pool: one query token per sequence, K/V read in place
// through the block table, so each cached token is read exactly once (no gather copy).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// Widen one row to float; the bf16 case is a plain shift so the compiler vectorizes it.
template <typename scalar_t>
static inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

template <typename scalar_t>
static void decode(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* block_tables,
                   const int64_t* context_lens, scalar_t* out, int64_t num_seqs, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  // Small batches run on one thread: waking the pool costs more than the work.
  const int64_t work_per_item = std::max<int64_t>(1, max_blocks * block_size * head_dim * (group + 1));
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / work_per_item);
  at::parallel_for(0, num_seqs * num_kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), row(head_dim), scores;
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t seq = idx / num_kv_heads, kvh = idx % num_kv_heads;
      const int64_t len = context_lens[seq];
      const int64_t* table = block_tables + seq * max_blocks;
      scores.assign(group * len, 0.f);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] = static_cast<float>(q[(seq * num_heads + kvh * group + g) * head_dim + d]) * scale;
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* kp = k_cache + (slot * num_kv_heads + kvh) * head_dim;
        to_float(kp, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          float s = 0.f;
          const float* qg = qf.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) s += qg[d] * row[d];
          scores[g * len + t] = s;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        float* sg = scores.data() + g * len;
        const float mx = *std::max_element(sg, sg + len);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sg[t] = std::exp(sg[t] - mx); sum += sg[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t slot = table[t / block_size] * block_size + t % block_size;
        const scalar_t* vp = v_cache + (slot * num_kv_heads + kvh) * head_dim;
        to_float(vp, row.data(), head_dim);
        for (int64_t g = 0; g < group; ++g) {
          const float p = scores[g * len + t];
          float* ag = acc.data() + g * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * row[d];
        }
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out[(seq * num_heads + kvh * group + g) * head_dim + d] = static_cast<scalar_t>(acc[g * head_dim + d]);
    }
  });
}

// q: [B, H, D]; k_cache, v_cache: [slots, KV, D]; block_tables: [B, max_blocks] int64; context_lens: [B] int64
// (tokens to attend, the current one included). Returns [B, H, D].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64,
              "block_tables and context_lens must be int64");
  auto bt = block_tables.contiguous();
  auto cl = context_lens.contiguous();
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     bt.data_ptr<int64_t>(), cl.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1),
                     k_cache.size(1), q.size(2), block_size, bt.size(1), static_cast<float>(scale));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV pool");
}
