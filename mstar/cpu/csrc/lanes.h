// int4 weights laid out 16 rows to a vector (`lanes`), times 1-8 activation rows rounded to
// int16 as `Int16Rows` rounds them, with AVX512-VNNI's `vpdpbusd` (64 products of an
// unsigned and a signed byte an instruction, summed in fours into 32-bit lanes).
//
// Layout (packed.py's `Packed.lanes`), uint8 [N/16, G * 320]: for each block of 16 weight
// rows and each group g of 32 columns, 320 bytes: four 64-byte octets, then the 16 rows'
// float16 scales, then their float16 minimums. Octet o's 32-bit lane r holds row r's
// weights 8o..8o+3 in its bytes' low nibbles and 8o+4..8o+7 in their high ones. One
// sequential stream a block, and no horizontal sums: each lane is an output row.
//
// The activations: each int16 a = 256 h + l (h = a >> 8 signed, l = a & 255 unsigned), so
// w . a = 256 (w . h) + (w . l) exactly, each a byte dot product: the nibbles (0..15) are
// the unsigned side against h, and the signed side against l. Per 16 rows and group: 4
// loads, 8 nibble masks, 16 dot products, then one conversion and two FMAs (scale, min),
// about half the instructions `gemv_i16` (i16_gemv.h) takes for the same weights: on Zen 4
// at two threads 1.3-2.7x its speed in cache, level from memory for SmolLM2's short calls
// (benchmarks/quant_kernels.py), so a step's weights stream as fast as the memory gives
// them. The same integers as `gemv_i16`; only the float32 sums' order differs.
//
// int8 weights the same way, int8 [N/16, G * 544]: per block and group 16 pairs of
// columns, 32 bytes each (row r's columns 2p, 2p+1 at bytes 2r, 2r+1), then the rows'
// float16 scales (a scale per 32 columns, repeated where the groups are wider). Each pair
// widened to 16 bits (`vpmovsxbw`) and dotted with the int16 activations (`vpdpwssd`): two
// instructions per 32 weights, where `streamed_i16`'s AVX2 head takes ~10 per 32 a row.
//
// Symmetric int4 (GGUF's Q4_0: every minimum -8 x its scale), uint8 [N/16, G, 288]: per block
// and group the 256 nibble bytes, then the 16 rows' float16 scales, no minimums (0.5625 bytes
// a weight, the file's own, not 0.625): each minimum made in registers as scale x -8, exact in
// float32, the value the 320-byte lanes' float16 minimum gives (packed.py lays them out only
// where that minimum is exactly -8 x scale), so the same sums bit for bit (`Scales::SYM`).
//
// Float32 scales (GGUF's K-quants, packed.py's third lanes axis): int4 [N/16, G, 384], the
// 16 rows' float32 scales and minimums in place of the float16 ones (Q4_K's d * sc and
// -dmin * m); int8 [N/16, G, 640], after the 512 weights' bytes the rows' float32 scales of
// columns 0-15, then of columns 16-31 (Q6_K's d * scale, a scale per 16 columns): the pairs'
// dot products summed in two chains, pairs 0-7 and 8-15, each times its own scale.
//
// The K-quants' own factors (`Scales::SUPER`, packed.py's super-block lanes): Q4_K, uint8
// [N/16, K/256, 2304]: per block and super-block of 256 columns, a head of 256 bytes (the 16
// rows' float16 d, then their float16 dmin, then per group j of 8 a byte a row, sc's low 4
// bits and m's above them, then a 32-bit lane a row, at bits 4j and 4j + 2 group j's sc's and
// m's top 2: the file's six bits each), then the 8 groups' 256 nibble bytes as above: 0.5625
// bytes a weight, the file's own, not 0.75; Q6_K, int8 [N/16, K/256, 3360]: a head of 288 bytes (the rows' float16
// d, then per 16 columns t of 16 the rows' int8 scale), then the 8 groups' 384 bytes of six-bit
// values (`six_bits`): 0.82 bytes a weight, the file's own, not 1.25. A group's scales d * sc
// (d * scale) and minimum -(dmin * m) are made in registers (a float16 and an 8-bit integer:
// exact in float32), the float32 lanes' stored values bit for bit, so the same sums. The same
// loops, templated on the layout (`Scales`), but Q6_K's (`lanes6_gemv`).
//
// Q6_K's group of 32 columns, per half c (columns 16c..16c+15), 3 vectors of 64 bytes: vector
// i's lane r holds row r's q = value + 32 (0..63) of columns 16c+4i..16c+4i+3 in its bytes' low
// 6 bits, and bits 2i, 2i+1 of those of columns 16c+12..16c+15 in their top 2: 4 vectors of
// values, as int4's octets hold theirs, in 9 instructions. Dotted as the nibbles are (q the
// unsigned side against the activations' high bytes, the signed side against their low ones),
// each half's sum starting at -32 x its 16 activations' sum: the same integers as (q - 32).
//
// Q5_K (`Scales::SUPER5`, packed.py's int8 lanes of minimums), int8 [N/16, K/256, 2816]: Q4_K's
// head, then per group its 256 nibble bytes (its low 4 bits a value, as Q4_K's) and 64 bytes of
// fifth bits: lane r's byte j holds at bit o row r's of column 8o + j, at bit 4 + o of 8o + 4 + j.
// The same loop as Q4_K's (`lanes_gemv`), each octet's nibbles with their fifth bits ORed in at
// bit 4 (a shift and a ternary logic a half; adding 16 x the bits' dot products instead would
// take 4 more dot products an octet a row): 0.6875 bytes a weight, the file's own.
#pragma once

#include "i16_gemv.h"

namespace {

constexpr int64_t LANE_ROWS = 16;          // weight rows a block
constexpr int64_t LANE_GROUP_BYTES = 320;  // a block's bytes a group: 256 nibbles, 32 scales, 32 minimums
constexpr int64_t LANE_SYM_BYTES = 288;    // symmetric int4: 256 nibbles, 32 scales
constexpr int64_t LANE_INT8_BYTES = 544;   // int8: 512 weights' bytes, 32 scales
constexpr int64_t LANE_F32_BYTES = 384;    // int4, float32 scales: 256 nibbles, 64 scales, 64 minimums
constexpr int64_t LANE_INT8_F32_BYTES = 640;  // int8, float32 scales: 512 weights' bytes, 2 x 64 scales

// How lanes hold their scales: float16 or float32 a group, float16 without minimums (int4's
// -8 x scale), or the K-quants' factors a super-block (SUPER5: Q5_K's, SUPER's int4 layout with
// a fifth bit a value).
enum class Scales { F16, F32, SYM, SUPER, SUPER5 };

// Whether lanes of the layout S hold the K-quants' factors a super-block.
constexpr bool factored(Scales S) {
  return S == Scales::SUPER || S == Scales::SUPER5;
}

// A group's weights' bytes in a block of a super-block's lanes (SUPER): Q4_K (uint8) 256 nibble
// bytes, Q6_K (int8) 384 of six-bit values; SUPER5 (Q5_K) 256 nibble bytes and 64 of fifth bits.
template <typename T, Scales S = Scales::SUPER>
constexpr int64_t group_bytes() {
  if constexpr (S == Scales::SUPER5) return 256 + 64;
  return std::is_same_v<T, uint8_t> ? 256 : 384;
}

// A super-block's head in a block (SUPER): int4 (Q4_K) the 16 rows' d, dmin (float16), 8 x
// (sc, m)'s low 4 bits (a byte a row), their top 2 (a 32-bit lane a row); int8 (Q6_K) their d
// (float16), 16 x scale (int8).
template <typename T>
constexpr int64_t super_head() {
  return std::is_same_v<T, uint8_t> ? 256 : 288;
}

// A block's bytes a super-block of 256 columns (SUPER, SUPER5): its head, then its 8 groups' weights.
template <typename T, Scales S = Scales::SUPER>
constexpr int64_t super_bytes() {
  return super_head<T>() + 8 * group_bytes<T, S>();
}

// A block's bytes a group of 32 columns (SUPER: on average): int4 (uint8) or int8 weights.
template <typename T, Scales S>
constexpr int64_t lane_bytes() {
  static_assert(S != Scales::SYM || std::is_same_v<T, uint8_t>, "symmetric lanes are int4's");
  if constexpr (factored(S)) return super_bytes<T, S>() / 8;
  else if constexpr (S == Scales::SYM) return LANE_SYM_BYTES;
  else if constexpr (std::is_same_v<T, uint8_t>) return S == Scales::F32 ? LANE_F32_BYTES : LANE_GROUP_BYTES;
  else return S == Scales::F32 ? LANE_INT8_F32_BYTES : LANE_INT8_BYTES;
}

#if defined(__AVX512VNNI__)

constexpr int64_t LANE_PASS = 4;         // most activation rows a pass over a block
constexpr int64_t LANES_AHEAD = 4096;    // bytes ahead of a block's stream asked for (prototype: 4096 > 2048 > 1024)

// Activation rows [M, K] rounded to int16 per group of 32 (`rounded_group16`, as `Int16Rows`
// rounds them), each also split into its high (signed) and low (unsigned) bytes; each
// group's scale and float32 sum.
struct LaneRows {
  int64_t K, G;
  std::vector<int16_t> q;     // [M, K]
  std::vector<int8_t> high;   // [M, K]: a >> 8
  std::vector<uint8_t> low;   // [M, K]: a & 255
  std::vector<float> scales;  // [M, G]
  std::vector<float> sums;    // [M, G]

  LaneRows(const float* x, int64_t M, int64_t K)
      : K(K), G(K / 32), q(M * K), high(M * K), low(M * K), scales(M * (K / 32)), sums(M * (K / 32)) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const int64_t at = m * K + g * 32;
        const __m512i v = rounded_group16(x + at, scales[m * G + g], sums[m * G + g]);
        _mm512_storeu_si512(&q[at], v);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&high[at]), _mm512_cvtepi16_epi8(_mm512_srai_epi16(v, 8)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&low[at]),
                            _mm512_cvtepi16_epi8(_mm512_and_si512(v, _mm512_set1_epi16(0xFF))));
      }
  }
};

// The lines LANES_AHEAD bytes past a block's `bytes` at p asked for.
inline void ask_ahead(const void* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(static_cast<const char*>(p) + LANES_AHEAD + line, _MM_HINT_T0);
}

// The 16 rows' scales (or minimums) at p as float32: float32 (`F32`) or float16.
template <bool F32>
inline __m512 lane_floats(const void* p) {
  if constexpr (F32) return _mm512_loadu_ps(p);
  else return _mm512_cvtph_ps(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// The 16 rows' 8-bit factors at p (uint8, or int8 where `SIGNED`) times their float16 factors
// at f, in float32 (exact).
template <bool SIGNED>
inline __m512 lane_product(const void* f, const void* p) {
  const __m128i bytes = _mm_loadu_si128(static_cast<const __m128i*>(p));
  const __m512i wide = SIGNED ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  return _mm512_mul_ps(lane_floats<false>(f), _mm512_cvtepi32_ps(wide));
}

// Group g's weights (`group_bytes`) in int4 (uint8) or int8 lanes block `block` (the layouts above).
template <typename T, Scales S>
inline const T* lane_group(const T* block, int64_t g) {
  if constexpr (factored(S)) return block + g / 8 * super_bytes<T, S>() + super_head<T>() + g % 8 * group_bytes<T, S>();
  else return block + g * lane_bytes<T, S>();
}

// The bytes group g adds to lanes block `block`'s stream: at, and how many (SUPER: the
// super-block's head with its first group).
template <typename T, Scales S>
inline std::pair<const T*, int64_t> lane_stream(const T* block, int64_t g) {
  if constexpr (factored(S)) {
    if (g % 8 == 0) return {block + g / 8 * super_bytes<T, S>(), super_head<T>() + group_bytes<T, S>()};
    return {lane_group<T, S>(block, g), group_bytes<T, S>()};
  } else {
    return {lane_group<T, S>(block, g), lane_bytes<T, S>()};
  }
}

// Group j's 16 six-bit sc and m (0..63, a 32-bit lane a row) in a Q4_K (Q5_K) super-block's
// head (`super_head`): the low 4 bits from the group's byte a row, the top 2 from the rows' lanes.
inline void six_bit_factors(const uint8_t* head, int64_t j, __m512i& sc, __m512i& m) {
  constexpr int OR_AND = 0xF8;  // a | (b & c)
  const __m512i low = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 64 + 16 * j)));
  const __m512i top = _mm512_srl_epi32(_mm512_loadu_si512(head + 192), _mm_cvtsi64_si128(4 * j));
  const __m512i bits = _mm512_set1_epi32(0x30);
  sc = _mm512_ternarylogic_epi32(_mm512_and_si512(low, _mm512_set1_epi32(0x0F)), _mm512_slli_epi32(top, 4), bits, OR_AND);
  m = _mm512_ternarylogic_epi32(_mm512_srli_epi32(low, 4), _mm512_slli_epi32(top, 2), bits, OR_AND);
}

// Group g's 16 scales and minimums in int4 lanes block `block`, as float32: held, or made:
// (SYM) the minimums as scale x -8, (SUPER) both as d * sc and -(dmin * m), the values the
// float16 (float32) lanes hold bit for bit.
template <Scales S>
inline void int4_factors(const uint8_t* block, int64_t g, __m512& scale, __m512& min) {
  if constexpr (S == Scales::SYM) {
    scale = lane_floats<false>(lane_group<uint8_t, S>(block, g) + 256);
    min = _mm512_mul_ps(scale, _mm512_set1_ps(-8.0f));
  } else if constexpr (factored(S)) {
    const uint8_t* head = block + g / 8 * super_bytes<uint8_t, S>();
    __m512i sc, m;
    six_bit_factors(head, g % 8, sc, m);
    scale = _mm512_mul_ps(lane_floats<false>(head), _mm512_cvtepi32_ps(sc));
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);  // -x exactly (0 - x makes -0 +0)
    const __m512 product = _mm512_mul_ps(lane_floats<false>(head + 32), _mm512_cvtepi32_ps(m));
    min = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(product), sign));
  } else {
    const uint8_t* p = lane_group<uint8_t, S>(block, g) + 256;
    scale = lane_floats<S == Scales::F32>(p);
    min = lane_floats<S == Scales::F32>(p + (S == Scales::F32 ? 64 : 32));
  }
}

// Group g's 16 scales of columns 0-15 and of 16-31 in int8 lanes block `block`, as float32
// (float16 scales: one for both): held, or (SUPER) made as d * scale, the values the float32
// lanes hold bit for bit.
template <Scales S>
inline void int8_factors(const int8_t* block, int64_t g, __m512& first, __m512& second) {
  if constexpr (S == Scales::SUPER) {
    const int8_t* head = block + g / 8 * super_bytes<int8_t>();
    first = lane_product<true>(head, head + 32 + 32 * (g % 8));
    second = lane_product<true>(head, head + 48 + 32 * (g % 8));
  } else {
    const int8_t* p = lane_group<int8_t, S>(block, g) + 512;
    first = lane_floats<S == Scales::F32>(p);
    second = S == Scales::F32 ? lane_floats<true>(p + 64) : first;
  }
}

// Four bytes at p as one 32-bit value in every lane.
inline __m512i quad(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// Octet o's nibbles `first` (weights 8o..8o+3) and `second` (8o+4..8o+7) with their fifth bits
// (Q5_K's, `high`: the group's 64 bytes) ORed in at each byte's bit 4. A 16-bit shift moves a
// byte's bit o (4 + o) to its bit 4; what it brings in from the next byte lands elsewhere.
inline void fifth_bits(__m512i high, int o, __m512i& first, __m512i& second) {
  const __m512i bit = _mm512_set1_epi8(0x10);
  constexpr int OR_AND = 0xF8;  // a | (b & c)
  first = _mm512_ternarylogic_epi32(first, _mm512_slli_epi16(high, 4 - o), bit, OR_AND);
  second = _mm512_ternarylogic_epi32(second, _mm512_srli_epi16(high, o), bit, OR_AND);
}

// Octet o of a group's bytes at p as its weights 8o..8o+3 (`first`) and 8o+4..8o+7 (`second`),
// a byte each (SUPER5: with their fifth bits from the group's 64 bytes `high`, `fifth_bits`).
template <Scales S>
inline void octet_values(const uint8_t* p, int o, __m512i high, __m512i& first, __m512i& second) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i bytes = _mm512_loadu_si512(p + 64 * o);
  first = _mm512_and_si512(bytes, nibble);
  second = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
  if constexpr (S == Scales::SUPER5) fifth_bits(high, o, first, second);
}

// y[m0 + i, 16 b .. 16 b + 16) (y's rows ldy apart) for activation rows m0..m0+ROWS-1: per
// block, per group, the four octets' nibbles dotted with each row's high and low bytes (four
// 32-bit sums a row, two chains each side), joined as 256 high + low, made float32, times
// weight scale x activation scale, plus minimum x the activations' sum (SUPER5: the nibbles'
// fifth bits ORed in first).
template <int ROWS, Scales S>
void lanes_gemv(const uint8_t* lanes, const LaneRows& x, int64_t m0, int64_t b, float* y, int64_t ldy) {
  const int64_t G = x.G, K = x.K;
  const uint8_t* block = lanes + b * G * lane_bytes<uint8_t, S>();
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto [stream, streamed] = lane_stream<uint8_t, S>(block, g);
    ask_ahead(stream, streamed);
    const uint8_t* p = lane_group<uint8_t, S>(block, g);
    __m512i hi[ROWS][2], lo[ROWS][2];
    for (int m = 0; m < ROWS; ++m) hi[m][0] = hi[m][1] = lo[m][0] = lo[m][1] = _mm512_setzero_si512();
    [[maybe_unused]] const __m512i high = S == Scales::SUPER5 ? _mm512_loadu_si512(p + 256) : _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int o = 0; o < 4; ++o) {
      __m512i first, second;
      octet_values<S>(p, o, high, first, second);
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m) {
        const int64_t at = (m0 + m) * K + g * 32 + 8 * o;
        hi[m][0] = _mm512_dpbusd_epi32(hi[m][0], first, quad(&x.high[at]));
        hi[m][1] = _mm512_dpbusd_epi32(hi[m][1], second, quad(&x.high[at + 4]));
        lo[m][0] = _mm512_dpbusd_epi32(lo[m][0], quad(&x.low[at]), first);
        lo[m][1] = _mm512_dpbusd_epi32(lo[m][1], quad(&x.low[at + 4]), second);
      }
    }
    __m512 scale, min;
    int4_factors<S>(block, g, scale, min);
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const int64_t at = (m0 + m) * G + g;
      const __m512i dot = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(hi[m][0], hi[m][1]), 8),
                                           _mm512_add_epi32(lo[m][0], lo[m][1]));
      acc[m] = _mm512_fmadd_ps(min, _mm512_set1_ps(x.sums[at]), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(x.scales[at])),
                               acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + b * LANE_ROWS, acc[m]);
}

// y[m0 + i, 16 b .. 16 b + 16) for activation rows m0..m0+ROWS-1 and int8 lanes: per
// block, per group, each pair of columns widened and dotted with each row's int16 pair (two
// chains a row: pairs even and odd, or with a scale per 16 columns (float32 scales: Q6_K's)
// pairs 0-7 and 8-15), made float32, times weight scale x activation scale (a scale per 16
// columns: each chain its own).
template <int ROWS, Scales S>
void lanes8_gemv(const int8_t* lanes, const LaneRows& x, int64_t m0, int64_t b, float* y, int64_t ldy) {
  constexpr bool PER16 = S != Scales::F16;  // a scale per 16 columns
  const int64_t G = x.G, K = x.K;
  const int8_t* block = lanes + b * G * lane_bytes<int8_t, S>();
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto [stream, streamed] = lane_stream<int8_t, S>(block, g);
    ask_ahead(stream, streamed);
    const int8_t* p = lane_group<int8_t, S>(block, g);
    __m512i dot[ROWS][2];
    for (int m = 0; m < ROWS; ++m) dot[m][0] = dot[m][1] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int pair = 0; pair < 16; ++pair) {
      const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32 * pair)));
      const int chain = PER16 ? pair / 8 : pair % 2;
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m)
        dot[m][chain] = _mm512_dpwssd_epi32(dot[m][chain], w, quad(&x.q[(m0 + m) * K + g * 32 + 2 * pair]));
    }
    __m512 scale, second;  // columns 0-15's and 16-31's
    int8_factors<S>(block, g, scale, second);
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const __m512 rows_scale = _mm512_set1_ps(x.scales[(m0 + m) * G + g]);
      if constexpr (PER16) {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][0]), _mm512_mul_ps(scale, rows_scale), acc[m]);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m][1]), _mm512_mul_ps(second, rows_scale), acc[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(dot[m][0], dot[m][1])),
                                 _mm512_mul_ps(scale, rows_scale), acc[m]);
      }
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + b * LANE_ROWS, acc[m]);
}

// Half c's 4 vectors of Q6_K values at p (3 x 64 bytes, the layout above): vector i's lane r
// row r's q (0..63) of the half's columns 4i..4i+3, a byte each.
inline void six_bits(const int8_t* p, __m512i q[4]) {
  const __m512i six = _mm512_set1_epi8(0x3F);
  const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64), c = _mm512_loadu_si512(p + 128);
  q[0] = _mm512_and_si512(a, six);
  q[1] = _mm512_and_si512(b, six);
  q[2] = _mm512_and_si512(c, six);
  // c's, b's and a's top 2 bits at a byte's bits 6-7, 4-5, 2-3 (selected: 0xCA, first operand's
  // bits choose the second's, else the third's; a shift within 16 bits keeps a byte's own bits
  // where they are kept), then down 2
  const __m512i cb = _mm512_ternarylogic_epi32(_mm512_set1_epi8(int8_t(0xC0)), c, _mm512_srli_epi16(b, 2), 0xCA);
  const __m512i cba = _mm512_ternarylogic_epi32(_mm512_set1_epi8(int8_t(0xF0)), cb, _mm512_srli_epi16(a, 4), 0xCA);
  q[3] = _mm512_and_si512(_mm512_srli_epi16(cba, 2), six);
}

// -32 x the sum of each 16 columns' int16 activations of x, [M, K/16]: with them Q6_K's values
// q (0..63) dotted with the activations are (q - 32)'s dot products.
inline std::vector<int32_t> q6_offsets(const LaneRows& x) {
  std::vector<int32_t> offsets(x.q.size() / 16);
  for (size_t t = 0; t < offsets.size(); ++t) {
    int32_t sum = 0;
    for (int k = 0; k < 16; ++k) sum += x.q[16 * t + k];
    offsets[t] = -32 * sum;
  }
  return offsets;
}

// y[m0 + i, 16 b .. 16 b + 16) for activation rows m0..m0+ROWS-1 and Q6_K lanes: per block, per
// group, per half, its four vectors of values (`six_bits`) dotted with each row's high and low
// bytes (two 32-bit sums a row, the low one starting at the half's `offsets`), joined as 256
// high + low: the integers of lanes8_gemv on the values q - 32, and its float32 operations at a
// scale per 16 columns.
template <int ROWS>
void lanes6_gemv(const int8_t* lanes, const LaneRows& x, const int32_t* offsets, int64_t m0, int64_t b, float* y,
                 int64_t ldy) {
  const int64_t G = x.G, K = x.K;
  const int8_t* block = lanes + b * G * lane_bytes<int8_t, Scales::SUPER>();
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const auto [stream, streamed] = lane_stream<int8_t, Scales::SUPER>(block, g);
    ask_ahead(stream, streamed);
    const int8_t* p = lane_group<int8_t, Scales::SUPER>(block, g);
    __m512i hi[ROWS][2], lo[ROWS][2];
    for (int m = 0; m < ROWS; ++m)
      for (int c = 0; c < 2; ++c) {
        hi[m][c] = _mm512_setzero_si512();
        lo[m][c] = _mm512_set1_epi32(offsets[(m0 + m) * 2 * G + 2 * g + c]);
      }
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      __m512i q[4];
      six_bits(p + 192 * c, q);
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int m = 0; m < ROWS; ++m) {
          const int64_t at = (m0 + m) * K + g * 32 + 16 * c + 4 * i;
          hi[m][c] = _mm512_dpbusd_epi32(hi[m][c], q[i], quad(&x.high[at]));
          lo[m][c] = _mm512_dpbusd_epi32(lo[m][c], quad(&x.low[at]), q[i]);
        }
    }
    __m512 scale, second;  // columns 0-15's and 16-31's
    int8_factors<Scales::SUPER>(block, g, scale, second);
#pragma GCC unroll 4
    for (int m = 0; m < ROWS; ++m) {
      const __m512 rows_scale = _mm512_set1_ps(x.scales[(m0 + m) * G + g]);
      const __m512i first = _mm512_add_epi32(_mm512_slli_epi32(hi[m][0], 8), lo[m][0]);
      const __m512i last = _mm512_add_epi32(_mm512_slli_epi32(hi[m][1], 8), lo[m][1]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), _mm512_mul_ps(scale, rows_scale), acc[m]);
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(last), _mm512_mul_ps(second, rows_scale), acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + (m0 + m) * ldy + b * LANE_ROWS, acc[m]);
}

// y = x @ W.T for M <= I16_ROWS rows of x [M, K] and int4 (uint8 `lanes`) or int8 (int8
// `lanes`) weights W [N, K] of the layout `S`, the activations rounded to int16 first, y's
// rows ldy apart; blocks of 16 rows handed out as `stream_piece` hands out rows, each block's
// weights read once from memory (a pass of up to LANE_PASS rows at a time, the rest from
// cache).
template <typename T, Scales S>
void lanes_i16(const T* lanes, const float* x, int64_t M, int64_t N, int64_t K, float* y, int64_t ldy) {
  const LaneRows xq(x, M, K);
  constexpr bool Q6 = std::is_same_v<T, int8_t> && S == Scales::SUPER;
  const std::vector<int32_t> offsets = Q6 ? q6_offsets(xq) : std::vector<int32_t>();
  const int64_t blocks = N / LANE_ROWS;
  const int64_t piece = std::max<int64_t>(1, stream_piece(N, K) / LANE_ROWS);
  share(blocks, piece, N * K >= PARALLEL_MIN, [&](int64_t b0, int64_t b1, int) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t m0 = 0; m0 < M; m0 += LANE_PASS)
        with_rows<LANE_PASS>(std::min(LANE_PASS, M - m0), [&](auto rows) {
          if constexpr (std::is_same_v<T, uint8_t>) lanes_gemv<rows(), S>(lanes, xq, m0, b, y, ldy);
          else if constexpr (Q6) lanes6_gemv<rows()>(lanes, xq, offsets.data(), m0, b, y, ldy);
          else lanes8_gemv<rows(), S>(lanes, xq, m0, b, y, ldy);
        });
  });
}

#endif

}  // namespace
