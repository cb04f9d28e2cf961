// Matmuls over quantized weights, read as stored (GGUF Q4_0/Q4_1/Q8_0, our int8 and int4).
//
// Weights are planar: qweight [N, K] int8 (8 bits) or [N, K/2] uint8 (4 bits: in each 32-wide group, byte j
// holds k = j in its low nibble and k = j + 16 in its high one, as GGML stores them), scales [N, K/group]
// fp32 and, for asymmetric 4 bits, mins [N, K/group]: w = scale * q + min.
//
// Small M (decode) is bandwidth-bound: each weight byte is read once and multiplied in integers against the
// activations quantized per 32 to int16 (AVX2 madd_epi16), with the exact float sum of each 32 for the min
// term. int8 activations (llama.cpp's Q8_0, maddubs) cost the default model +1.2% perplexity against the fp32
// product of the same weights; int16 ones are within rounding of it. Large M goes through quant_dequantize
// and a float GEMM (the crossover is chosen in quant_linear.py by measurement).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;  // activation quantization block; group sizes are multiples of it

enum Path : int64_t { kScalar = 0, kAvx2 = 1 };

inline float bf16_bits_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

// Activations quantized per 32: int16 values, their scale, and the exact float sum of the block.
constexpr float kActivationMax = 32767.f;

struct QuantizedRows {
  std::vector<int16_t> q;
  std::vector<float> scale, sum;
};

QuantizedRows quantize_rows(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1), blocks = k / kBlock;
  QuantizedRows out{std::vector<int16_t>(m * k), std::vector<float>(m * blocks), std::vector<float>(m * blocks)};
  const bool bf16 = x.scalar_type() == torch::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xb = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr()) : nullptr;
  at::parallel_for(0, m * blocks, 64, [&](int64_t begin, int64_t end) {
    float v[kBlock];
    for (int64_t rb = begin; rb < end; ++rb) {
      const int64_t row = rb / blocks, b = rb % blocks, base = row * k + b * kBlock;
      float amax = 0.f, sum = 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        v[i] = bf16 ? bf16_bits_to_float(xb[base + i]) : xf[base + i];
        amax = std::max(amax, std::fabs(v[i]));
        sum += v[i];
      }
      const float d = amax / kActivationMax, inv = d > 0.f ? 1.f / d : 0.f;
      for (int64_t i = 0; i < kBlock; ++i) {
        out.q[base + i] = static_cast<int16_t>(std::clamp(std::nearbyint(v[i] * inv), -kActivationMax, kActivationMax));
      }
      out.scale[rb] = d;
      out.sum[rb] = sum;
    }
  });
  return out;
}

// Integer dot product of one 32-block of weights with one of activations.
inline int32_t dot_block_scalar(const uint8_t* w, const int16_t* x, int64_t bits) {
  int32_t s = 0;
  if (bits == 4) {
    for (int i = 0; i < 16; ++i) s += (w[i] & 0xF) * x[i] + (w[i] >> 4) * x[i + 16];
  } else {
    const int8_t* ws = reinterpret_cast<const int8_t*>(w);
    for (int i = 0; i < kBlock; ++i) s += ws[i] * x[i];
  }
  return s;
}

#if defined(__AVX2__)
// 32 weights widened to int16 in k order (two vectors of 16): unsigned nibbles or signed int8.
struct Weights16 {
  __m256i lo, hi;
};

inline Weights16 load_weights(const uint8_t* w, int64_t bits) {
  if (bits == 4) {
    const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i low = _mm_and_si128(packed, _mm_set1_epi8(0x0F));
    const __m128i high = _mm_and_si128(_mm_srli_epi16(packed, 4), _mm_set1_epi8(0x0F));
    return {_mm256_cvtepu8_epi16(low), _mm256_cvtepu8_epi16(high)};
  }
  const __m128i* p = reinterpret_cast<const __m128i*>(w);
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(p)), _mm256_cvtepi8_epi16(_mm_loadu_si128(p + 1))};
}

// 8 int32 partial sums of w . x over one block (|w| <= 128, |x| <= 32767: pair sums fit in int32).
inline __m256i dot_block_avx2(const Weights16& w, const int16_t* x) {
  const __m256i* xv = reinterpret_cast<const __m256i*>(x);
  return _mm256_add_epi32(_mm256_madd_epi16(w.lo, _mm256_loadu_si256(xv)),
                          _mm256_madd_epi16(w.hi, _mm256_loadu_si256(xv + 1)));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

void check_weights(const torch::Tensor& qweight, const torch::Tensor& scales, const c10::optional<torch::Tensor>& mins,
                   int64_t bits, int64_t group, int64_t k) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(k % kBlock == 0 && group % kBlock == 0 && k % group == 0, "K and the group must be multiples of 32");
  TORCH_CHECK(qweight.is_contiguous() && scales.is_contiguous(), "qweight and scales must be contiguous");
  TORCH_CHECK(qweight.size(1) == (bits == 4 ? k / 2 : k), "qweight width does not match K");
  TORCH_CHECK(qweight.scalar_type() == (bits == 4 ? torch::kUInt8 : torch::kInt8), "qweight dtype does not match bits");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.size(0) == qweight.size(0) && scales.size(1) == k / group,
              "scales must be fp32 [N, K/group]");
  if (mins) {
    TORCH_CHECK(bits == 4 && mins->is_contiguous() && mins->sizes() == scales.sizes() &&
                mins->scalar_type() == torch::kFloat, "mins must be fp32 like scales (4 bits only)");
  }
}

}  // namespace

std::vector<int64_t> quant_paths() {
#if defined(__AVX2__)
  return {kScalar, kAvx2};
#else
  return {kScalar};
#endif
}

// y[M, N] = x[M, K] @ W^T, x fp32 or bf16 (y in x's dtype). path: 0 scalar, 1 AVX2.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                           c10::optional<torch::Tensor> mins, int64_t bits, int64_t group, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  check_weights(qweight, scales, mins, bits, group, k);
  const auto paths = quant_paths();
  TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "kernel path ", path,
              " is not built for this CPU");
  const QuantizedRows xq = quantize_rows(x);
  const int64_t blocks = k / kBlock, per_group = group / kBlock, row_bytes = qweight.size(1);
  const int64_t block_bytes = bits == 4 ? kBlock / 2 : kBlock;
  const uint8_t* wq = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const float* ws = scales.data_ptr<float>();
  const float* wm = mins ? mins->data_ptr<float>() : nullptr;
  auto out = torch::empty({m, n}, x.options().dtype(torch::kFloat));
  float* y = out.data_ptr<float>();
  // Rows per task: enough weight bytes that waking a thread pays for itself.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, row_bytes));
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> acc_min(m);
#if defined(__AVX2__)
    std::vector<__m256> acc(path == kAvx2 ? m : 0);
#endif
    std::vector<float> acc_scalar(m);
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* wrow = wq + row * row_bytes;
      const float* srow = ws + row * (k / group);
      const float* mrow = wm ? wm + row * (k / group) : nullptr;
      std::fill(acc_min.begin(), acc_min.end(), 0.f);
      std::fill(acc_scalar.begin(), acc_scalar.end(), 0.f);
#if defined(__AVX2__)
      if (path == kAvx2) {
        for (auto& a : acc) a = _mm256_setzero_ps();
        for (int64_t b = 0; b < blocks; ++b) {
          const Weights16 w = load_weights(wrow + b * block_bytes, bits);
          const float sw = srow[b / per_group];
          for (int64_t r = 0; r < m; ++r) {
            const __m256i d = dot_block_avx2(w, xq.q.data() + r * k + b * kBlock);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(sw * xq.scale[r * blocks + b]), _mm256_cvtepi32_ps(d), acc[r]);
          }
          if (mrow) {
            const float mw = mrow[b / per_group];
            for (int64_t r = 0; r < m; ++r) acc_min[r] += mw * xq.sum[r * blocks + b];
          }
        }
        for (int64_t r = 0; r < m; ++r) y[r * n + row] = hsum(acc[r]) + acc_min[r];
        continue;
      }
#endif
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* w = wrow + b * block_bytes;
        const float sw = srow[b / per_group], mw = mrow ? mrow[b / per_group] : 0.f;
        for (int64_t r = 0; r < m; ++r) {
          const int32_t d = dot_block_scalar(w, xq.q.data() + r * k + b * kBlock, bits);
          acc_scalar[r] += sw * xq.scale[r * blocks + b] * static_cast<float>(d);
          acc_min[r] += mw * xq.sum[r * blocks + b];
        }
      }
      for (int64_t r = 0; r < m; ++r) y[r * n + row] = acc_scalar[r] + acc_min[r];
    }
  });
  return x.scalar_type() == torch::kFloat ? out : out.to(torch::kBFloat16);
}

// The weights as a float matrix [N, K] in dtype (fp32 or bf16): the large-M path and the reference.
torch::Tensor quant_dequantize(torch::Tensor qweight, torch::Tensor scales, c10::optional<torch::Tensor> mins,
                               int64_t bits, int64_t group, c10::ScalarType dtype) {
  const int64_t n = qweight.size(0), k = bits == 4 ? qweight.size(1) * 2 : qweight.size(1);
  check_weights(qweight, scales, mins, bits, group, k);
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "dtype must be fp32 or bf16");
  auto out = torch::empty({n, k}, qweight.options().dtype(dtype));
  const uint8_t* wq = reinterpret_cast<const uint8_t*>(qweight.data_ptr());
  const float* ws = scales.data_ptr<float>();
  const float* wm = mins ? mins->data_ptr<float>() : nullptr;
  const int64_t row_bytes = qweight.size(1), groups = k / group;
  at::parallel_for(0, n, std::max<int64_t>(1, (1 << 14) / k), [&](int64_t begin, int64_t end) {
    std::vector<float> row_values(k);
    for (int64_t row = begin; row < end; ++row) {
      const uint8_t* w = wq + row * row_bytes;
      for (int64_t i = 0; i < k; ++i) {
        int32_t q;
        if (bits == 4) {
          const int64_t block = i / kBlock, j = i % kBlock;
          const uint8_t byte = w[block * (kBlock / 2) + (j % 16)];
          q = j < 16 ? (byte & 0xF) : (byte >> 4);
        } else {
          q = reinterpret_cast<const int8_t*>(w)[i];
        }
        const int64_t g = row * groups + i / group;
        row_values[i] = ws[g] * static_cast<float>(q) + (wm ? wm[g] : 0.f);
      }
      if (dtype == torch::kFloat) {
        std::memcpy(out.data_ptr<float>() + row * k, row_values.data(), sizeof(float) * k);
      } else {
        uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr()) + row * k;
        for (int64_t i = 0; i < k; ++i) o[i] = float_to_bf16_bits(row_values[i]);
      }
    }
  });
  return out;
}
