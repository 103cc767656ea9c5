// An int8 estimate of a matmul with a Q8_0 weight or the head's 3- or 4-bit copy
// (quant_head_copy.h), for the output head's rescoring (models/layers/head.py).
//
// Each row of x is quantized to int8 per block (d = max|x| / 127, codes rounded; 32 values
// for Q8_0, 64 for a copy) and multiplied with the weights' codes on VNNI (vpdpbusd: 64
// products of unsigned and signed bytes an op), then scaled per block in float32. Q8_0 is a
// big head's own table (Gemma 3's 262144 x 640, 178 MB), with no room for a copy: per 64
// codes one byte permutation, one xor and one vpdpbusd, where the exact path widens the
// codes to bf16 in seven ops per 32, so the table is read at memory speed. A copy is what a
// head gets where memory allows: its planes take a shift and a mask (4 bits) or two shifts,
// a mask and a merge (3 bits), and its scales follow its codes in one stream. Many rows (a
// batch's) take about half the work of bf16 products. Not exact: the head recomputes each
// row's top candidates with the exact arithmetic; the estimate orders them and gives the
// far tail.
//
// Q8_0's layout (quant_formats.h, quant_strip.h): a tile is 16 columns x 32 k; a column's
// codes for k = 4q + c sit in vector 2q + c's word 2 col + 1, those for k = 4q + c + 2 in its
// word 2 col, a byte a code, 32 bytes a vector: the 64 bytes from vector 2g on hold all four
// codes of k = 4g .. 4g + 3 for every column; one vpermb puts column c's four in lane c, in
// the order x's codes are stored (q8_order), so each vpdpbusd takes one broadcast dword of x.
//
// Without VNNI, on AVX2, the copies' estimate runs quant_estimate_avx2.h's kernels (the same
// bits); a Q8_0 table has no estimate there.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_head_copy.h"
#include "quant_strip.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VBMI__) && defined(__AVX512BW__) && \
    defined(__AVX512F__)
#define SHOAL_ESTIMATE_VNNI 1
#include "quant_prefetch.h"
#else
#define SHOAL_ESTIMATE_VNNI 0
#endif
// The copies' estimate on AVX2 where there is no VNNI.
#define SHOAL_ESTIMATE_AVX2 (!SHOAL_ESTIMATE_VNNI && SHOAL_QUANT_AVX2)
#if SHOAL_ESTIMATE_AVX2
#include "quant_estimate_avx2.h"
#endif

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {

// x [m, k] as int8 blocks of `block` values along k.
struct Int8Rows {
  std::vector<int8_t> codes;  // [m, k]
  std::vector<float> scales;  // [m, k / block]: d of each block
  std::vector<int32_t> sums;  // [m, k / block]: each block's code sum
  std::vector<float> offsets; // [m, k / block]: d x the code sum (what a block's offset scales)
};

// One strip's estimate for some rows of x: (strip, k, x, first row, out [rows][16]).
using EstimateFn = void (*)(const uint8_t*, int64_t, const Int8Rows&, int64_t, float*);

#if SHOAL_ESTIMATE_VNNI || SHOAL_ESTIMATE_AVX2
// Rows per pass: an int32 and a float32 accumulator each, in registers (AVX2: per half of a
// strip's columns, and int16 sums beside them). More rows run pass after pass over blocks of
// about kEstimateBlockBytes of weights, which stay in L2.
constexpr int kEstimateRows = SHOAL_ESTIMATE_VNNI ? 8 : 4;
constexpr int64_t kEstimateBlockBytes = 256 * 1024;

Int8Rows quantize_rows(const bf16* x, int64_t m, int64_t k, int block) {
  const int64_t blocks = k / block;
  Int8Rows out{std::vector<int8_t>(m * k), std::vector<float>(m * blocks),
               std::vector<int32_t>(m * blocks), std::vector<float>(m * blocks)};
  for (int64_t r = 0; r < m; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const bf16* v = x + r * k + b * block;
      float amax = 0.f;
      for (int i = 0; i < block; ++i) amax = std::max(amax, std::fabs(static_cast<float>(v[i])));
      const float d = amax / 127.f;
      const float inverse = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      int8_t* codes = out.codes.data() + r * k + b * block;
      for (int i = 0; i < block; ++i) {
        const float q = std::nearbyint(static_cast<float>(v[i]) * inverse);
        codes[i] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
        sum += codes[i];
      }
      out.scales[r * blocks + b] = d;
      out.sums[r * blocks + b] = sum;
      out.offsets[r * blocks + b] = d * static_cast<float>(sum);
    }
  return out;
}

// out [m, n] = every strip's estimate: one pass over all strips where the rows fit one; else
// blocks of strips that stay in L2, pass after pass of kEstimateRows rows.
void estimate_strips(const EstimateFn* run, const uint8_t* weights, int64_t strips,
                     int64_t bytes, int64_t n, int64_t k, const Int8Rows& xq, int64_t m,
                     float* y) {
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
}
#endif

#if SHOAL_ESTIMATE_VNNI
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

// With few rows, a row's dot products over a block run in several chains (vpdpbusd's
// latency); int32 sums are exact in any order, so a row's result is the same whatever rows
// share its pass.
template <int R>
constexpr int kChains = R <= 2 ? 4 : R <= 4 ? 2 : 1;

// The int32 dots of R rows with one block's planes: plane(p) gives plane p's codes (vpdpbusd's
// unsigned operand), which take x's dword p of the block.
template <int R, int Planes, class PlaneFn>
void block_dots(const PlaneFn& plane, const int8_t* const* codes_x, int64_t at,
                __m512i (&sums)[R]) {
  __m512i dot[R][kChains<R>];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kChains<R>; ++c) dot[r][c] = _mm512_setzero_si512();
  static_for<Planes>([&](auto p) {
    const __m512i codes = plane(p);
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, codes_x[r] + at + 4 * p, 4);
      dot[r][p % kChains<R>] =
          _mm512_dpbusd_epi32(dot[r][p % kChains<R>], codes, _mm512_set1_epi32(four));
    }
  });
  for (int r = 0; r < R; ++r) {
    sums[r] = dot[r][0];
    for (int c = 1; c < kChains<R>; ++c) sums[r] = _mm512_add_epi32(sums[r], dot[r][c]);
  }
}

__m512 halves(const uint8_t* p) {  // [16] fp16 -> float32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// R rows (from row0) times one Q8_0 strip -> out [R][16] float32: per tile, for column c and
// a row with x codes q (scale dx), d_c dx (sum u q - 128 sum q), the weight's code being
// u = q_w + 128 (vpdpbusd's unsigned operand).
template <int R>
void estimate_q8_strip(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                       float* out) {
  const Format& f = format_of(QType::kQ8_0);
  const StripView view{f, k, strip};
  const int64_t blocks = k / kTileK, next_strip = strip_bytes(f, k);
  const int scale_at = meta_pos(f).d;
  const __m512i index = q8_order(), flip = _mm512_set1_epi8(static_cast<char>(0x80));
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = xq.codes.data() + (row0 + r) * k;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* tile = view.tile(b);
    prefetch_ahead<512>(tile + kPrefetchBytes);
    // The next strip's meta: it follows that strip's tiles, so their prefetch reaches it last.
    _mm_prefetch(reinterpret_cast<const char*>(view.meta(b) + next_strip), _MM_HINT_T0);
    __m512i sums[R];
    block_dots<R, kTileK / 4>([&](int p) {
      return _mm512_xor_si512(_mm512_permutexvar_epi8(index, _mm512_loadu_si512(tile + 64 * p)),
                              flip);
    }, codes_x, b * kTileK, sums);
    const __m512 scale = halves(view.meta(b) + scale_at);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      const __m512i dot = _mm512_sub_epi32(sums[r], _mm512_set1_epi32(128 * xq.sums[at]));
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xq.scales[at]));
      total[r] = _mm512_fmadd_ps(dots, scale, total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, total[r]);
}

// Plane p of a copy's block (quant_head_copy.h). The shifts move bits across bytes only into
// positions the masks clear.
template <int Bits, int P>
__m512i copy_plane(const uint8_t* block) {
  constexpr CopyLayout layout = copy_layout(Bits);
  if constexpr (Bits == 4) {
    const __m512i chunk = _mm512_loadu_si512(block + 64 * (P / 2));
    return _mm512_and_si512(P % 2 ? _mm512_srli_epi32(chunk, 4) : chunk,
                            _mm512_set1_epi8(0x0F));
  } else {
    constexpr int bit = P % 8;
    const __m512i low = _mm512_loadu_si512(block + 64 * (P / 4));
    const __m512i high = _mm512_loadu_si512(block + layout.high_at + 64 * (P / 8));
    __m512i shifted;  // the third bit of plane P's codes on bit 2
    if constexpr (bit < 2) shifted = _mm512_slli_epi32(high, 2 - bit);
    else if constexpr (bit == 2) shifted = high;
    else shifted = _mm512_srli_epi32(high, bit - 2);
    const __m512i two = _mm512_and_si512(_mm512_srli_epi32(low, 2 * (P % 4)),
                                         _mm512_set1_epi8(3));
    return _mm512_ternarylogic_epi32(shifted, _mm512_set1_epi8(4), two, 0xEA);  // (s & 4) | two
  }
}

// R rows (from row0) times one strip of a copy -> out [R][16] float32: per block of 64,
// d dx sum u q + m dx sum q.
template <int Bits, int R>
void estimate_copy_strip(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                         float* out) {
  constexpr CopyLayout layout = copy_layout(Bits);
  const int64_t blocks = k / kCopyBlockK;
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = xq.codes.data() + (row0 + r) * k;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = strip + b * layout.block_bytes;
    prefetch_ahead<layout.block_bytes>(block + prefetch_bytes(R));
    __m512i sums[R];
    block_dots<R, kCopyBlockK / 4>([&](auto p) { return copy_plane<Bits, p>(block); }, codes_x,
                                   b * kCopyBlockK, sums);
    const __m512 scale = halves(block + layout.scale_at), minimum = halves(block + layout.min_at);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(xq.scales[at]));
      total[r] = _mm512_fmadd_ps(dots, scale, total[r]);
      total[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xq.offsets[at]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, total[r]);
}

template <template <int> class Kernel>
struct ByRows {
  static constexpr EstimateFn run[kEstimateRows] = {
      Kernel<1>::run, Kernel<2>::run, Kernel<3>::run, Kernel<4>::run,
      Kernel<5>::run, Kernel<6>::run, Kernel<7>::run, Kernel<8>::run};
};

template <int R>
struct Q8Kernel {
  static constexpr EstimateFn run = estimate_q8_strip<R>;
};
template <int R>
struct Copy3Kernel {
  static constexpr EstimateFn run = estimate_copy_strip<3, R>;
};
template <int R>
struct Copy4Kernel {
  static constexpr EstimateFn run = estimate_copy_strip<4, R>;
};

// Each type's kernels by rows (1 .. kEstimateRows); a copy's on AVX2 too, Q8_0's only where
// the build has VNNI.
constexpr const EstimateFn* kQ8Kernels = ByRows<Q8Kernel>::run;
constexpr const EstimateFn* kCopy3Kernels = ByRows<Copy3Kernel>::run;
constexpr const EstimateFn* kCopy4Kernels = ByRows<Copy4Kernel>::run;
#elif SHOAL_ESTIMATE_AVX2
template <int Bits, int R>
void estimate_copy_avx2(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                        float* out) {
  estimate_copy_strip_avx2<Bits, R>(strip, k, xq.codes.data(), xq.scales.data(),
                                    xq.offsets.data(), row0, out);
}

constexpr EstimateFn kCopy3Avx2[kEstimateRows] = {
    estimate_copy_avx2<3, 1>, estimate_copy_avx2<3, 2>, estimate_copy_avx2<3, 3>,
    estimate_copy_avx2<3, 4>};
constexpr EstimateFn kCopy4Avx2[kEstimateRows] = {
    estimate_copy_avx2<4, 1>, estimate_copy_avx2<4, 2>, estimate_copy_avx2<4, 3>,
    estimate_copy_avx2<4, 4>};
constexpr const EstimateFn* kQ8Kernels = nullptr;
constexpr const EstimateFn* kCopy3Kernels = kCopy3Avx2;
constexpr const EstimateFn* kCopy4Kernels = kCopy4Avx2;
#else
constexpr const EstimateFn* kQ8Kernels = nullptr;
constexpr const EstimateFn* kCopy3Kernels = nullptr;
constexpr const EstimateFn* kCopy4Kernels = nullptr;
#endif

// Checks the weights' size and x; runs run[] over x quantized per `block` -> float32 [M, n].
at::Tensor estimate(const char* who, const at::Tensor& packed, int64_t n, int64_t k,
                    int64_t bytes, const at::Tensor& input, int block, const EstimateFn* run) {
  TORCH_CHECK(run != nullptr, who, ": this build has no kernel for it (",
              SHOAL_QUANT_AVX2 ? "AVX512-VNNI and VBMI" : "AVX2", ")");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.numel() == strip_count(n) * bytes,
              who, ": not a packed [", n, ", ", k, "] weight of this kind");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k,
              who, ": x must be [M, ", k, "] bfloat16");
  const at::Tensor x = input.contiguous();
  const int64_t m = x.size(0);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
#if SHOAL_ESTIMATE_VNNI || SHOAL_ESTIMATE_AVX2
  if (m == 0) return out;
  const Int8Rows xq = quantize_rows(x.data_ptr<bf16>(), m, k, block);
  estimate_strips(run, packed.data_ptr<uint8_t>(), strip_count(n), bytes, n, k, xq, m,
                  out.data_ptr<float>());
#endif
  return out;
}

}  // namespace

bool int8_estimate_available() { return kQ8Kernels != nullptr; }

bool copy_estimate_available() { return kCopy3Kernels != nullptr; }

at::Tensor int8_estimate(int64_t type, const at::Tensor& packed, int64_t n, int64_t k,
                         const at::Tensor& x) {
  const QType qt = qtype(type);
  TORCH_CHECK(qt == QType::kQ8_0, "int8_estimate: weights must be Q8_0, not ",
              format_of(qt).name);
  TORCH_CHECK(k % kTileK == 0, "int8_estimate: k must be a multiple of ", kTileK);
  return estimate("int8_estimate", packed, n, k, strip_bytes(format_of(qt), k), x, kTileK,
                  kQ8Kernels);
}

at::Tensor int8_estimate_copy(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits,
                              const at::Tensor& x) {
  TORCH_CHECK(bits == 3 || bits == 4, "int8_estimate_copy: bits must be 3 or 4, not ", bits);
  TORCH_CHECK(k % kCopyBlockK == 0, "int8_estimate_copy: k must be a multiple of ",
              kCopyBlockK);
  return estimate("int8_estimate_copy", packed, n, k, copy_strip_bytes(bits, k), x,
                  kCopyBlockK, bits == 3 ? kCopy3Kernels : kCopy4Kernels);
}

}  // namespace shoal_quant
