// Many activation rows on int4 and Q6_K lanes (lanes.h's layouts) in 8-bit integers, as
// llama.cpp multiplies its blocks: each group of 32 activations rounded to int8 (`Int8Rows`:
// scale = max |x| / 127, to nearest, ties to even), then the lanes' unsigned values (int4's
// nibbles, Q5_K's with their fifth bits, Q6_K's six bits) dotted with them by VNNI's
// `vpdpbusd`, one instruction for 4 columns, 16 weight rows and a token: half of
// `lanes_gemv`'s (its int16 activations take two, their high and low bytes), and twice the
// products of bfloat16's `vdpbf16ps` an instruction. The weights are the file's exactly; the
// activations carry the rounding (at most 1/254 of a group's largest: bfloat16 panels round
// both sides, each to 1/512 of the value). Per block of 16 weight rows, every activation
// row in passes of `i8_pass` (the block's weights from L1/L2 after the first), each group's
// integers made float32 and scaled as `lanes_gemv` scales them: weight scale x activation
// scale, plus minimum x the rounded activations' sum (Q6_K: its -32 folded into the
// integers, as `lanes6_gemv` folds it): the weights times the rounded activations.
#pragma once

#include "lanes.h"

namespace {

#if defined(__AVX512VNNI__)

constexpr int64_t I8_ROWS = 2;  // fewest rows rounded to int8 where asked (one: int16, as fast from memory)

// Activation rows a pass over a block of int4 (two registers a row) or Q6_K lanes (three).
template <typename T>
constexpr int64_t i8_pass() {
  return std::is_same_v<T, uint8_t> ? 8 : 4;
}

// One group of 32 activations at xg rounded to int8 (scale = max |x| / 127, to nearest, ties
// to even; a group under 1e-30 left at zero), in order; its scale into `scale` and the sums of
// its integers, columns 0-15 and 16-31, into `halves`.
inline __m256i rounded_group8(const float* xg, float& scale, int32_t halves[2]) {
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 1e-30f ? 127.0f / amax : 0.0f);
  scale = amax > 1e-30f ? amax / 127.0f : 0.0f;
  const __m128i low = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)));
  const __m128i high = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse)));
  halves[0] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(low));
  halves[1] = _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(high));
  return _mm256_inserti128_si256(_mm256_castsi128_si256(low), high, 1);
}

// Activation rows [M, K] rounded to int8 per group of 32 (`rounded_group8`), rows shared
// among the threads (in a gang, each thread all of them); each group's scale and its rounded
// values' sum (scale x the integers' sum: the minimums meet the rounded activations, so a
// product is the weights times them exactly; with the float32 sums the rounding errors would
// meet w - min, all of one sign: on SmolLM2 a 1.8% higher perplexity, against 0.17%); for
// Q6_K lanes (`q6`) also -32 x each 16 columns' sum of the integers.
struct Int8Rows {
  int64_t K, G;
  std::vector<int8_t> q;         // [M, K]
  std::vector<float> scales;     // [M, G]
  std::vector<float> sums;       // [M, G]: scale x the integers' sum
  std::vector<int32_t> offsets;  // [M, K/16] (q6), else empty

  Int8Rows(const float* x, int64_t M, int64_t K, bool q6)
      : K(K), G(K / 32), q(M * K), scales(M * G), sums(M * G), offsets(q6 ? M * K / 16 : 0) {
    auto round = [&](int64_t m0, int64_t m1, int) {
      for (int64_t at = m0 * G; at < m1 * G; ++at) {
        int32_t halves[2];
        const __m256i v = rounded_group8(x + 32 * at, scales[at], halves);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&q[32 * at]), v);
        sums[at] = scales[at] * static_cast<float>(halves[0] + halves[1]);
        if (!q6) continue;
        offsets[2 * at] = -32 * halves[0];
        offsets[2 * at + 1] = -32 * halves[1];
      }
    };
    if (Gang::current() != nullptr) round(0, M, 0);
    else share(M, 16, M * K >= PARALLEL_MIN, round);
  }
};

// A block's weight factors, float32 [G, 2, 16] (int4: 16 scales, 16 minimums a group; Q6_K:
// the scales of columns 0-15, of 16-31), made by its first pass over the activation rows as
// it streams the block and kept for the rest (Q4_K's six-bit sc and m, Q6_K's d x scale: 5-10%
// of a pass's instructions). Made in a pass of their own before the first, their reads missed
// the stream's prefetches: 8 rows at once on Q6_K 24% slower. What a pass does with them (a
// template argument, no branch in the loop): make them (a block of one pass), make and keep
// them (the first of several), or read them (the rest).
enum class Factors { MAKE, KEEP, READ };

// Group g's two vectors of factors in `held` ([G, 2, 16]) as F says, made by `make`.
template <Factors F, typename Make>
inline void block_factors(float* held, int64_t g, __m512& first, __m512& second, const Make& make) {
  if constexpr (F == Factors::READ) {
    first = _mm512_loadu_ps(held + 32 * g);
    second = _mm512_loadu_ps(held + 32 * g + 16);
  } else {
    make(first, second);
    if constexpr (F == Factors::KEEP) {
      _mm512_storeu_ps(held + 32 * g, first);
      _mm512_storeu_ps(held + 32 * g + 16, second);
    }
  }
}

// y[m0 + i, 16 b .. 16 b + 16) (y's rows ldy apart) for activation rows m0..m0+ROWS-1 and int4
// lanes of the layout S: per group, the four octets' nibbles (SUPER5: with their fifth bits)
// dotted with each row's int8 activations, made float32, times weight scale x activation
// scale, plus minimum x the rounded activations' sum; the block's scales and minimums made
// or read as F says (in `held`).
template <int ROWS, Scales S, Factors F>
void lanes_i8_gemv(const uint8_t* lanes, const Int8Rows& x, int64_t m0, int64_t b, float* held, float* y,
                   int64_t ldy) {
  const int64_t G = x.G, K = x.K;
  const uint8_t* block = lanes + b * G * lane_bytes<uint8_t, S>();
  const int8_t* rows = x.q.data() + m0 * K;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto [stream, streamed] = lane_stream<uint8_t, S>(block, g);
    ask_ahead(stream, streamed);
    const uint8_t* p = lane_group<uint8_t, S>(block, g);
    __m512i dot[ROWS];
    for (int m = 0; m < ROWS; ++m) dot[m] = _mm512_setzero_si512();
    [[maybe_unused]] const __m512i high = S == Scales::SUPER5 ? _mm512_loadu_si512(p + 256) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      __m512i first, second;
      octet_values<S>(p, o, high, first, second);
#pragma GCC unroll 12
      for (int m = 0; m < ROWS; ++m) {
        const int8_t* at = rows + m * K + g * 32 + 8 * o;
        dot[m] = _mm512_dpbusd_epi32(dot[m], first, quad(at));
        dot[m] = _mm512_dpbusd_epi32(dot[m], second, quad(at + 4));
      }
    }
    __m512 scale, min;
    block_factors<F>(held, g, scale, min, [&](__m512& s, __m512& m) { int4_factors<S>(block, g, s, m); });
#pragma GCC unroll 12
    for (int m = 0; m < ROWS; ++m) {
      const int64_t at = (m0 + m) * G + g;
      acc[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(x.sums[at]), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), _mm512_mul_ps(scale, _mm512_set1_ps(x.scales[at])),
                               acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + b * LANE_ROWS, acc[m]);
}

// The same for Q6_K lanes: per group, per half, its four vectors of values (`six_bits`) dotted
// with each row's int8 activations from the half's offset (-32 x their sum), made float32,
// times the half's weight scale x activation scale (made or read as F says).
template <int ROWS, Factors F>
void lanes6_i8_gemv(const int8_t* lanes, const Int8Rows& x, int64_t m0, int64_t b, float* held, float* y,
                    int64_t ldy) {
  const int64_t G = x.G, K = x.K;
  const int8_t* block = lanes + b * G * lane_bytes<int8_t, Scales::SUPER>();
  const int8_t* rows = x.q.data() + m0 * K;
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto [stream, streamed] = lane_stream<int8_t, Scales::SUPER>(block, g);
    ask_ahead(stream, streamed);
    const int8_t* p = lane_group<int8_t, Scales::SUPER>(block, g);
    __m512i dot[ROWS][2];
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      __m512i q[4];
      six_bits(p + 192 * c, q);
      for (int m = 0; m < ROWS; ++m) dot[m][c] = _mm512_set1_epi32(x.offsets[(m0 + m) * 2 * G + 2 * g + c]);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
#pragma GCC unroll 12
        for (int m = 0; m < ROWS; ++m)
          dot[m][c] = _mm512_dpbusd_epi32(dot[m][c], q[i], quad(rows + m * K + g * 32 + 16 * c + 4 * i));
    }
    __m512 first, second;  // columns 0-15's and 16-31's scales
    block_factors<F>(held, g, first, second,
                     [&](__m512& f, __m512& s) { int8_factors<Scales::SUPER>(block, g, f, s); });
#pragma GCC unroll 12
    for (int m = 0; m < ROWS; ++m) {
      const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), second,
                                         _mm512_mul_ps(_mm512_cvtepi32_ps(dot[m][0]), first));
      acc[m] = _mm512_fmadd_ps(sum, _mm512_set1_ps(x.scales[(m0 + m) * G + g]), acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + b * LANE_ROWS, acc[m]);
}

// Whether `lanes_i8_rows` takes lanes of element T and the layout S: int4's (Q5_K's too), and
// Q6_K's; not int8 pairs (signed weights: vpdpbusd's unsigned side is the weights').
template <typename T, Scales S>
constexpr bool i8_takes() {
  return std::is_same_v<T, uint8_t> || S == Scales::SUPER;
}

// y [M, N] = x [M, K] @ W.T for float32 x (contiguous) rounded to int8 per group of 32 and W
// int4 or Q6_K lanes of N x K of the layout S (`i8_takes`), y's rows ldy apart: blocks of 16
// weight rows handed out as `lanes_i16` hands them out, each block's every activation row in
// passes of `i8_pass`, its weights read once from memory; with more than one pass, the
// block's factors made once, by the first (`Factors`).
template <typename T, Scales S>
void lanes_i8_rows(const T* lanes, const float* x, int64_t M, int64_t N, int64_t K, float* y, int64_t ldy) {
  static_assert(i8_takes<T, S>(), "int8 activations take int4 and Q6_K lanes");
  constexpr bool Q6 = std::is_same_v<T, int8_t>;
  const Int8Rows xq(x, M, K, Q6);
  const int64_t piece = std::max<int64_t>(1, stream_piece(N, K) / LANE_ROWS);
  const bool hoist = M > i8_pass<T>();
  share(N / LANE_ROWS, piece, N * K * M >= PARALLEL_MIN, [&](int64_t b0, int64_t b1, int) {
    thread_local std::vector<float> held;  // a thread's, kept: no allocation (nor zeroing) a piece
    if (hoist && held.size() < static_cast<size_t>(32 * xq.G)) held.resize(32 * xq.G);
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += i8_pass<T>()) {
        const auto pass = [&](auto rows, auto factors) {
          constexpr Factors F = decltype(factors)::value;
          if constexpr (Q6) lanes6_i8_gemv<rows(), F>(lanes, xq, m0, b, held.data(), y, ldy);
          else lanes_i8_gemv<rows(), S, F>(lanes, xq, m0, b, held.data(), y, ldy);
        };
        with_rows<i8_pass<T>()>(std::min(i8_pass<T>(), M - m0), [&](auto rows) {
          using F = Factors;
          if (!hoist) pass(rows, std::integral_constant<F, F::MAKE>());
          else if (m0 == 0) pass(rows, std::integral_constant<F, F::KEEP>());
          else pass(rows, std::integral_constant<F, F::READ>());
        });
      }
  });
}

#endif

}  // namespace
