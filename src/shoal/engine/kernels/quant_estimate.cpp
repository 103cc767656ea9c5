// An int8 estimate of a Q8_0 or Q4_1 matmul, for the output head's rescoring
// (models/layers/head.py).
//
// Each row of x is quantized per 32 values to int8 (d = max|x| / 127, codes rounded) and
// multiplied with the weights' codes on VNNI (vpdpbusd: 64 products of unsigned and signed
// bytes an op), then scaled per block in float32. Q8_0 is a big head's own table (Gemma 3's
// 262144 x 640, 178 MB), with no room for a copy: per 64 codes one byte permutation, one
// xor and one vpdpbusd, where the exact path widens the codes to bf16 in seven ops per 32,
// so the table is read at memory speed. Q4_1 is the 4-bit copy a head gets where memory
// allows: its codes split into two byte planes, and many rows (a batch's) take half the
// work of bf16 products. Not exact: the head recomputes each row's top candidates with the
// exact arithmetic; the estimate orders them and gives the far tail.
//
// Layout (quant_formats.h, quant_strip.h): a tile is 16 columns x 32 k; a column's codes
// for k = 4q + c sit in vector 2q + c's word 2 col + 1, those for k = 4q + c + 2 in its
// word 2 col.
//   Q8_0 (a byte a code, 32 bytes a vector): the 64 bytes from vector 2g on hold all four
//   codes of k = 4g .. 4g + 3 for every column; one vpermb puts column c's four in lane c.
//   Q4_1 (nibbles: vector 4 g + n in bits 4n .. 4n + 3 of each word of 64-byte chunk g):
//   lane c of chunk g already holds column c's eight codes of k = 8g .. 8g + 7; its low
//   nibbles are k = 8g + (2, 6, 0, 4), its high nibbles 8g + (3, 7, 1, 5), byte by byte.
// x's codes are stored in the order the lanes take them (kOrder), so each vpdpbusd takes
// one broadcast dword of x.

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
#include "quant_prefetch.h"
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

// Where each of a tile's 32 x codes goes: code i of a tile, in kernel order, is x's k =
// order[i] (header comment).
struct Order {
  int8_t k[kTileK];
};

constexpr Order order_of(QType type) {
  Order out{};
  for (int i = 0; i < kTileK; ++i) out.k[i] = static_cast<int8_t>(i);
  if (type == QType::kQ4_1) {
    constexpr int lanes[8] = {2, 6, 0, 4, 3, 7, 1, 5};
    for (int g = 0; g < 4; ++g)
      for (int i = 0; i < 8; ++i) out.k[8 * g + i] = static_cast<int8_t>(8 * g + lanes[i]);
  }
  return out;
}

// x [m, k] as int8 blocks of 32 along k, each block's codes in kernel order.
struct Int8Rows {
  std::vector<int8_t> codes;  // [m, k]
  std::vector<float> scales;  // [m, k / 32]: d of each block
  std::vector<int32_t> sums;  // [m, k / 32]: each block's code sum
  std::vector<float> offsets; // [m, k / 32]: d x the code sum (what a block's offset scales)
};

Int8Rows quantize_rows(const bf16* x, int64_t m, int64_t k, const Order& order) {
  const int64_t blocks = k / kTileK;
  Int8Rows out{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
               std::vector<int32_t>(m * blocks), std::vector<float>(m * blocks)};
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
        const float q = std::nearbyint(static_cast<float>(v[order.k[i]]) * inverse);
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
        sum += codes[i];
      }
      out.scales[r * blocks + b] = d;
      out.sums[r * blocks + b] = sum;
      out.offsets[r * blocks + b] = d * static_cast<float>(sum);
    }
  return out;
}

// vpermb's index for Q8_0: lane c gets column c's codes for k = 4g .. 4g + 3.
__m512i q8_order() {
  alignas(64) int8_t index[64];
  for (int c = 0; c < kCols; ++c) {
    index[4 * c] = static_cast<int8_t>(2 * c + 1);
    index[4 * c + 1] = static_cast<int8_t>(32 + 2 * c + 1);
    index[4 * c + 2] = static_cast<int8_t>(2 * c);
    index[4 * c + 3] = static_cast<int8_t>(32 + 2 * c);
  }
  return _mm512_load_si512(index);
}

// One tile's codes as vpdpbusd's unsigned operand: kDwords planes of [16 columns x 4 k],
// plane i taking x's dword i of the tile (kernel order).
template <QType T>
struct TileCodes {
  static constexpr int kDwords = kTileK / 4;
  static constexpr int kBytes = T == QType::kQ8_0 ? 512 : 256;
  __m512i plane[kDwords];

  TileCodes(const uint8_t* tile, const __m512i& q8_index) {
    if constexpr (T == QType::kQ8_0) {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));  // q + 128
      for (int g = 0; g < kDwords; ++g)
        plane[g] = _mm512_xor_si512(
            _mm512_permutexvar_epi8(q8_index, _mm512_loadu_si512(tile + 64 * g)), flip);
    } else {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int g = 0; g < kDwords / 2; ++g) {
        const __m512i chunk = _mm512_loadu_si512(tile + 64 * g);
        plane[2 * g] = _mm512_and_si512(chunk, low);
        plane[2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low);
      }
    }
  }
};

// R rows (from row0) times one strip -> out [R][16] float32: per block, for column c and a
// row with x codes q (scale dx), S_c dx (sum u q - U sum q) + O_c dx sum q, where the
// weight is S_c (u - U) + O_c: Q8_0's u = q_w + 128, U = 128, O = 0; Q4_1's U = 0,
// O = m (stored negated, as e). With few rows, a row's dot products over a tile run in
// several chains (vpdpbusd's latency); int32 sums are exact in any order, so a row's result
// is the same whatever rows share its pass.
template <QType T, int R>
void estimate_strip(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                    float* out) {
  using Tile = TileCodes<T>;
  constexpr int kChains = R <= 2 ? 4 : R <= 4 ? 2 : 1;
  constexpr int kShift = T == QType::kQ8_0 ? 128 : 0;
  const Format& f = format_of(T);
  const StripView view{f, k, strip};
  const MetaPos pos = meta_pos(f);
  const int64_t blocks = k / kTileK;
  const __m512i q8_index = q8_order();
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = xq.codes.data() + (row0 + r) * k;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = view.tile(b);
    prefetch_ahead<Tile::kBytes>(tile + kPrefetchBytes);
    // The next strip's meta: it follows that strip's tiles, so their prefetch reaches it last.
    if (b == 0) prefetch_span(view.meta(0) + strip_bytes(f, k), blocks * meta_bytes(f));
    const Tile codes(tile, q8_index);
    __m512i dot[R][kChains];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kChains; ++c) dot[r][c] = _mm512_setzero_si512();
    for (int g = 0; g < Tile::kDwords; ++g)
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, codes_x[r] + b * kTileK + 4 * g, 4);
        dot[r][g % kChains] =
            _mm512_dpbusd_epi32(dot[r][g % kChains], codes.plane[g], _mm512_set1_epi32(four));
      }
    const uint8_t* meta = view.meta(b);
    const __m512 scale = _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(meta + pos.d)));  // [16] fp16
    __m512 offset = _mm512_setzero_ps();
    if constexpr (T == QType::kQ4_1)
      offset = _mm512_sub_ps(offset, _mm512_cvtph_ps(_mm256_loadu_si256(
                                         reinterpret_cast<const __m256i*>(meta + pos.e))));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      __m512i sum = dot[r][0];
      for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot[r][c]);
      if constexpr (kShift != 0)
        sum = _mm512_sub_epi32(sum, _mm512_set1_epi32(kShift * xq.sums[at]));
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(sum), _mm512_set1_ps(xq.scales[at]));
      total[r] = _mm512_fmadd_ps(dots, scale, total[r]);
      if constexpr (T == QType::kQ4_1)
        total[r] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xq.offsets[at]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, total[r]);
}

using EstimateFn = void (*)(const uint8_t*, int64_t, const Int8Rows&, int64_t, float*);

template <QType T>
struct EstimateKernels {
  static constexpr EstimateFn run[kEstimateRows] = {
      estimate_strip<T, 1>, estimate_strip<T, 2>, estimate_strip<T, 3>, estimate_strip<T, 4>,
      estimate_strip<T, 5>, estimate_strip<T, 6>, estimate_strip<T, 7>, estimate_strip<T, 8>};
};
#endif

}  // namespace

bool int8_estimate_available() { return SHOAL_ESTIMATE_VNNI; }

at::Tensor int8_estimate(int64_t type, const at::Tensor& packed, int64_t n, int64_t k,
                         const at::Tensor& input) {
  const QType qt = qtype(type);
  TORCH_CHECK(qt == QType::kQ8_0 || qt == QType::kQ4_1,
              "int8_estimate: weights must be Q8_0 or Q4_1, not ", format_of(qt).name);
  TORCH_CHECK(SHOAL_ESTIMATE_VNNI, "int8_estimate: this build has no AVX512-VNNI and VBMI");
  TORCH_CHECK(k % kTileK == 0, "int8_estimate: k must be a multiple of ", kTileK);
  const int64_t strips = strip_count(n), bytes = strip_bytes(format_of(qt), k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == strips * bytes,
              "int8_estimate: not a packed ", format_of(qt).name, " [", n, ", ", k, "] weight");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k,
              "int8_estimate: x must be [M, ", k, "] bfloat16");
  const at::Tensor x = input.contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#if SHOAL_ESTIMATE_VNNI
  if (m == 0) return out;
  const Int8Rows xq = quantize_rows(x.data_ptr<bf16>(), m, k, order_of(qt));
  const EstimateFn* run = qt == QType::kQ8_0 ? EstimateKernels<QType::kQ8_0>::run
                                             : EstimateKernels<QType::kQ4_1>::run;
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
          run[rows - 1](weights + s * bytes, k, xq, r0, acc);
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
