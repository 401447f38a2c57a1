// The layer ops' attention (`attention`, registered in layer_ops.cpp, which includes this
// after the helpers it shares: `exp8`, `spread`, `grain`, `check_f32`). From the q/k/v GEMM's
// output: rotary applied to q and k, the step's new keys and values written into the layer's
// pages (float32, or bfloat16: rounded to nearest even there, read back exactly; rows k_rows /
// v_rows of the layer seen as [P * 2 * S, H_kv * D], what KVCache.write_rows gives), then
// each row's queries over that row's pages, causal (a row's i-th of n queries sees all but
// its last n - 1 - i keys), softmax in float32; query heads h read KV head h / (H / H_kv).
// A query at a time: what a decode step or a short prefill needs (long prompts go to SDPA's
// blocked kernel instead: mstar/models/llama/attention.py); fewer queries than threads: each query's keys
// in parts, merged by their softmax sums.
#pragma once

namespace {

// Keys in a block of `key_scores` (a vector of scores), and the rows of scores it fills: len
// rounded up to whole blocks.
constexpr int64_t BLOCK = 8;
inline int64_t blocks(int64_t len) { return (len + BLOCK - 1) / BLOCK * BLOCK; }

// A KV cache's element: float32, or bfloat16 held as its bits (`Bf16`): the float32 value
// of one (exact), and a float32 value made one (bfloat16: rounded to nearest even).
using Bf16 = uint16_t;
inline float f32(float x) { return x; }
inline float f32(Bf16 b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
template <typename T>
inline T cached(float x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return c10::BFloat16(x).x;
}

// Keys and values ahead of the one being read that are asked of memory now (`key_scores`
// asks for a block's eight at once): a row's keys lie a slot apart in pages anywhere in
// the cache, read from DRAM once the caches outgrow L3 (further ahead measured no faster).
constexpr int64_t AHEAD = 4;

// The cache lines of n elements at p, asked for into L2 (a hint: p may lie past a page's end;
// into L1 instead, attention from memory ran 1.14-1.22x slower on Zen 4 at 401-2049 keys).
template <typename T>
inline void prefetch(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / sizeof(T))
    _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T1);
}

// The pages of the task a thread likely takes next (its keys' and values' blocks), asked for
// into L2 a few cache lines at a time (`drip`, from the passes over the keys and values of
// the task at hand): a layer's pages are in DRAM by the next step (the weights streamed in
// between evict them), and a task's first pass over them would otherwise wait on them.
struct NextPages {
  std::vector<const char*> blocks;
  int64_t bytes = 0;        // of each block
  int64_t rate = 0;         // lines a `drip`
  size_t block = 0;         // the next line asked for: blocks[block] + at
  int64_t at = 0;

  int64_t lines() const { return static_cast<int64_t>(blocks.size()) * ((bytes + 63) / 64); }
  void drip() {
    for (int64_t n = 0; n < rate && block < blocks.size(); ++n) {
      _mm_prefetch(blocks[block] + at, _MM_HINT_T1);
      if ((at += 64) >= bytes) at = 0, ++block;
    }
  }
};

// The vector ops of attention: eight lanes (AVX2), or sixteen (`Lanes16`, AVX-512 builds,
// for heads of a whole number of 16 floats: half the instructions a key). Within each
// 128-bit lane, `pairs` adds two vectors' lanes pairwise, interleaved ([a0+a2, b0+b2, a1+a3,
// b1+b3]), `quads` two such ([a, b, c, d] partial sums); `lanes` adds the 128-bit lanes.
struct Lanes8 {
  using V = __m256;
  static constexpr int N = 8;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const Bf16* p) {  // eight bfloat16 as float32 (exact: the bits shifted up)
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  }
  static void halves(const Bf16* p, V& even, V& odd) {  // 16 bfloat16: 0, 2, ... and 1, 3, ...
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    even = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32(-65536)));
  }
  static void store_pairs(float* p, V even, V odd) {  // halves' order undone
    const V lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V pairs(V a, V b) { return add(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b)); }
  static V quads(V a, V b) {
    return add(_mm256_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
               _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  static __m256 lanes(V a, V b) {  // [a's two 128-bit lanes added, b's]
    return add(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
};

#if defined(__AVX512F__)
struct Lanes16 {
  using V = __m512;
  static constexpr int N = 16;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const Bf16* p) {
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
  }
  static void halves(const Bf16* p, V& even, V& odd) {
    const __m512i b = _mm512_loadu_si512(p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(-65536)));
  }
  static void store_pairs(float* p, V even, V odd) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    _mm512_storeu_ps(p, _mm512_permutex2var_ps(even, lo, odd));
    _mm512_storeu_ps(p + 16, _mm512_permutex2var_ps(even, hi, odd));
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V pairs(V a, V b) { return add(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)); }
  static V quads(V a, V b) {
    return add(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
               _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  static __m256 lanes(V a, V b) {  // [a's four 128-bit lanes added, b's]
    const V w = add(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                    _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));  // [a0+a2, a1+a3, b0+b2, b1+b3]
    return _mm256_add_ps(_mm512_castps512_ps256(_mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(2, 0, 2, 0))),
                         _mm512_castps512_ps256(_mm512_shuffle_f32x4(w, w, _MM_SHUFFLE(3, 1, 3, 1))));
  }
};
using Wide = Lanes16;  // the widest lanes of this build
#else
using Wide = Lanes8;
#endif

// [sum(v[0]), ..., sum(v[7])]: pairs, then quads within each 128-bit lane (keys 0-3 in the
// first vector's lanes, 4-7 in the second's), then the lanes.
template <typename L>
__m256 sums8(const typename L::V* v) {
  return L::lanes(L::quads(L::pairs(v[0], v[1]), L::pairs(v[2], v[3])),
                  L::quads(L::pairs(v[4], v[5]), L::pairs(v[6], v[7])));
}

// A bfloat16 head is read 2N elements at a time as two float32 vectors, its even elements and
// its odd ones (`halves`: a shift and a mask, no widening shuffle); q [dim] made to match:
// each whole run of 2N floats in that order into `split` (the rest as it is).
template <typename L>
const float* in_halves(const float* q, int64_t dim, std::vector<float>& split) {
  split.assign(q, q + dim);
  for (int64_t c = 0; c + 2 * L::N <= dim; c += 2 * L::N)
    for (int j = 0; j < L::N; ++j) {
      split[c + j] = q[c + 2 * j];
      split[c + L::N + j] = q[c + 2 * j + 1];
    }
  return split.data();
}

// out[l] = sc * (q . key l) for the keys at key[l] (dim floats each), eight keys at a time
// (their sums as one vector: `sums8`), -inf past len to blocks(len); the `ahead` elements at
// the keys AHEAD on asked for too. Bfloat16 keys: q `in_halves`' order. (One query head a
// pass: reading each key once for the heads that share it, two or three a pass, measured
// 5-10% slower on Zen 4.)
template <typename L, typename T>
void key_scores(const float* q, const T* const* key, int64_t len, int64_t dim, float sc,
                int64_t ahead, float* out, NextPages* next) {
  const __m256 scale = _mm256_set1_ps(sc);
  for (int64_t l = 0; l < len; l += BLOCK) {
    if (next != nullptr) next->drip();
    for (int64_t j = l + AHEAD; j < std::min(l + AHEAD + BLOCK, len); ++j) prefetch(key[j], ahead);
    const T* k[BLOCK];  // the last block's missing keys: its last key again
    for (int j = 0; j < BLOCK; ++j) k[j] = key[std::min(l + j, len - 1)];
    typename L::V a[BLOCK];
    for (auto& v : a) v = L::zero();
    int64_t i = 0;
    if constexpr (std::is_same_v<T, Bf16>) {
      for (; i + 2 * L::N <= dim; i += 2 * L::N) {
        const typename L::V even = L::load(q + i), odd = L::load(q + i + L::N);
        for (int j = 0; j < BLOCK; ++j) {
          typename L::V ke, ko;
          L::halves(k[j] + i, ke, ko);
          a[j] = L::fma(even, ke, L::fma(odd, ko, a[j]));
        }
      }
    }
    for (; i + L::N <= dim; i += L::N) {
      const typename L::V qv = L::load(q + i);
      for (int j = 0; j < BLOCK; ++j) a[j] = L::fma(qv, L::load(k[j] + i), a[j]);
    }
    alignas(32) float t[BLOCK];
    _mm256_store_ps(t, _mm256_mul_ps(sums8<L>(a), scale));
    for (int64_t d = i; d < dim; ++d)  // a head width of no whole N floats: the rest one by one
      for (int j = 0; j < BLOCK; ++j) t[j] += sc * q[d] * f32(k[j][d]);
    for (int64_t j = len - l; j < BLOCK; ++j) t[j] = -INFINITY;
    std::copy_n(t, BLOCK, out + l);
  }
}

// A softmax's scale: the scores' largest and the sum of e^(score - largest).
struct Softmax {
  float peak, total;
};

// s[0..blocks(len)) = e^(s - max s), eight at a time, zeros past len (where s is -inf). A
// NaN score is passed over by the max (as `s > peak ? s : peak` does) and stays NaN.
Softmax exp_scores(float* s, int64_t len) {
  __m256 top = _mm256_set1_ps(-INFINITY);
  for (int64_t l = 0; l < len; l += BLOCK) top = _mm256_max_ps(_mm256_loadu_ps(s + l), top);
  alignas(32) float tops[8];
  _mm256_store_ps(tops, top);
  float peak = -INFINITY;
  for (const float t : tops) peak = t > peak ? t : peak;
  const __m256 shift = _mm256_set1_ps(peak);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t l = 0; l < len; l += BLOCK) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + l), shift));
    if (len - l < BLOCK)  // exp8 of -inf is ~1e-38, not 0
      e = _mm256_and_ps(e, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(len - l), lane)));
    _mm256_storeu_ps(s + l, e);
    sums = _mm256_add_ps(sums, e);
  }
  return {peak, hsum(sums)};
}

// Query heads whose weighted values one pass of `weighted_values` sums: as many as keep
// their 64 floats of sums in registers (four heads of four AVX-512 vectors; one of eight
// AVX2 vectors: AVX2 has 16 registers).
template <typename L>
constexpr int VALUE_HEADS = L::N == 16 ? 4 : 1;

// For G query heads g (their scores p + g * ps, e^(score - peak) over len keys):
// o[g * dim .. (g + 1) * dim) = inv[g] * sum_l p[l] * (value l at value[l] + off), 64 floats
// at a time in registers, each value read once for the G heads (bfloat16 values: as
// `halves` reads them, put back in order as stored); the `ahead` elements at the value
// AHEAD on asked for too.
template <typename L, typename T, int G>
void weighted_values(const float* p, int64_t ps, const float* inv, const T* const* value,
                     int64_t off, int64_t len, int64_t dim, int64_t ahead, float* o,
                     NextPages* next) {
  constexpr int K = 64 / L::N;
  using V = typename L::V;
  int64_t i = 0;
  for (; i + 64 <= dim; i += 64) {
    V a[G][K];
    for (auto& head : a)
      for (auto& v : head) v = L::zero();
    for (int64_t l = 0; l < len; ++l) {
      if (ahead > 0 && l + AHEAD < len) prefetch(value[l + AHEAD] + off, ahead);
      if (next != nullptr && l % BLOCK == 0) next->drip();
      V pl[G];
      for (int g = 0; g < G; ++g) pl[g] = L::set1(p[g * ps + l]);
      const T* v = value[l] + off + i;
      if constexpr (std::is_same_v<T, Bf16>) {
        for (int k = 0; k < K; k += 2) {
          V even, odd;
          L::halves(v + L::N * k, even, odd);
          for (int g = 0; g < G; ++g) {
            a[g][k] = L::fma(pl[g], even, a[g][k]);
            a[g][k + 1] = L::fma(pl[g], odd, a[g][k + 1]);
          }
        }
      } else {
        for (int k = 0; k < K; ++k) {
          const V x = L::load(v + L::N * k);
          for (int g = 0; g < G; ++g) a[g][k] = L::fma(pl[g], x, a[g][k]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const V scale = L::set1(inv[g]);
      float* out = o + g * dim + i;
      if constexpr (std::is_same_v<T, Bf16>) {
        for (int k = 0; k < K; k += 2)
          L::store_pairs(out + L::N * k, L::mul(a[g][k], scale), L::mul(a[g][k + 1], scale));
      } else {
        for (int k = 0; k < K; ++k) L::store(out + L::N * k, L::mul(a[g][k], scale));
      }
    }
    ahead = 0;
  }
  for (; i < dim; ++i)
    for (int g = 0; g < G; ++g) {
      float sum = 0.f;
      for (int64_t l = 0; l < len; ++l) sum += p[g * ps + l] * f32(value[l][off + i]);
      o[g * dim + i] = sum * inv[g];
    }
}

// The `group` query heads q + h * qs of one KV head over its len keys (`slots`; values
// `off` floats after each key): each head's scaled scores into its row of `scores` [group,
// blocks(len)] and their softmax, then the weighted values into o + h * dim,
// `VALUE_HEADS` heads a pass. With `part` (a part of the keys, to be merged:
// `merge_parts`), the values are left unnormalized and head h's softmax scale is part[h].
template <typename L, typename T>
void attend(const float* q, int64_t qs, int64_t group, const T* const* slots, int64_t len,
            int64_t dim, float sc, int64_t off, int64_t ahead, float* scores, float* o,
            Softmax* part, NextPages* next) {
  std::vector<float> split;  // a head's query in `in_halves`' order, for bfloat16 keys
  std::vector<float> inv(group);  // each head's values' scale
  const int64_t ps = blocks(len);
  for (int64_t h = 0; h < group; ++h) {
    const float* qh = q + h * qs;
    if constexpr (std::is_same_v<T, Bf16>) qh = in_halves<L>(qh, dim, split);
    key_scores<L, T>(qh, slots, len, dim, sc, h == 0 ? ahead : 0, scores + h * ps, next);
    const Softmax m = exp_scores(scores + h * ps, len);
    if (part != nullptr) part[h] = m;
    inv[h] = part != nullptr ? 1.f : 1.f / m.total;
  }
  for (int64_t h = 0; h < group; h += VALUE_HEADS<L>, ahead = 0) {
    const float* p = scores + h * ps;
    const float* i = inv.data() + h;
    float* out = o + h * dim;
    if constexpr (VALUE_HEADS<L> == 1) {
      weighted_values<L, T, 1>(p, ps, i, slots, off, len, dim, ahead, out, next);
    } else {
      switch (std::min<int64_t>(VALUE_HEADS<L>, group - h)) {
        case 1: weighted_values<L, T, 1>(p, ps, i, slots, off, len, dim, ahead, out, next); break;
        case 2: weighted_values<L, T, 2>(p, ps, i, slots, off, len, dim, ahead, out, next); break;
        case 3: weighted_values<L, T, 3>(p, ps, i, slots, off, len, dim, ahead, out, next); break;
        default: weighted_values<L, T, 4>(p, ps, i, slots, off, len, dim, ahead, out, next);
      }
    }
  }
}

// o[h] (dim floats) = the softmax over all n parts' keys for each of `heads` heads, from
// each part's unnormalized values (values[i * heads + h]) and softmax scale (parts[i *
// heads + h]): each part weighed by e^(its peak - the largest peak).
void merge_parts(const float* values, const Softmax* parts, int64_t n, int64_t heads,
                 int64_t dim, float* o) {
  for (int64_t h = 0; h < heads; ++h) {
    float peak = -INFINITY, total = 0.f;
    for (int64_t i = 0; i < n; ++i) peak = std::max(peak, parts[i * heads + h].peak);
    float* out = o + h * dim;
    std::fill_n(out, dim, 0.f);
    for (int64_t i = 0; i < n; ++i) {
      const Softmax& m = parts[i * heads + h];
      const float w = std::exp(m.peak - peak);
      total += w * m.total;
      const float* v = values + (i * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) out[d] += w * v[d];
    }
    for (int64_t d = 0; d < dim; ++d) out[d] /= total;
  }
}

// One step's attention in every layer (the layers share the step's rows and pages): built
// once a step from the rows, checked here; then a layer at a time (`operator()`), in three
// phases any threads can share: the tokens' q and k rotated, k and v written into the
// layer (`write`); the tasks, a query each or, when there are fewer queries than threads
// to keep busy, each query's keys in parts (`attend`); those parts merged by their
// softmax scales (`merge`).
// rows: per row r, its q_lens[r] query tokens from q_index[r] on (none: 0, q_index -1),
// its pages kv_indices[kv_indptr[r]:kv_indptr[r+1]] holding kv_lens[r] keys in order, the
// step's own (written into rows k_rows / v_rows of the layer seen as [P * 2 * S, H_kv *
// D]) last. Every token is one row's query. T: the layer's elements (float32, or
// bfloat16's bits). gang: the threads of the `Gang` its phases run in (1: none; the
// team's where the work repays waking them).
template <typename T>
class AttentionStep {
 public:
  AttentionStep(const at::Tensor& layer, int64_t tokens, const at::Tensor& k_rows,
                const at::Tensor& v_rows, const at::Tensor& q_index, const at::Tensor& q_lens,
                const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                const at::Tensor& kv_lens, int64_t heads, double scale, int64_t gang = 1)
      : tokens_(tokens), heads_(heads), sc_(static_cast<float>(scale)) {
    TORCH_CHECK(layer.dim() == 5 && layer.size(1) == 2 && layer.size(4) % 2 == 0,
                "expected layer [P, 2, S, H_kv, D], D even");
    pages_ = layer.size(0), page_ = layer.size(2), kv_heads_ = layer.size(3), dim_ = layer.size(4);
    TORCH_CHECK(heads % kv_heads_ == 0, "expected H a multiple of H_kv");
    group_ = heads / kv_heads_;
    slot_ = kv_heads_ * dim_, half_page_ = page_ * slot_;
    for (const auto* t : {&k_rows, &v_rows, &q_index, &q_lens, &kv_indptr, &kv_indices, &kv_lens}) {
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "expected int64 indices");
    }
    TORCH_CHECK(k_rows.numel() == tokens && v_rows.numel() == tokens, "expected int64 write rows, one per token");
    kr_ = k_rows.data_ptr<int64_t>(), vr_ = v_rows.data_ptr<int64_t>();
    const int64_t num_rows = pages_ * 2 * page_;
    for (int64_t t = 0; t < tokens; ++t) {
      TORCH_CHECK(kr_[t] >= 0 && kr_[t] < num_rows && vr_[t] >= 0 && vr_[t] < num_rows,
                  "write row out of the layer");
    }
    const int64_t rows = kv_lens.size(0);
    TORCH_CHECK(q_index.numel() == rows && q_lens.numel() == rows && kv_indptr.numel() == rows + 1,
                "expected q_index, q_lens [R], kv_indptr [R + 1] for kv_lens [R]");
    indptr_ = kv_indptr.data_ptr<int64_t>(), indices_ = kv_indices.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; ++r) {
      TORCH_CHECK(indptr_[r] >= 0 && indptr_[r] <= indptr_[r + 1] && indptr_[r + 1] <= kv_indices.numel(),
                  "row ", r, ": expected its pages within kv_indices, got ", indptr_[r], "..", indptr_[r + 1]);
    }
    for (int64_t i = 0; i < kv_indices.numel(); ++i) {
      TORCH_CHECK(indices_[i] >= 0 && indices_[i] < pages_, "page id ", indices_[i], " out of the layer");
    }
    qi_ = q_index.data_ptr<int64_t>(), ql_ = q_lens.data_ptr<int64_t>(), lens_ = kv_lens.data_ptr<int64_t>();
    q_row_.reserve(tokens);
    q_at_.reserve(tokens);
    int64_t keys = 0;  // the (query, key) pairs of the step
    for (int64_t r = 0; r < rows; ++r) {
      const bool placed = ql_[r] == 0 || (qi_[r] >= 0 && qi_[r] + ql_[r] <= tokens);
      TORCH_CHECK(ql_[r] >= 0 && ql_[r] <= lens_[r] && placed, "row ", r,
                  ": expected its queries among qkv's tokens and its keys, got ", ql_[r], " from ",
                  qi_[r], " over ", lens_[r], " keys");
      const int64_t pages = (lens_[r] + page_ - 1) / page_;
      TORCH_CHECK(pages <= indptr_[r + 1] - indptr_[r], "row ", r, ": expected pages for its ",
                  lens_[r], " keys, got ", indptr_[r + 1] - indptr_[r]);
      for (int64_t i = 0; i < ql_[r]; ++i) {
        q_row_.push_back(r);
        q_at_.push_back(i);
        keys += lens_[r] - ql_[r] + i + 1;
      }
    }
    TORCH_CHECK(static_cast<int64_t>(q_row_.size()) == tokens, "expected every token a row's query,",
                " got ", q_row_.size(), " queries for ", tokens, " tokens");
    const int64_t work = keys * heads * dim_ * 2;  // multiply-adds: scores and values
    // the tasks: with fewer queries than twice the kernels' threads, each query's keys in
    // parts of a page or more (a thread's next part's pages asked for while it reads one: a
    // layer's keys come from DRAM), whoever runs them (a gang or the team: the same sums)
    const int64_t team = gang > 1 ? gang : team_threads();
    few_ = team > 1 && tokens < 2 * team;
    first_.assign(tokens + 1, 0);  // query k's parts: first_[k] .. first_[k + 1]
    for (int64_t k = 0; k < tokens; ++k) {
      const int64_t pages = (len_of(k) + page_ - 1) / page_;
      first_[k + 1] = first_[k] + (few_ ? std::clamp<int64_t>(pages, 1, 4 * team) : 1);
    }
    tasks_ = first_[tokens];
    // the threads they are spread over: a gang's (`gang` > 1), awake anyway, a task a
    // piece; else the team's where the work repays waking it (`grain`), else the caller's
    threads_ = gang > 1 ? gang : threaded(work) ? team : 1;
    grain_ = gang > 1 ? 1 : grain(tasks_, work / std::max<int64_t>(tasks_, 1));
    values_.resize(few_ ? tasks_ * heads * dim_ : 0);
    scales_.resize(few_ ? tasks_ * heads : 0);
    head_ = dim_ % Wide::N == 0 ? &attend<Wide, T> : &attend<Lanes8, T>;
  }

  // Checks one layer's qkv [T, (H + 2 H_kv) D], cos and sin [T, D] (as rotary_'s) and layer
  // (the first's shape).
  void check(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& layer) const {
    check_f32(qkv, "qkv");
    check_f32(cos, "cos");
    check_f32(sin, "sin");
    TORCH_CHECK(qkv.dim() == 2 && qkv.size(0) == tokens_ && qkv.size(1) == (heads_ + 2 * kv_heads_) * dim_,
                "expected qkv [T, (H + 2 H_kv) * D] of the layer's heads");
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == tokens_ * dim_, "expected cos and sin [T, D]");
    TORCH_CHECK(layer.dim() == 5 && layer.size(0) == pages_ && layer.size(1) == 2 && layer.size(2) == page_ &&
                    layer.size(3) == kv_heads_ && layer.size(4) == dim_,
                "expected every layer [P, 2, S, H_kv, D] as the first");
  }

  // One layer's attention over `layer` from its qkv: out [T, H * D] (q [T, H, D]: room for
  // the rotated queries). Within a gang, each phase shared by its threads.
  void operator()(const float* qkv, const float* cos, const float* sin, T* layer, float* q, float* out) {
    share(tokens_, std::max<int64_t>(tokens_, 1), false, [&](int64_t t0, int64_t t1, int) {
      write(qkv, cos, sin, layer, q, t0, t1);
    });
    share(tasks_, grain_, threads_ > 1 && tasks_ > grain_, [&](int64_t i0, int64_t i1, int) {
      attend_tasks(layer, q, out, i0, i1);
    });
    if (few_) {
      share(tokens_, std::max<int64_t>(tokens_, 1), false, [&](int64_t k0, int64_t k1, int) {
        for (int64_t k = k0; k < k1; ++k)
          if (parts_of(k) > 1)
            merge_parts(values_.data() + first_[k] * heads_ * dim_, scales_.data() + first_[k] * heads_,
                        parts_of(k), heads_, dim_, out + token_of(k) * heads_ * dim_);
      });
    }
  }

 private:
  // query k's token in qkv and out, the keys it sees (its row's, causal), its parts
  int64_t token_of(int64_t k) const { return qi_[q_row_[k]] + q_at_[k]; }
  int64_t len_of(int64_t k) const { return lens_[q_row_[k]] - ql_[q_row_[k]] + q_at_[k] + 1; }
  int64_t parts_of(int64_t k) const { return first_[k + 1] - first_[k]; }

  // Tokens [t0, t1) of qkv: K heads rotated into their write rows, V heads into theirs (as
  // the layer's elements: `cached`), Q heads rotated into q.
  void write(const float* qkv, const float* cos, const float* sin, T* layer, float* q, int64_t t0, int64_t t1) const {
    const int64_t half = dim_ / 2, width = (heads_ + 2 * kv_heads_) * dim_;
    std::vector<float> key(dim_);  // a K head rotated, before it is stored
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = qkv + t * width;
      const float* c = cos + t * dim_;
      const float* s = sin + t * dim_;
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        const float* x = row + h * dim_;
        float* o = h < heads_ ? q + (t * heads_ + h) * dim_ : key.data();
        for (int64_t i = 0; i < half; ++i) {
          o[i] = x[i] * c[i] + x[i + half] * s[i];
          o[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        if (h >= heads_) std::transform(o, o + dim_, layer + kr_[t] * slot_ + (h - heads_) * dim_, cached<T>);
      }
      const float* v = row + (heads_ + kv_heads_) * dim_;
      std::transform(v, v + slot_, layer + vr_[t] * slot_, cached<T>);
    }
  }

  // Task i: its query and keys [l0, l1) (l0 on a page's start).
  void task(int64_t i, int64_t& k, int64_t& l0, int64_t& l1) const {
    k = std::upper_bound(first_.begin(), first_.end(), i) - first_.begin() - 1;
    const int64_t n = parts_of(k), at = i - first_[k], len = len_of(k);
    const int64_t pages = (len + page_ - 1) / page_;
    l0 = pages * at / n * page_;
    l1 = std::min(len, pages * (at + 1) / n * page_);
  }

  // The blocks of query k's pages holding keys [l0, l1) into next, to be asked for over
  // the `calls` drips of a task.
  void pages_of(const T* layer, int64_t k, int64_t l0, int64_t l1, int64_t calls, NextPages& next) const {
    next.blocks.clear();
    next.block = 0;
    next.at = 0;
    next.bytes = half_page_ * static_cast<int64_t>(sizeof(T));
    const int64_t row = indptr_[q_row_[k]];
    for (int64_t j = row + l0 / page_; j < row + (l1 + page_ - 1) / page_; ++j) {
      const char* base = reinterpret_cast<const char*>(layer + indices_[j] * 2 * half_page_);
      next.blocks.push_back(base);
      next.blocks.push_back(base + next.bytes);
    }
    next.rate = (next.lines() + calls - 1) / std::max<int64_t>(calls, 1);
  }

  // Tasks [begin, end) (a thread's piece), each writing its query's output (or, for a part
  // of its keys, its part's unnormalized values and softmax scales); the task the thread
  // likely takes next (the next in the piece, or the first of its next piece: the threads
  // take pieces of one size in turn) has its pages asked for meanwhile.
  void attend_tasks(const T* layer, const float* q, float* out, int64_t begin, int64_t end) {
    std::vector<float> scores;    // [group, blocks(len)]
    std::vector<const T*> slots;  // [len]: each key's slot at one KV head
    NextPages next;
    for (int64_t i = begin; i < end; ++i) {
      int64_t k, l0, l1, nk, n0, n1;
      task(i, k, l0, l1);
      const int64_t ni = i + 1 < end ? i + 1 : end + (end - begin) * (threads_ - 1);
      if (ni < tasks_) {
        task(ni, nk, n0, n1);
        // the drips of a task over keys [l0, l1): a block of keys' each query head's
        // scores and each KV head's values (a pass for its query heads where VALUE_HEADS holds them)
        pages_of(layer, nk, n0, n1, (heads_ + kv_heads_) * (blocks(l1 - l0) / BLOCK), next);
      }
      const bool whole = parts_of(k) == 1;
      float* o = whole ? out + token_of(k) * heads_ * dim_ : values_.data() + i * heads_ * dim_;
      Softmax* part = whole ? nullptr : scales_.data() + i * heads_;
      const int64_t r = q_row_[k], t = token_of(k), len = l1 - l0;
      scores.resize(group_ * blocks(len));
      slots.resize(len);
      for (int64_t kh = 0; kh < kv_heads_; ++kh) {
        // the keys at KV head kh, page by page (no division a key)
        for (int64_t l = 0, j = indptr_[r] + l0 / page_; l < len; ++j) {
          const T* base = layer + indices_[j] * 2 * half_page_ + kh * dim_;
          for (const int64_t e = std::min(len, l + page_); l < e; ++l, base += slot_) slots[l] = base;
        }
        const int64_t ahead = kh == 0 ? slot_ : 0;  // the first pass asks for the whole slots
        head_(q + (t * heads_ + kh * group_) * dim_, dim_, group_, slots.data(), len, dim_, sc_, half_page_,
              ahead, scores.data(), o + kh * group_ * dim_, part == nullptr ? nullptr : part + kh * group_,
              ni < tasks_ ? &next : nullptr);
      }
    }
  }

  int64_t tokens_, heads_, pages_, page_, kv_heads_, dim_, group_, slot_, half_page_;
  float sc_;
  const int64_t *kr_, *vr_, *qi_, *ql_, *lens_, *indptr_, *indices_;
  std::vector<int64_t> q_row_, q_at_;  // each query as (row, its index in the row)
  int64_t threads_, tasks_, grain_;
  bool few_;                        // queries' keys in parts
  std::vector<int64_t> first_;     // query k's tasks: first_[k] .. first_[k + 1]
  std::vector<float> values_;      // a part's unnormalized values [tasks, H, D]
  std::vector<Softmax> scales_;    // and softmax scales [tasks, H]
  void (*head_)(const float*, int64_t, int64_t, const T* const*, int64_t, int64_t, float, int64_t,
                int64_t, float*, float*, Softmax*, NextPages*);
};

// The attention of one layer (qkv [T, (H + 2 H_kv) D], rotary applied here: cos, sin [T,
// D] as rotary_'s; layer [P, 2, S, H_kv, D]; the rows as `AttentionStep`'s): [T, H * D].
template <typename T>
at::Tensor attention_over(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor layer, const at::Tensor& k_rows, const at::Tensor& v_rows,
                          const at::Tensor& q_index, const at::Tensor& q_lens,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                          const at::Tensor& kv_lens, int64_t heads, double scale) {
  AttentionStep<T> step(layer, qkv.size(0), k_rows, v_rows, q_index, q_lens, kv_indptr, kv_indices,
                        kv_lens, heads, scale);
  step.check(qkv, cos, sin, layer);
  const int64_t dim = layer.size(4);
  auto q = at::empty({qkv.size(0), heads, dim}, qkv.options());
  auto out = at::empty({qkv.size(0), heads * dim}, qkv.options());
  step(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), static_cast<T*>(layer.data_ptr()),
       q.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// attention_over for the layer's elements: float32 or bfloat16.
at::Tensor attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor layer, const at::Tensor& k_rows, const at::Tensor& v_rows,
                     const at::Tensor& q_index, const at::Tensor& q_lens,
                     const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                     const at::Tensor& kv_lens, int64_t heads, double scale) {
  const bool bf16 = layer.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || layer.scalar_type() == at::kFloat) && layer.device().is_cpu(),
              "layer: expected a float32 or bfloat16 CPU tensor, got ", layer.scalar_type(),
              " on ", layer.device());
  TORCH_CHECK(layer.is_contiguous(), "layer: expected a contiguous tensor");
  const auto over = bf16 ? &attention_over<Bf16> : &attention_over<float>;
  return over(qkv, cos, sin, layer, k_rows, v_rows, q_index, q_lens, kv_indptr, kv_indices,
              kv_lens, heads, scale);
}

}  // namespace
