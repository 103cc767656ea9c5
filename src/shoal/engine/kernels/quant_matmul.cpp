// QuantLinear (quant.h): packed segments, the backend, and which path a forward call takes.
// The paths (quant_paths.cpp) split the work over torch's threads; the arithmetic is in
// quant_avx512.h (vectors) and quant_amx.h (AMX tiles).
//
// Generated tokens take AMX's summation order on every machine (vectors for a few rows;
// AMX tiles for more where there are any, else vectors over decoded strips): the same bits
// on every path. Prompt tokens take AMX tiles with split weights where there are any, and
// elsewhere an order of their own on vectors (strips_prompt: several rows and strips per
// pass, one chain per sub-block).

#include <ATen/Parallel.h>
#include <sys/syscall.h>
#include <torch/extension.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "quant.h"
#include "quant_strip.h"
#include "vector.h"

#include "quant_backend.h"

namespace shoal_quant {

using bf16 = at::BFloat16;

namespace {


// Portable reference for CPUs without AVX2 or AVX512-BF16: scalar, slow.
void strip_portable(const Format& f, const uint8_t* strip, int64_t k, const bf16* x, int64_t rows,
                    float* out) {
  const StripView view{f, k, strip};
  std::vector<float> totals(rows);
  float w[kTileK];
  for (int c = 0; c < kCols; ++c) {
    std::fill(totals.begin(), totals.end(), 0.f);
    for (int64_t t = 0; t < k / kTileK; ++t) {  // each row sums in k order
      tile_column(view, t, c, w);
      for (int64_t r = 0; r < rows; ++r)
        for (int j = 0; j < kTileK; ++j)
          totals[r] += static_cast<float>(x[r * k + t * kTileK + j]) * w[j];
    }
    for (int64_t r = 0; r < rows; ++r) out[r * kCols + c] = totals[r];
  }
}

Backend resolve(int64_t requested) {
  const bool amx = amx_usable();
  switch (static_cast<Backend>(requested)) {
    case Backend::kAuto:
      return amx                  ? Backend::kAmx
             : SHOAL_QUANT_AVX512 ? Backend::kAvx512
             : SHOAL_QUANT_AVX2   ? Backend::kAvx2
                                  : Backend::kPortable;
    case Backend::kAmx:
      TORCH_CHECK(amx, "QuantLinear: AMX is not available on this machine");
      return Backend::kAmx;
    case Backend::kAvx512:
      TORCH_CHECK(SHOAL_QUANT_AVX512, "QuantLinear: built without AVX512-BF16");
      return Backend::kAvx512;
    case Backend::kAvx2:
      TORCH_CHECK(SHOAL_QUANT_AVX2, "QuantLinear: built without AVX2, FMA and F16C");
      return Backend::kAvx2;
    case Backend::kPortable:
      return Backend::kPortable;
  }
  TORCH_CHECK(false, "QuantLinear: unknown backend ", requested);
}

}  // namespace

namespace {

#if SHOAL_QUANT_AVX512
// r[j]'s lane i -> r[i]'s lane j (16 x 16 float32).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);
  }
}
#endif

}  // namespace

// Sums of x over each run of `run` along k: [M, k / run], the terms O' multiplies. Each run
// sums its elements in order from zero; on AVX-512, 16 runs at a time, one per lane
// (transposed in registers: the same sums, ~5x faster than element by element).
std::vector<float> run_sums(const bf16* x, int64_t m, int64_t k, int run) {
  const int64_t runs = k / run;
  std::vector<float> sums(m * runs);
  // Rows over the threads (a prompt's rows are many).
  at::parallel_for(0, m, std::max<int64_t>(1, 65536 / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* row = x + r * k;
      float* out = sums.data() + r * runs;
      int64_t g = 0;
#if SHOAL_QUANT_AVX512
      for (; run % 16 == 0 && g + 16 <= runs; g += 16) {
        __m512 total = _mm512_setzero_ps();
        for (int h = 0; h < run; h += 16) {
          __m512 v[16];  // v[j]: run g + j's elements h .. h + 15, then transposed
          for (int j = 0; j < 16; ++j) v[j] = shoal_vec::load(row + (g + j) * run + h);
          transpose16(v);
          for (int i = 0; i < 16; ++i) total = _mm512_add_ps(total, v[i]);
        }
        _mm512_storeu_ps(out + g, total);
      }
#endif
      for (; g < runs; ++g) {
        float total = 0.f;
        for (int i = 0; i < run; ++i) total += static_cast<float>(row[g * run + i]);
        out[g] = total;
      }
    }
  });
  return sums;
}

bool amx_usable() {
#if SHOAL_QUANT_AMX
  // Linux hands out the AMX tile state only on request (ARCH_REQ_XCOMP_PERM, XTILEDATA).
  static const bool granted = [] {
    const char* off = std::getenv("SHOAL_AMX");
    if (off != nullptr && std::strcmp(off, "0") == 0) return false;
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

bool fast_kernels() { return SHOAL_QUANT_AVX512 || SHOAL_QUANT_AVX2; }

const char* backend_name(Backend backend) {
  switch (backend) {
    case Backend::kAmx: return "amx";
    case Backend::kAvx512: return "avx512";
    case Backend::kAvx2: return "avx2";
    case Backend::kPortable: return "portable";
    default: return "auto";
  }
}

std::string default_backend() { return backend_name(resolve(0)); }

QuantLinear::QuantLinear(const std::vector<int64_t>& types, const std::vector<at::Tensor>& packed,
                         const std::vector<int64_t>& rows, int64_t k,
                         const std::optional<at::Tensor>& bias, int64_t backend)
    : k_(k), backend_(resolve(backend)) {
  TORCH_CHECK(!types.empty() && types.size() == packed.size() && types.size() == rows.size(),
              "QuantLinear: one type, packed tensor and row count per segment");
  for (size_t i = 0; i < types.size(); ++i) {
    const QType type = qtype(types[i]);
    const Format& f = format_of(type);
    TORCH_CHECK(k % f.super_k == 0, "QuantLinear: ", f.name, " needs k to be a multiple of ",
                f.super_k);
    Segment segment{type, packed[i].contiguous(), rows[i], strip_count(rows[i]),
                    strip_bytes(f, k), n_total_, strips_total_};
    TORCH_CHECK(segment.packed.scalar_type() == at::kByte &&
                    segment.packed.numel() == segment.strips * segment.strip_bytes,
                "QuantLinear: segment ", i, " is not a packed ", f.name, " [", rows[i], ", ", k,
                "] weight");
    n_total_ += rows[i];
    strips_total_ += segment.strips;
    (f.sub_k == 16 ? runs16_ : runs32_) = true;
    if (f.has_e) (f.sub_k == 16 ? mins16_ : mins32_) = true;
    segments_.push_back(std::move(segment));
  }
  if (bias.has_value() && bias->defined()) {
    bias_ = bias->to(at::kFloat).contiguous();
    TORCH_CHECK(bias_.numel() == n_total_, "QuantLinear: bias has ", bias_.numel(),
                " entries for ", n_total_, " outputs");
  }
}

int64_t QuantLinear::nbytes() const {
  int64_t total = bias_.defined() ? bias_.numel() * 4 : 0;
  for (const Segment& s : segments_) total += s.packed.numel();
  return total;
}

std::string QuantLinear::backend() const { return backend_name(backend_); }

const QuantLinear::Segment& QuantLinear::segment_of(int64_t strip) const {
  for (const Segment& segment : segments_)
    if (strip < segment.first_strip + segment.strips) return segment;
  return segments_.back();
}

const QuantLinear::Segment& QuantLinear::segment_of_column(int64_t column) const {
  for (const Segment& segment : segments_)
    if (column < segment.first_column + segment.n) return segment;
  return segments_.back();
}

at::Tensor QuantLinear::forward(const at::Tensor& input, bool float_out, bool prompt) const {
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && input.dim() == 2 && input.size(1) == k_,
              "QuantLinear: x must be [M, ", k_, "] bfloat16");
  const at::Tensor x = input.contiguous();
  const int64_t m = x.size(0);
  at::Tensor out =
      at::empty({m, n_total_}, x.options().dtype(float_out ? at::kFloat : at::kBFloat16));
  if (m == 0) return out;
  Call call{x.data_ptr<bf16>(), m, bias_.defined() ? bias_.data_ptr<float>() : nullptr,
            float_out, out.data_ptr()};
  if (backend_ == Backend::kPortable) {
    run_portable(call);
    return out;
  }
#if SHOAL_QUANT_AVX2
  if (backend_ == Backend::kAvx2) {
    run_avx2(call);
    return out;
  }
#endif
  if (prompt && backend_ == Backend::kAmx) {
    run_amx_prompt(call);
    return out;
  }
#if SHOAL_QUANT_AVX512
  if (runs16_) call.sums16 = run_sums(call.x, m, k_, 16);
  if (runs32_) call.sums32 = run_sums(call.x, m, k_, 32);
  if (prompt) {
    call.chained = chain_order(call.x, m, k_);
    if (m <= kDirectRows) {
      run_direct(call, true);
    } else {
      run_groups(call);
    }
  } else if (m > kDirectRows && backend_ == Backend::kAmx) {
    run_tiles(call);
  } else {
    call.chained = chain_order(call.x, m, k_);
    run_direct(call);
  }
#endif
  return out;
}

std::vector<at::Tensor> QuantLinear::forward_generated(
    const std::vector<const QuantLinear*>& linears, const std::vector<at::Tensor>& inputs) {
  TORCH_CHECK(linears.size() == inputs.size(), "forward_generated: one input per linear");
  const size_t n = linears.size();
  bool together = SHOAL_QUANT_AVX512;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(linears[i] != nullptr, "forward_generated: a linear is missing");
    const Backend backend = linears[i]->backend_;
    const int64_t m = inputs[i].dim() == 2 ? inputs[i].size(0) : 0;
    together = together && (backend == Backend::kAvx512 || backend == Backend::kAmx) &&
               m >= 1 && m <= kDirectRows;
  }
  std::vector<at::Tensor> outs;
  outs.reserve(n);
  if (!together) {
    for (size_t i = 0; i < n; ++i) outs.push_back(linears[i]->forward(inputs[i], false, false));
    return outs;
  }
#if SHOAL_QUANT_AVX512
  // As forward's generated path (run_direct), each linear's strips numbered on from the last.
  std::vector<at::Tensor> xs(n);
  std::vector<Call> calls;
  calls.reserve(n);
  std::vector<int64_t> first(n + 1, 0);
  for (size_t i = 0; i < n; ++i) {
    const QuantLinear& op = *linears[i];
    TORCH_CHECK(inputs[i].scalar_type() == at::kBFloat16 && inputs[i].size(1) == op.k_,
                "forward_generated: x must be [M, ", op.k_, "] bfloat16");
    xs[i] = inputs[i].contiguous();
    const int64_t m = xs[i].size(0);
    outs.push_back(at::empty({m, op.n_total_}, xs[i].options()));
    calls.push_back(Call{xs[i].data_ptr<bf16>(), m,
                         op.bias_.defined() ? op.bias_.data_ptr<float>() : nullptr, false,
                         outs[i].data_ptr()});
    Call& call = calls.back();
    if (op.runs16_) call.sums16 = run_sums(call.x, m, op.k_, 16);
    if (op.runs32_) call.sums32 = run_sums(call.x, m, op.k_, 32);
    call.chained = chain_order(call.x, m, op.k_);
    first[i + 1] = first[i] + op.strips_total_;
  }
  at::parallel_for(0, first[n], 4, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(first.begin(), first.end(), begin) - first.begin() - 1;
    for (; i < n && first[i] < end; ++i) {
      const int64_t b0 = std::max(begin, first[i]) - first[i];
      const int64_t b1 = std::min(end, first[i + 1]) - first[i];
      if (b0 < b1)
        linears[i]->direct_rows(calls[i], false, b0, b1, 0, static_cast<int>(calls[i].m));
    }
  });
#endif
  return outs;
}

void QuantLinear::run_portable(const Call& call) const {
  at::parallel_for(0, strips_total_, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(call.m * kCols);
    for (int64_t s = begin; s < end; ++s) {
      const Segment& seg = segment_of(s);
      const int64_t local = s - seg.first_strip;
      strip_portable(format_of(seg.type), seg.packed.data_ptr<uint8_t>() + local * seg.strip_bytes,
                     k_, call.x, call.m, acc.data());
      store(call, seg, local, acc.data(), static_cast<int>(call.m), 0);
    }
  });
}

}  // namespace shoal_quant
