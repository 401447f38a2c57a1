// The small ops of a fused decoder layer (mstar/cpu/layer_ops.py), float32, CPU.
//
// rms_norm:      y = x * (1 / sqrt(mean(x^2) + eps)) * w, per row; with `delta`, first
//                x += delta in place (the residual add before the norm).
// head_norms_:   each query head of x [T, W] (the first `heads` of head_dim D) through
//                rms_norm of weight q_w [D], the next `kv_heads` (keys) of k_w, in place.
// rotary_:       the first `heads` heads of each row of x [T, W] (head_dim D) rotated in
//                place: x * cos + swap(x) * sin', swap exchanging the two halves of a head,
//                sin' = sin with its first half negated (see rotary.py).
// silu_mul:      silu(g) * u for x = [g | u] [T, 2I].
// attention:     the step's q/k/v through rotary, the cache write and each query over its
//                row's pages (layer_attention.h).
// Rows (tokens; for attention, queries or parts of their keys) are spread over the kernels'
// threads (`Team`, team.h: built into one extension with them, awake
// through a step) where the work repays handing it out (`grain`); exponentials run eight
// at a time (`exp8`, within 2 ulp of std::exp).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include "team.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// e^x in each lane (Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-5 polynomial
// in r, times 2^n; within 2 ulp of std::exp); x clamped to [-87.3, 88.7] (below: ~0;
// a NaN stays NaN).
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.3f), _mm256_min_ps(_mm256_set1_ps(88.7f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  for (const float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                        5.0000001201e-1f})
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// Whether `work` units (multiply-adds, or elements) repay handing pieces to the kernels'
// threads (a few microseconds).
inline bool threaded(int64_t work) { return work >= (int64_t{1} << 17); }

// Rows a piece of work: all of them (the calling thread alone) unless the whole is
// `threaded` (`per_row` units a row), else ~2^14 units a piece (the threads take pieces
// as they finish).
inline int64_t grain(int64_t rows, int64_t per_row) {
  per_row = std::max<int64_t>(per_row, 1);
  if (!threaded(rows * per_row)) return std::max<int64_t>(rows, 1);
  return std::max<int64_t>(1, (int64_t{1} << 14) / per_row);
}

// fn(begin, end) over [0, n) in pieces of `piece` (`grain`), on the kernels' threads.
template <typename F>
void spread(int64_t n, int64_t piece, const F& fn) {
  share(n, piece, n > piece, [&](int64_t begin, int64_t end, int) { fn(begin, end); });
}

void check_f32(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.device().is_cpu(), name,
              ": expected a float32 CPU tensor, got ", t.scalar_type(), " on ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

}  // namespace

#include "layer_attention.h"

namespace {

// One row of `norm_rows`: row += delta (null: nothing added), out = weight * row / rms(row).
inline void norm_row(float* row, const float* delta, const float* weight, int64_t n, double eps,
                     float* out) {
  if (delta != nullptr) {
    for (int64_t i = 0; i < n; ++i) row[i] += delta[i];
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += row[i] * row[i];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(n) + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = weight[i] * (row[i] * inv);
}

// out = rms_norm(x += delta) for rows [T, n] (delta nullptr: nothing added), `spread` (within
// a gang: shared by its threads).
void norm_rows(float* x, const float* delta, const float* weight, int64_t rows, int64_t n, double eps,
               float* out) {
  spread(rows, grain(rows, n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(x + r * n, delta == nullptr ? nullptr : delta + r * n, weight, n, eps, out + r * n);
  });
}

// Checks rms_norm's x [T, N], delta (x's shape) and weight [N].
void check_norm(const at::Tensor& x, const std::optional<at::Tensor>& delta, const at::Tensor& weight) {
  check_f32(x, "x");
  check_f32(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1),
              "expected x [T, N] and weight [N]");
  if (delta.has_value()) {
    check_f32(*delta, "delta");
    TORCH_CHECK(delta->sizes() == x.sizes(), "expected delta of x's shape");
  }
}

at::Tensor rms_norm(at::Tensor x, const std::optional<at::Tensor>& delta, const at::Tensor& weight,
                    double eps) {
  check_norm(x, delta, weight);
  auto out = at::empty_like(x);
  norm_rows(x.data_ptr<float>(), delta.has_value() ? delta->data_ptr<float>() : nullptr,
            weight.data_ptr<float>(), x.size(0), x.size(1), eps, out.data_ptr<float>());
  return out;
}

// Rows [T, width] of `heads` query heads then `kv_heads` key heads of `dim` floats from
// each row's start: each head through norm_row of q_w (queries) or k_w (keys) in place,
// rows shared as `norm_rows` shares them.
void norm_heads(float* x, int64_t rows, int64_t width, const float* q_w, const float* k_w,
                int64_t heads, int64_t kv_heads, int64_t dim, double eps) {
  spread(rows, grain(rows, (heads + kv_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (int64_t h = 0; h < heads + kv_heads; ++h) {
        float* head = x + r * width + h * dim;
        norm_row(head, nullptr, h < heads ? q_w : k_w, dim, eps, head);
      }
  });
}

void head_norms_(at::Tensor x, const at::Tensor& q_w, const at::Tensor& k_w, int64_t heads,
                 int64_t kv_heads, double eps) {
  check_f32(x, "x");
  check_f32(q_w, "q_w");
  check_f32(k_w, "k_w");
  const int64_t dim = q_w.numel();
  TORCH_CHECK(x.dim() == 2 && q_w.dim() == 1 && k_w.sizes() == q_w.sizes() &&
                  (heads + kv_heads) * dim <= x.size(1),
              "expected x [T, W] holding heads + kv_heads heads of q_w's and k_w's width");
  norm_heads(x.data_ptr<float>(), x.size(0), x.size(1), q_w.data_ptr<float>(), k_w.data_ptr<float>(),
             heads, kv_heads, dim, eps);
}

void rotary_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
             int64_t head_dim) {
  check_f32(x, "x");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  const int64_t rows = x.size(0), width = x.size(1), half = head_dim / 2;
  TORCH_CHECK(x.dim() == 2 && heads * head_dim <= width && head_dim % 2 == 0,
              "expected x [T, W] holding `heads` heads of an even head_dim");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == rows * head_dim,
              "expected cos and sin [T, head_dim]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  spread(rows, grain(rows, heads * head_dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cp + r * head_dim;
      const float* s = sp + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = xp + r * width + h * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float a = v[i], b = v[i + half];
          v[i] = a * c[i] + b * s[i];
          v[i + half] = b * c[i + half] + a * s[i + half];
        }
      }
    }
  });
}

// One row of `silu_rows`: out [I] = silu(g) * u for x = [g | u] [2I].
inline void silu_row(const float* x, int64_t inner, float* out) {
  const float* u = x + inner;
  int64_t i = 0;
  for (; i + 8 <= inner; i += 8) {
    const __m256 gv = _mm256_loadu_ps(x + i);
    const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                            _mm256_loadu_ps(u + i)));
  }
  for (; i < inner; ++i) out[i] = x[i] / (1.f + std::exp(-x[i])) * u[i];
}

// out [T, I] = silu(g) * u for x = [g | u] [T, 2I], rows shared as `norm_rows` shares them.
void silu_rows(const float* x, int64_t rows, int64_t inner, float* out) {
  spread(rows, grain(rows, inner), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_row(x + r * 2 * inner, inner, out + r * inner);
  });
}

at::Tensor silu_mul(const at::Tensor& x) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "expected x [T, 2I]");
  auto out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  silu_rows(x.data_ptr<float>(), x.size(0), x.size(1) / 2, out.data_ptr<float>());
  return out;
}

}  // namespace

TORCH_LIBRARY(mstar_layer, m) {
  m.def("rms_norm(Tensor(a!) x, Tensor? delta, Tensor weight, float eps) -> Tensor");
  m.def(
      "head_norms_(Tensor(a!) x, Tensor q_w, Tensor k_w, int heads, int kv_heads, float eps)"
      " -> ()");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin, int heads, int head_dim) -> ()");
  m.def(
      "attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) layer, Tensor k_rows,"
      " Tensor v_rows, Tensor q_index, Tensor q_lens, Tensor kv_indptr, Tensor kv_indices,"
      " Tensor kv_lens, int heads, float scale) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_layer, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("head_norms_", head_norms_);
  m.impl("rotary_", rotary_);
  m.impl("attention", attention);
  m.impl("silu_mul", silu_mul);
}
