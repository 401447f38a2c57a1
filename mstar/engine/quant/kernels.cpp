// Linear layers on packed weights, float32 activations, AVX2 + FMA + F16C (and, for
// 1-4 rows, AVX-512 where the build has it).
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
// Up to GEMV_ROWS activation rows (decode) stream the weights once, converting them
// to float32 in registers. int4 at 2-4 rows reads 32 bytes (two groups) as eight
// 32-bit lanes and takes nibble i of every lane at once ((d >> 4i) & 15): no byte
// shuffles; the activations are permuted once per call to match (`permute_int4`).
// With AVX-512 they take `gemv_wide` instead: 16 lanes, the weights dequantized exactly.
// More rows (prefill, batched decode): 16 weight rows at a time (32 with AVX-512) are
// dequantized into a float32 panel, transposed ([K, 16], in L2), and every activation
// row is multiplied against it by a register-blocked kernel (6 rows x 16 outputs in 12
// accumulators, 6 x 32 with AVX-512; the activations broadcast, no horizontal sums).
// With AVX512-BF16 a layer may also hold its weights as bfloat16 panels (`bf16_linear`,
// below): its many-row products multiply in bfloat16, sums in float32.
// The work is handed out in pieces to the kernels' own threads (`Team`: as many as
// torch's, kept awake through a step), each taking the next piece as it finishes
// (`share`), so a core busy with something else does less of it.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t GEMV_ROWS = 4;         // most activation rows for the streaming path
#if defined(__AVX512F__)
constexpr int64_t PANEL_ROWS = 12;       // fewest activation rows for the panel path (measured)
#else
constexpr int64_t PANEL_ROWS = 48;
#endif
constexpr int64_t PIECE = 16384;         // weights per piece of GEMV work
constexpr int64_t PARALLEL_MIN = 1 << 18;  // fewer weights (x rows) than this: one thread

float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Room for n floats and at least one zero after them, a multiple of 8.
int64_t padded(int64_t n) { return (n + 8) / 8 * 8; }

// n float16 values as float32 into out[0..n), zeros after them to padded(n).
inline void to_float(const at::Half* h, int64_t n, float* out) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(out + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < n; ++j) out[j] = _cvtsh_ss(h[j].x);
  for (; j < padded(n); ++j) out[j] = 0.0f;
}

// The threads the kernels share their work with: the caller and torch's thread count less
// one helpers (fixed at first use), each helper awake (spinning) for SPIN after its last
// job before it sleeps. So the ~120 calls of a decode step wake a helper once, not once a
// call: torch's OpenMP threads, under OMP_WAIT_POLICY=PASSIVE, sleep after every parallel
// region, and waking one cost ~25 us a call here (a one-row GEMV's whole time).
class Team {
 public:
  static constexpr auto SPIN = std::chrono::microseconds(500);

  // This process's team, built anew in a forked child (the parent's helpers are not in
  // it) and when torch's thread count has grown past it (the old helpers sleep on).
  static Team& get() {
    static Team* team = nullptr;
    static std::mutex made;
    std::lock_guard<std::mutex> lock(made);
    if (team == nullptr || team->pid_ != getpid() || team->size_ < at::get_num_threads())
      team = new Team(std::max(1, at::get_num_threads()));  // lives as long as the process
    return *team;
  }

  int size() const { return size_; }

  // job(i) for i < threads (<= size()) at once, the caller running job(0); returns when all have.
  void run(int threads, const std::function<void(int)>& job) {
    std::lock_guard<std::mutex> one_at_a_time(running_);
    job_ = &job;
    threads_ = threads;
    pending_.store(size_ - 1, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mu_);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    cv_.notify_all();
    job(0);
    while (pending_.load(std::memory_order_acquire) != 0) _mm_pause();
  }

 private:
  explicit Team(int size) : size_(size), pid_(getpid()) {
    for (int i = 1; i < size; ++i) std::thread([this, i] { loop(i); }).detach();
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      const auto start = std::chrono::steady_clock::now();
      for (int spins = 0; epoch_.load(std::memory_order_acquire) == seen; ++spins) {
        std::this_thread::yield();  // a thread of torch's own (attention, prefill) may want this core
        if (spins % 16 == 0 && std::chrono::steady_clock::now() - start > SPIN) {
          std::unique_lock<std::mutex> lock(mu_);
          cv_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
        }
      }
      seen = epoch_.load(std::memory_order_acquire);
      if (index < threads_) (*job_)(index);
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  const int size_;
  const pid_t pid_;
  const std::function<void(int)>* job_ = nullptr;
  int threads_ = 1;
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> pending_{0};
  std::mutex mu_, running_;
  std::condition_variable cv_;
};

// Runs fn(i0, i1, thread) over [0, n) in pieces of `piece`, the team's threads (numbered
// from 0, the caller) taking the next piece as they finish; inline (thread 0) unless
// `parallel`.
template <typename F>
void share(int64_t n, int64_t piece, bool parallel, const F& fn) {
  if (!parallel || n <= piece || at::get_num_threads() == 1 || at::in_parallel_region()) {
    fn(int64_t{0}, n, 0);
    return;
  }
  Team& team = Team::get();
  std::atomic<int64_t> next{0};
  team.run(std::min(team.size(), at::get_num_threads()), [&](int thread) {
    for (int64_t i; (i = next.fetch_add(piece)) < n;) fn(i, std::min(n, i + piece), thread);
  });
}

// Threads `share` may use (scratch space for each).
int64_t team_threads() { return std::min<int64_t>(Team::get().size(), at::get_num_threads()); }

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

  // Group j of row n as 32 integers in float32, in their own order (four vectors).
  void load(int64_t n, int64_t j, __m256 v[4]) const {
    const uint8_t* p = q + (n * G + j) * 16;
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
  void load(int64_t n, int64_t j, __m256 v[4]) const {
    for (int i = 0; i < 4; ++i) v[i] = values(q + n * K + j * 32 + 8 * i);
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

// One activation row, each weight row streamed once in its own order, scale and min
// taken out of each group: out[n] = sum_j scale_j (x . q_j) + sum_j min_j xsum[j].
template <typename W>
void gemv1(const W& w, const float* x, const float* xsum, int64_t K, int64_t n0, int64_t n1,
           float* out) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < K / 32; ++j) {
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
    float s = 0;
    for (int k = 0; k < 32; ++k) s += x[j * 32 + k];
    sums[j] = s;
  }
  return sums;
}

#if defined(__AVX512F__)
// AVX-512 (built so where torch sees it, `cpp_build.flags`): 1-4 activation rows in
// their own order, each group of 32 weights dequantized into two 16-lane vectors
// exactly as `dequantize` does, and multiplied in place.

constexpr int64_t AHEAD_BYTES = 1024;  // how far ahead a row's stream of weights is asked for (measured)

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
    _mm_prefetch(reinterpret_cast<const char*>(w.q + (n * w.G + j) * 16 + AHEAD_BYTES), _MM_HINT_T0);
  }
  void group(int64_t n, int64_t j, __m512 v[2]) const {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i b = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q + (n * w.G + j) * 16)));
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
    _mm_prefetch(reinterpret_cast<const char*>(w.q + n * w.K + j * 32 + AHEAD_BYTES), _MM_HINT_T0);
  }
  void group(int64_t n, int64_t j, __m512 v[2]) const {
    const int8_t* p = w.q + n * w.K + j * 32;
    const __m512 sc = _mm512_set1_ps(s[j]);
    for (int h = 0; h < 2; ++h)
      v[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16 * h)))),
                           sc);
  }
};

// y[:, n0:n1] for ROWS activation rows [ROWS, K], two groups a step (four accumulators
// a row, so the additions of one row do not wait on each other).
template <int ROWS, typename Wide>
void gemv_wide(Wide& wide, const float* x, int64_t K, int64_t n0, int64_t n1, float* y, int64_t N) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    wide.row(n);
    __m512 acc[ROWS][4];
    for (int m = 0; m < ROWS; ++m)
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 2 <= G; j += 2) {
      __m512 v[4];
      wide.ahead(n, j);
      wide.group(n, j, v);
      wide.group(n, j + 1, v + 2);
#pragma GCC unroll 4
      for (int m = 0; m < ROWS; ++m)
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i)
          acc[m][i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + j * 32 + 16 * i), v[i], acc[m][i]);
    }
    if (j < G) {  // an odd last group
      __m512 v[2];
      wide.group(n, j, v);
      for (int m = 0; m < ROWS; ++m)
        for (int i = 0; i < 2; ++i)
          acc[m][i] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + j * 32 + 16 * i), v[i], acc[m][i]);
    }
    for (int m = 0; m < ROWS; ++m)
      y[m * N + n] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3])));
  }
}
#endif

#if defined(__AVX512F__)
template <typename W>
void streamed(const W& w, const float* x, int64_t M, int64_t N, int64_t K, float* y) {
  using Wide = std::conditional_t<std::is_same_v<W, Int4>, Int4Wide, Int8Wide>;
  const int64_t piece = std::max<int64_t>(4, (N / team_threads() + 3) / 4 * 4);
  share(N, piece, N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    Wide wide(w);
    switch (M) {
      case 1: return gemv_wide<1>(wide, x, K, n0, n1, y, N);
      case 2: return gemv_wide<2>(wide, x, K, n0, n1, y, N);
      case 3: return gemv_wide<3>(wide, x, K, n0, n1, y, N);
      default: return gemv_wide<4>(wide, x, K, n0, n1, y, N);
    }
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
  const int64_t piece = std::max<int64_t>(4, PIECE / K / 4 * 4);
  share(N, piece, N * K >= PARALLEL_MIN, [&](int64_t n0, int64_t n1, int) {
    switch (M) {
      case 1: return gemv<1>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      case 2: return gemv<2>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      case 3: return gemv<3>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
      default: return gemv<4>(w, x, xp.data(), xsum.data(), n0, n1, y, N);
    }
  });
}
#endif

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

// 5 to PANEL_ROWS - 1 activation rows: 4 weight rows at a time dequantized into a tile
// (row-major, no transpose: cheaper per weight than a panel, which more rows repay)
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
  switch (rows) {
    case 1: return micro<1>(x, panel, K, y, ldy);
    case 2: return micro<2>(x, panel, K, y, ldy);
    case 3: return micro<3>(x, panel, K, y, ldy);
    case 4: return micro<4>(x, panel, K, y, ldy);
    case 5: return micro<5>(x, panel, K, y, ldy);
    default: return micro<6>(x, panel, K, y, ldy);
  }
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
  switch (rows) {
    case 1: return micro_bf16<1>(x, panel, K, y, ldy);
    case 2: return micro_bf16<2>(x, panel, K, y, ldy);
    case 3: return micro_bf16<3>(x, panel, K, y, ldy);
    case 4: return micro_bf16<4>(x, panel, K, y, ldy);
    case 5: return micro_bf16<5>(x, panel, K, y, ldy);
    default: return micro_bf16<6>(x, panel, K, y, ldy);
  }
}

// y = x @ W.T for float32 x [..., K] and bfloat16 panels [N/32, K/2, 32, 2].
at::Tensor bf16_linear(const at::Tensor& x_in, const at::Tensor& panels) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "expected float32 activations, got ",
              x_in.scalar_type());
  TORCH_CHECK(panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() && panels.dim() == 4 &&
                  panels.size(2) == BF16_NB && panels.size(3) == 2,
              "expected contiguous bfloat16 panels [N/32, K/2, 32, 2], got ", panels.sizes());
  const int64_t K = panels.size(1) * 2, N = panels.size(0) * BF16_NB;
  TORCH_CHECK(x_in.size(-1) == K, "expected activations of width ", K, ", got ", x_in.size(-1));
  TORCH_CHECK(K % 32 == 0, "expected K % 32 == 0, got ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  std::vector<uint16_t> xb(M * K);  // whole 16-lane vectors: whole pairs of 16-lane vectors
  const float* xf = x.data_ptr<float>();
  for (int64_t i = 0; i < M * K; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xb.data() + i),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(xf + i)));
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  float* out = y.data_ptr<float>();
  share(panels.size(0), 1, N * K * M >= PARALLEL_MIN, [&](int64_t p0, int64_t p1, int) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t m = 0; m < M; m += ROWS_MAX)
        micro_bf16_rows(std::min<int64_t>(ROWS_MAX, M - m), xb.data() + m * K, w + p * K * BF16_NB,
                        K, out + m * N + p * BF16_NB, N);
  });
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}
#else
at::Tensor bf16_linear(const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "the kernels were built without AVX512-BF16 (this CPU's flags lack it)");
}
#endif

// y = x @ W.T for float32 x [..., K] and the N x K weights `w`.
template <typename W>
at::Tensor packed_linear(const at::Tensor& x_in, const W& w, int64_t N, int64_t K) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "expected float32 activations, got ",
              x_in.scalar_type());
  TORCH_CHECK(x_in.size(-1) == K, "expected activations of width ", K, ", got ", x_in.size(-1));
  TORCH_CHECK(N % 4 == 0 && K % 32 == 0, "expected N % 4 == 0 and K % 32 == 0, got ", N, ", ", K);
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t M = x.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M <= GEMV_ROWS) streamed(w, x.data_ptr<float>(), M, N, K, y.data_ptr<float>());
  else if (M < PANEL_ROWS) tiled(w, x.data_ptr<float>(), M, N, K, y.data_ptr<float>());
  else paneled(w, x.data_ptr<float>(), M, N, K, y.data_ptr<float>());
  auto sizes = x_in.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                       const at::Tensor& mins) {
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && mins.scalar_type() == at::kHalf, "bad scales");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous(), "expected contiguous scales");
  const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
  const Int4 w{qweight.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(),
               K, K / 32};
  return packed_linear(x, w, N, K);
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  TORCH_CHECK(qweight.scalar_type() == at::kChar && qweight.is_contiguous(), "bad qweight");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(), "bad scales");
  const int64_t N = qweight.size(0), K = qweight.size(1), group = K / scales.size(1);
  TORCH_CHECK(group % 32 == 0, "expected an int8 group size divisible by 32, got ", group);
  const Int8 w{qweight.data_ptr<int8_t>(), scales.data_ptr<at::Half>(), K, scales.size(1), group};
  return packed_linear(x, w, N, K);
}

}  // namespace

TORCH_LIBRARY(mstar_quant, m) {
  m.def("int4_linear(Tensor x, Tensor qweight, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor qweight, Tensor scales) -> Tensor");
  m.def("bf16_linear(Tensor x, Tensor panels) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_quant, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
  m.impl("bf16_linear", &bf16_linear);
}
