// An int8 estimate of a Q8_0 matmul, for the output head's rescoring (models/layers/head.py).
//
// Each row of x is quantized per 32 values to int8 (d = max|x| / 127, codes rounded) and
// multiplied with the weights' own int8 codes on VNNI: per 64 codes one byte permutation,
// one xor and one vpdpbusd, where the exact path widens the codes to bf16 in seven ops per
// 32. A big head (Gemma 3's 262144 x 640 Q8_0, 178 MB) is then read at memory speed and no
// second copy of it is needed. Not exact: the head recomputes each row's top candidates
// with the exact arithmetic; the estimate orders them and gives the far tail.
//
// Layout (quant_formats.h): a tile (16 columns x 32 k) holds 16 vectors of 32 bytes; vector
// 2g has column c's codes for k = 4g in byte 2c + 1 and k = 4g + 2 in byte 2c, vector
// 2g + 1 those for k = 4g + 1 and 4g + 3. So 64 bytes from vector 2g on hold all four
// codes of group g for every column; one vpermb puts column c's four in lane c, in k order.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_strip.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && \
    defined(__AVX512F__)
#define SHOAL_ESTIMATE_VNNI 1
#include <immintrin.h>
#else
#define SHOAL_ESTIMATE_VNNI 0
#endif

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {

#if SHOAL_ESTIMATE_VNNI
// Rows per pass: an int32 and a float32 accumulator each, in registers. More rows run pass
// after pass over blocks of about kEstimateBlockBytes of weights, which stay in L2.
constexpr int kEstimateRows = 8;
constexpr int64_t kEstimateBlockBytes = 256 * 1024;
constexpr int kGroups = kTileK / 4;  // groups of four k per tile
// Lines asked for this far ahead of the one being read (batch-1 streams every weight once).
constexpr int kAhead = 2048;

// x [m, k] as int8 blocks of 32 along k.
struct Int8Rows {
  std::vector<int8_t> codes;     // [m, k]
  std::vector<float> scales;     // [m, k / 32]: d of each block
  std::vector<int32_t> offsets;  // [m, k / 32]: 128 x the block's code sum (the weights'
                                 // codes enter as q + 128, unsigned, as vpdpbusd wants them)
};

Int8Rows quantize_rows(const bf16* x, int64_t m, int64_t k) {
  const int64_t blocks = k / kTileK;
  Int8Rows out{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
               std::vector<int32_t>(m * blocks)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const bf16* v = x + r * k + b * kTileK;
      float amax = 0.f;
      for (int i = 0; i < kTileK; ++i) amax = std::max(amax, std::fabs(static_cast<float>(v[i])));
      const float d = amax / 127.f;
      const float inverse = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      int8_t* codes = out.codes.data() + r * k + b * kTileK;
      for (int i = 0; i < kTileK; ++i) {
        const float q = std::nearbyint(static_cast<float>(v[i]) * inverse);
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
        sum += codes[i];
      }
      out.scales[r * blocks + b] = d;
      out.offsets[r * blocks + b] = 128 * sum;
    }
  return out;
}

// vpermb's index: lane c gets column c's codes for k = 4g .. 4g + 3 (header comment).
__m512i group_order() {
  alignas(64) int8_t index[64];
  for (int c = 0; c < kCols; ++c) {
    index[4 * c] = static_cast<int8_t>(2 * c + 1);
    index[4 * c + 1] = static_cast<int8_t>(32 + 2 * c + 1);
    index[4 * c + 2] = static_cast<int8_t>(2 * c);
    index[4 * c + 3] = static_cast<int8_t>(32 + 2 * c);
  }
  return _mm512_load_si512(index);
}

// R rows (from row0) times one Q8_0 strip -> out [R][16] float32. With few rows, a row's
// dot products over a tile run in several chains (vpdpbusd's latency); int32 sums are
// exact in any order, so a row's result is the same whatever rows share its pass.
template <int R>
void estimate_strip(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                    float* out) {
  constexpr int kChains = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  const StripView view{format_of(QType::kQ8_0), k, strip};
  const int64_t blocks = k / kTileK;
  const __m512i order = group_order();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = xq.codes.data() + (row0 + r) * k;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = view.tile(b);
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int g = 0; g < kGroups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(tile) + 64 * g + kAhead, _MM_HINT_T0);
      // [16 columns x 4 k] unsigned codes q + 128
      const __m512i w = _mm512_xor_si512(
          _mm512_permutexvar_epi8(order, _mm512_loadu_si512(tile + 64 * g)), flip);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, codes_x[r] + b * kTileK + 4 * g, 4);
        dot[r][g % kChains] = _mm512_dpbusd_epi32(dot[r][g % kChains], w, _mm512_set1_epi32(four));
      }
    }
    const __m512 d = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(view.meta(b))));  // [16] fp16
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      __m512i sum = dot[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot[r][c]);
      const __m512i exact = _mm512_sub_epi32(sum, _mm512_set1_epi32(xq.offsets[at]));
      total[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact),
                                 _mm512_mul_ps(d, _mm512_set1_ps(xq.scales[at])), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, total[r]);
}

using EstimateFn = void (*)(const uint8_t*, int64_t, const Int8Rows&, int64_t, float*);
constexpr EstimateFn kEstimate[kEstimateRows] = {
    estimate_strip<1>, estimate_strip<2>, estimate_strip<3>, estimate_strip<4>,
    estimate_strip<5>, estimate_strip<6>, estimate_strip<7>, estimate_strip<8>};
#endif

}  // namespace

bool int8_estimate_available() { return SHOAL_ESTIMATE_VNNI; }

at::Tensor int8_estimate(const at::Tensor& packed, int64_t n, int64_t k, const at::Tensor& input) {
  TORCH_CHECK(SHOAL_ESTIMATE_VNNI, "int8_estimate: this build has no AVX512-VNNI and VBMI");
  TORCH_CHECK(k % kTileK == 0, "int8_estimate: k must be a multiple of ", kTileK);
  const int64_t strips = strip_count(n), bytes = strip_bytes(format_of(QType::kQ8_0), k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == strips * bytes,
              "int8_estimate: not a packed Q8_0 [", n, ", ", k, "] weight");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k,
              "int8_estimate: x must be [M, ", k, "] bfloat16");
  const at::Tensor x = input.contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#if SHOAL_ESTIMATE_VNNI
  if (m == 0) return out;
  const Int8Rows xq = quantize_rows(x.data_ptr<bf16>(), m, k);
  const uint8_t* weights = packed.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  // One pass over all strips where the rows fit one; else blocks that stay in L2.
  const int64_t block =
      m <= kEstimateRows ? strips : std::max<int64_t>(1, kEstimateBlockBytes / bytes);
  const int64_t grain = std::max<int64_t>(1, 65536 / (k * kCols));
  at::parallel_for(0, strips, grain, [&](int64_t begin, int64_t end) {
    alignas(64) float acc[kEstimateRows * kCols];
    for (int64_t b0 = begin; b0 < end; b0 += block)
      for (int64_t r0 = 0; r0 < m; r0 += kEstimateRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kEstimateRows, m - r0));
        for (int64_t s = b0; s < std::min(end, b0 + block); ++s) {
          kEstimate[rows - 1](weights + s * bytes, k, xq, r0, acc);
          const int64_t cols = std::min<int64_t>(kCols, n - s * kCols);
          for (int r = 0; r < rows; ++r)
            std::memcpy(y + (r0 + r) * n + s * kCols, acc + r * kCols, cols * sizeof(float));
        }
      }
  });
#endif
  return out;
}

}  // namespace shoal_quant
