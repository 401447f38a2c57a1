// Linear layers on packed weights, float32 activations, AVX2 + FMA + F16C.
//
// int4: qweight uint8 [N, K/2], GGUF's Q4 block order: in each group of 32 weights,
//       byte j holds weight j (low nibble) and weight j + 16 (high nibble);
//       scales, mins float16 [N, K/32]; w = q * scale + min.
// int8: qweight int8 [N, K]; scales float16 [N, K/G] (G a multiple of 32); w = q * scale.
//
// q * scale is exact in float32 (a float16 times a 4- or 8-bit integer), so each
// dequantized weight equals gguf's numpy dequantization bit for bit; the output
// differs from F.linear on those weights only in the order of the sums.
//
// A few activation rows (decode; at most GEMV_ROWS) stream the weights once,
// converting each group of 32 to float32 in registers: sum_g scale_g * (x . q)_g
// + min_g * (sum of x over g). More rows (prefill, batched decode): each task
// dequantizes a tile of NR weight rows x KC columns into float32 (in L1) and
// multiplies every activation row against it, MR rows at a time. Tasks are
// spread over torch's threads (at::parallel_for).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t GEMV_ROWS = 4;  // most activation rows for the streaming path
constexpr int64_t NR = 4;         // weight rows per tile
constexpr int64_t MR = 3;         // activation rows per micro-kernel
constexpr int64_t KC = 1024;      // columns per tile (4 x 1024 floats = 16 KiB)

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

float to_float(at::Half h) { return _cvtsh_ss(h.x); }

// int4 weights: group j of row n as 32 integers in float32 (four vectors of 8).
struct Int4 {
  const uint8_t* q;
  const at::Half *scales, *mins;
  int64_t groups;  // per row

  void load(int64_t n, int64_t j, __m256 v[4]) const {
    const uint8_t* p = q + (n * groups + j) * 16;
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
    const __m256i mask = _mm256_set1_epi32(0x0F);
    v[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, mask));
    v[1] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
    v[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    v[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
  }
  float scale(int64_t n, int64_t j) const { return to_float(scales[n * groups + j]); }
  float min(int64_t n, int64_t j) const { return to_float(mins[n * groups + j]); }
  // sum over the row's groups of min_j * xsum[j]
  float min_dot(int64_t n, const float* xsum) const {
    const at::Half* mn = mins + n * groups;
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= groups; j += 8) {
      const __m256 m8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + j)));
      acc = _mm256_fmadd_ps(m8, _mm256_loadu_ps(xsum + j), acc);
    }
    float sum = hsum(acc);
    for (; j < groups; ++j) sum += to_float(mn[j]) * xsum[j];
    return sum;
  }
};

// int8 weights, one scale per `group` columns (a multiple of 32).
struct Int8 {
  const int8_t* q;
  const at::Half* scales;
  int64_t K, per_row, group;

  void load(int64_t n, int64_t j, __m256 v[4]) const {
    const int8_t* p = q + n * K + j * 32;
    for (int i = 0; i < 4; ++i) {
      const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i));
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
    }
  }
  float scale(int64_t n, int64_t j) const { return to_float(scales[n * per_row + j * 32 / group]); }
  float min(int64_t, int64_t) const { return 0.0f; }
  float min_dot(int64_t, const float*) const { return 0.0f; }
};

// Weight rows [n0, n1) against ROWS activation rows, streaming each weight once:
// out[m, n] = sum_j scale_j (x_m . q_j) + min_j xsum[m, j].
template <int64_t ROWS, typename W>
void gemv(const W& w, const float* x, const float* xsum, int64_t K, int64_t n0, int64_t n1,
          float* out, int64_t N) {
  const int64_t groups = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[ROWS];
    for (int64_t m = 0; m < ROWS; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t j = 0; j < groups; ++j) {
      __m256 v[4];
      w.load(n, j, v);
      const __m256 s = _mm256_set1_ps(w.scale(n, j));
      for (int64_t m = 0; m < ROWS; ++m) {
        const float* xp = x + m * K + j * 32;
        __m256 a = _mm256_mul_ps(_mm256_loadu_ps(xp), v[0]);
        __m256 b = _mm256_mul_ps(_mm256_loadu_ps(xp + 8), v[1]);
        a = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), v[2], a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), v[3], b);
        acc[m] = _mm256_fmadd_ps(_mm256_add_ps(a, b), s, acc[m]);
      }
    }
    for (int64_t m = 0; m < ROWS; ++m) out[m * N + n] = hsum(acc[m]) + w.min_dot(n, xsum + m * groups);
  }
}

// out[m, r] += x[m, 0..kc) . t[r, 0..kc) for m < ROWS, r < NR (t: a dequantized tile).
template <int64_t ROWS>
void micro(const float* x, int64_t ldx, const float* t, int64_t kc, float* out, int64_t ldo) {
  __m256 acc[ROWS][NR];
  for (int64_t m = 0; m < ROWS; ++m)
    for (int64_t r = 0; r < NR; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kc; k += 8) {
    __m256 xv[ROWS];
    for (int64_t m = 0; m < ROWS; ++m) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
    for (int64_t r = 0; r < NR; ++r) {
      const __m256 tv = _mm256_loadu_ps(t + r * KC + k);
      for (int64_t m = 0; m < ROWS; ++m) acc[m][r] = _mm256_fmadd_ps(xv[m], tv, acc[m][r]);
    }
  }
  for (int64_t m = 0; m < ROWS; ++m)
    for (int64_t r = 0; r < NR; ++r) out[m * ldo + r] += hsum(acc[m][r]);
}

// Weight rows [n0, n1) (a multiple of NR apart) against all M activation rows,
// a dequantized tile at a time: w = q * scale + min, exact in float32.
template <typename W>
void gemm(const W& w, const float* x, int64_t M, int64_t K, int64_t n0, int64_t n1, float* out,
          int64_t N) {
  std::vector<float> tile(NR * KC);
  for (int64_t n = n0; n < n1; n += NR) {
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      for (int64_t r = 0; r < NR; ++r) {
        for (int64_t k = 0; k < kc; k += 32) {
          const int64_t j = (k0 + k) / 32;
          __m256 v[4];
          w.load(n + r, j, v);
          const __m256 s = _mm256_set1_ps(w.scale(n + r, j)), mn = _mm256_set1_ps(w.min(n + r, j));
          for (int i = 0; i < 4; ++i)
            _mm256_storeu_ps(tile.data() + r * KC + k + 8 * i, _mm256_fmadd_ps(v[i], s, mn));
        }
      }
      int64_t m = 0;
      for (; m + MR <= M; m += MR) micro<MR>(x + m * K + k0, K, tile.data(), kc, out + m * N + n, N);
      for (; m < M; ++m) micro<1>(x + m * K + k0, K, tile.data(), kc, out + m * N + n, N);
    }
  }
}

// Sums of x over each group of 32 columns: [M, K / 32].
std::vector<float> group_sums(const float* x, int64_t M, int64_t K) {
  std::vector<float> sums(M * (K / 32));
  for (int64_t i = 0; i < M * (K / 32); ++i) {
    float s = 0;
    for (int k = 0; k < 32; ++k) s += x[i * 32 + k];
    sums[i] = s;
  }
  return sums;
}

template <typename W>
void gemv_rows(const W& w, const float* x, const float* xsum, int64_t rows, int64_t K,
               int64_t n0, int64_t n1, float* out, int64_t N) {
  switch (rows) {
    case 1: return gemv<1>(w, x, xsum, K, n0, n1, out, N);
    case 2: return gemv<2>(w, x, xsum, K, n0, n1, out, N);
    case 3: return gemv<3>(w, x, xsum, K, n0, n1, out, N);
    default: return gemv<4>(w, x, xsum, K, n0, n1, out, N);
  }
}

// y = x @ W.T for float32 x [..., K] and the N x K weights `w`.
template <typename W>
at::Tensor packed_linear(const at::Tensor& x_in, const W& w, int64_t N, int64_t K) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "expected float32 activations, got ",
              x_in.scalar_type());
  TORCH_CHECK(x_in.size(-1) == K, "expected activations of width ", K, ", got ", x_in.size(-1));
  TORCH_CHECK(N % NR == 0 && K % 32 == 0, "expected N % 4 == 0 and K % 32 == 0, got ", N, ", ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = M <= GEMV_ROWS ? at::empty({M, N}, x.options()) : at::zeros({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= GEMV_ROWS) {  // gemv writes every output, gemm adds to it
    const std::vector<float> xsum = group_sums(xp, M, K);
    // a task of at least ~64K weights: a small layer's rows are not worth waking a thread
    const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 16) / K);
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      gemv_rows(w, xp, xsum.data(), M, K, n0, n1, yp, N);
    });
  } else {
    at::parallel_for(0, N / NR, 1, [&](int64_t t0, int64_t t1) {
      gemm(w, xp, M, K, t0 * NR, t1 * NR, yp, N);
    });
  }
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf, "bad scales");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  const Int4 w{qweight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
               K / 32};
  return packed_linear(x, w, N, K);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf, "bad scales");
  const int64_t N = qweight.size(0), K = qweight.size(1), group = K / scales.size(1);
  TORCH_CHECK(group % 32 == 0, "expected an int8 group size divisible by 32, got ", group);
  const Int8 w{qweight.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K, scales.size(1), group};
  return packed_linear(x, w, N, K);
}

}  // namespace

TORCH_LIBRARY(mstar_quant, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_quant, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}
