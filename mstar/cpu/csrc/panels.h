// 5+ activation rows in float32: dequantized tiles (`tiled`) or transposed panels (`paneled`).
#pragma once

#include "formats.h"
#include "team.h"

namespace {

// y[m, r] = x[m, :] . tile[r, :] for m < ROWS, r < 4: tile [4, K] (dequantized rows,
// in L1), x rows of stride K; one horizontal sum per output.
template <int ROWS>
void dots(const float* x, const float* tile, int64_t K, float* y, int64_t N) {
  __m256 a0[ROWS], a1[ROWS], a2[ROWS], a3[ROWS];
  for (int m = 0; m < ROWS; ++m) a0[m] = a1[m] = a2[m] = a3[m] = _mm256_setzero_ps();
  int64_t k = 0;
  do {  // K >= 32: a do-while keeps gcc from giving the accumulators a home in memory
    const __m256 t0 = _mm256_loadu_ps(tile + k), t1 = _mm256_loadu_ps(tile + K + k);
    const __m256 t2 = _mm256_loadu_ps(tile + 2 * K + k), t3 = _mm256_loadu_ps(tile + 3 * K + k);
#pragma GCC unroll 3
    for (int m = 0; m < ROWS; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * K + k);
      a0[m] = _mm256_fmadd_ps(xv, t0, a0[m]);
      a1[m] = _mm256_fmadd_ps(xv, t1, a1[m]);
      a2[m] = _mm256_fmadd_ps(xv, t2, a2[m]);
      a3[m] = _mm256_fmadd_ps(xv, t3, a3[m]);
    }
  } while ((k += 8) < K);
  for (int m = 0; m < ROWS; ++m) {
    y[m * N] = hsum(a0[m]);
    y[m * N + 1] = hsum(a1[m]);
    y[m * N + 2] = hsum(a2[m]);
    y[m * N + 3] = hsum(a3[m]);
  }
}

// GEMV_ROWS + 1 to PANEL_ROWS - 1 activation rows: 4 weight rows at a time dequantized
// into a tile (row-major, no transpose: cheaper per weight than a panel, which more rows repay)
// and dotted with every activation row, 3 at a time.
template <typename W>
void tiled(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  std::vector<float> tiles(team_threads() * 4 * K);
  share(N / 4, 4, N * K * M >= PARALLEL_MIN, [&](int64_t t0, int64_t t1, int thread) {
    float* tile = tiles.data() + thread * 4 * K;
    for (int64_t t = t0; t < t1; ++t) {
      w.dequantize(4 * t, 4 * t + 4, tile);
      int64_t m = 0;
      for (; m + 3 <= M; m += 3) dots<3>(x + m * K, tile, K, y + m * N + 4 * t, N);
      for (; m < M; ++m) dots<1>(x + m * K, tile, K, y + m * N + 4 * t, N);
    }
  });
}

// 8 x 8 block of floats: src rows (stride ls) into dst columns (stride ld).
inline void transpose8(const float* src, int64_t ls, float* dst, int64_t ld) {
  __m256 r[8], t[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * ls);
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4)
    for (int j = 0; j < 2; ++j) {
      r[i + j] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0x44);
      r[i + j + 2] = _mm256_shuffle_ps(t[i + j], t[i + j + 2], 0xEE);
    }
  // r[0], r[2], r[1], r[3] hold columns 0, 1, 2, 3 of rows 0-3 (low half) and 4-7 of them
  // (high half); r[4..7] the same for rows 4-7.
  const int order[4] = {0, 2, 1, 3};
  for (int c = 0; c < 4; ++c) {
    _mm256_storeu_ps(dst + c * ld, _mm256_permute2f128_ps(r[order[c]], r[order[c] + 4], 0x20));
    _mm256_storeu_ps(dst + (c + 4) * ld, _mm256_permute2f128_ps(r[order[c]], r[order[c] + 4], 0x31));
  }
}

// The widest float vector the build has: 16 lanes with AVX-512, else 8.
struct Lanes {
#if defined(__AVX512F__)
  using V = __m512;
  static constexpr int64_t N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V set1(float a) { return _mm512_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
#else
  using V = __m256;
  static constexpr int64_t N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V set1(float a) { return _mm256_set1_ps(a); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
#endif
};

constexpr int64_t NB = 2 * Lanes::N;  // weight rows per panel (two vectors of outputs)
constexpr int ROWS_MAX = 6;  // activation rows per micro-kernel

// y[m, 0..NB) = x[m, :] . panel[:, 0..NB) for m < ROWS: panel [K, NB] (dequantized,
// transposed), x rows of stride K, y rows of stride ldy; no horizontal sums.
template <int ROWS>
void micro(const float* x, const float* panel, int64_t K, float* y, int64_t ldy) {
  using V = Lanes::V;
  V lo[ROWS], hi[ROWS];  // two arrays, not one [ROWS][2]: gcc keeps these in registers
  for (int m = 0; m < ROWS; ++m) lo[m] = hi[m] = Lanes::zero();
  int64_t k = 0;
  do {
    const V w0 = Lanes::load(panel + k * NB), w1 = Lanes::load(panel + k * NB + Lanes::N);
#pragma GCC unroll 6
    for (int m = 0; m < ROWS; ++m) {
      const V xv = Lanes::set1(x[m * K + k]);
      lo[m] = Lanes::fma(xv, w0, lo[m]);
      hi[m] = Lanes::fma(xv, w1, hi[m]);
    }
  } while (++k < K);
  for (int m = 0; m < ROWS; ++m) {
    Lanes::store(y + m * ldy, lo[m]);
    Lanes::store(y + m * ldy + Lanes::N, hi[m]);
  }
}

void micro_rows(int64_t rows, const float* x, const float* panel, int64_t K, float* y, int64_t ldy) {
  with_rows<ROWS_MAX>(rows, [&](auto r) { micro<decltype(r)::value>(x, panel, K, y, ldy); });
}

// More rows: NB weight rows at a time dequantized to float32 and transposed into a
// panel [K, NB] (in L2), multiplied by every activation row, ROWS_MAX rows at a time.
template <typename W>
void paneled(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  const int64_t threads = team_threads(), panels = (N + NB - 1) / NB;
  // per thread: the rows as dequantized [NB, K], the panel [K, NB], a partial panel's outputs
  std::vector<float> scratch(threads * (2 * NB * K + ROWS_MAX * NB));
  share(panels, 1, N * K * M >= PARALLEL_MIN, [&](int64_t p0, int64_t p1, int thread) {
    float* rows = scratch.data() + thread * (2 * NB * K + ROWS_MAX * NB);
    float* panel = rows + NB * K;
    float* part = panel + NB * K;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * NB, nb = std::min(NB, N - n0);
      w.dequantize(n0, n0 + nb, rows);
      std::fill(rows + nb * K, rows + NB * K, 0.0f);
      for (int64_t k = 0; k < K; k += 8)
        for (int64_t r = 0; r < NB; r += 8) transpose8(rows + r * K + k, K, panel + k * NB + r, NB);
      for (int64_t m = 0; m < M; m += ROWS_MAX) {
        const int64_t rows_here = std::min<int64_t>(ROWS_MAX, M - m);
        if (nb == NB) {
          micro_rows(rows_here, x + m * K, panel, K, y + m * N + n0, N);
          continue;
        }
        micro_rows(rows_here, x + m * K, panel, K, part, NB);
        for (int64_t i = 0; i < rows_here; ++i)
          std::copy(part + i * NB, part + i * NB + nb, y + (m + i) * N + n0);
      }
    }
  });
}

}  // namespace
