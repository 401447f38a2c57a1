// A decode step's whole stack of Llama layers in one call (mstar/integrations/llama_step.py):
// the layer ops of layer_ops.cpp and the packed linear layers of quant/kernels.cpp, in the
// order FusedLlamaLayer calls them, so the same results bit for bit, without a Python
// call and a trip through the dispatcher per op (~8 a layer, ~1.5 us each, and the
// Python between them: a sixth of a one-row step on SmolLM2).
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

at::Tensor packed(const at::Tensor& x, const at::Tensor* w, bool int16_activations) {
  if (w[0].scalar_type() == at::kByte)
    return int16_activations ? int4_linear_i16(x, w[0], w[1], w[2]) : int4_linear(x, w[0], w[1], w[2]);
  return int16_activations ? int8_linear_i16(x, w[0], w[1]) : int8_linear(x, w[0], w[1]);
}

at::Tensor decode_layers(at::Tensor h, at::TensorList weights, at::TensorList caches, double eps,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_rows,
                         const at::Tensor& v_rows, const at::Tensor& q_index,
                         const at::Tensor& q_lens, const at::Tensor& kv_indptr,
                         const at::Tensor& kv_indices, const at::Tensor& kv_lens, int64_t heads,
                         double scale, bool int16_activations) {
  const int64_t layers = static_cast<int64_t>(caches.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == layers * LAYER_TENSORS, "expected ",
              LAYER_TENSORS, " weight tensors a layer for ", layers, " layers, got ",
              weights.size());
  std::optional<at::Tensor> mlp;  // the previous layer's MLP output, none before the first
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * LAYER_TENSORS;
    const at::Tensor x = rms_norm(h, mlp, w[0], eps);
    const at::Tensor out =
        attention(packed(x, w + 1, int16_activations), cos, sin, caches[i], k_rows, v_rows, q_index,
                  q_lens, kv_indptr, kv_indices, kv_lens, heads, scale);
    const at::Tensor y = rms_norm(h, packed(out, w + 4, int16_activations), w[7], eps);
    mlp = packed(silu_mul(packed(y, w + 8, int16_activations)), w + 11, int16_activations);
  }
  TORCH_CHECK(mlp.has_value(), "expected at least one layer");
  return *mlp;
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
