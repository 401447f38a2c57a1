// Up to GEMV_ROWS activation rows: the weights streamed once (`streamed`), AVX2 (1-4 rows)
// or AVX-512 (1-8).
#pragma once

#include "formats.h"
#include "team.h"

namespace {

// One activation row, each weight row streamed once in its own order, scale and min
// taken out of each group: out[n] = sum_j scale_j (x . q_j) + sum_j min_j xsum[j].
template <typename W>
void gemv1(const W& w, const float* x, const float* xsum, int64_t K, int64_t n0, int64_t n1,
           float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 32; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w.group_bytes(n, j)) + AHEAD_BYTES, _MM_HINT_T0);
      __m256 v[4];
      w.load(n, j, v);
      const float* xc = x + j * 32;
      __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xc), v[0]);
      __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xc + 8), v[1]);
      a = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 16), v[2], a);
      b = _mm256_fmadd_ps(_mm256_loadu_ps(xc + 24), v[3], b);
      acc = _mm256_fmadd_ps(_mm256_add_ps(a, b), _mm256_set1_ps(w.scale(n, j)), acc);
    }
    out[n] = hsum(acc) + w.min_dot(n, xsum);
  }
}

// y[:, n0:n1] for ROWS <= GEMV_ROWS activation rows.
template <int ROWS>
void gemv(const Int8& w, const float* x, const float*, const float*, int64_t n0, int64_t n1,
          float* y, int64_t N) {
  if constexpr (ROWS == 1) gemv1(w, x, nullptr, w.K, n0, n1, y);
  else w.gemv<ROWS>(x, n0, n1, y, N);
}

template <int ROWS>
void gemv(const Int4& w, const float* x, const float* xp, const float* xsum, int64_t n0, int64_t n1,
          float* y, int64_t N) {
  if constexpr (ROWS == 1) gemv1(w, x, xsum, w.K, n0, n1, y);
  else w.gemv<ROWS>(xp, n0, n1, y, N);
}

// Sums of one row of x over each group of 32 columns: [padded(K / 32)], zeros after K / 32.
std::vector<float> group_sums(const float* x, int64_t K) {
  std::vector<float> sums(padded(K / 32), 0.0f);
  for (int64_t j = 0; j < K / 32; ++j) {
    const float* g = x + j * 32;
    sums[j] = hsum(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(g), _mm256_loadu_ps(g + 8)),
                                 _mm256_add_ps(_mm256_loadu_ps(g + 16), _mm256_loadu_ps(g + 24))));
  }
  return sums;
}

#if defined(__AVX512F__)
// AVX-512 (built so where torch sees it, `mstar.cpu.build.flags`): 1-8 activation rows in
// their own order, each group of 32 weights dequantized into two 16-lane vectors
// exactly as `dequantize` does, and multiplied in place.

// int4: the group's 16 bytes widened to 32-bit lanes hold weights 0-15 (low nibbles)
// and 16-31 (high nibbles) in order; each is looked up in the group's table
// fma(0..15, scale, min) (vpermps reads an index's low 4 bits only).
struct Int4Wide {
  const Int4& w;
  std::vector<float> s, mn;
  explicit Int4Wide(const Int4& w) : w(w), s(padded(w.G)), mn(padded(w.G)) {}
  void row(int64_t n) {
    to_float(w.scales + n * w.G, w.G, s.data());
    to_float(w.mins + n * w.G, w.G, mn.data());
  }
  void ahead(int64_t n, int64_t j) const {
    _mm_prefetch(reinterpret_cast<const char*>(w.group_bytes(n, j)) + AHEAD_BYTES, _MM_HINT_T0);
  }
  void group(int64_t n, int64_t j, __m512 v[2]) const {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.group_bytes(n, j))));
    const __m512 table = _mm512_fmadd_ps(iota, _mm512_set1_ps(s[j]), _mm512_set1_ps(mn[j]));
    v[0] = _mm512_permutexvar_ps(b, table);
    v[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
  }
};

// int8: two 16-byte halves widened, as float32, times the group's scale.
struct Int8Wide {
  const Int8& w;
  std::vector<float> s;
  explicit Int8Wide(const Int8& w) : w(w), s(padded(w.K / 32)) {}
  void row(int64_t n) { w.row_scales(n, s.data()); }
  void ahead(int64_t n, int64_t j) const {
    _mm_prefetch(reinterpret_cast<const char*>(w.group_bytes(n, j)) + AHEAD_BYTES, _MM_HINT_T0);
  }
  void group(int64_t n, int64_t j, __m512 v[2]) const {
    const int8_t* p = w.group_bytes(n, j);
    const __m512 sc = _mm512_set1_ps(s[j]);
    for (int h = 0; h < 2; ++h)
      v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)))),
                           sc);
  }
};

// int4 at one activation row: 64 bytes of a row (4 groups) at a time, transposed in
// registers (vpermd, vpshufb) so that 32-bit lane l holds byte l of each of the 4 groups;
// group g's weights 0-15 are then nibble 2g of the lanes, 16-31 nibble 2g + 1: a shift
// and a permute of 0..15 each make them float32, multiplied by x in its own order, no
// widening shuffle a group. Scale and min are taken out of each group's sum, as `gemv1`.
// A row's 64 bytes of groups 4c.. (`groups` of them, < 4: the row's last chunk), zeros after.
inline __m512i chunk_bytes(const uint8_t* p, int64_t groups) {
  if (groups >= 4) return _mm512_loadu_si512(p);  // plain loads: a masked one is ~3x slower here
  if (groups == 2)
    return _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_maskz_loadu_epi8((__mmask64{1} << (16 * groups)) - 1, p);
}

inline __m512i transposed_groups(const uint8_t* p, int64_t groups) {
  const __m512i dwords = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  const __m512i bytes =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  return _mm512_shuffle_epi8(_mm512_permutexvar_epi32(dwords, chunk_bytes(p, groups)), bytes);
}

void gemv1_int4(const Int4& w, const float* x, const float* xsum, int64_t n0, int64_t n1, float* y) {
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const int64_t G = w.G;
  std::vector<float> s(padded(G));
  for (int64_t n = n0; n < n1; ++n) {
    to_float(w.scales + n * G, G, s.data());
    const uint8_t* q = w.q + n * G * 16;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t j = 0; j < G; j += 4) {
      _mm_prefetch(reinterpret_cast<const char*>(q + j * 16 + AHEAD_BYTES), _MM_HINT_T0);
      const __m512i d = transposed_groups(q + j * 16, G - j);
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) {
        if (j + g == G) break;
        const __m512i low = g ? _mm512_srli_epi32(d, 8 * g) : d;
        const __m512 lo = _mm512_permutexvar_ps(low, iota);
        const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 8 * g + 4), iota);
        const float* xg = x + (j + g) * 32;
        const __m512 dot = _mm512_fmadd_ps(_mm512_loadu_ps(xg + 16), hi,
                                           _mm512_mul_ps(_mm512_loadu_ps(xg), lo));
        acc[g & 1] = _mm512_fmadd_ps(dot, _mm512_set1_ps(s[j + g]), acc[g & 1]);
      }
    }
    y[n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0], acc[1])) + w.min_dot(n, xsum);
  }
}

// y[:, n0:n1] for ROWS activation rows [ROWS, K], two groups a step, each group
// dequantized once for all the rows: four accumulators a row up to four rows (so the
// additions of one row do not wait on each other), two beyond (within 32 registers).
template <int ROWS, typename Wide>
void gemv_wide(Wide& wide, const float* x, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  constexpr int A = ROWS <= 4 ? 4 : 2;
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    wide.row(n);
    __m512 acc[ROWS][A];
    for (int m = 0; m < ROWS; ++m)
      for (int i = 0; i < A; ++i) acc[m][i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= G; j += 2) {
      __m512 v[4];
      wide.ahead(n, j);
      wide.group(n, j, v);
      wide.group(n, j + 1, v + 2);
#pragma GCC unroll 8
      for (int m = 0; m < ROWS; ++m)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          acc[m][i % A] =
              _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + j * 32 + 16 * i), v[i], acc[m][i % A]);
    }
    if (j < G) {  // an odd last group
      __m512 v[2];
      wide.group(n, j, v);
      for (int m = 0; m < ROWS; ++m)
        for (int i = 0; i < 2; ++i)
          acc[m][i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + j * 32 + 16 * i), v[i], acc[m][i]);
    }
    for (int m = 0; m < ROWS; ++m) {
      __m512 sum = _mm512_add_ps(acc[m][0], acc[m][1]);
      if constexpr (A == 4) sum = _mm512_add_ps(sum, _mm512_add_ps(acc[m][2], acc[m][3]));
      y[m * N + n] = _mm512_reduce_add_ps(sum);
    }
  }
}
#endif

#if defined(__AVX512F__)
template <typename W>
void streamed(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  using Wide = std::conditional_t<std::is_same_v<W, Int4>, Int4Wide, Int8Wide>;
  const int64_t piece = std::max<int64_t>(4, (N / team_threads() + 3) / 4 * 4);
  if constexpr (std::is_same_v<W, Int4>) {
    if (M == 1) {
      const std::vector<float> xsum = group_sums(x, K);
      return share(N, piece, N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
        gemv1_int4(w, x, xsum.data(), n0, n1, y);
      });
    }
  }
  share(N, piece, N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    Wide wide(w);
    with_rows<GEMV_ROWS>(M, [&](auto rows) { gemv_wide<rows()>(wide, x, K, n0, n1, y, N); });
  });
}
#else
template <typename W>
void streamed(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  std::vector<float> xp, xsum;
  if constexpr (std::is_same_v<W, Int4>) {
    if (M == 1) xsum = group_sums(x, K);
    else xp = permute_int4(x, M, K);
  }
  share(N, stream_piece(N, K), N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    switch (M) {
      case 1: return gemv<1>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      case 2: return gemv<2>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      case 3: return gemv<3>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      default: return gemv<4>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
    }
  });
}
#endif

}  // namespace
