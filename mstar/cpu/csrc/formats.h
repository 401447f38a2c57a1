// The packed formats read in AVX2 (`Int4`, `Int8`): a row's groups as float32.
#pragma once

#include "common.h"

namespace {

// The eight vectors of a 64-weight int4 chunk (32 bytes, lane l = bytes 4l..4l+3):
// vector i holds nibble i of each lane, as float32.
inline __m256 nibbles(__m256i d, int i) {
  const __m256i low = _mm256_set1_epi32(0x0F);
  if (i == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(d, low));
  if (i == 7) return _mm256_cvtepi32_ps(_mm256_srli_epi32(d, 28));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(d, 4 * i), low));
}

// Group pair (b[0], b[1]) as [b0 x4, b1 x4], the lanes of `nibbles`.
inline __m256 pair(const float* b) {
  return _mm256_set_m128(_mm_broadcast_ss(b + 1), _mm_broadcast_ss(b));
}

// Activations [M, K] in `nibbles`' order: chunk c (groups 2c, 2c+1), vector i, lane l
// = weight 16 * (i % 2) + 4 * (l % 4) + i / 2 of group 2c + l / 4; an odd last group's
// partner is zeros. Returns [M, C * 64] with C = ceil(K / 64).
std::vector<float> permute_int4(const float* x, int64_t M, int64_t K) {
  const int64_t G = K / 32, C = (G + 1) / 2;
  std::vector<float> xp(M * C * 64, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < C; ++c)
      for (int i = 0; i < 8; ++i)
        for (int l = 0; l < 8; ++l) {
          const int64_t g = 2 * c + l / 4;
          if (g < G) xp[(m * C + c) * 64 + i * 8 + l] = x[m * K + g * 32 + 16 * (i % 2) + 4 * (l % 4) + i / 2];
        }
  return xp;
}

struct Int4 {
  const uint8_t* q;
  const at::Half *scales, *mins;
  int64_t K, G;  // G = K / 32 groups per row

  __m256i chunk(int64_t n, int64_t c) const {  // groups 2c, 2c + 1 of row n (zeros past G)
    const uint8_t* p = q + (n * G + 2 * c) * 16;
    if (2 * c + 1 < G) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }

  const uint8_t* group_bytes(int64_t n, int64_t j) const { return q + (n * G + j) * 16; }  // 16 of them

  // Group j of row n as 32 integers in float32, in their own order (four vectors).
  void load(int64_t n, int64_t j, __m256 v[4]) const {
    const uint8_t* p = group_bytes(n, j);
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i low = _mm256_set1_epi32(0x0F);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, low));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  float scale(int64_t n, int64_t j) const { return _cvtsh_ss(scales[n * G + j].x); }
  // sum over row n's groups of min_j * xsum[j]
  float min_dot(int64_t n, const float* xsum) const {
    const at::Half* mn = mins + n * G;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= G; j += 8)
      acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + j))),
                            _mm256_loadu_ps(xsum + j), acc);
    float sum = hsum(acc);
    for (; j < G; ++j) sum += _cvtsh_ss(mn[j].x) * xsum[j];
    return sum;
  }

  // ROWS activation rows (permuted, [ROWS, C * 64]) against weights fma(q, scale, min).
  template <int ROWS>
  void gemv(const float* xp, int64_t n0, int64_t n1, float* out, int64_t N) const {
    const int64_t C = (G + 1) / 2;
    std::vector<float> s(padded(G)), mn(padded(G));
    for (int64_t n = n0; n < n1; ++n) {
      to_float(scales + n * G, G, s.data());
      to_float(mins + n * G, G, mn.data());
      __m256 even[ROWS], odd[ROWS];
      for (int m = 0; m < ROWS; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      for (int64_t c = 0; c < C; ++c) {
        const __m256i d = chunk(n, c);
        const __m256 sc = pair(s.data() + 2 * c), mc = pair(mn.data() + 2 * c);
        const float* xc = xp + c * 64;
#pragma GCC unroll 4
        for (int i = 0; i < 8; i += 2) {
          const __m256 w0 = _mm256_fmadd_ps(nibbles(d, i), sc, mc);
          const __m256 w1 = _mm256_fmadd_ps(nibbles(d, i + 1), sc, mc);
#pragma GCC unroll 4
          for (int m = 0; m < ROWS; ++m) {
            even[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + m * C * 64 + 8 * i), w0, even[m]);
            odd[m] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + m * C * 64 + 8 * i + 8), w1, odd[m]);
          }
        }
      }
      for (int m = 0; m < ROWS; ++m) out[m * N + n] = hsum(_mm256_add_ps(even[m], odd[m]));
    }
  }

  // Rows [n0, n1) dequantized into dst [n1 - n0, K], in the weights' own order.
  void dequantize(int64_t n0, int64_t n1, float* dst) const {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t j = 0; j < G; ++j, dst += 32) {
        __m256 v[4];
        load(n, j, v);
        const __m256 s = _mm256_set1_ps(scale(n, j));
        const __m256 mn = _mm256_set1_ps(_cvtsh_ss(mins[n * G + j].x));
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(dst + 8 * i, _mm256_fmadd_ps(v[i], s, mn));
      }
  }
};

// int8 weights, one scale per `group` columns (a multiple of 32).
struct Int8 {
  const int8_t* q;
  const at::Half* scales;
  int64_t K, per_row, group;

  // Row n's scale of each group of 32 columns into s [K / 32].
  void row_scales(int64_t n, float* s) const {
    if (group == 32) return to_float(scales + n * per_row, per_row, s);
    for (int64_t j = 0; j < K / 32; ++j) s[j] = _cvtsh_ss(scales[n * per_row + j * 32 / group].x);
  }

  inline __m256 values(const int8_t* p) const {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  const int8_t* group_bytes(int64_t n, int64_t j) const { return q + n * K + j * 32; }  // 32 of them
  void load(int64_t n, int64_t j, __m256 v[4]) const {
    for (int i = 0; i < 4; ++i) v[i] = values(group_bytes(n, j) + 8 * i);
  }
  float scale(int64_t n, int64_t j) const { return _cvtsh_ss(scales[n * per_row + j * 32 / group].x); }
  float min_dot(int64_t, const float*) const { return 0.0f; }

  // ROWS activation rows [ROWS, K] against weights q * scale.
  template <int ROWS>
  void gemv(const float* x, int64_t n0, int64_t n1, float* out, int64_t N) const {
    std::vector<float> s(padded(K / 32));
    for (int64_t n = n0; n < n1; ++n) {
      row_scales(n, s.data());
      __m256 even[ROWS], odd[ROWS];
      for (int m = 0; m < ROWS; ++m) even[m] = odd[m] = _mm256_setzero_ps();
      const int8_t* p = q + n * K;
      for (int64_t j = 0; j < K / 32; ++j) {
        const __m256 sc = _mm256_broadcast_ss(s.data() + j);
#pragma GCC unroll 2
        for (int i = 0; i < 4; i += 2) {
          const __m256 w0 = _mm256_mul_ps(values(p + j * 32 + 8 * i), sc);
          const __m256 w1 = _mm256_mul_ps(values(p + j * 32 + 8 * i + 8), sc);
#pragma GCC unroll 4
          for (int m = 0; m < ROWS; ++m) {
            even[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + j * 32 + 8 * i), w0, even[m]);
            odd[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + j * 32 + 8 * i + 8), w1, odd[m]);
          }
        }
      }
      for (int m = 0; m < ROWS; ++m) out[m * N + n] = hsum(_mm256_add_ps(even[m], odd[m]));
    }
  }

  void dequantize(int64_t n0, int64_t n1, float* dst) const {
    std::vector<float> s(padded(K / 32));
    for (int64_t n = n0; n < n1; ++n) {
      row_scales(n, s.data());
      for (int64_t j = 0; j < K / 32; ++j, dst += 32) {
        const __m256 sc = _mm256_broadcast_ss(s.data() + j);
        for (int i = 0; i < 4; ++i)
          _mm256_storeu_ps(dst + 8 * i, _mm256_mul_ps(values(q + n * K + j * 32 + 8 * i), sc));
      }
    }
  }
};

}  // namespace
