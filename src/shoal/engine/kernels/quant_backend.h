// Which vector paths this build of the packed-weight matmul has: SHOAL_QUANT_AVX512
// (AVX512-BF16 with BW and VL: every type's kernels, quant_kernels.h) and SHOAL_QUANT_AMX
// (set by quant_amx.h). Without AVX512-BF16 only the portable loop is built.

#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SHOAL_QUANT_AVX512 1
#include "quant_buffers.h"
#include "quant_kernels.h"
#else
#define SHOAL_QUANT_AVX512 0
#define SHOAL_QUANT_AMX 0
#endif
