// Linear layers on packed weights, float32 activations, AVX2 + FMA + F16C (and, for
// 1-8 rows, AVX-512 where the build has it).
//
// int4: qweight uint8 [N, K/2], GGUF's Q4 block order: in each group of 32 weights,
//       byte j holds weight j (low nibble) and weight j + 16 (high nibble);
//       scales, mins float16 [N, K/32]; w = q * scale + min.
// int8: qweight int8 [N, K]; scales float16 [N, K/G] (G a multiple of 32); w = q * scale.
//
// q * scale is exact in float32 (a float16 times a 4- or 8-bit integer), so a weight
// dequantized as fma(q, scale, min) equals gguf's numpy dequantization bit for bit;
// the output differs from F.linear on those weights only in the order of the sums
// (and, for int4 at one activation row, in taking scale and min out of each group's
// sum: sum_g scale_g * (x . q)_g + min_g * (sum of x over g)).
//
// Up to GEMV_ROWS activation rows (4; 8 with AVX-512: decode, short prefills) stream
// the weights once, converting them to float32 in registers. int4 at 2-4 rows reads 32
// bytes (two groups) as eight 32-bit lanes and takes nibble i of every lane at once
// ((d >> 4i) & 15): no byte shuffles; the activations are permuted once per call to
// match (`permute_int4`). With AVX-512 they take `gemv_wide` instead: 16 lanes, the
// weights dequantized exactly, once for all the rows; int4 at one row takes `gemv1_int4`:
// 64 bytes (4 groups) transposed in registers, each nibble made float32 by a permute.
// More rows (prefill, batched decode): 16 weight rows at a time (32 with AVX-512) are
// dequantized into a float32 panel, transposed ([K, 16], in L2), and every activation
// row is multiplied against it by a register-blocked kernel (6 rows x 16 outputs in 12
// accumulators, 6 x 32 with AVX-512; the activations broadcast, no horizontal sums).
// With AVX512-BF16 a layer may also hold its weights as bfloat16 panels (`bf16_linear`,
// bf16_panels.h): its many-row products multiply in bfloat16, sums in float32.
// The work is handed out in pieces to the kernels' own threads (`Team`: as many as
// torch's, kept awake through a step), each taking the next piece as it finishes
// (`share`), so a core busy with something else does less of it.
//
// `int4_linear_i16` rounds up to I16_ROWS activation rows (`int16_rows(4)`: 8 with
// AVX512-VNNI, 4 on AVX2, 1 on AVX-512 without VNNI) to int16 per group of 32 and
// multiplies them by the int4 weights in integers (i16_gemv.h: VNNI's `vpdpwssd`, else
// AVX2's `vpmaddwd`): no float conversion of the weights, close to exact but not exact;
// `int8_linear_i16` the same for int8 weights at one row (AVX2's, every build);
// `lanes_i16` the same products on int4 or int8 weights laid out 16 rows to a vector
// (lanes.h, AVX512-VNNI builds: `lanes_rows()` rows, int8's too); `lanes_bf16` any row
// count of them in bfloat16, each 32-row panel dequantized from the lanes as it is reached
// (lane_panels.h, AVX512-BF16 builds): `bf16_linear` on the panels it would hold, bit for bit;
// `lanes_i8` any row count of int4 or Q6_K lanes on activations rounded to int8 per group of
// 32 (lanes_i8.h: half the dot products of int16's, ~1.3x bfloat16's speed at 512 rows).
// With AMX-BF16, `amx_rows()` rows or more on bfloat16 panels multiply on AMX's tiles
// (amx_tiles.h).
// The lanes' scales are float16 (int4's alone where each minimum is -8 x its scale: GGUF's
// Q4_0) or float32 (GGUF's Q4_K and Q6_K: int4 groups of 32, int8 a scale per 16 columns), or their
// own factors a super-block of 256 columns, which only the lanes take.
//
// `gguf_rows`: a GGUF tensor's rows of blocks dequantized as looked up (gguf_rows.h: a token
// embedding kept in the file's blocks), gguf-py's values bit for bit.
//
// The parts, in csrc/: common.h, team.h, amx_tiles.h, formats.h, gemv.h, i16_gemv.h, lanes.h, panels.h,
// bf16_panels.h, lane_panels.h, lanes_i8.h, gguf_rows.h.
#include "bf16_panels.h"
#include "gemv.h"
#include "gguf_rows.h"
#include "panels.h"
#include "i16_gemv.h"
#include "lanes.h"
#include "lane_panels.h"
#include "lanes_i8.h"

namespace {

// Most rows the weights `W` take rounded to int16 (int4: I16_ROWS; int8: one).
template <typename W>
constexpr int64_t i16_rows() {
  return std::is_same_v<W, Int4> ? I16_ROWS : 1;
}

// y [M, N] = x [M, K] @ W.T, both contiguous float32, by the kernel for M rows; up to
// `i16_rows<W>()` rows of x rounded to int16 first when `int16_rows`. No tensors: for
// callers holding their own buffers (decode_layers.cpp).
template <typename W>
void linear_rows(const W& w, const float* x, int64_t M, int64_t N, int64_t K, bool int16_rows,
                 float* y) {
  if (M <= i16_rows<W>() && int16_rows) streamed_i16(w, x, M, N, K, y);
  else if (M <= GEMV_ROWS) streamed(w, x, M, N, K, y);
  else if (M < PANEL_ROWS) tiled(w, x, M, N, K, y);
  else paneled(w, x, M, N, K, y);
}

// What N x K packed weights take of activations `width` wide: width K, N % 4 == 0 and
// K % 32 == 0.
void check_shape(int64_t N, int64_t K, int64_t width) {
  TORCH_CHECK(width == K, "expected activations of width ", K, ", got ", width);
  TORCH_CHECK(N % 4 == 0 && K % 32 == 0, "expected N % 4 == 0 and K % 32 == 0, got ", N, ", ", K);
}

// What a call of N x K packed weights takes: float32 activations x [..., K] (`check_shape`).
void check_linear(const at::Tensor& x, int64_t N, int64_t K) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "expected float32 activations, got ",
              x.scalar_type());
  check_shape(N, K, x.size(-1));
}

// y = x @ W.T for float32 x [..., K] and the N x K weights `w`; up to `i16_rows<W>()`
// rows of x rounded to int16 first when `int16_rows`.
template <typename W>
at::Tensor packed_linear(const at::Tensor& x_in, const W& w, int64_t N, int64_t K,
                         bool int16_rows = false) {
  check_linear(x_in, N, K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  linear_rows(w, x.data_ptr<float>(), M, N, K, int16_rows, y.data_ptr<float>());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

Int4 int4_weights(const at::Tensor& qweight, const at::Tensor& scales, const at::Tensor& mins) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf, "bad scales");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous(), "expected contiguous scales");
  const int64_t K = qweight.size(1) * 2;
  return Int4{qweight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
              K, K / 32};
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  const Int4 w = int4_weights(qweight, scales, mins);
  return packed_linear(x, w, qweight.size(0), w.K);
}

// As int4_linear, up to I16_ROWS rows of x rounded to int16 per group of 32 first.
at::Tensor int4_linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                          const at::Tensor& mins) {
  const Int4 w = int4_weights(qweight, scales, mins);
  return packed_linear(x, w, qweight.size(0), w.K, true);
}

Int8 int8_weights(const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "bad scales");
  const int64_t K = qweight.size(1), group = K / scales.size(1);
  TORCH_CHECK(group % 32 == 0, "expected an int8 group size divisible by 32, got ", group);
  return Int8{qweight.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K, scales.size(1), group};
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return packed_linear(x, int8_weights(qweight, scales), qweight.size(0), qweight.size(1));
}

// As int8_linear, one row of x rounded to int16 per group of 32 first.
at::Tensor int8_linear_i16(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  return packed_linear(x, int8_weights(qweight, scales), qweight.size(0), qweight.size(1), true);
}

// Most activation rows the int4 and int8 `lanes` take, rounded to int16 (lanes.h: I16_ROWS
// with AVX512-VNNI; 0: this build has no lanes).
int64_t lane_rows() {
#if defined(__AVX512VNNI__)
  return I16_ROWS;
#else
  return 0;
#endif
}

// M activation rows, at most what the lanes take.
void check_lane_rows(int64_t M) {
  TORCH_CHECK(M <= lane_rows(), "expected at most ", lane_rows(), " activation rows for lanes, got ", M);
}

// The layout of int4 (uint8) or int8 (int8) `lanes`, checked: float16 scales [N/16, K/32 *
// 320] and [N/16, K/32 * 544], int4 symmetric [N/16, K/32, 288], float32 scales [N/16, K/32,
// 384] and [N/16, K/32, 640], the K-quants' factors [N/16, K/256, 2304] (Q4_K), [N/16, K/256,
// 3360] (Q6_K) and int8 [N/16, K/256, 2816] (Q5_K: SUPER5) (lanes.h).
Scales lanes_layout(const at::Tensor& lanes) {
  TORCH_CHECK(lane_rows() > 0, "lanes need a build with AVX512-VNNI (lanes_rows() is 0 here)");
  const bool int4 = lanes.scalar_type() == at::kByte;
  const bool known = (int4 || lanes.scalar_type() == at::kChar) && lanes.is_contiguous() && lanes.dim() >= 2;
  const int64_t last = lanes.size(-1);
  if (known && lanes.dim() == 2 && last % (int4 ? LANE_GROUP_BYTES : LANE_INT8_BYTES) == 0) return Scales::F16;
  if (known && lanes.dim() == 3 && last == (int4 ? LANE_F32_BYTES : LANE_INT8_F32_BYTES)) return Scales::F32;
  if (known && lanes.dim() == 3 && int4 && last == LANE_SYM_BYTES) return Scales::SYM;
  if (known && lanes.dim() == 3 && !int4 && last == super_bytes<uint8_t, Scales::SUPER5>()) return Scales::SUPER5;
  TORCH_CHECK(known && lanes.dim() == 3 && last == (int4 ? super_bytes<uint8_t>() : super_bytes<int8_t>()),
              "expected contiguous uint8 (int4) or int8 lanes [N/16, K/32 * 320 or 544] (float16 scales),"
              " uint8 [N/16, K/32, 288] (symmetric), [N/16, K/32, 384 or 640] (float32) or"
              " [N/16, K/256, 2304 or 3360, int8 2816] (the K-quants' factors), got ",
              lanes.scalar_type(), " ", lanes.sizes());
  return Scales::SUPER;
}

// N and K of the weights `lanes` hold (`lanes_layout`).
std::pair<int64_t, int64_t> lanes_shape(const at::Tensor& lanes) {
  const Scales layout = lanes_layout(lanes);
  const bool int4 = lanes.scalar_type() == at::kByte;
  const int64_t K = factored(layout) ? lanes.size(1) * 256
                    : layout == Scales::F32 || layout == Scales::SYM ? lanes.size(1) * 32
                                            : lanes.size(1) / (int4 ? LANE_GROUP_BYTES : LANE_INT8_BYTES) * 32;
  return {lanes.size(0) * LANE_ROWS, K};
}

// f(data, layout) for `lanes` (`lanes_layout`): data a const uint8_t* (int4, and Q5_K's int8
// lanes: SUPER5, read as int4's) or int8_t*, layout a std::integral_constant of its `Scales`.
template <typename F>
void on_lanes(const at::Tensor& lanes, F&& f) {
  using F16 = std::integral_constant<Scales, Scales::F16>;
  using F32 = std::integral_constant<Scales, Scales::F32>;
  using SYM = std::integral_constant<Scales, Scales::SYM>;
  using SUPER = std::integral_constant<Scales, Scales::SUPER>;
  using SUPER5 = std::integral_constant<Scales, Scales::SUPER5>;
  const bool int4 = lanes.scalar_type() == at::kByte;
  switch (lanes_layout(lanes)) {
    case Scales::F16:
      return int4 ? f(lanes.data_ptr<uint8_t>(), F16()) : f(lanes.data_ptr<int8_t>(), F16());
    case Scales::F32:
      return int4 ? f(lanes.data_ptr<uint8_t>(), F32()) : f(lanes.data_ptr<int8_t>(), F32());
    case Scales::SYM:  // int4's alone
      return f(lanes.data_ptr<uint8_t>(), SYM());
    case Scales::SUPER:
      return int4 ? f(lanes.data_ptr<uint8_t>(), SUPER()) : f(lanes.data_ptr<int8_t>(), SUPER());
    case Scales::SUPER5:
      return f(reinterpret_cast<uint8_t*>(lanes.data_ptr<int8_t>()), SUPER5());
  }
}

// y [M, N] = x [M, K] @ W.T for M <= lanes_rows() rows of x (contiguous float32) rounded to
// int16, W int4 or int8 `lanes` of N x K (`lanes_shape`); y's rows `ldy` apart (0: N); with
// `int8_rows`, I8_ROWS rows or more on lanes `lanes_i8` takes rounded to int8 instead. No
// tensors: for decode_layers.cpp.
void multiply_lanes(const at::Tensor& lanes, int64_t N, int64_t K, const float* x, int64_t M, float* y,
                    int64_t ldy = 0, bool int8_rows = false) {
#if defined(__AVX512VNNI__)
  ldy = ldy ? ldy : N;
  on_lanes(lanes, [&](auto data, auto layout) {
    using T = std::remove_pointer_t<decltype(data)>;
    if constexpr (i8_takes<T, decltype(layout)::value>()) {
      if (int8_rows && M >= I8_ROWS) return lanes_i8_rows<T, decltype(layout)::value>(data, x, M, N, K, y, ldy);
    }
    check_lane_rows(M);
    lanes_i16<T, decltype(layout)::value>(data, x, M, N, K, y, ldy);
  });
#else
  check_lane_rows(M);
#endif
}

// y = x @ W.T for float32 x [..., K] of at most lanes_rows() rows, rounded to int16 per group
// of 32 as the `*_i16` ops round them, and int4 or int8 weights W laid out as `lanes`.
at::Tensor lanes_i16_linear(const at::Tensor& x_in, const at::Tensor& lanes) {
  const auto [N, K] = lanes_shape(lanes);
  check_linear(x_in, N, K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  multiply_lanes(lanes, N, K, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// y = x @ W.T for float32 x [..., K] (any rows) rounded to bfloat16 and int4 or int8 weights W
// laid out as `lanes` (N % 32 == 0), each 32-row panel dequantized to bfloat16 as reached.
at::Tensor lanes_bf16_linear(const at::Tensor& x_in, const at::Tensor& lanes) {
  const auto [N, K] = lanes_shape(lanes);
  check_linear(x_in, N, K);
  TORCH_CHECK(N % 32 == 0, "expected lanes of rows divisible by 32 for bfloat16 panels, got ", N);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512BF16__) && defined(__AVX512VNNI__)
  on_lanes(lanes, [&](auto data, auto layout) {
    lanes_bf16_rows<std::remove_pointer_t<decltype(data)>, decltype(layout)::value>(
        data, x.data_ptr<float>(), x.size(0), N, K, y.data_ptr<float>());
  });
#else
  TORCH_CHECK(false, "the kernels were built without AVX512-BF16 (this CPU's flags lack it)");
#endif
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// Fewest rows `multiply_lanes` rounds to int8 where asked (0: no build with AVX512-VNNI).
int64_t int8_lane_rows() {
#if defined(__AVX512VNNI__)
  return I8_ROWS;
#else
  return 0;
#endif
}

// Whether `lanes_i8` takes `lanes` (`lanes_layout`): int4 (Q5_K's too) and Q6_K lanes, with
// AVX512-VNNI; not int8 pairs.
bool lanes_i8_takes(const at::Tensor& lanes) {
#if defined(__AVX512VNNI__)
  // the layout's dtype and shape alone (a meta tensor's too): int8 lanes of the K-quants'
  // factors are Q6_K's (SUPER) or Q5_K's (SUPER5, read as int4's)
  return lanes.scalar_type() == at::kByte || factored(lanes_layout(lanes));
#else
  return false;
#endif
}

// y = x @ W.T for float32 x [..., K] (any rows) rounded to int8 per group of 32 and int4 or
// Q6_K weights W laid out as `lanes` (`lanes_i8_takes`).
at::Tensor lanes_i8_linear(const at::Tensor& x_in, const at::Tensor& lanes) {
  const auto [N, K] = lanes_shape(lanes);
  check_linear(x_in, N, K);
  TORCH_CHECK(lanes_i8_takes(lanes), "expected int4 or Q6_K lanes for int8 activations, got ",
              lanes.scalar_type(), " ", lanes.sizes());
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512VNNI__)
  on_lanes(lanes, [&](auto data, auto layout) {
    using T = std::remove_pointer_t<decltype(data)>;
    if constexpr (i8_takes<T, decltype(layout)::value>())
      lanes_i8_rows<T, decltype(layout)::value>(data, x.data_ptr<float>(), x.size(0), N, K, y.data_ptr<float>(), N);
  });
#endif
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

// Most rows the int4 (bits 4) or int8 (bits 8) ops `*_i16` round to int16.
int64_t int16_rows(int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "expected bits 4 or 8, got ", bits);
  return bits == 4 ? i16_rows<Int4>() : i16_rows<Int8>();
}

}  // namespace

TORCH_LIBRARY(mstar_quant, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("int4_linear_i16(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int8_linear_i16(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("int16_rows(int bits) -> int", &int16_rows);
  m.def("lanes_rows() -> int", &lane_rows);
  m.def("lanes_i16(Tensor x, Tensor lanes) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor panels) -> Tensor");
  m.def("lanes_bf16(Tensor x, Tensor lanes) -> Tensor");
  m.def("lanes_i8_takes(Tensor lanes) -> bool", &lanes_i8_takes);
  m.def("lanes_i8(Tensor x, Tensor lanes) -> Tensor");
  m.def("int8_lane_rows() -> int", &int8_lane_rows);
  m.def("amx_rows() -> int", &amx_rows);
  m.def("gguf_rows_take(str type_name) -> bool", &gguf_rows_take);
  m.def("gguf_rows(Tensor blocks, Tensor ids, str type_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_quant, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_i16", &int4_linear_i16);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_i16", &int8_linear_i16);
  m.impl("bf16_linear", &bf16_linear);
  m.impl("lanes_i16", &lanes_i16_linear);
  m.impl("lanes_bf16", &lanes_bf16_linear);
  m.impl("lanes_i8", &lanes_i8_linear);
  m.impl("gguf_rows", &gguf_rows);
}
