// Activation rows in bfloat16 on bfloat16 panels (`bf16_linear`, AVX512-BF16 builds): the
// many-row products of packed layers, and every product of bf16 ones (the panels themselves);
// AMX_ROWS rows or more on AMX's tiles where the build has them (amx_tiles.h).
#pragma once

#include "amx_tiles.h"
#include "panels.h"
#include "team.h"

namespace {

// bfloat16 panels (builds with AVX512-BF16): the weights [N, K] rounded to bfloat16, 32
// rows a panel, each panel [K/2, 32, 2] (k pair, output, k within the pair): a 64-byte
// line holds 16 outputs' pairs, as vdpbf16ps takes them. The activations are rounded to
// bfloat16 once a call; each pair of them, broadcast, is multiplied against two lines
// (32 outputs) and summed in float32: two weights a multiply-add, where float32 panels
// take one, and nothing to dequantize.
#if defined(__AVX512BF16__)
constexpr int64_t BF16_NB = 32;  // weight rows per bfloat16 panel

// y[m, 0..32) = x[m, :] . panel for m < ROWS (x bfloat16, rows of stride K).
template <int ROWS>
void micro_bf16(const uint16_t* x, const uint16_t* panel, int64_t K, float* y, int64_t ldy) {
  __m512 lo[ROWS], hi[ROWS];
  for (int m = 0; m < ROWS; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  int64_t k = 0;
  do {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * BF16_NB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * BF16_NB + 32);
#pragma GCC unroll 6
    for (int m = 0; m < ROWS; ++m) {
      const __m512bh xv =
          (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(x + m * K + k));
      lo[m] = _mm512_dpbf16_ps(lo[m], xv, w0);
      hi[m] = _mm512_dpbf16_ps(hi[m], xv, w1);
    }
  } while ((k += 2) < K);
  for (int m = 0; m < ROWS; ++m) {
    _mm512_storeu_ps(y + m * ldy, lo[m]);
    _mm512_storeu_ps(y + m * ldy + 16, hi[m]);
  }
}

void micro_bf16_rows(int64_t rows, const uint16_t* x, const uint16_t* panel, int64_t K, float* y,
                     int64_t ldy) {
  with_rows<ROWS_MAX>(rows, [&](auto r) { micro_bf16<decltype(r)::value>(x, panel, K, y, ldy); });
}

// M rows of K float32 values (K % 16 == 0) rounded to bfloat16, to nearest even; zero rows
// after them up to `bf16_rows_held(M)`.
std::vector<uint16_t> bf16_activations(const float* xf, int64_t M, int64_t K) {
  std::vector<uint16_t> xb(bf16_rows_held(M) * K);
  for (int64_t i = 0; i < M * K; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.data() + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + i)));
  return xb;
}

// y[m, 0..32) (rows of stride N) = x[m, :] . panel for every m < M (x bfloat16 [M, K], as
// `bf16_activations` makes it).
void bf16_panel_rows(const uint16_t* xb, int64_t M, int64_t K, const uint16_t* panel, float* y, int64_t N) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (on_tiles(M)) return amx_panel_rows(xb, M, K, panel, y, N);
#endif
  for (int64_t m = 0; m < M; m += ROWS_MAX)
    micro_bf16_rows(std::min<int64_t>(ROWS_MAX, M - m), xb + m * K, panel, K, y + m * N, N);
}

// y [M, N] = x [M, K] @ W.T for float32 x (contiguous) and bfloat16 panels [N/32, K/2, 32,
// 2] at w (N = panel count * 32, K % 32 == 0): the activations rounded to bfloat16 once.
void bf16_rows(const float* xf, int64_t M, int64_t K, const uint16_t* w, int64_t panel_count,
               float* out) {
  const int64_t N = panel_count * BF16_NB;
  const std::vector<uint16_t> xb = bf16_activations(xf, M, K);  // K % 32 == 0: whole vectors
  share(panel_count, 1, N * K * M >= PARALLEL_MIN, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p) bf16_panel_rows(xb.data(), M, K, w + p * K * BF16_NB, out + p * BF16_NB, N);
  });
}
#endif

// N of bfloat16 panels [N/32, K/2, 32, 2] for activations of width K, checked: contiguous,
// K % 32 == 0, a build with AVX512-BF16.
int64_t panels_rows(const at::Tensor& panels, int64_t K) {
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(2) == 32 && panels.size(3) == 2,
              "expected contiguous bfloat16 panels [N/32, K/2, 32, 2], got ", panels.sizes());
  TORCH_CHECK(K == panels.size(1) * 2, "expected activations of width ", panels.size(1) * 2, ", got ", K);
  TORCH_CHECK(K % 32 == 0, "expected K % 32 == 0, got ", K);
#if !defined(__AVX512BF16__)
  TORCH_CHECK(false, "the kernels were built without AVX512-BF16 (this CPU's flags lack it)");
#endif
  return panels.size(0) * 32;
}

// What a call of bfloat16 panels takes: float32 activations x [..., K] and panels
// (`panels_rows`); returns N.
int64_t check_bf16(const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "expected float32 activations, got ", x.scalar_type());
  return panels_rows(panels, x.size(-1));
}

// y = x @ W.T for float32 x [..., K] and bfloat16 panels [N/32, K/2, 32, 2].
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& panels) {
  const int64_t N = check_bf16(x_in, panels), K = panels.size(1) * 2;
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  at::Tensor y = at::empty({x.size(0), N}, x.options());
#if defined(__AVX512BF16__)
  bf16_rows(x.data_ptr<float>(), x.size(0), K, reinterpret_cast<const uint16_t*>(panels.data_ptr()),
            panels.size(0), y.data_ptr<float>());
#endif
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace
