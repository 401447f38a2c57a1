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
// qweight uint8 for int4 (mins its float16 minimums), int8 for int8 (mins empty),
// bfloat16 panels [N/32, K/2, 32, 2] for bf16 (scales and mins empty); int4 or int8 weights
// laid out as lanes (quant/cpp/lanes.h: uint8 [N/16, K/32 * 320] or int8 [N/16, K/32 * 544])
// with scales and mins empty;
// int16_activations: they take their activations rounded to int16 (int4/int8_linear_i16).
// caches: per layer its KV tensor [P, 2, S, H_kv, D] (float32 or bfloat16); the rest as
// layer_ops' attention's.
// h [T, hidden] gets every layer's attention and all but the last layer's MLP output
// added in place; returns the last layer's MLP output, for the caller's final norm to add.

namespace {

constexpr int64_t LAYER_TENSORS = 14;

// Checks x [T, K] contiguous and makes `y` [T, N] when it is not (held through the call).
void rows_into(const at::Tensor& x, int64_t N, at::Tensor& y) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "expected contiguous activations [T, K]");
  const int64_t M = x.size(0);
  if (!y.defined() || y.size(0) != M || y.size(1) != N) y = at::empty({M, N}, x.options());
}

// y = x @ W.T into `y` (`rows_into`): packed_linear's checks and kernels without a new
// tensor a call.
template <typename W>
void linear_into(const at::Tensor& x, const W& w, int64_t N, bool int16_activations, at::Tensor& y) {
  check_linear(x, N, w.K);
  rows_into(x, N, y);
  linear_rows(w, x.data_ptr<float>(), x.size(0), N, w.K, int16_activations, y.data_ptr<float>());
}

// y = x @ W.T into `y` (`rows_into`) for bfloat16 panels W: bf16_linear without a new tensor.
void bf16_into(const at::Tensor& x, const at::Tensor& panels, at::Tensor& y) {
  rows_into(x, check_bf16(x, panels), y);
#if defined(__AVX512BF16__)
  bf16_rows(x.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t*>(panels.data_ptr()),
            panels.size(0), y.data_ptr<float>());
#endif
}

// y = x @ W.T into `y` (`rows_into`) for int4 or int8 weights W laid out as lanes (lanes.h),
// x's rows rounded to int16: lanes_i16 without a new tensor.
void lanes_into(const at::Tensor& x, const at::Tensor& lanes, at::Tensor& y) {
  const auto [N, K] = lanes_shape(lanes);
  check_linear(x, N, K);
  rows_into(x, N, y);
  multiply_lanes(lanes, N, K, x.data_ptr<float>(), x.size(0), y.data_ptr<float>());
}

// One packed linear layer (qweight, scales, mins at w; bf16: qweight the panels; int4 or
// int8 lanes: qweight the lanes, scales empty) of the stack into `y`.
void packed_into(const at::Tensor& x, const at::Tensor* w, bool int16_activations, at::Tensor& y) {
  if (w[0].scalar_type() == at::kBFloat16)
    bf16_into(x, w[0], y);
  else if (w[1].numel() == 0)
    lanes_into(x, w[0], y);
  else if (w[0].scalar_type() == at::kByte)
    linear_into(x, int4_weights(w[0], w[1], w[2]), w[0].size(0), int16_activations, y);
  else
    linear_into(x, int8_weights(w[0], w[1]), w[0].size(0), int16_activations, y);
}

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
    packed_into(x, w + 1, int16_activations, qkv);
    const at::Tensor out = attention(qkv, cos, sin, caches[i], k_rows, v_rows, q_index, q_lens,
                                     kv_indptr, kv_indices, kv_lens, heads, scale);
    packed_into(out, w + 4, int16_activations, o);
    const at::Tensor y = rms_norm(h, o, w[7], eps);
    packed_into(y, w + 8, int16_activations, gate_up);
    packed_into(silu_mul(gate_up), w + 11, int16_activations, mlp);
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
