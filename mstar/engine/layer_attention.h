// The layer ops' attention (`attention`, registered in layer_ops.cpp, which includes this
// after the helpers it shares: `exp8`, `spread`, `grain`, `check_f32`). From the q/k/v GEMM's
// output: rotary applied to q and k, the step's new keys and values written into the layer's
// pages (float32, or bfloat16: rounded to nearest even there, read back exactly; rows k_rows /
// v_rows of the layer seen as [P * 2 * S, H_kv * D], what KVCache.write_rows gives), then
// each row's queries over that row's pages, causal (a row's i-th of n queries sees all but
// its last n - 1 - i keys), softmax in float32; query heads h read KV head h / (H / H_kv).
// A query at a time: what a decode step or a short prefill needs (long prompts go to SDPA's
// blocked kernel instead: step_attention.py); fewer queries than threads: each query's keys
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

// Row t of qkv [T, (H + 2 H_kv) D]: its K heads rotated into row k_rows[t] of the layer
// seen as [P * 2 * S, H_kv * D], its V heads into row v_rows[t] (both as the layer's
// elements T: `cached`), its Q heads rotated into q[t] ([T, H, D]).
template <typename T>
void rotate_write(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  at::Tensor& layer, const at::Tensor& k_rows, const at::Tensor& v_rows,
                  at::Tensor& q, int64_t heads) {
  const int64_t tokens = qkv.size(0), kv_heads = layer.size(3), dim = layer.size(4);
  const int64_t half = dim / 2, slot = kv_heads * dim, num_rows = layer.numel() / slot;
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "expected qkv [T, (H + 2 H_kv) * D] of the layer's heads");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == tokens * dim,
              "expected cos and sin [T, D]");
  TORCH_CHECK(k_rows.numel() == tokens && v_rows.numel() == tokens &&
                  k_rows.scalar_type() == at::kLong && v_rows.scalar_type() == at::kLong,
              "expected int64 write rows, one per token");
  T* lp = static_cast<T*>(layer.data_ptr());
  float* qp = q.data_ptr<float>();
  const float* xp = qkv.data_ptr<float>();
  std::vector<float> key(dim);  // a K head rotated, before it is stored
  const int64_t* kr = k_rows.data_ptr<int64_t>();
  const int64_t* vr = v_rows.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(kr[t] >= 0 && kr[t] < num_rows && vr[t] >= 0 && vr[t] < num_rows,
                "write row out of the layer");
    const float* row = xp + t * qkv.size(1);
    const float* c = cos.data_ptr<float>() + t * dim;
    const float* s = sin.data_ptr<float>() + t * dim;
    for (int64_t h = 0; h < heads + kv_heads; ++h) {
      const float* x = row + h * dim;
      float* out = h < heads ? qp + (t * heads + h) * dim : key.data();
      for (int64_t i = 0; i < half; ++i) {
        out[i] = x[i] * c[i] + x[i + half] * s[i];
        out[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
      }
      if (h >= heads) std::transform(out, out + dim, lp + kr[t] * slot + (h - heads) * dim, cached<T>);
    }
    const float* v = row + (heads + kv_heads) * dim;
    std::transform(v, v + slot, lp + vr[t] * slot, cached<T>);
  }
}

// qkv [T, (H + 2 H_kv) D] (rotary applied here: cos, sin [T, D] as rotary_'s); layer
// [P, 2, S, H_kv, D]; per row r: its q_lens[r] query tokens from q_index[r] on (none: 0,
// q_index -1), its pages kv_indices[kv_indptr[r]:kv_indptr[r+1]] holding kv_lens[r] keys
// in order, the step's own (written here) last. Every token is one row's query. Returns
// [T, H * D]. T: the layer's elements (float32, or bfloat16's bits).
template <typename T>
at::Tensor attention_over(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          at::Tensor layer, const at::Tensor& k_rows, const at::Tensor& v_rows,
                          const at::Tensor& q_index, const at::Tensor& q_lens,
                          const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                          const at::Tensor& kv_lens, int64_t heads, double scale) {
  check_f32(qkv, "qkv");
  check_f32(cos, "cos");
  check_f32(sin, "sin");
  TORCH_CHECK(layer.dim() == 5 && layer.size(1) == 2 && layer.size(4) % 2 == 0,
              "expected layer [P, 2, S, H_kv, D], D even");
  for (const auto* t : {&q_index, &q_lens, &kv_indptr, &kv_indices, &kv_lens}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "expected int64 indices");
  }
  const int64_t rows = kv_lens.size(0), tokens = qkv.size(0);
  TORCH_CHECK(q_index.numel() == rows && q_lens.numel() == rows && kv_indptr.numel() == rows + 1,
              "expected q_index, q_lens [R], kv_indptr [R + 1] for kv_lens [R]");
  auto q = at::empty({tokens, heads, layer.size(4)}, qkv.options());
  rotate_write<T>(qkv, cos, sin, layer, k_rows, v_rows, q, heads);
  for (int64_t i = 0; i < kv_indices.numel(); ++i) {
    const int64_t p = kv_indices.data_ptr<int64_t>()[i];
    TORCH_CHECK(p >= 0 && p < layer.size(0), "page id ", p, " out of the layer");
  }
  const int64_t* qi = q_index.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  // each query as (row, its index in the row): the tasks below
  std::vector<int64_t> q_row, q_at;
  q_row.reserve(tokens);
  q_at.reserve(tokens);
  int64_t keys = 0;  // the (query, key) pairs of the step
  for (int64_t r = 0; r < rows; ++r) {
    const bool placed = ql[r] == 0 || (qi[r] >= 0 && qi[r] + ql[r] <= tokens);
    TORCH_CHECK(ql[r] >= 0 && ql[r] <= lens[r] && placed, "row ", r,
                ": expected its queries among qkv's tokens and its keys, got ", ql[r], " from ",
                qi[r], " over ", lens[r], " keys");
    for (int64_t i = 0; i < ql[r]; ++i) {
      q_row.push_back(r);
      q_at.push_back(i);
      keys += lens[r] - ql[r] + i + 1;
    }
  }
  TORCH_CHECK(static_cast<int64_t>(q_row.size()) == tokens, "expected every token a row's query,",
              " got ", q_row.size(), " queries for ", tokens, " tokens");
  const int64_t dim = q.size(2);
  const int64_t page = layer.size(2), kv_heads = layer.size(3);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(heads % kv_heads == 0, "expected H a multiple of H_kv");
  auto out = at::empty({tokens, heads * dim}, q.options());
  const float* qp = q.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const T* lp = static_cast<const T*>(layer.data_ptr());
  const int64_t slot = kv_heads * dim, half_page = page * slot, page_stride = 2 * half_page;
  const int64_t* indptr = kv_indptr.data_ptr<int64_t>();
  const int64_t* indices = kv_indices.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);
  const auto head = dim % Wide::N == 0 ? &attend<Wide, T> : &attend<Lanes8, T>;
  // query k's token in qkv and out, and the keys it sees (its row's, causal)
  auto token_of = [&](int64_t k) { return qi[q_row[k]] + q_at[k]; };
  auto len_of = [&](int64_t k) { return lens[q_row[k]] - ql[q_row[k]] + q_at[k] + 1; };
  // the blocks of query k's pages holding keys [l0, l1) into next, to be asked for over
  // the `calls` drips of a task
  auto pages_of = [&](int64_t k, int64_t l0, int64_t l1, int64_t calls, NextPages& next) {
    next.blocks.clear();
    next.block = 0;
    next.at = 0;
    next.bytes = half_page * static_cast<int64_t>(sizeof(T));
    const int64_t row = indptr[q_row[k]];
    for (int64_t j = row + l0 / page; j < row + (l1 + page - 1) / page; ++j) {
      const char* base = reinterpret_cast<const char*>(lp + indices[j] * page_stride);
      next.blocks.push_back(base);
      next.blocks.push_back(base + next.bytes);
    }
    next.rate = (next.lines() + calls - 1) / std::max<int64_t>(calls, 1);
  };
  // the drips of a task over keys [l0, l1), a block of keys' each query head's scores and
  // each KV head's values (a pass for its query heads where VALUE_HEADS holds them)
  auto drips = [&](int64_t l0, int64_t l1) {
    return (heads + kv_heads) * (blocks(l1 - l0) / BLOCK);
  };
  const int64_t work = keys * heads * dim * 2;  // multiply-adds: scores and values
  // the threads the tasks are spread over: the kernels' team where the work repays waking
  // it (`grain`; asked of the team only then), else the caller alone
  const int64_t threads = threaded(work) ? team_threads() : 1;
  // the task a thread likely takes after task i of its piece [begin, end): the next in the
  // piece, or the first of its next piece (the threads take pieces of one size in turn)
  auto likely_next = [&](int64_t i, int64_t begin, int64_t end) {
    return i + 1 < end ? i + 1 : end + (end - begin) * (threads - 1);
  };
  // keys [l0, l1) of query k's row (l0 on a page's start), every KV head, into o (and its
  // softmax scales into part), the next task's pages asked for meanwhile
  auto keys_of = [&](int64_t k, int64_t l0, int64_t l1, float* o, Softmax* part,
                     std::vector<float>& scores, std::vector<const T*>& slots, NextPages* next) {
    const int64_t r = q_row[k], t = token_of(k), len = l1 - l0;
    scores.resize(group * blocks(len));
    slots.resize(len);
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      // the keys at KV head kh, page by page (no division a key)
      for (int64_t l = 0, j = indptr[r] + l0 / page; l < len; ++j) {
        const T* base = lp + indices[j] * page_stride + kh * dim;
        for (const int64_t end = std::min(len, l + page); l < end; ++l, base += slot) slots[l] = base;
      }
      const int64_t ahead = kh == 0 ? slot : 0;  // the first pass asks for the whole slots
      head(qp + t * qs0 + kh * group * qs1, qs1, group, slots.data(), len, dim, sc, half_page,
           ahead, scores.data(), o + kh * group * dim,
           part == nullptr ? nullptr : part + kh * group, next);
    }
  };
  // The tasks: a query each or, when there are fewer queries than threads to keep busy,
  // each query's keys in parts (up to four a thread, four pages or more each), merged by
  // their softmax scales (a query of one part is written out at once).
  const int64_t torch_threads = at::get_num_threads();
  const bool few = threaded(work) && tokens < 2 * torch_threads && torch_threads > 1;
  std::vector<int64_t> first(tokens + 1, 0);  // query k's parts: first[k] .. first[k + 1]
  for (int64_t k = 0; k < tokens; ++k) {
    const int64_t pages = (len_of(k) + page - 1) / page;
    first[k + 1] = first[k] + (few ? std::clamp<int64_t>(pages / 4, 1, 4 * threads) : 1);
  }
  const int64_t parts = first[tokens];
  std::vector<float> values(few ? parts * heads * dim : 0);
  std::vector<Softmax> scales(few ? parts * heads : 0);
  auto parts_of = [&](int64_t k) { return first[k + 1] - first[k]; };
  // part i: its query and keys [l0, l1)
  auto part_of = [&](int64_t i, int64_t& k, int64_t& l0, int64_t& l1) {
    k = std::upper_bound(first.begin(), first.end(), i) - first.begin() - 1;
    const int64_t n = parts_of(k), at = i - first[k], len = len_of(k);
    const int64_t pages = (len + page - 1) / page;
    l0 = pages * at / n * page;
    l1 = std::min(len, pages * (at + 1) / n * page);
  };
  // threads only where the step's attention repays waking them (`grain`)
  spread(parts, grain(parts, work / std::max<int64_t>(parts, 1)), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;    // [group, blocks(len)]
    std::vector<const T*> slots;  // [len]: each key's slot at one KV head
    NextPages next;
    for (int64_t i = begin; i < end; ++i) {
      int64_t k, l0, l1, nk, n0, n1;
      part_of(i, k, l0, l1);
      const int64_t ni = likely_next(i, begin, end);
      if (ni < parts) {
        part_of(ni, nk, n0, n1);
        pages_of(nk, n0, n1, drips(l0, l1), next);
      }
      const bool whole = parts_of(k) == 1;
      float* o = whole ? op + token_of(k) * heads * dim : values.data() + i * heads * dim;
      keys_of(k, l0, l1, o, whole ? nullptr : scales.data() + i * heads, scores, slots,
              ni < parts ? &next : nullptr);
    }
  });
  for (int64_t k = 0; k < tokens; ++k)
    if (parts_of(k) > 1)
      merge_parts(values.data() + first[k] * heads * dim, scales.data() + first[k] * heads,
                  parts_of(k), heads, dim, op + token_of(k) * heads * dim);
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
