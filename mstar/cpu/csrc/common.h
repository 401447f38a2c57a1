// The kernels' shared includes, constants and small helpers (see kernels.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
constexpr int64_t GEMV_ROWS = 8;         // most activation rows for the streaming path
constexpr int64_t PANEL_ROWS = 12;       // fewest activation rows for the panel path (measured)
#else
constexpr int64_t GEMV_ROWS = 4;
constexpr int64_t PANEL_ROWS = 48;
#endif
// most activation rows rounded to int16 where asked (i16_gemv.h); more stay float32
#if defined(__AVX512VNNI__)
constexpr int64_t I16_ROWS = 8;
#elif defined(__AVX512F__)
constexpr int64_t I16_ROWS = 1;  // AVX2's kernel beside AVX-512's float32 ones: unmeasured past 1
#else
constexpr int64_t I16_ROWS = 4;  // 1.0-1.4x the float32 kernel at 1-4 rows (Zen 1, from memory)
#endif
constexpr int64_t PIECE = 16384;         // fewest weights a piece of GEMV work
constexpr int64_t PARALLEL_MIN = 1 << 18;  // fewer weights (x rows) than this: one thread
// how far ahead of a row's stream of weights its bytes are asked for (measured: 1024 on
// Zen 5; 2048 on Zen 1, 1.3x the int8 head's speed beside none)
#if defined(__AVX512F__)
constexpr int64_t AHEAD_BYTES = 1024;
#else
constexpr int64_t AHEAD_BYTES = 2048;
#endif

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Room for n floats and at least one zero after them, a multiple of 8.
int64_t padded(int64_t n) { return (n + 8) / 8 * 8; }

// n float16 values as float32 into out[0..n), zeros after them to padded(n).
inline void to_float(const at::Half* h, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < n; ++j) out[j] = _cvtsh_ss(h[j].x);
  for (; j < padded(n); ++j) out[j] = 0.0f;
}

// fn(std::integral_constant<int, R>{}) for R = min(rows, MAX) (rows >= 1): a run-time row
// count as a compile-time one, for kernels unrolled over their rows.
template <int MAX, typename F>
void with_rows(int64_t rows, const F& fn) {
  if constexpr (MAX > 1) {
    if (rows < MAX) return with_rows<MAX - 1>(rows, fn);
  }
  fn(std::integral_constant<int, MAX>{});
}

}  // namespace
