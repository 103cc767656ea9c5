// Compile-time loops and prefetching for the x86 vector kernels (quant_simd.h, the int8
// estimate in quant_estimate.cpp, and the AVX2 path in quant_avx2.h).

#pragma once

#include <immintrin.h>

#include <cstdint>
#include <type_traits>
#include <utility>

namespace shoal_quant {

template <int N, class F, int... I>
inline void static_for_impl(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// f(0), f(1), ... f(N - 1) with compile-time indices (register indices and shift counts).
template <int N, class F>
inline void static_for(F&& f) {
  static_for_impl<N>(f, std::make_integer_sequence<int, N>{});
}

// Batch-1 decode streams each weight from memory once: asking for the tiles this far ahead
// keeps enough lines in flight for the memory to run at full speed.
constexpr int64_t kPrefetchBytes = 2048;

// How far ahead a pass of `rows` rows over tiles decoded in registers asks for them. Passes
// of several rows go further ahead (measured on a 1.5B model's layers, 2 threads: 4 rows
// ~12% faster with 8 KiB than with 2 KiB, while one row was ~8% slower).
constexpr int64_t prefetch_bytes(int rows) {
  return rows == 1 ? kPrefetchBytes : 4 * kPrefetchBytes;
}

// Prefetches the `Bytes` bytes at p, one request per 64-byte line.
template <int Bytes>
inline void prefetch_ahead(const uint8_t* p) {
  static_for<(Bytes + 63) / 64>([&](auto line) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + 64 * line, _MM_HINT_T0);
  });
}

// Prefetches `bytes` bytes at p (a length known at run time: a strip's meta), one request per
// 64-byte line. A prefetch past the end of the weights is dropped by the CPU, never a fault.
inline void prefetch_span(const uint8_t* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + line, _MM_HINT_T0);
}

}  // namespace shoal_quant
