// A decode step's whole stack of Llama-family layers in one call (mstar/models/llama/step.py):
// the layer ops of layer_ops.cpp and the packed linear layers of quant/kernels.cpp, in the
// order FusedLlamaLayer calls them, so the same results bit for bit, without a Python
// call and a trip through the dispatcher per op (~8 a layer, ~1.5 us each, and the
// Python between them: a sixth of a one-row step on SmolLM2); the linear layers write
// into buffers made once a call, not new tensors (~4 us a call on Zen 1). Every layer is
// checked before any runs; then the kernels' threads go through the layers together (a
// `Gang`, team.h), each op shared among them and a spin barrier after it: one
// hand-off a step instead of ~150 (the products of a step's SmolLM2 layers 1.7 ms instead
// of 2.15 on Zen 4 in benchmarks/stack_products.py).
//
// Built in one unit after kernels.cpp and layer_ops.cpp (kernels.py's BOTH), whose
// functions it calls.
//
// weights: per layer, in order, 14 tensors: input norm weight [hidden]; q/k/v, o,
// post-attention norm weight, gate/up, down, each linear as (qweight, scales, mins):
// qweight uint8 for int4 (mins its float16 minimums), int8 for int8 (mins empty),
// bfloat16 panels [N/32, K/2, 32, 2] for bf16 (scales and mins empty); int4 or int8 weights
// laid out as lanes (lanes.h: uint8 [N/16, K/32 * 320] or int8 [N/16, K/32 * 544]; symmetric
// int4 uint8 [N/16, K/32, 288]; with float32 scales [N/16, K/32, 384 or 640]; of the K-quants'
// factors [N/16, K/256, 2304 or 3360]) with scales and mins empty; or up to three such lanes of different layouts in its
// three slots (the rest empty), their outputs side by side (fused_linear.py's `SideBySide`:
// a Q4_K_M file's q/k int4 and v int8);
// int16_activations: they take their activations rounded to int16 (int4/int8_linear_i16);
// int8_slots: bit j set, every layer's j-th linear (0 q/k/v, 1 o, 2 gate/up, 3 down) whose
// lanes take them (int4, Q5_K, Q6_K) takes 2+ rows rounded to int8 instead (`multiply_lanes`,
// lanes_i8.h): a model whose attention is too sensitive to that rounding keeps it on its MLP.
// biases: none (no layer has one), or per layer 4: q/k/v's, o's, gate/up's and down's,
// float32 [N] each (empty: that layer has none), added after its product (as PackedLinear's
// `y + bias`). head_norms: none, or per layer 2: the RMSNorm weights [D] of each query head
// and of each key head (Qwen3), applied to q/k/v's output in place before the attention
// (layer_ops' head_norms_), eps the layers' norm epsilon.
// caches: per layer its KV tensor [P, 2, S, H_kv, D] (float32 or bfloat16); the rest as
// layer_ops' attention's.
// h [T, hidden] gets every layer's attention and all but the last layer's MLP output
// added in place; returns the last layer's MLP output, for the caller's final norm to add.

namespace {

constexpr int64_t LAYER_TENSORS = 14;

// Whether t holds lanes (uint8 or int8: lanes.h's layouts), not scales.
bool holds_lanes(const at::Tensor& t) {
  return t.scalar_type() == at::kByte || t.scalar_type() == at::kChar;
}

// One linear layer of the stack (its tensors at w: qweight, scales, mins; or bfloat16 panels
// or lanes, scales empty; or `parts` lanes side by side, each of `rows[i]` output rows; its
// bias [N] or nullptr), N x K, checked by `stack_linear` before the step runs.
struct StackLinear {
  const at::Tensor* w;
  int64_t N, K;
  bool int16_activations;
  bool int8_rows = false;
  int parts = 0;                // lanes tensors side by side (0: not lanes)
  int64_t rows[3] = {0, 0, 0};  // each one's output rows
  const float* bias = nullptr;  // (nullptr: none)

  // y [M, N] = x [M, K] @ W.T (+ bias), packed_linear's kernels (the bias added after, its
  // rows shared as the norms' are).
  void operator()(const float* x, int64_t M, float* y) const {
    product(x, M, y);
    if (bias == nullptr) return;
    spread(M, grain(M, N), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t j = 0; j < N; ++j) y[r * N + j] += bias[j];
    });
  }

  void product(const float* x, int64_t M, float* y) const {
    if (w[0].scalar_type() == at::kBFloat16) {
#if defined(__AVX512BF16__)
      bf16_rows(x, M, K, reinterpret_cast<const uint16_t*>(w[0].data_ptr()), w[0].size(0), y);
#endif
    } else if (parts > 0) {
      int64_t at = 0;  // the part's first output column
      for (int i = 0; i < parts; at += rows[i], ++i) multiply_lanes(w[i], rows[i], K, x, M, y + at, N, int8_rows);
    } else if (w[0].scalar_type() == at::kByte) {
      linear_rows(int4_weights(w[0], w[1], w[2]), x, M, N, K, int16_activations, y);
    } else {
      linear_rows(int8_weights(w[0], w[1]), x, M, N, K, int16_activations, y);
    }
  }
};

// The linear layer at w for M rows of activations of width K, checked as its op checks it.
StackLinear stack_linear(const at::Tensor* w, int64_t K, int64_t M, bool int16_activations, bool int8_rows) {
  StackLinear linear{w, 0, K, int16_activations, int8_rows};
  int64_t held = K;  // held: the width the weights take
  if (w[0].scalar_type() == at::kBFloat16) {
    linear.N = panels_rows(w[0], K);
  } else if (w[1].numel() == 0 || holds_lanes(w[1])) {
    check_lane_rows(M);
    for (; linear.parts < 3 && w[linear.parts].numel() > 0; ++linear.parts) {
      TORCH_CHECK(holds_lanes(w[linear.parts]), "expected lanes side by side, got ", w[linear.parts].scalar_type());
      int64_t n = 0;
      std::tie(n, held) = lanes_shape(w[linear.parts]);
      check_shape(n, held, K);
      linear.rows[linear.parts] = n;
      linear.N += n;
    }
  } else if (w[0].scalar_type() == at::kByte) {
    linear.N = w[0].size(0), held = int4_weights(w[0], w[1], w[2]).K;
  } else {
    linear.N = w[0].size(0), held = int8_weights(w[0], w[1]).K;
  }
  check_shape(linear.N, held, K);
  return linear;
}

// A norm weight of width n.
void check_norm_weight(const at::Tensor& w, int64_t n) {
  check_f32(w, "norm weight");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == n, "expected a norm weight [", n, "], got ", w.sizes());
}

// The bias of `linear` (empty: none, nullptr), checked.
const float* stack_bias(const at::Tensor& bias, const StackLinear& linear) {
  if (bias.numel() == 0) return nullptr;
  check_f32(bias, "bias");
  TORCH_CHECK(bias.dim() == 1 && bias.size(0) == linear.N, "expected a bias [", linear.N, "], got ",
              bias.sizes());
  return bias.data_ptr<float>();
}

// decode_layers over caches of elements T (float32, or bfloat16's bits): every layer checked
// and every buffer made first, then the layers run by a gang of the kernels' threads (each
// op shared by them, `Gang`: one hand-off a step, not one an op).
template <typename T>
at::Tensor run_layers(at::Tensor h, at::TensorList weights, at::TensorList biases,
                      at::TensorList head_norms, at::TensorList caches, double eps,
                      const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_rows,
                      const at::Tensor& v_rows, const at::Tensor& q_index, const at::Tensor& q_lens,
                      const at::Tensor& kv_indptr, const at::Tensor& kv_indices,
                      const at::Tensor& kv_lens, int64_t heads, double scale, bool int16_activations,
                      int64_t int8_slots) {
  const int64_t layers = static_cast<int64_t>(caches.size()), M = h.size(0), hidden = h.size(1);
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(team_threads());
  AttentionStep<T> attention(caches[0], M, k_rows, v_rows, q_index, q_lens, kv_indptr, kv_indices,
                             kv_lens, heads, scale, threads);
  const int64_t dim = caches[0].size(4), kv_heads = caches[0].size(3);
  TORCH_CHECK(biases.empty() || static_cast<int64_t>(biases.size()) == 4 * layers,
              "expected no biases or 4 a layer, got ", biases.size());
  TORCH_CHECK(head_norms.empty() || static_cast<int64_t>(head_norms.size()) == 2 * layers,
              "expected no head norms or 2 a layer, got ", head_norms.size());
  for (const at::Tensor& w : head_norms) check_norm_weight(w, dim);
  std::vector<StackLinear> linears;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * LAYER_TENSORS;
    check_norm_weight(w[0], hidden);
    check_norm_weight(w[7], hidden);
    const auto int8 = [&](int j) { return ((int8_slots >> j) & 1) != 0; };
    linears.push_back(stack_linear(w + 1, hidden, M, int16_activations, int8(0)));
    linears.push_back(stack_linear(w + 4, heads * dim, M, int16_activations, int8(1)));
    linears.push_back(stack_linear(w + 8, hidden, M, int16_activations, int8(2)));
    TORCH_CHECK(linears.back().N % 2 == 0, "expected gate/up of an even width, got ", linears.back().N);
    linears.push_back(stack_linear(w + 11, linears.back().N / 2, M, int16_activations, int8(3)));
    TORCH_CHECK(linears[4 * i + 1].N == hidden && linears[4 * i + 3].N == hidden,
                "expected o and down of the hidden width ", hidden);
    for (int64_t j = 0; j < 4; ++j) {
      TORCH_CHECK(linears[4 * i + j].N == linears[j].N, "expected every layer of the first's shapes");
      if (!biases.empty()) linears[4 * i + j].bias = stack_bias(biases[4 * i + j], linears[4 * i + j]);
    }
  }
  // the ops' outputs, made once (each read before the next layer writes it; mlp, the previous
  // layer's MLP output, returned at the end); and each thread's own residual stream (the
  // first's h itself), norm output and activation: the rows are few, so each thread computes
  // the norms and the SiLU whole (the same sums), and no barrier waits on them
  auto buffer = [&](int64_t width) { return at::empty({M, width}, h.options()); };
  at::Tensor qkv = buffer(linears[0].N), q = buffer(heads * dim), out = buffer(heads * dim),
             o = buffer(hidden), gate_up = buffer(linears[2].N), mlp = buffer(hidden);
  std::vector<at::Tensor> own_h{h}, own_x, own_act;
  for (int t = 0; t < threads; ++t) {
    if (t > 0) own_h.push_back(h.clone());
    own_x.push_back(buffer(hidden));
    own_act.push_back(buffer(linears[3].K));
  }
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK(caches[i].scalar_type() == caches[0].scalar_type() && caches[i].is_contiguous(),
                "expected every layer's cache contiguous, of the first's dtype");
    attention.check(qkv, cos, sin, caches[i]);
  }
  float *qkvp = qkv.data_ptr<float>(), *qp = q.data_ptr<float>(), *outp = out.data_ptr<float>(),
        *op = o.data_ptr<float>(), *gp = gate_up.data_ptr<float>(), *mp = mlp.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t inner = linears[3].K;
  Gang::run(threads, [&](int thread) {
    float *hp = own_h[thread].data_ptr<float>(), *xp = own_x[thread].data_ptr<float>(),
          *ap = own_act[thread].data_ptr<float>();
    auto norm = [&](const float* delta, const at::Tensor& weight) {
      for (int64_t r = 0; r < M; ++r)
        norm_row(hp + r * hidden, delta == nullptr ? nullptr : delta + r * hidden,
                 weight.data_ptr<float>(), hidden, eps, xp + r * hidden);
    };
    for (int64_t i = 0; i < layers; ++i) {
      const at::Tensor* w = weights.data() + i * LAYER_TENSORS;
      const StackLinear* linear = linears.data() + 4 * i;
      norm(i == 0 ? nullptr : mp, w[0]);
      linear[0](xp, M, qkvp);
      if (!head_norms.empty())
        norm_heads(qkvp, M, linear[0].N, head_norms[2 * i].data_ptr<float>(),
                   head_norms[2 * i + 1].data_ptr<float>(), heads, kv_heads, dim, eps);
      attention(qkvp, cp, sp, static_cast<T*>(caches[i].data_ptr()), qp, outp);
      linear[1](outp, M, op);
      norm(op, w[7]);
      linear[2](xp, M, gp);
      for (int64_t r = 0; r < M; ++r) silu_row(gp + r * 2 * inner, inner, ap + r * inner);
      linear[3](ap, M, mp);
    }
  });
  return mlp;
}

at::Tensor decode_layers(at::Tensor h, at::TensorList weights, at::TensorList biases,
                         at::TensorList head_norms, at::TensorList caches, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_rows,
                         const at::Tensor& v_rows, const at::Tensor& q_index,
                         const at::Tensor& q_lens, const at::Tensor& kv_indptr,
                         const at::Tensor& kv_indices, const at::Tensor& kv_lens, int64_t heads,
                         double scale, bool int16_activations, int64_t int8_slots) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0, "expected at least one layer");
  TORCH_CHECK(int8_slots >= 0 && int8_slots < 16, "expected int8_slots of bits 0-3, got ", int8_slots);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * LAYER_TENSORS, "expected ",
              LAYER_TENSORS, " weight tensors a layer for ", layers, " layers, got ",
              weights.size());
  check_f32(h, "h");
  TORCH_CHECK(h.dim() == 2, "expected h [T, hidden], got ", h.sizes());
  const bool bf16 = caches[0].scalar_type() == at::kBFloat16;
  TORCH_CHECK((bf16 || caches[0].scalar_type() == at::kFloat) && caches[0].device().is_cpu(),
              "caches: expected float32 or bfloat16 CPU tensors, got ", caches[0].scalar_type());
  const auto run = bf16 ? &run_layers<Bf16> : &run_layers<float>;
  return run(h, weights, biases, head_norms, caches, eps, cos, sin, k_rows, v_rows, q_index, q_lens, kv_indptr,
             kv_indices, kv_lens, heads, scale, int16_activations, int8_slots);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mstar_layer, m) {
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] weights, Tensor[] biases, Tensor[] head_norms,"
      " Tensor(b!)[] caches,"
      " float eps, Tensor cos, Tensor sin, Tensor k_rows, Tensor v_rows, Tensor q_index,"
      " Tensor q_lens, Tensor kv_indptr, Tensor kv_indices, Tensor kv_lens, int heads,"
      " float scale, bool int16_activations, int int8_slots=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_layer, CPU, m) { m.impl("decode_layers", decode_layers); }
