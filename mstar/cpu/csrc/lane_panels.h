// Many activation rows on int4 or int8 `lanes` (lanes.h's layouts) in bfloat16, no panels
// held: each 32-row panel (two blocks of lanes) is dequantized into a bfloat16 panel of
// bf16_panels.h's layout as the product reaches it (the thread's own buffer, K * 64 bytes:
// 512 KiB at K = 8192, in L2), then every activation row is multiplied against it by
// `micro_bf16`. The panel's values are `Packed.dequantize()`'s float32 weights (q * scale
// + min: q * scale is exact in float32, so one rounding, as numpy's) rounded to nearest
// even: the panels `bf16_panels` would hold, so the same products bit for bit, reading
// the lanes' 0.56-1.1 bytes a weight where held panels cost 2 beside them. Dequantizing a
// panel is ~5 instructions a 16 weights, once for all M rows (M * 1.5 a 16 for the
// products): 1-2% of a 512-row prefill, ~10% at 64 rows.
#pragma once

#include "bf16_panels.h"
#include "lanes.h"

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)

// Two float32 vectors (16 rows' columns c and c + 1) as one line of a bfloat16 panel:
// row r's pair at elements 2r, 2r + 1, each rounded to nearest even.
inline __m512i panel_line(__m512 even, __m512 odd) {
  // cvtne2ps: elements 0..15 from its second operand, 16..31 from its first
  const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(odd, even);
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, halves);
}

// Group g of int4 lanes block `block` (16 rows, of the layout `S`; SUPER5: Q5_K's, each nibble's
// fifth bit from the group's 64 bytes after its octets) into the panel's 16 lines of k pairs
// 16g..16g+15, half `half` of each (rows 16 half..16 half + 15).
template <Scales S>
inline void int4_group_lines(const uint8_t* block, uint16_t* panel, int64_t g, int half) {
  __m512 scale, min;
  int4_factors<S>(block, g, scale, min);
  const uint8_t* nibbles = lane_group<uint8_t, S>(block, g);
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  [[maybe_unused]] const __m512i high = S == Scales::SUPER5 ? _mm512_loadu_si512(nibbles + 256) : _mm512_setzero_si512();
  for (int o = 0; o < 4; ++o) {
    const __m512i bytes = _mm512_loadu_si512(nibbles + 64 * o);
    __m512 w[8];  // weights 8o..8o+7: byte j's low nibble is 8o + j, its high one 8o + 4 + j
    for (int t = 0; t < 8; ++t) {
      __m512i q = _mm512_and_si512(_mm512_srli_epi32(bytes, 8 * (t % 4) + 4 * (t / 4)), nibble);
      if constexpr (S == Scales::SUPER5) {  // its fifth bit: byte t % 4's bit 4 (t / 4) + o, to bit 4
        const __m512i bit = _mm512_slli_epi32(_mm512_srli_epi32(high, 8 * (t % 4) + 4 * (t / 4) + o), 4);
        q = _mm512_ternarylogic_epi32(q, bit, _mm512_set1_epi32(0x10), 0xF8);  // q | (bit & 16)
      }
      w[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), scale, min);
    }
    for (int t = 0; t < 8; t += 2) {
      const int64_t pair = 16 * g + 4 * o + t / 2;
      _mm512_storeu_si512(panel + pair * 64 + 32 * half, panel_line(w[t], w[t + 1]));
    }
  }
}

// Group g of int8 lanes block `block` (16 rows, of the layout `S`; a scale per 16 columns but
// with float16 scales): each 32-byte pair of columns is already a line's order (row r's pair
// at bytes 2r, 2r + 1), so widened, scaled, rounded.
template <Scales S>
inline void int8_group_lines(const int8_t* block, uint16_t* panel, int64_t g, int half) {
  const __m512i first = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
  __m512 scales[2], low_rows[2], high_rows[2];  // per half of the columns (float16: one scale for both)
  int8_factors<S>(block, g, scales[0], scales[1]);
  for (int c = 0; c < 2; ++c) {
    low_rows[c] = _mm512_permutexvar_ps(first, scales[c]);
    high_rows[c] = _mm512_permutexvar_ps(second, scales[c]);
  }
  const int8_t* pairs = lane_group<int8_t, S>(block, g);
  for (int p = 0; p < 16; ++p) {
    const int c = p / 8;  // pairs 0-7: columns 0-15
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 32 * p));
    const __m512 low =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))), low_rows[c]);
    const __m512 high =
        _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))), high_rows[c]);
    _mm512_storeu_si512(panel + (16 * g + p) * 64 + 32 * half, (__m512i)_mm512_cvtne2ps_pbh(high, low));
  }
}

// Group g of Q6_K lanes block `block` (16 rows) into the panel's 16 lines of k pairs
// 16g..16g+15, half `half` of each: each column's 16 values (`six_bits`: byte j of a vector's
// lanes) less 32, times its scale (one per 16 columns), rounded.
inline void q6_group_lines(const int8_t* block, uint16_t* panel, int64_t g, int half) {
  __m512 scales[2];  // columns 0-15's and 16-31's
  int8_factors<Scales::SUPER>(block, g, scales[0], scales[1]);
  const int8_t* values = lane_group<int8_t, Scales::SUPER>(block, g);
  const __m512i byte = _mm512_set1_epi32(0xFF), offset = _mm512_set1_epi32(32);
  for (int c = 0; c < 2; ++c) {
    __m512i q[4];
    six_bits(values + 192 * c, q);
    for (int i = 0; i < 4; ++i) {
      __m512 w[4];  // columns 16c + 4i + j
      for (int j = 0; j < 4; ++j) {
        const __m512i v = _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(q[i], 8 * j), byte), offset);
        w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(v), scales[c]);
      }
      for (int j = 0; j < 4; j += 2) {
        const int64_t pair = 16 * g + 8 * c + 2 * i + j / 2;
        _mm512_storeu_si512(panel + pair * 64 + 32 * half, panel_line(w[j], w[j + 1]));
      }
    }
  }
}

// Panel p (lanes blocks 2p, 2p + 1) of int4 (uint8) or int8 lanes with G groups, of the
// layout `S`, dequantized into `panel` [K/2, 32, 2] bfloat16.
template <typename T, Scales S>
void lane_panel(const T* lanes, int64_t p, int64_t G, uint16_t* panel) {
  constexpr int64_t bytes = lane_bytes<T, S>();
  for (int half = 0; half < 2; ++half) {
    const T* block = lanes + (2 * p + half) * G * bytes;
    for (int64_t g = 0; g < G; ++g) {
      if constexpr (std::is_same_v<T, uint8_t>) int4_group_lines<S>(block, panel, g, half);
      else if constexpr (S == Scales::SUPER) q6_group_lines(block, panel, g, half);
      else int8_group_lines<S>(block, panel, g, half);
    }
  }
}

// y [M, N] = x [M, K] @ W.T for float32 x (contiguous) and int4 or int8 `lanes` of N x K
// (N % 32 == 0), of the layout `S`: the activations rounded to bfloat16 once, the weights a
// panel at a time.
template <typename T, Scales S>
void lanes_bf16_rows(const T* lanes, const float* xf, int64_t M, int64_t N, int64_t K, float* out) {
  const std::vector<uint16_t> xb = bf16_activations(xf, M, K);
  const int64_t G = K / 32;
  share(N / BF16_NB, 1, N * K * M >= PARALLEL_MIN, [&](int64_t p0, int64_t p1, int) {
    thread_local std::vector<uint16_t> panel;
    panel.resize(K * BF16_NB);
    for (int64_t p = p0; p < p1; ++p) {
      lane_panel<T, S>(lanes, p, G, panel.data());
      bf16_panel_rows(xb.data(), M, K, panel.data(), out + p * BF16_NB, N);
    }
  });
}

#endif

}  // namespace
