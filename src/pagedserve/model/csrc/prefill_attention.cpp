// Causal prefill attention over the paged KV pool for bf16, with AVX-512 BF16: every prefill span of a step
// (fresh prompts and chunked continuations alike) in one call. A task is a tile of up to 16 queries of one
// span for one kv head; it walks the span's keys 16 at a time through the block table with an online
// softmax, so both q.k and p.v are bf16 dot-product instructions with fp32 accumulation and no score
// matrix is ever materialised. PyTorch's CPU SDPA runs these short causal shapes at ~40 GFLOP/s.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_quant.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include "vec_math.h"

namespace {

constexpr int kTile = 16;  // queries per task and keys per chunk

struct Span {
  int64_t start, num_tokens, context_len;
  const int64_t* table;
};

struct Task {
  int64_t span, kv_head, q0;
};

// One kv head's 16-key chunk, laid out for dot products: kt[i] holds dims (2i, 2i+1) of all 16 keys (a
// transpose in 32-bit units), vp[p][c] holds dims 16c..16c+15 of keys 2p and 2p+1 interleaved.
template <int D>
struct Chunk {
  alignas(64) uint32_t kt[D / 2][kTile];
  alignas(64) uint16_t vp[kTile / 2][D * 2];
};

// Rows of the chunk's n keys (bf16; those past n are zero), read in place from a bf16 cache or, from a
// quantized one, dequantized into the task's small staging rows.
template <int D>
struct ChunkRows {
  alignas(64) uint16_t zero[D] = {};
  alignas(64) uint16_t k_stage[kTile][D];
  alignas(64) uint16_t v_stage[kTile][D];
  const uint16_t* k[kTile];
  const uint16_t* v[kTile];
};

template <int D>
inline void dequantize_bf16(const QuantRowReader& r, int64_t slot, int64_t head, uint16_t* dst) {
  alignas(64) float row[D];
  r.template load<D>(slot, head, row);
  for (int f = 0; f < D / 16; ++f)
    _mm256_store_si256(reinterpret_cast<__m256i*>(dst + f * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + f * 16)));
}

template <int D>
void chunk_rows(const uint16_t* k_cache, const uint16_t* v_cache, const QuantRowReader* kq, const QuantRowReader* vq,
                int64_t kv_head, const int64_t* slots, int64_t n, int64_t row_stride, ChunkRows<D>& rows) {
  for (int64_t j = 0; j < kTile; ++j) {
    if (j >= n) {
      rows.k[j] = rows.v[j] = rows.zero;
    } else if (kq != nullptr) {
      dequantize_bf16<D>(*kq, slots[j], kv_head, rows.k_stage[j]);
      dequantize_bf16<D>(*vq, slots[j], kv_head, rows.v_stage[j]);
      rows.k[j] = rows.k_stage[j];
      rows.v[j] = rows.v_stage[j];
    } else {
      rows.k[j] = k_cache + slots[j] * row_stride + kv_head * D;
      rows.v[j] = v_cache + slots[j] * row_stride + kv_head * D;
    }
  }
}

template <int D>
void load_chunk(const uint16_t* const* k_rows, const uint16_t* const* v_rows, Chunk<D>& ch) {
  for (int j = 0; j < kTile; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(k_rows[j]);
    for (int i = 0; i < D / 2; ++i) ch.kt[i][j] = k[i];
  }
  // Interleave two value rows: out[2d] = a[d], out[2d + 1] = b[d] for 16 dims per output vector.
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
  for (int p = 0; p < kTile / 2; ++p)
    for (int c = 0; c < D / 32; ++c) {
      const __m512i a = _mm512_loadu_si512(v_rows[2 * p] + c * 32);
      const __m512i b = _mm512_loadu_si512(v_rows[2 * p + 1] + c * 32);
      _mm512_store_si512(ch.vp[p] + c * 64, _mm512_permutex2var_epi16(a, lo, b));
      _mm512_store_si512(ch.vp[p] + c * 64 + 32, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// Online-softmax state of one query row (one query token, one head).
template <int D>
struct Row {
  const uint32_t* q;  // bf16 pairs
  int64_t limit;      // keys visible: positions < limit
  float m, l;
  alignas(64) float acc[D];
};

// Rows r..r+3 (fewer at the end) against one chunk whose first key sits at position k0.
template <int D, int N>
inline void rows_against_chunk(Row<D>* rows, const Chunk<D>& ch, int64_t k0, int64_t n, float scale) {
  __m512 s[N];
  for (int r = 0; r < N; ++r) s[r] = _mm512_setzero_ps();
  for (int i = 0; i < D / 2; ++i) {
    const __m512bh kt = (__m512bh)_mm512_load_si512(ch.kt[i]);
    for (int r = 0; r < N; ++r)
      s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(static_cast<int>(rows[r].q[i])), kt);
  }
  uint32_t pairs[N][kTile / 2];
  bool live[N];
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(k0)),
                                       _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  for (int r = 0; r < N; ++r) {
    Row<D>& row = rows[r];
    const int64_t visible = std::min<int64_t>(n, row.limit - k0);
    live[r] = visible > 0;
    if (!live[r]) continue;
    const __mmask16 mask = _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(k0 + visible)));
    const __m512 sc = _mm512_mask_mul_ps(_mm512_set1_ps(kNegative), mask, s[r], _mm512_set1_ps(scale));
    const float mx = std::max(row.m, _mm512_reduce_max_ps(sc));
    const float correction = std::exp(row.m - mx);  // 0 on a row's first chunk (m = kNegative)
    const __m512 e = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(sc, _mm512_set1_ps(mx))));
    row.l = row.l * correction + _mm512_reduce_add_ps(e);
    row.m = mx;
    const __m256bh pb = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs[r]), (__m256i)pb);
    const __m512 cv = _mm512_set1_ps(correction);
    for (int f = 0; f < D / 16; ++f)
      _mm512_store_ps(row.acc + f * 16, _mm512_mul_ps(_mm512_load_ps(row.acc + f * 16), cv));
  }
  for (int r = 0; r < N; ++r) {
    if (!live[r]) continue;
    __m512 acc[D / 16];
    for (int f = 0; f < D / 16; ++f) acc[f] = _mm512_load_ps(rows[r].acc + f * 16);
    for (int p = 0; p < kTile / 2; ++p) {
      const __m512bh pp = (__m512bh)_mm512_set1_epi32(static_cast<int>(pairs[r][p]));
      for (int f = 0; f < D / 16; ++f)
        acc[f] = _mm512_dpbf16_ps(acc[f], pp, (__m512bh)_mm512_load_si512(ch.vp[p] + f * 32));
    }
    for (int f = 0; f < D / 16; ++f) _mm512_store_ps(rows[r].acc + f * 16, acc[f]);
  }
}

template <int D>
void run_task(const Task& t, const Span& sp, const uint16_t* q, int64_t q_row_stride, const uint16_t* k_cache,
              const uint16_t* v_cache, const QuantRowReader* kq, const QuantRowReader* vq, uint16_t* out,
              int64_t num_heads, int64_t num_kv_heads, int64_t block_size, float scale) {
  const int64_t group = num_heads / num_kv_heads, row_stride = num_kv_heads * D;
  const int64_t nq = std::min<int64_t>(kTile, sp.num_tokens - t.q0);
  std::vector<Row<D>> rows(nq * group);
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      Row<D>& row = rows[i * group + g];
      row.q = reinterpret_cast<const uint32_t*>(q + (sp.start + t.q0 + i) * q_row_stride + (t.kv_head * group + g) * D);
      row.limit = sp.context_len + t.q0 + i + 1;
      row.m = kNegative;
      row.l = 0.f;
      std::fill(row.acc, row.acc + D, 0.f);
    }
  const int64_t keys = sp.context_len + t.q0 + nq;
  Chunk<D> ch;
  ChunkRows<D> chunk;
  int64_t slots[kTile];
  for (int64_t k0 = 0; k0 < keys; k0 += kTile) {
    const int64_t n = std::min<int64_t>(kTile, keys - k0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = k0 + j;
      slots[j] = sp.table[p / block_size] * block_size + p % block_size;
    }
    chunk_rows<D>(k_cache, v_cache, kq, vq, t.kv_head, slots, n, row_stride, chunk);
    load_chunk<D>(chunk.k, chunk.v, ch);
    // Four rows at a time share each key vector load; rows that see none of the chunk skip its softmax.
    int64_t r = 0;
    const int64_t total = static_cast<int64_t>(rows.size());
    for (; r + 4 <= total; r += 4) rows_against_chunk<D, 4>(rows.data() + r, ch, k0, n, scale);
    for (; r < total; ++r) rows_against_chunk<D, 1>(rows.data() + r, ch, k0, n, scale);
  }
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < group; ++g) {
      const Row<D>& row = rows[i * group + g];
      uint16_t* o = out + ((sp.start + t.q0 + i) * num_heads + t.kv_head * group + g) * D;
      const __m512 inv = _mm512_set1_ps(1.f / row.l);
      for (int f = 0; f < D / 16; ++f)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + f * 16),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(row.acc + f * 16), inv)));
    }
}

}  // namespace

bool prefill_attention_available() { return true; }

// q: [T, H, D] bf16 (rows may be strided, each [H, D] contiguous); k_cache, v_cache: [slots, KV, D], bf16 or fp8 /
// int8 / int4 with their scales (kv_quant.h), holding every span's keys, this step's included; spans: [S, 3] int64 rows
// (first row in q, new tokens, tokens already cached); block_tables: [S, max_blocks] int64. Writes the spans' rows
// of out ([T, H, D], contiguous).
void prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, torch::Tensor spans,
                       torch::Tensor block_tables, int64_t block_size, double scale, torch::Tensor out,
                       c10::optional<torch::Tensor> k_tail, c10::optional<torch::Tensor> tail_of_block) {
  TORCH_CHECK(q.scalar_type() == torch::kBFloat16 && out.scalar_type() == torch::kBFloat16,
              "prefill_attention is for bfloat16");
  const KVKind kind = kv_kind(k_cache, q);
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches must share a format");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && out.is_contiguous(),
              "caches and out must be contiguous");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2), "each query row [H, D] must be contiguous");
  TORCH_CHECK(spans.scalar_type() == torch::kInt64 && block_tables.scalar_type() == torch::kInt64,
              "spans and block_tables must be int64");
  const int64_t d = q.size(2), num_heads = q.size(1), num_kv_heads = k_cache.size(1);
  TORCH_CHECK(d == 64 || d == 128, "head_dim must be 64 or 128");
  QuantRowReader kr{}, vr{};
  const QuantRowReader *kq = nullptr, *vq = nullptr;
  if (kind != KVKind::kPlain) {
    std::tie(kr, vr) = quant_readers(kind, k_cache, v_cache, k_scale, v_scale, k_tail, tail_of_block, block_size);
    kq = &kr;
    vq = &vr;
  }
  auto sp_t = spans.contiguous();
  auto bt = block_tables.contiguous();
  const int64_t* s = sp_t.data_ptr<int64_t>();
  std::vector<Span> sp;
  std::vector<Task> tasks;
  for (int64_t i = 0; i < sp_t.size(0); ++i) {
    sp.push_back({s[3 * i], s[3 * i + 1], s[3 * i + 2], bt.data_ptr<int64_t>() + i * bt.size(1)});
    for (int64_t h = 0; h < num_kv_heads; ++h)
      for (int64_t q0 = 0; q0 < s[3 * i + 1]; q0 += kTile) tasks.push_back({i, h, q0});
  }
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Task& t = tasks[i];
      if (d == 64)
        run_task<64>(t, sp[t.span], qp, q.stride(0), kp, vp, kq, vq, op, num_heads, num_kv_heads, block_size, scale);
      else
        run_task<128>(t, sp[t.span], qp, q.stride(0), kp, vp, kq, vq, op, num_heads, num_kv_heads, block_size, scale);
    }
  });
}

#else

bool prefill_attention_available() { return false; }

void prefill_attention(torch::Tensor, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                       c10::optional<torch::Tensor>, torch::Tensor, torch::Tensor, int64_t, double, torch::Tensor,
                       c10::optional<torch::Tensor>, c10::optional<torch::Tensor>) {
  TORCH_CHECK(false, "prefill_attention needs AVX-512 BF16");
}

#endif
