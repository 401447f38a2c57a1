// int4 weights times activations rounded to int16, 1-8 rows, with AVX512-VNNI (`vpdpwssd`:
// 32 products of 16-bit integers an instruction, summed in pairs into 32-bit lanes). Not
// exact, but close: each group of 32 activations is rounded to int16 first (`Int16Rows`:
// scale = max |x| / 32767, an error of at most 1/65534 of the group's largest; llama.cpp
// rounds to int8, 256x coarser); the weights' minimums still meet the float32 sums of the
// activations. The nibbles need no float conversion (no permute a group, as `gemv1_int4`
// has): ~1.5x its speed in cache, and at 2 threads the weights' stream is the limit. Built
// where the CPU has AVX512-BF16 (mstar/cpu/build.py: BF16_FLAGS), which every CPU with it has; an
// AVX2 version of the same rounding below it for every other build (rows: see I16_ROWS),
// and int8 weights on one row so rounded, in AVX2 for every build.
#pragma once

#include "gemv.h"

namespace {

// One group of 32 activations rounded to int16 into out[0..32) (scale = max |x| / 32767,
// to nearest, ties to even; a group under 1e-30 left at zero, as 32767 / a denormal would
// be inf); returns the scale, and the group's float32 sum in `sum`. AVX2, any build.
inline float rounded_group(const float* xg, int16_t* out, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xg + 8 * i);
    top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[i]));
    total = _mm256_add_ps(total, v[i]);
  }
  float tops[8];
  _mm256_storeu_ps(tops, top);
  const float amax = *std::max_element(tops, tops + 8);
  const __m256 inverse = _mm256_set1_ps(amax > 1e-30f ? 32767.0f / amax : 0.0f);
  alignas(32) int32_t r[32];  // |x| * inverse <= 32767
  for (int i = 0; i < 4; ++i)
    _mm256_store_si256(reinterpret_cast<__m256i*>(r + 8 * i), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse)));
  std::copy_n(r, 32, out);
  sum = hsum(total);
  return amax > 1e-30f ? amax / 32767.0f : 0.0f;
}

#if defined(__AVX512VNNI__)

// One group of 32 activations at xg rounded to int16 (scale = max |x| / 32767, to nearest,
// ties to even; a group under 1e-30 left at zero: zeros, and 32767 / a denormal would be
// inf), in order; the group's scale into `scale` and its float32 sum into `sum`. What
// `Int16Rows` and lanes.h's `LaneRows` take, so their integers are the same.
inline __m512i rounded_group16(const float* xg, float& scale, float& sum) {
  const __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inverse = _mm512_set1_ps(amax > 1e-30f ? 32767.0f / amax : 0.0f);
  scale = amax > 1e-30f ? amax / 32767.0f : 0.0f;
  sum = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
  return _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(a, inverse)))),
      _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(b, inverse))), 1);
}

// Activation rows [M, K] rounded to int16 per group of 32 (scale = max |x| / 32767, to
// nearest, ties to even), laid out as a chunk's weights come out of its 64 bytes (groups
// 4c..4c+3, a 128-bit lane each) widened to 16 bits: 4 vectors, vector v's lane k holding
// weights 8v..8v+7 of group 4c + k; zeros past the last group. Each group's scale and
// float32 sum plainly per row, in blocks of 16 groups (4 chunks), zeros past the last.
struct Int16Rows {
  int64_t C;                  // chunks a row: ceil(G / 4)
  int64_t S;                  // groups a row rounded up to 16: ceil(G / 16) * 16
  std::vector<int16_t> q;     // [M, C, 4, 4, 8]: vector v, group k, weight 8v + j
  std::vector<float> scales;  // [M, S]
  std::vector<float> sums;    // [M, S]: the group's sum of x

  Int16Rows(const float* x, int64_t M, int64_t K)
      : C((K / 32 + 3) / 4), S((K / 32 + 15) / 16 * 16), q(M * C * 128, 0), scales(M * S, 0.0f),
        sums(M * S, 0.0f) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < K / 32; ++g) {
        const int64_t c = g / 4, k = g % 4;
        int16_t v[32];
        _mm512_storeu_si512(v, rounded_group16(x + m * K + g * 32, scales[m * S + g], sums[m * S + g]));
        for (int u = 0; u < 4; ++u) std::copy_n(v + 8 * u, 8, &q[(m * C + c) * 128 + u * 32 + k * 8]);
      }
  }
};

// 16 float16 values from h as float32; `left` < 16 of them: zeros after.
inline __m512 block16(const at::Half* h, int64_t left) {
  if (left >= 16) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << left) - 1), h));
}

// y[:, n0:n1] for ROWS rows: per weight row, 16 groups (4 chunks) at a time: their float16
// scales and minimums made float32 once; the minimums times the activations' sums, and
// weight scale x activation scale per row, 16 lanes; then each chunk's nibbles (widened
// to 16 bits) dotted with every activation row's integers in 32-bit lanes (4 per group),
// made float32 and scaled by the chunk's 4 scales, each to its 4 lanes (one `vpermps`).
template <int ROWS>
void gemv_i16(const Int4& w, const Int16Rows& xq, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t G = w.G, C = xq.C, S = xq.S;
  const __m512i low = _mm512_set1_epi16(0x0F), zero = _mm512_setzero_si512();
  const __m512i quarter = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i pick[4] = {quarter, _mm512_add_epi32(quarter, _mm512_set1_epi32(4)),
                           _mm512_add_epi32(quarter, _mm512_set1_epi32(8)),
                           _mm512_add_epi32(quarter, _mm512_set1_epi32(12))};  // chunk k's 4 groups
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* p = w.q + n * G * 16;
    __m512 acc[ROWS];
    for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t b = 0; b < G; b += 16) {
      const __m512 ws = block16(w.scales + n * G + b, G - b);
      const __m512 wm = block16(w.mins + n * G + b, G - b);
      __m512 scale[ROWS];
      for (int m = 0; m < ROWS; ++m) {
        acc[m] = _mm512_fmadd_ps(wm, _mm512_loadu_ps(&xq.sums[m * S + b]), acc[m]);
        scale[m] = _mm512_mul_ps(ws, _mm512_loadu_ps(&xq.scales[m * S + b]));
      }
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {
        const int64_t c = b / 4 + k;
        if (c == C) break;
        _mm_prefetch(reinterpret_cast<const char*>(p + c * 64 + AHEAD_BYTES), _MM_HINT_T0);
        const __m512i bytes = chunk_bytes(p + c * 64, G - 4 * c);
        const __m512i first = _mm512_unpacklo_epi8(bytes, zero);  // bytes 0-7 of each group
        const __m512i second = _mm512_unpackhi_epi8(bytes, zero);  // bytes 8-15
        const __m512i wv[4] = {_mm512_and_si512(first, low), _mm512_and_si512(second, low),
                               _mm512_srli_epi16(first, 4), _mm512_srli_epi16(second, 4)};
#pragma GCC unroll 8
        for (int m = 0; m < ROWS; ++m) {
          const int16_t* xc = &xq.q[(m * C + c) * 128];
          __m512i dot = _mm512_dpwssd_epi32(zero, wv[0], _mm512_loadu_si512(xc));
          dot = _mm512_dpwssd_epi32(dot, wv[1], _mm512_loadu_si512(xc + 32));
          dot = _mm512_dpwssd_epi32(dot, wv[2], _mm512_loadu_si512(xc + 64));
          dot = _mm512_dpwssd_epi32(dot, wv[3], _mm512_loadu_si512(xc + 96));
          const __m512 s4 = _mm512_permutexvar_ps(pick[k], scale[m]);
          acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s4, acc[m]);
        }
      }
    }
    for (int m = 0; m < ROWS; ++m) y[m * N + n] = _mm512_reduce_add_ps(acc[m]);
  }
}

// y = x @ W.T for M <= GEMV_ROWS rows of x [M, K], the activations rounded to int16 first.
void streamed_i16(const Int4& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  const Int16Rows xq(x, M, K);
  const int64_t piece = std::max<int64_t>(4, (N / team_threads() + 3) / 4 * 4);
  share(N, piece, N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    with_rows<GEMV_ROWS>(M, [&](auto rows) { gemv_i16<rows()>(w, xq, n0, n1, y, N); });
  });
}

#else

// AVX2 (`vpmaddwd`: 16 products of 16-bit integers an instruction, summed in pairs into
// 32-bit lanes, then added): the same rounding as above, two groups a 32-byte chunk (the
// int4 rows' own `Int4::chunk`): about half the float32 kernel's instructions a weight at
// one row; 1.0-1.4x its speed at 1-4 rows on Zen 1 (I16_ROWS).

// Activation rows [M, K] rounded to int16 per group of 32, laid out as `gemv_i16` takes a
// chunk's weights (groups 2c, 2c+1, 16 bytes each) out of its 16-bit lanes: lane j of
// the chunk holds bytes 2j, 2j+1 of group 2c + j / 8, so weights 2i, 2i + 16, 2i + 1,
// 2i + 17 (i = j % 8) in its four nibbles, low first; vector v's lane j holds the
// activation of its nibble v; zeros past the last group. Per chunk also 8 lanes of each
// group's scale, lane l for group 2c + l / 4; and the groups' float32 sums, for
// `Int4::min_dot`.
struct Int16Rows {
  static constexpr int NIBBLE_WEIGHT[4] = {0, 16, 1, 17};  // nibble v of lane j: weight 2(j % 8) + this
  int64_t C;                  // chunks a row: ceil(G / 2)
  std::vector<int16_t> q;     // [M, C, 4, 16]: vector v, lane j
  std::vector<float> scales;  // [M, C, 8]
  std::vector<float> sums;    // [M, padded(G)]

  Int16Rows(const float* x, int64_t M, int64_t K)
      : C((K / 32 + 1) / 2), q(M * C * 64, 0), scales(M * C * 8, 0.0f), sums(M * padded(K / 32), 0.0f) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < K / 32; ++g) {
        int16_t v[32];
        const float scale = rounded_group(x + m * K + g * 32, v, sums[m * padded(K / 32) + g]);
        const int64_t c = g / 2, k = g % 2;
        for (int u = 0; u < 4; ++u)
          for (int i = 0; i < 8; ++i) q[(m * C + c) * 64 + u * 16 + k * 8 + i] = v[2 * i + NIBBLE_WEIGHT[u]];
        std::fill_n(&scales[(m * C + c) * 8 + k * 4], 4, scale);
      }
  }
};

// y[:, n0:n1] for ROWS rows: per weight row, each chunk's nibbles masked in place in its
// 16-bit lanes (nibbles 1 and 2 left 16x: their products summed, then shifted back, exact)
// dotted with every activation row's integers in 32-bit lanes (4 per group), made float32
// and scaled by weight scale x activation scale; plus the weights' minimums times the sums.
// No byte unpacks: 3-6% faster than widening the nibbles at one row, 2-3% slower at four (Zen 1).
template <int ROWS>
void gemv_i16(const Int4& w, const Int16Rows& xq, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t C = xq.C, G = w.G;
  const __m256i first = _mm256_set1_epi16(0x000F), second = _mm256_set1_epi16(0x00F0);
  std::vector<float> s(padded(G));
  for (int64_t n = n0; n < n1; ++n) {
    to_float(w.scales + n * G, G, s.data());
    __m256 acc[ROWS];
    for (int m = 0; m < ROWS; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t c = 0; c < C; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(w.group_bytes(n, 2 * c)) + AHEAD_BYTES, _MM_HINT_T0);
      const __m256i d = w.chunk(n, c);
      const __m256i wv[4] = {_mm256_and_si256(d, first), _mm256_and_si256(d, second),
                             _mm256_and_si256(_mm256_srli_epi16(d, 4), second),
                             _mm256_srli_epi16(d, 12)};  // x1, x16, x16, x1
      const __m256 ws = pair(s.data() + 2 * c);
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m) {
        const int64_t at = m * C + c;
        const __m256i* xc = reinterpret_cast<const __m256i*>(&xq.q[at * 64]);
        const __m256i sixteen = _mm256_add_epi32(_mm256_madd_epi16(wv[1], _mm256_loadu_si256(xc + 1)),
                                                 _mm256_madd_epi16(wv[2], _mm256_loadu_si256(xc + 2)));
        const __m256i dot = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(wv[0], _mm256_loadu_si256(xc)),
                             _mm256_madd_epi16(wv[3], _mm256_loadu_si256(xc + 3))),
            _mm256_srai_epi32(sixteen, 4));
        const __m256 scale = _mm256_mul_ps(ws, _mm256_loadu_ps(&xq.scales[at * 8]));
        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
      }
    }
    for (int m = 0; m < ROWS; ++m)
      y[m * N + n] = hsum(acc[m]) + w.min_dot(n, &xq.sums[m * padded(G)]);
  }
}

// y = x @ W.T for M <= I16_ROWS rows of x [M, K], the activations rounded to int16 first.
void streamed_i16(const Int4& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  const Int16Rows xq(x, M, K);
  share(N, stream_piece(N, K), N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    with_rows<I16_ROWS>(M, [&](auto rows) { gemv_i16<rows()>(w, xq, n0, n1, y, N); });
  });
}

#endif

// int8 weights times one activation row rounded to int16 (`rounded_group`, in its own
// order), any build: each group's 32 bytes widened to 16 bits (`vpmovsxbw`) and multiplied
// in pairs (`vpmaddwd`), about half the float32 kernel's instructions a weight.
void streamed_i16(const Int8& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  TORCH_CHECK(M == 1, "int16 activations for int8 weights take one row, got ", M);
  const int64_t G = K / 32;
  std::vector<int16_t> q(K);
  std::vector<float> xs(G);
  for (int64_t g = 0; g < G; ++g) {
    float unused;
    xs[g] = rounded_group(x + g * 32, q.data() + g * 32, unused);
  }
  share(N, stream_piece(N, K), N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    std::vector<float> s(padded(G));
    for (int64_t n = n0; n < n1; ++n) {
      w.row_scales(n, s.data());
      __m256 acc = _mm256_setzero_ps();
      for (int64_t g = 0; g < G; ++g) {
        const int8_t* p = w.group_bytes(n, g);
        _mm_prefetch(reinterpret_cast<const char*>(p) + AHEAD_BYTES, _MM_HINT_T0);
        const __m256i* xg = reinterpret_cast<const __m256i*>(q.data() + g * 32);
        const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(a, _mm256_loadu_si256(xg)),
                                             _mm256_madd_epi16(b, _mm256_loadu_si256(xg + 1)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(s[g] * xs[g]), acc);
      }
      y[n] = hsum(acc);
    }
  });
}

}  // namespace
