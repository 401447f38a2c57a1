// A decode step's whole stack of Llama layers in one call (mstar/integrations/llama_step.py):
// the layer ops of layer_ops.cpp and the packed linear layers of quant/kernels.cpp, in the
// order FusedLlamaLayer calls them, so the same results bit for bit, without a Python
// call and a trip through the dispatcher per op (~8 a layer, ~1.5 us each, and the
// Python between them: a sixth of a one-row step on SmolLM2); the linear layers write
// into buffers held through the call, not new tensors (~4 us a call on Zen 1).
//
// Built in one unit after kernels.cpp and layer_ops.cpp (kernels.py's BOTH), whose
// functions it calls.
//
// weights: per layer, in order, 14 tensors: input norm weight [hidden]; q/k/v, o,
// post-attention norm weight, gate/up, down, each linear as (qweight, scales, mins):
// qweight uint8 for int4 (mins its float16 minimums), int8 for int8 (mins empty);
// int16_activations: they take their activations rounded to int16 (int4/int8_linear_i16).
// caches: per layer its KV tensor [P, 2, S, H_kv, D]; the rest as layer_ops' attention's.
// h [T, hidden] gets every layer's attention and all but the last layer's MLP output
// added in place; returns the last layer's MLP output, for the caller's final norm to add.

namespace {

constexpr int64_t LAYER_TENSORS = 14;

// One packed linear layer of the stack: its weights (checked as int4_linear's and
// int8_linear's are) and whether its rows take int16 activations.
struct StackLinear {
  std::optional<Int4> int4;
  std::optional<Int8> int8;
  int64_t N, K;
  bool int16_activations;

  StackLinear(const at::Tensor* w, bool int16) : int16_activations(int16) {
    if (w[0].scalar_type() == at::kByte) {
      int4 = int4_weights(w[0], w[1], w[2]);
      K = int4->K;
    } else {
      int8 = int8_weights(w[0], w[1]);
      K = int8->K;
    }
    N = w[0].size(0);
    TORCH_CHECK(N % 4 == 0 && K % 32 == 0, "expected N % 4 == 0 and K % 32 == 0, got ", N, ", ", K);
  }

  // y = x @ W.T into `y` (resized to [T, N] if it is not), x [T, K] contiguous float32.
  void operator()(const at::Tensor& x, at::Tensor& y) const {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == K,
                "expected contiguous float32 activations of width ", K);
    const int64_t M = x.size(0);
    if (!y.defined() || y.size(0) != M || y.size(1) != N) y = at::empty({M, N}, x.options());
    if (int4) linear_rows(*int4, x.data_ptr<float>(), M, N, K, int16_activations, y.data_ptr<float>());
    else linear_rows(*int8, x.data_ptr<float>(), M, N, K, int16_activations, y.data_ptr<float>());
  }
};

at::Tensor decode_layers(at::Tensor h, at::TensorList weights, at::TensorList caches, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_rows,
                         const at::Tensor& v_rows, const at::Tensor& q_index,
                         const at::Tensor& q_lens, const at::Tensor& kv_indptr,
                         const at::Tensor& kv_indices, const at::Tensor& kv_lens, int64_t heads,
                         double scale, bool int16_activations) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(layers > 0, "expected at least one layer");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * LAYER_TENSORS, "expected ",
              LAYER_TENSORS, " weight tensors a layer for ", layers, " layers, got ",
              weights.size());
  // the linear layers' outputs, in buffers shared by the layers (each read before the
  // next layer writes it; mlp, the previous layer's MLP output, returned at the end)
  at::Tensor qkv, o, gate_up, mlp;
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * LAYER_TENSORS;
    const at::Tensor x = rms_norm(h, i == 0 ? std::nullopt : std::optional<at::Tensor>(mlp), w[0], eps);
    StackLinear(w + 1, int16_activations)(x, qkv);
    const at::Tensor out = attention(qkv, cos, sin, caches[i], k_rows, v_rows, q_index, q_lens,
                                     kv_indptr, kv_indices, kv_lens, heads, scale);
    StackLinear(w + 4, int16_activations)(out, o);
    const at::Tensor y = rms_norm(h, o, w[7], eps);
    StackLinear(w + 8, int16_activations)(y, gate_up);
    StackLinear(w + 11, int16_activations)(silu_mul(gate_up), mlp);
  }
  return mlp;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mstar_layer, m) {
  m.def(
      "decode_layers(Tensor(a!) h, Tensor[] weights, Tensor(b!)[] caches,"
      " float eps, Tensor cos, Tensor sin, Tensor k_rows, Tensor v_rows, Tensor q_index,"
      " Tensor q_lens, Tensor kv_indptr, Tensor kv_indices, Tensor kv_lens, int heads,"
      " float scale, bool int16_activations) -> Tensor");
}

TORCH_LIBRARY_IMPL(mstar_layer, CPU, m) { m.impl("decode_layers", decode_layers); }
