// Fused bf16 elementwise ops of one decoder layer: each is one pass over memory with fp32 math,
// where PyTorch's bf16 versions take 3-8 ops (and as many passes and dispatches) each.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kv_quant.h"
#include "vec_math.h"

static inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Round to nearest even, as at::BFloat16 does (inputs here are finite).
static inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline const uint16_t* bits(const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); }
static inline uint16_t* bits_mut(torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// Rows per task so that a decode-sized call runs on one thread: waking the pool costs more than the work.
static inline int64_t grain(int64_t row_elems) { return std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, row_elems)); }

static void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, name, " must be bfloat16");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have unit stride in its last dimension");
}

// x: [T, H] (rows may be strided), w: [H]. Returns w * x / rms(x) as a new contiguous [T, H].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(x.dim() == 2 && w.is_contiguous() && w.size(0) == x.size(1), "x must be [T, H] and w [H]");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const uint16_t *xp = bits(x), *wp = bits(w);
  uint16_t* op = bits_mut(out);
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* xr = xp + r * ld;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) { const float v = bf16_to_float(xr[i]); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / h + static_cast<float>(eps));
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) op[r * h + i] = float_to_bf16(bf16_to_float(xr[i]) * inv * bf16_to_float(wp[i]));
    }
  });
  return out;
}

// gate_up: [T, 2I] = [gate | up]. Returns silu(gate) * up, [T, I].
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  const uint16_t* gp = bits(gate_up);
  uint16_t* op = bits_mut(out);
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *g = gp + r * ld, *u = g + n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = bf16_to_float(g[i]);
        op[r * n + i] = float_to_bf16(a / (1.f + std::exp(-a)) * bf16_to_float(u[i]));
      }
    }
  });
  return out;
}

// Gemma's RMSNorm: x / rms(x) * scale in fp32, rounded once (scale = 1 + w, fp32 [H], as transformers computes
// it). x: [T, H] (rows may be strided). With residual ([T, H] contiguous): residual + the norm, the norm rounded to
// bf16 first as the PyTorch layer rounds it (Gemma's norms after attention and the MLP). Returns a new [T, H].
torch::Tensor gemma_rms_norm(torch::Tensor x, torch::Tensor scale, double eps, c10::optional<torch::Tensor> residual) {
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2 && scale.scalar_type() == torch::kFloat && scale.is_contiguous() && scale.size(0) == x.size(1),
              "x must be [T, H] and scale float32 [H]");
  TORCH_CHECK(!residual || (residual->scalar_type() == torch::kBFloat16 && residual->is_contiguous() &&
                            residual->sizes() == x.sizes()), "residual must be a contiguous bf16 [T, H]");
  const int64_t rows = x.size(0), h = x.size(1), ld = x.stride(0);
  auto out = torch::empty({rows, h}, x.options());
  const uint16_t* xp = bits(x);
  const uint16_t* rp = residual ? bits(*residual) : nullptr;
  const float* wp = scale.data_ptr<float>();
  uint16_t* op = bits_mut(out);
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* xr = xp + r * ld;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < h; ++i) { const float v = bf16_to_float(xr[i]); ss += v * v; }
      const float inv = 1.f / std::sqrt(ss / h + static_cast<float>(eps));
      uint16_t* o = op + r * h;
      if (rp == nullptr) {
#pragma omp simd
        for (int64_t i = 0; i < h; ++i) o[i] = float_to_bf16(bf16_to_float(xr[i]) * inv * wp[i]);
      } else {
        const uint16_t* res = rp + r * h;
#pragma omp simd
        for (int64_t i = 0; i < h; ++i)
          o[i] = float_to_bf16(bf16_to_float(res[i]) + bf16_to_float(float_to_bf16(bf16_to_float(xr[i]) * inv * wp[i])));
      }
    }
  });
  return out;
}

// Gemma's QK-norm in place: each q and k head of qkv ([T, (H + 2 KV) * D], rows may be strided) becomes
// head / rms(head) * scale (q_scale, k_scale: fp32 [D], 1 + w), rounded once.
void gemma_qk_norm(torch::Tensor qkv, torch::Tensor q_scale, torch::Tensor k_scale, int64_t num_heads,
                   int64_t num_kv_heads, double eps) {
  check_bf16(qkv, "qkv");
  const int64_t d = q_scale.size(0), rows = qkv.size(0), ld = qkv.stride(0);
  TORCH_CHECK(q_scale.scalar_type() == torch::kFloat && k_scale.scalar_type() == torch::kFloat &&
              q_scale.is_contiguous() && k_scale.is_contiguous() && k_scale.size(0) == d &&
              qkv.size(1) == (num_heads + 2 * num_kv_heads) * d, "shapes do not match");
  uint16_t* base = bits_mut(qkv);
  const float *qs = q_scale.data_ptr<float>(), *ks = k_scale.data_ptr<float>();
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t head = 0; head < num_heads + num_kv_heads; ++head) {
        uint16_t* x = base + t * ld + head * d;
        const float* w = head < num_heads ? qs : ks;
        float ss = 0.f;
#pragma omp simd reduction(+ : ss)
        for (int64_t i = 0; i < d; ++i) { const float v = bf16_to_float(x[i]); ss += v * v; }
        const float inv = 1.f / std::sqrt(ss / d + static_cast<float>(eps));
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) x[i] = float_to_bf16(bf16_to_float(x[i]) * inv * w[i]);
      }
  });
}

// gate_up: [T, 2I] = [gate | up]. Returns gelu(gate) * up with the tanh GELU (GeGLU: Gemma), [T, I]:
// 0.5 (1 + tanh u) = sigmoid(2u), so one exp per element.
torch::Tensor gelu_tanh_and_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [T, 2I]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2, ld = gate_up.stride(0);
  auto out = torch::empty({rows, n}, gate_up.options());
  const uint16_t* gp = bits(gate_up);
  uint16_t* op = bits_mut(out);
  constexpr float kTwoRoot2OverPi = 2.f * 0.7978845608028654f;
  at::parallel_for(0, rows, grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t *g = gp + r * ld, *u = g + n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float a = bf16_to_float(g[i]);
        // exp(-2u) capped at exp(80) (gelu there is ~0): past it, fast-math's exp overflows to garbage.
        const float two_u = std::max(kTwoRoot2OverPi * (a + 0.044715f * a * a * a), -80.f);
        op[r * n + i] = float_to_bf16(a / (1.f + std::exp(-two_u)) * bf16_to_float(u[i]));
      }
    }
  });
  return out;
}

// Rotate-half RoPE of one token's q and k heads (bf16, in place).
static inline void rope_row(uint16_t* row, const float* c, const float* s, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t head = 0; head < heads; ++head) {
    uint16_t* x = row + head * d;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = bf16_to_float(x[i]), x2 = bf16_to_float(x[i + half]);
      x[i] = float_to_bf16(x1 * c[i] - x2 * s[i]);
      x[i + half] = float_to_bf16(x2 * c[i] + x1 * s[i]);
    }
  }
}

// Sylvester's Hadamard transform, orthonormal, of `heads` bf16 vectors of d (a power of two) in place: the basis
// fp8 caches keep queries and keys in (KVFormat.rotates_keys in model/kv_cache_dtype.py).
static void hadamard_rows(uint16_t* row, int64_t heads, int64_t d, float* x) {
  const float norm = 1.f / std::sqrt(static_cast<float>(d));
  for (int64_t head = 0; head < heads; ++head) {
    uint16_t* r = row + head * d;
    for (int64_t i = 0; i < d; ++i) x[i] = bf16_to_float(r[i]);
    int64_t h = 1;
#if defined(__AVX512F__)
    if (d % 16 == 0) {  // the four butterfly stages inside each 16 lanes
      for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(x + c, hadamard16(_mm512_loadu_ps(x + c)));
      h = 16;
    }
#endif
    for (; h < d; h <<= 1)
      for (int64_t i = 0; i < d; i += 2 * h)
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = a + b;
          x[j + h] = a - b;
        }
    for (int64_t i = 0; i < d; ++i) r[i] = float_to_bf16(x[i] * norm);
  }
}

// qkv: [T, (H + 2 KV) * D], the fused projection's output. Rotates q and k in place (rotate-half RoPE,
// cos/sin: [T, D/2] fp32, already gathered at each token's position) and writes k and v into the caches
// ([slots, KV, D], bfloat16, or fp8 / int8 quantized on the way in with k_scale / v_scale as in kv_quant.h)
// at slot_mapping. fp8 with a power-of-two D: q and k then go into the Hadamard basis, in place too.
void rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                    torch::Tensor v_cache, c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale,
                    torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  check_bf16(qkv, "qkv");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches must be contiguous and share a format");
  const KVKind kind = kv_kind(k_cache, qkv);
  TORCH_CHECK(kind != KVKind::kPlain || k_cache.scalar_type() == torch::kBFloat16, "an unquantized cache must be bf16");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos and sin must be contiguous float32");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t rows = qkv.size(0), ld = qkv.stride(0), d = k_cache.size(2), half = d / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && cos.size(0) == rows && cos.size(1) == half &&
              slot_mapping.size(0) == rows && k_cache.size(1) == num_kv_heads, "shapes do not match");
  // Quantized caches: the scales' shapes are checked by the readers' constructor; writers use the raw pointers.
  const float *ks = nullptr, *vs = nullptr;  // fp8: the heads' scales
  uint8_t *k_codes = nullptr, *v_codes = nullptr;  // int8: the rows' scale codes
  if (kind != KVKind::kPlain) {
    const QuantRowReader kr = quant_reader(k_cache, k_scale, kind), vr = quant_reader(v_cache, v_scale, kind);
    ks = kr.scales;
    vs = vr.scales;
    k_codes = const_cast<uint8_t*>(kr.row_scales);
    v_codes = const_cast<uint8_t*>(vr.row_scales);
  }
  uint16_t* base = bits_mut(qkv);
  uint8_t *kc = reinterpret_cast<uint8_t*>(k_cache.data_ptr()), *vc = reinterpret_cast<uint8_t*>(v_cache.data_ptr());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t kv_row = num_kv_heads * d, elem = k_cache.element_size();
  const bool turn = (kind == KVKind::kFp8E4M3 || kind == KVKind::kFp8E5M2) && (d & (d - 1)) == 0;
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    std::vector<float> x_f(d);
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* row = base + t * ld;
      rope_row(row, cp + t * half, sp + t * half, num_heads + num_kv_heads, d);
      if (turn) hadamard_rows(row, num_heads + num_kv_heads, d, x_f.data());
      const int64_t slot = slots[t];
      if (kind == KVKind::kPlain) {
        std::memcpy(kc + slot * kv_row * elem, row + num_heads * d, kv_row * 2);
        std::memcpy(vc + slot * kv_row * elem, row + (num_heads + num_kv_heads) * d, kv_row * 2);
        continue;
      }
      for (int64_t h = 0; h < num_kv_heads; ++h)
        for (int which = 0; which < 2; ++which) {
          const uint16_t* src = row + (num_heads + which * num_kv_heads + h) * d;
          for (int64_t i = 0; i < d; ++i) x_f[i] = bf16_to_float(src[i]);
          uint8_t* dst = (which ? vc : kc) + (slot * num_kv_heads + h) * d;
          const int64_t at = slot * num_kv_heads + h;
          if (kind == KVKind::kInt8) {
            quantize_row(kind, x_f.data(), d, dst, (which ? v_codes : k_codes) + at, 1.f);
          } else {
            quantize_row(kind, x_f.data(), d, dst, nullptr, (which ? vs : ks)[h]);
          }
        }
    }
  });
}

// The int4 pool's write (model/kv_int4.py has the reference): rotates q and k in place as rope_and_cache does and
// shifts k by the layer's key offset (k_offset, float32 [KV, D]; the shifted keys stay in qkv), quantizes each
// token's v per token into its slot, copies each k into its block's bf16 tail row (key_rows, -1: none), then
// quantizes the keys of every block that fills this step per channel (completions: [C, 3] int64 of block, tail or
// -1, first qkv row when the whole block was written this step).
void rope_and_cache_int4(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor k_params, torch::Tensor v_params, torch::Tensor k_tail,
                         torch::Tensor k_offset, torch::Tensor slot_mapping, torch::Tensor key_rows,
                         torch::Tensor completions, int64_t block_size, int64_t num_heads, int64_t num_kv_heads) {
  check_bf16(qkv, "qkv");
  TORCH_CHECK(k_cache.scalar_type() == torch::kByte && v_cache.scalar_type() == torch::kByte && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "int4 caches must be contiguous uint8");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat && sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
              sin.is_contiguous(), "cos and sin must be contiguous float32");
  for (const auto* t : {&slot_mapping, &key_rows, &completions})
    TORCH_CHECK(t->scalar_type() == torch::kInt64 && t->is_contiguous(), "slot_mapping, key_rows, completions: int64");
  const int64_t rows = qkv.size(0), ld = qkv.stride(0), d = k_cache.size(2) * 2, half = d / 2;
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d && cos.size(0) == rows && cos.size(1) == half &&
                  slot_mapping.size(0) == rows && key_rows.size(0) == rows && k_cache.size(1) == num_kv_heads &&
                  completions.dim() == 2 && completions.size(1) == 3,
              "shapes do not match");
  const int64_t slots = k_cache.size(0), blocks = slots / block_size, num_tail_rows = k_tail.size(0);
  TORCH_CHECK(k_params.scalar_type() == torch::kByte && v_params.scalar_type() == torch::kByte &&
                  k_params.is_contiguous() && v_params.is_contiguous() &&
                  k_params.numel() == blocks * num_kv_heads * d * 3 / 2 && v_params.numel() == slots * num_kv_heads * 2 &&
                  k_tail.scalar_type() == torch::kBFloat16 && k_tail.is_contiguous() &&
                  k_offset.scalar_type() == torch::kFloat && k_offset.is_contiguous() &&
                  k_offset.numel() == num_kv_heads * d,
              "int4 parameters, tails and key offsets do not match the pool");
  uint16_t* base = bits_mut(qkv);
  uint8_t *kc = k_cache.data_ptr<uint8_t>(), *vc = v_cache.data_ptr<uint8_t>();
  uint8_t *kp = k_params.data_ptr<uint8_t>(), *vp = v_params.data_ptr<uint8_t>();
  const float* offset = k_offset.data_ptr<float>();
  auto* tail = reinterpret_cast<uint16_t*>(k_tail.data_ptr());
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *sm = slot_mapping.data_ptr<int64_t>(), *kr = key_rows.data_ptr<int64_t>();
  at::parallel_for(0, rows, grain(qkv.size(1)), [&](int64_t begin, int64_t end) {
    std::vector<float> x(d);
    std::vector<uint8_t> codes(d);
    for (int64_t t = begin; t < end; ++t) {
      uint16_t* row = base + t * ld;
      rope_row(row, cp + t * half, sp + t * half, num_heads + num_kv_heads, d);
      uint16_t* k = row + num_heads * d;
      for (int64_t i = 0; i < num_kv_heads * d; ++i) k[i] = float_to_bf16(bf16_to_float(k[i]) - offset[i]);
      const int64_t slot = sm[t];
      TORCH_CHECK(slot >= 0 && slot < slots && kr[t] < num_tail_rows, "slot or key row out of range");
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        const uint16_t* v = row + (num_heads + num_kv_heads + h) * d;
        for (int64_t i = 0; i < d; ++i) x[i] = bf16_to_float(v[i]);
        uint8_t* p = vp + (slot * num_kv_heads + h) * 2;
        int4_codes(x.data(), d, 1, codes.data(), p, p + 1);
        uint8_t* dst = vc + (slot * num_kv_heads + h) * half;
        for (int64_t i = 0; i < half; ++i) dst[i] = codes[2 * i] | (codes[2 * i + 1] << 4);
      }
      if (kr[t] >= 0) std::memcpy(tail + kr[t] * num_kv_heads * d, row + num_heads * d, num_kv_heads * d * 2);
    }
  });
  const int64_t* comp = completions.data_ptr<int64_t>();
  at::parallel_for(0, completions.size(0) * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> x(block_size * d);
    std::vector<uint8_t> codes(block_size);
    for (int64_t idx = begin; idx < end; ++idx) {
      const int64_t* c = comp + (idx / num_kv_heads) * 3;
      const int64_t h = idx % num_kv_heads, block = c[0], from_tail = c[1], first = c[2];
      TORCH_CHECK(block >= 0 && block < blocks && (from_tail >= 0 ? (from_tail + 1) * block_size <= num_tail_rows
                                                                  : first >= 0 && first + block_size <= rows),
                  "completion out of range");
      for (int64_t j = 0; j < block_size; ++j) {
        const uint16_t* k = from_tail >= 0 ? tail + ((from_tail * block_size + j) * num_kv_heads + h) * d
                                           : base + (first + j) * ld + (num_heads + h) * d;
        for (int64_t i = 0; i < d; ++i) x[j * d + i] = bf16_to_float(k[i]);
      }
      uint8_t* p = kp + (block * num_kv_heads + h) * (d + half);
      for (int64_t i = 0; i < d; ++i) {
        uint8_t zero;
        int4_codes(x.data() + i, block_size, d, codes.data(), p + i, &zero);
        uint8_t& zeros = p[d + i / 2];
        zeros = (i % 2 == 0) ? static_cast<uint8_t>((zeros & 0xF0) | zero) : static_cast<uint8_t>((zeros & 0x0F) | (zero << 4));
        for (int64_t j = 0; j < block_size; ++j) {
          uint8_t& dst = kc[((block * block_size + j) * num_kv_heads + h) * half + i / 2];
          dst = (i % 2 == 0) ? static_cast<uint8_t>((dst & 0xF0) | codes[j]) : static_cast<uint8_t>((dst & 0x0F) | (codes[j] << 4));
        }
      }
    }
  });
}
