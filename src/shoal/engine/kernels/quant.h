// Packed GGUF weights: packing (quant_pack.cpp) and the linear layer that multiplies with
// them (quant_matmul.cpp). Formats and layout: quant_formats.h.

#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "quant_formats.h"

// The AVX2 path (quant_avx2.h): x86 CPUs with AVX2, FMA and F16C, AVX-512 ones included.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SHOAL_QUANT_AVX2 1
#else
#define SHOAL_QUANT_AVX2 0
#endif

namespace shoal_quant {

QType qtype(int64_t code);

// Sums of x [m, k] over each run of `run` along k: [m, k / run] (the offset terms).
std::vector<float> run_sums(const at::BFloat16* x, int64_t m, int64_t k, int run);

// raw: the file's bytes of an [n, k] weight (uint8, n * row bytes) -> the strip layout.
at::Tensor pack(int64_t type, const at::Tensor& raw, int64_t n, int64_t k);
// Float32 [rows, k] of the given rows of a packed [n, k] weight (gguf's values exactly).
at::Tensor dequantize_rows(int64_t type, const at::Tensor& packed, int64_t n, int64_t k,
                           const at::Tensor& rows);
at::Tensor dequantize(int64_t type, const at::Tensor& packed, int64_t n, int64_t k);
int64_t packed_bytes(int64_t type, int64_t n, int64_t k);
// Whether this build multiplies packed weights fast: on AVX512-BF16 or on AVX2 (else a slow
// portable loop: callers then keep weights dense).
bool fast_kernels();
// Whether this build has the AVX2 path (quant_avx2.h).
bool avx2_available();
bool amx_usable();
// An output head's int8 estimate (quant_estimate.cpp): float32 [M, n] from x [M, k] bf16,
// quantized to int8 per block, where the build has VNNI or AVX2. From a split Q8_0 table's
// high nibbles (quant_head_split.h), x per 32:
bool split_estimate_available();
at::Tensor int8_estimate_split(const at::Tensor& split, int64_t n, int64_t k, const at::Tensor& x);
// From the head's 3- or 4-bit copy (quant_head_copy.h), x per 64:
bool copy_estimate_available();
at::Tensor int8_estimate_copy(const at::Tensor& packed, int64_t n, int64_t k, int64_t bits,
                              const at::Tensor& x);

// Which arithmetic a QuantLinear uses; kAuto: AMX where usable, else AVX512-BF16, else AVX2
// (float32 arithmetic, quant_avx2.h).
enum class Backend : int { kAuto = 0, kAvx512 = 1, kAmx = 2, kPortable = 3, kAvx2 = 4 };
// The backend kAuto resolves to here: "amx", "avx512", "avx2" or "portable".
std::string default_backend();

// y = x @ W.T (+ bias) for packed weights W: segments of output rows stacked in order (a
// fused q/k/v or gate/up projection whose parts may differ in type), all [*, k].
//
// Every output row is computed by the same sequence of float operations whatever the number
// of rows in x and wherever the row sits among them, so a token's result does not depend on
// what shares its batch or how its prompt was split.
class QuantLinear {
 public:
  QuantLinear(const std::vector<int64_t>& types, const std::vector<at::Tensor>& packed,
              const std::vector<int64_t>& rows, int64_t k, const std::optional<at::Tensor>& bias,
              int64_t backend = 0);

  // x: [M, k] bfloat16 -> [M, out_features] bfloat16 or (float_out) float32. prompt: the
  // rows are prompt tokens (prefill), which AMX machines compute on tiles; generated tokens
  // (decode) always take the vector path. Each kind of row gets one arithmetic, whatever
  // else is in x, so a token's result depends on its role, never on its batch.
  at::Tensor forward(const at::Tensor& x, bool float_out, bool prompt = false) const;
  // Several linears' forward(inputs[i], false, false) (bf16 out, generated rows), in one
  // parallel region over all their strips where each has at most kDirectRows rows on the
  // AVX512 or AMX path (else one forward after another): a mixture-of-experts decode step
  // runs its chosen experts' small projections so, not one thread handoff per expert. The
  // bits are each forward's.
  static std::vector<at::Tensor> forward_generated(
      const std::vector<const QuantLinear*>& linears, const std::vector<at::Tensor>& inputs);
  // Float32 [M, C]: row r's outputs at columns[r] ([M, C] int64), each exactly as forward
  // computes it for a generated row (the output head's rescored candidates).
  at::Tensor forward_columns(const at::Tensor& x, const at::Tensor& columns) const;

  int64_t in_features() const { return k_; }
  int64_t out_features() const { return n_total_; }
  int64_t nbytes() const;
  std::string backend() const;

 private:
  struct Segment {
    QType type;
    at::Tensor packed;
    int64_t n, strips, strip_bytes, first_column, first_strip;
  };
  // One forward call's inputs and output.
  struct Call {
    const at::BFloat16* x;
    int64_t m;
    const float* bias;
    bool float_out;
    void* out;
    std::vector<float> sums16 = {}, sums32 = {};  // x summed over runs of 16 / 32 along k
    std::vector<at::BFloat16> chained = {};       // x in the weights' chain order
  };
  const Segment& segment_of(int64_t strip) const;
  const Segment& segment_of_column(int64_t column) const;
  void store(const Call& call, const Segment& seg, int64_t local, const float* acc, int rows,
             int64_t row0, int64_t acc_stride = kCols) const;
  // Strips local and local + 1 of seg together, each row's 32 bf16 columns in one 64-byte
  // store (a whole cache line where aligned, which the CPU need not read first); false
  // (nothing stored) where they are not two whole strips or the output is float32.
  bool store_pair(const Call& call, const Segment& seg, int64_t local, const float* first,
                  const float* second, int rows, int64_t row0) const;
  // The paths (quant_paths.cpp; run_portable in quant_matmul.cpp).
  void run_direct(const Call& call, bool prompt = false) const;
  void direct_rows(const Call& call, bool prompt, int64_t begin, int64_t end, int64_t row0,
                   int rows) const;
  // Without AMX, more prompt rows than direct takes: groups of strips decoded once, the
  // rows run over them (quant_groups.cpp).
  void run_groups(const Call& call) const;
  void run_tiles(const Call& call) const;
  void run_amx_prompt(const Call& call) const;
  void run_portable(const Call& call) const;
  // The AVX2 paths (quant_avx2.cpp): every row of a call, prompt and generated rows alike;
  // strips [begin, end) of one segment on dequantized weights (x float32 [m, k]); one row
  // times one strip as a generated row.
  void run_avx2(const Call& call) const;
  void avx2_dequantized(const Call& call, const Segment& seg, int64_t begin, int64_t end,
                        const float* x) const;
  // forward_columns on AVX2: x [m, k], wanted [m, count] checked -> out [m, count].
  void avx2_columns(const at::BFloat16* x, int64_t m, const int64_t* wanted, int64_t count,
                    float* out) const;

  std::vector<Segment> segments_;
  int64_t k_, n_total_ = 0, strips_total_ = 0;
  // Whether some segment's type scales runs of 16 / 32 along k: the run sums a forward
  // call needs (the other size is not computed).
  bool runs16_ = false, runs32_ = false;
  // The same for the types with a min (has_e), whose folds alone read the sums on AVX2.
  bool mins16_ = false, mins32_ = false;
  Backend backend_;
  at::Tensor bias_;  // [n_total] float32, or undefined
};

}  // namespace shoal_quant
