// An int8 estimate of a matmul with the output head's 3- or 4-bit copy (quant_head_copy.h)
// or a split Q8_0 table's high nibbles (quant_head_split.h), for the head's rescoring
// (models/layers/head.py).
//
// Each row of x is quantized to int8 per block (d = max|x| / 127, codes rounded; 64 values
// for a copy, 32 for a split table) and multiplied with the weights' codes on VNNI (vpdpbusd:
// 64 products of unsigned and signed bytes an op), then scaled per block in float32. A
// block's planes take a shift and a mask (4 bits) or two shifts, a mask and a merge (3 bits),
// and its scales follow its codes in one stream. Many rows (a batch's) take about half the
// work of bf16 products. Not exact: the head recomputes each row's top candidates with the
// exact arithmetic; the estimate orders them and gives the far tail.
//
// A split table's high nibbles are half of Q8_0's bytes: Gemma 3's 262144 x 640 head takes
// 1.3 ms a row on a 2-core AVX512 host, where an estimate from Q8_0's own codes (a byte
// permutation, an xor and a vpdpbusd per 64 codes over all 178 MB) took 4.9.
//
// Without VNNI, on AVX2, quant_estimate_avx2.h's kernels run (the same bits).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_head_copy.h"
#include "quant_head_split.h"
#include "quant_strip.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512F__)
#define SHOAL_ESTIMATE_VNNI 1
#include "quant_prefetch.h"
#else
#define SHOAL_ESTIMATE_VNNI 0
#endif
// The estimate on AVX2 where there is no VNNI.
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

// The blocks an estimate strip reads (quant_estimate_avx2.h has their AVX2 twins): a copy's
// (quant_head_copy.h), or a split Q8_0 table's high part (quant_head_split.h). Each gives k
// and bytes per block, plane P's codes, and the scale and minimum of w = scale u + minimum
// for the 16 columns.
template <int Bits>
struct CopyBlocks {
  static constexpr CopyLayout kLayout = copy_layout(Bits);
  static constexpr int kK = kCopyBlockK, kBytes = kLayout.block_bytes;
  template <int P>
  static __m512i plane(const uint8_t* block) { return copy_plane<Bits, P>(block); }
  static void scales(const uint8_t* block, __m512& scale, __m512& minimum) {
    scale = halves(block + kLayout.scale_at);
    minimum = halves(block + kLayout.min_at);
  }
};

struct SplitBlocks {
  static constexpr int kK = kSplitBlockK, kBytes = kSplitHighBytes;
  template <int P>
  static __m512i plane(const uint8_t* block) { return copy_plane<4, P>(block); }
  static void scales(const uint8_t* block, __m512& scale, __m512& minimum) {
    const __m512 d = halves(block + kSplitScaleAt);  // w ~ 16 d h - 120.5 d
    scale = _mm512_mul_ps(d, _mm512_set1_ps(16.f));
    minimum = _mm512_mul_ps(d, _mm512_set1_ps(kSplitMinimum));
  }
};

// R rows (from row0) times one strip of Blocks -> out [R][16] float32: per block, scale dx
// sum u q + minimum dx sum q.
template <class Blocks, int R>
void estimate_strip(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                    float* out) {
  const int64_t blocks = k / Blocks::kK;
  const int8_t* codes_x[R];
  for (int r = 0; r < R; ++r) codes_x[r] = xq.codes.data() + (row0 + r) * k;
  __m512 total[R];
  for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = strip + b * Blocks::kBytes;
    prefetch_ahead<Blocks::kBytes>(block + prefetch_bytes(R));
    __m512i sums[R];
    block_dots<R, Blocks::kK / 4>(
        [&](auto p) { return Blocks::template plane<decltype(p)::value>(block); }, codes_x,
        b * Blocks::kK, sums);
    __m512 scale, minimum;
    Blocks::scales(block, scale, minimum);
    for (int r = 0; r < R; ++r) {
      const int64_t at = (row0 + r) * blocks + b;
      const __m512 dots = _mm512_mul_ps(_mm512_cvtepi32_ps(sums[r]), _mm512_set1_ps(xq.scales[at]));
      total[r] = _mm512_fmadd_ps(dots, scale, total[r]);
      total[r] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(xq.offsets[at]), total[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * kCols, total[r]);
}

template <class Blocks>
constexpr EstimateFn kByRows[kEstimateRows] = {
    estimate_strip<Blocks, 1>, estimate_strip<Blocks, 2>, estimate_strip<Blocks, 3>,
    estimate_strip<Blocks, 4>, estimate_strip<Blocks, 5>, estimate_strip<Blocks, 6>,
    estimate_strip<Blocks, 7>, estimate_strip<Blocks, 8>};

// Each kind's kernels by rows (1 .. kEstimateRows).
constexpr const EstimateFn* kSplitKernels = kByRows<SplitBlocks>;
constexpr const EstimateFn* kCopy3Kernels = kByRows<CopyBlocks<3>>;
constexpr const EstimateFn* kCopy4Kernels = kByRows<CopyBlocks<4>>;
#elif SHOAL_ESTIMATE_AVX2
template <class Blocks, int R>
void estimate_avx2(const uint8_t* strip, int64_t k, const Int8Rows& xq, int64_t row0,
                   float* out) {
  estimate_strip_avx2<Blocks, R>(strip, k, xq.codes.data(), xq.scales.data(),
                                 xq.offsets.data(), row0, out);
}

template <class Blocks>
constexpr EstimateFn kAvx2ByRows[kEstimateRows] = {
    estimate_avx2<Blocks, 1>, estimate_avx2<Blocks, 2>, estimate_avx2<Blocks, 3>,
    estimate_avx2<Blocks, 4>};
constexpr const EstimateFn* kCopy3Kernels = kAvx2ByRows<CopyBlocks<3>>;
constexpr const EstimateFn* kCopy4Kernels = kAvx2ByRows<CopyBlocks<4>>;
constexpr const EstimateFn* kSplitKernels = kAvx2ByRows<SplitBlocks>;
#else
constexpr const EstimateFn* kCopy3Kernels = nullptr;
constexpr const EstimateFn* kCopy4Kernels = nullptr;
constexpr const EstimateFn* kSplitKernels = nullptr;
#endif

// Checks the weights' size and x; runs run[] over x quantized per `block` -> float32 [M, n].
at::Tensor estimate(const char* who, const at::Tensor& packed, int64_t n, int64_t k,
                    int64_t bytes, const at::Tensor& input, int block, const EstimateFn* run) {
  TORCH_CHECK(run != nullptr, who, ": this build has no kernel for it (",
              "AVX512-VNNI or AVX2", ")");
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

bool copy_estimate_available() { return kCopy3Kernels != nullptr; }

bool split_estimate_available() { return kSplitKernels != nullptr; }

at::Tensor int8_estimate_split(const at::Tensor& split, int64_t n, int64_t k,
                               const at::Tensor& x) {
  TORCH_CHECK(k % kSplitBlockK == 0, "int8_estimate_split: k must be a multiple of ",
              kSplitBlockK);
  TORCH_CHECK(split.numel() == split_total_bytes(strip_count(n), k),
              "int8_estimate_split: not a split [", n, ", ", k, "] Q8_0 table");
  // The estimate reads the high part alone: every strip's high blocks come first.
  const at::Tensor high = split.narrow(0, 0, split_high_bytes(strip_count(n), k));
  return estimate("int8_estimate_split", high, n, k, k / kSplitBlockK * kSplitHighBytes, x,
                  kSplitBlockK, kSplitKernels);
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
