"""The fused forward on the Llama family's other architectures: Mistral,
Qwen2 (q/k/v biases) and Qwen3 (q/k head norms, a head size of its own)
give HF's logits and greedy tokens, their layer stack the layers' logits bit
for bit (random int4 layers and a GGUF's Q4_0), and a sliding window's model
runs fused while its window hides no key."""

from __future__ import annotations

import pytest
import torch
from gguf_files import LlamaShape, write_llama_gguf
from test_fused import Twin, _llama, _prompt, _stack_against_layers, stack_equals_layers
from test_fused import kernels as kernels  # (a fixture)

from mstar.cpu.layer_ops import layer_ops_or_why
from mstar.cpu.quant.linear import PackedLinear
from mstar.models import hf
from mstar.models.hf import register
from mstar.models.llama.fused_linear import SideBySide
from mstar.models.llama.stack import LayerStack
from mstar.models.llama.step import fused_refusal, fused_step

# each architecture as the fused path serves it: Mistral without a window, Qwen3 with a
# head size other than hidden / heads (24, not 16)
SERVED = {"mistral": {"sliding_window": None}, "qwen2": {}, "qwen3": {"head_dim": 24}}


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "packed"])
@pytest.mark.parametrize("arch", list(SERVED))
def test_each_architecture_matches_hf(kernels, arch, packed):
    """Prefill chunks beside decode rows, then decode rows: every step's
    logits are HF's forward's, each stream's the model's own full forward's
    and its greedy tokens ``generate``'s."""
    reference, paged = _llama(packed, arch=arch, **SERVED[arch])
    assert fused_refusal(paged) is None and fused_step(paged) is not None
    a, b = _prompt(9, 1), _prompt(5, 2)
    run = Twin(paged)
    run.step([("a", a[:4]), ("b", b)])
    run.step([("b", [run.next_token("b")]), ("a", a[4:])])
    for _ in range(3):
        run.decode(["a", "b"])
    for name, prompt in (("a", a), ("b", b)):
        run.check(reference, name, len(prompt))


@pytest.mark.parametrize(
    "arch, settings",
    [
        ("mistral", {"sliding_window": 8}),
        # the first layer without a window, the others with one (a hybrid model)
        ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ],
)
def test_a_window_s_model_runs_fused_while_its_window_hides_no_key(kernels, arch, settings):
    """A step whose every position is below the (smallest) window of 8
    runs fused; a step past it runs HF's forward, whose window hides the
    early keys: HF's logits and greedy tokens throughout."""
    reference, paged = _llama(arch=arch, **settings)
    assert fused_refusal(paged) is None
    spec = hf.kv_spec(paged)
    assert min(w for w in spec.layer_windows if w is not None) == 8
    assert hf._fused(paged, spec, torch.tensor([0, 7, 3])) is not None
    assert hf._fused(paged, spec, torch.tensor([0, 8])) is None
    prompt = _prompt(6, 4)
    run = Twin(paged)
    run.step([("a", prompt)])
    for _ in range(6):  # positions 6 to 11: the window hides keys from 8 on
        run.decode(["a"])
    run.check(reference, "a", len(prompt))


@pytest.mark.parametrize("weights", ["float32", "lanes"], ids=["float32", "int4 lanes"])
@pytest.mark.parametrize("arch", list(SERVED))
def test_layer_stack_is_the_layers_bit_for_bit(arch, weights):
    """int4 layers (float32 activations, or int16 from their lanes): Qwen2's
    biases and Qwen3's head norms in the one-call stack give the layers'
    logits bit for bit."""
    _stack_against_layers(weights, torch.float32, arch=arch, **SERVED[arch])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_gguf_q4_0_stack_is_the_layers_bit_for_bit(tmp_path, arch, dtype):
    """A Qwen2 and a Qwen3 GGUF of Q4_0 layers (its q/k/v biases, its head
    norms as the file holds them) load packed (in bfloat16 arithmetic on
    lanes without minimums, where the kernels have lanes); the stack serves
    them, and its logits are the layers' bit for bit."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    from mstar.models.loader import load

    types = {"token_embd": "Q8_0", "output": "Q8_0"}
    names = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    shape = LlamaShape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=288)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MSTAR_KV_CACHE", str(tmp_path / "cache"))
        path = write_llama_gguf(tmp_path / f"{arch}.gguf", types | dict.fromkeys(names, "Q4_0"),
                                shape, arch=arch)  # fmt: skip
        model = load(str(path), quantization="gguf", dtype=dtype)[0]
    if dtype == torch.bfloat16 and torch.ops.mstar_quant.lanes_rows():
        int4 = [m for m in model.modules() if isinstance(m, PackedLinear) and m.kind == "int4"]
        assert len(int4) == 14 and all(m.lanes.shape[2:] == (288,) for m in int4)
    model.set_attn_implementation(register())
    assert fused_refusal(model) is None
    assert LayerStack.refusal(fused_step(model).layers) is None
    stack_equals_layers(model)


def test_the_family_table_checks_each_architecture_s_own_classes():
    """A Qwen2 whose layer holds a Mistral MLP (the same computation, not
    its class), and a Qwen3 whose head norms differ in epsilon, are refused
    with the reason."""
    from transformers.models.mistral.modeling_mistral import MistralMLP

    _, qwen2 = _llama(arch="qwen2")
    qwen2.model.layers[1].mlp = MistralMLP(qwen2.config)
    assert fused_refusal(qwen2) == "has a MistralMLP where a Qwen2MLP is expected"
    _, qwen3 = _llama(arch="qwen3", head_dim=24)
    qwen3.model.layers[0].self_attn.k_norm.variance_epsilon = 1e-3
    assert fused_refusal(qwen3) == "has query and key head norms of different epsilons"


def test_biased_layers_side_by_side_run_in_the_stack():
    """A Qwen2 of a Q4_K_M file's formats (q/k int4, v int8: side by side,
    each with its bias): the stack serves it, its logits the layers' bit for
    bit, and those give HF's greedy tokens, and its logits within the prompt's
    rounding to int8 (its 6 rows: ``PackedLinear.int8_rows``; 7e-3 here)."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    reference, paged = _llama(packed=True, kquants=True, arch="qwen2")
    fused = fused_step(paged)
    assert any(isinstance(layer.qkv.module, SideBySide) for layer in fused.layers)
    assert fused.stack is not None and LayerStack.refusal(fused.layers) is None
    stack_equals_layers(paged)
    prompt = _prompt(6, 1)
    run = Twin(paged)
    run.step([("a", prompt)])
    for _ in range(3):
        run.decode(["a"])
    run.check(reference, "a", len(prompt), tol=2e-2)
