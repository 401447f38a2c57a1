"""The fused Llama forward (``mstar.models.llama.step``) against HF's
own: the same logits step by step (float32 and packed weights, with and
without the layer ops), the same greedy tokens as ``generate``, and HF's
forward for whatever it refuses."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import Streams

transformers = pytest.importorskip("transformers")

from mstar.cpu.layer_ops import layer_ops_or_why  # noqa: E402
from mstar.cpu.quant.at_load import quantize_int4, quantize_int8  # noqa: E402
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why  # noqa: E402
from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear  # noqa: E402
from mstar.cpu.quant.packed import Packed, bf16_panels, pack_bf16  # noqa: E402
from mstar.engine.resources.kv.cache import KVCache  # noqa: E402
from mstar.models import hf  # noqa: E402
from mstar.models.hf import forward_step, register  # noqa: E402
from mstar.models.llama import step as llama_step  # noqa: E402
from mstar.models.llama.fused_linear import (  # noqa: E402
    RowConcat,
    SideBySide,
    StorageCheck,
    concat_refusal,
)
from mstar.models.llama.stack import LayerStack  # noqa: E402
from mstar.models.llama.step import fused_refusal, fused_step  # noqa: E402

SIZES = {
    "vocab_size": 96,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "bos_token_id": None,
    "eos_token_id": None,
    "rope_theta": 500.0,
}
TOL = 1e-4
# the Llama family's architectures: (causal LM, config) class names
ARCHS = {
    "llama": ("LlamaForCausalLM", "LlamaConfig"),
    "mistral": ("MistralForCausalLM", "MistralConfig"),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config"),
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config"),
}


def _k_quant(weight: torch.Tensor, int8: bool) -> Packed:
    """``weight`` packed as GGUF's K-quants are, float32 scales: int8 with a
    scale per 16 columns (Q6_K's 6-bit values), else int4 groups of 32."""
    if int8:
        rows = weight.shape[0]
        scales = weight.detach().abs().view(rows, -1, 16).amax(-1) / 31
        q = torch.round(weight.detach() / scales.repeat_interleave(16, dim=1)).clamp(-32, 31)
        return Packed("int8", q.to(torch.int8), scales)
    p = quantize_int4(weight)
    return Packed("int4", p.qweight, p.scales.float(), p.mins.float())


def _llama(
    packed: bool = False,
    int16: bool = False,
    bf16: bool = False,
    lanes: bool = False,
    kquants: bool = False,
    arch: str = "llama",
    **settings,
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A seeded tiny Llama (or another of ``ARCHS``; its biases, zeros
    when made, drawn at random) (the reference: its own forward, SDPA
    attention) and its twin on the plan; ``packed``: both with int4 layers
    and an int8 head (the reference dequantized, as the mode check's), the
    int4 ones on int16 activations with ``int16`` (and their ``lanes`` with
    ``lanes``); or with ``bf16`` every layer as bfloat16 panels; or with
    ``kquants`` as a Q4_K_M file's (v, down and the head int8 of float32
    scales per 16 columns, the rest int4 of float32 scales) on lanes alone
    (many rows on panels dequantized from them), q/k/v side by side."""
    torch.manual_seed(0)
    causal_lm, config = (getattr(transformers, name) for name in ARCHS[arch])
    model = causal_lm(config(**SIZES, **settings)).eval()
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(".bias"):
                weight.normal_(0, 0.1)
    if packed:
        needs_panels = bf16 or kquants
        if (why := kernel_or_why() or (bf16_or_why() if needs_panels else None)) is not None:
            pytest.skip(f"packed kernels: {why}")
        for name, module in list(model.named_modules()):
            if isinstance(module, torch.nn.Linear):
                head = name == "lm_head"
                if kquants:
                    int8 = head or name.endswith(("v_proj", "down_proj"))
                    weights = _k_quant(module.weight, int8)
                    lanes = weights.lanes()  # many rows on panels from the lanes, none held
                    layer = PackedLinear(weights, module.bias, None, True, lanes, lane_panels=True)
                    model.set_submodule(name, layer)
                    continue
                if bf16:
                    weights = pack_bf16(module.weight)
                else:
                    weights = (quantize_int8 if head else quantize_int4)(module.weight)
                held = weights.lanes() if lanes and not head else None
                layer = PackedLinear(weights, module.bias, None, int16 and not head, held)
                model.set_submodule(name, layer)
    paged = copy.deepcopy(model)
    paged.set_attn_implementation(register())
    reference = copy.deepcopy(model)
    for name, module in list(reference.named_modules()):
        if isinstance(module, PackedLinear):
            reference.set_submodule(name, module.dequantized())
    return reference, paged


@pytest.fixture(params=["layer ops", "aten"])
def kernels(request, monkeypatch):
    """Both ways a fused layer computes: through the layer ops, or aten alone."""
    if request.param == "layer ops":
        if layer_ops_or_why() is not None:
            pytest.skip(f"layer ops: {layer_ops_or_why()}")
    else:
        monkeypatch.setattr(llama_step, "layer_ops_or_why", lambda: "off in this test")
    return request.param


class Twin:
    """Feeds the same steps through the fused path and HF's, each with a
    cache of its own, and keeps each stream's tokens and fused logits."""

    def __init__(self, model: torch.nn.Module, page_size: int = 4, num_pages: int = 48) -> None:
        self.model = model
        self.streams = {f: Streams(num_pages, page_size, seed=3) for f in (True, False)}
        spec = hf.kv_spec(model).cache_kwargs()
        self.caches = {
            f: KVCache(num_pages=num_pages, page_size=page_size, **spec) for f in (True, False)
        }
        self.tokens: dict[str, list[int]] = {}
        self.logits: dict[str, list[torch.Tensor]] = {}

    def step(self, feeds: list[tuple[str, list[int]]], decode: bool = False) -> None:
        """One step of ``feeds`` (``decode``: a decode plan, one token each)."""
        ids = torch.tensor([t for _, chunk in feeds for t in chunk], dtype=torch.long)
        out = {}
        for fused in (True, False):
            streams = self.streams[fused]
            plan = (
                streams.decode_plan([n for n, _ in feeds])
                if decode
                else streams.plan([(n, len(c)) for n, c in feeds])
            )
            out[fused] = forward_step(self.model, ids, plan, self.caches[fused], fused=fused)
        err = (out[True] - out[False]).abs().max().item() if ids.numel() else 0.0
        assert err <= TOL, f"fused against HF's forward: max abs logit error {err}"
        for (name, chunk), rows in zip(feeds, out[True].split([len(c) for _, c in feeds])):
            if chunk:
                self.tokens.setdefault(name, []).extend(chunk)
                self.logits.setdefault(name, []).append(rows)

    def next_token(self, name: str) -> int:
        return int(self.logits[name][-1][-1].argmax())

    def decode(self, names: list[str]) -> None:
        self.step([(n, [self.next_token(n)]) for n in names], decode=True)

    def check(self, reference: torch.nn.Module, name: str, prompt_len: int) -> None:
        """The stream's logits against one full forward, its greedy tokens
        against ``generate``."""
        tokens = torch.tensor([self.tokens[name]])
        with torch.no_grad():
            expected = reference(tokens, use_cache=False).logits[0]
        err = (torch.cat(self.logits[name]) - expected).abs().max().item()
        assert err <= TOL, f"{name}: max abs logit error {err}"
        new = tokens.shape[1] - prompt_len + 1
        generated = reference.generate(tokens[:, :prompt_len], max_new_tokens=new, do_sample=False)
        assert generated[0, prompt_len:].tolist() == [
            *self.tokens[name][prompt_len:],
            self.next_token(name),
        ]


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SIZES["vocab_size"], (n,), generator=gen).tolist()


@pytest.mark.parametrize("packed", [False, True], ids=["float32", "packed"])
def test_mixed_steps_match_hf(kernels, packed):
    """Chunked prefills beside decode rows, a row that only reads, then
    decode plans of three rows: every step's logits are HF's forward's, and
    each stream's are the model's own full forward and generate."""
    reference, paged = _llama(packed)
    assert fused_step(paged) is not None
    a, b, c = _prompt(9, 1), _prompt(5, 2), _prompt(6, 3)
    run = Twin(paged)
    run.step([("a", a[:4]), ("b", b)])
    run.step([("b", [run.next_token("b")]), ("a", a[4:]), ("c", c[:2])])
    run.step([("c", c[2:]), ("a", [run.next_token("a")]), ("b", [])])
    for _ in range(3):
        run.decode(["a", "b", "c"])
    # one token per row but a row that only reads: the decode kernel's rows without a query
    run.step([("a", [run.next_token("a")]), ("b", []), ("c", [run.next_token("c")])])
    run.decode(["a", "b", "c"])
    for name, prompt in (("a", a), ("b", b), ("c", c)):
        run.check(reference, name, len(prompt))


def test_rope_scaling_and_bias_follow_the_model(kernels):
    """Llama 3's rope scaling and biased projections come from the model's
    own modules."""
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8,
            "rope_theta": 500.0}  # fmt: skip
    reference, paged = _llama(rope_parameters=rope, attention_bias=True, mlp_bias=True)
    assert fused_step(paged) is not None
    prompt = _prompt(12, 4)
    run = Twin(paged, page_size=3)
    run.step([("a", prompt)])
    for _ in range(3):
        run.decode(["a"])
    run.check(reference, "a", len(prompt))


def test_refused_models_run_hf_forward():
    """A Gemma (not of the Llama family), a layer with a hook, training
    mode, a compiled or wrapped forward: refused, and ``forward_step`` runs
    HF's forward (exact as before)."""
    config = transformers.GemmaConfig(**SIZES, head_dim=16)
    gemma = transformers.GemmaForCausalLM(config).eval()
    assert "is a GemmaForCausalLM, not one of LlamaForCausalLM" in fused_refusal(gemma)
    _, paged = _llama()
    paged.model.layers[1].mlp.register_forward_hook(lambda *args: None)
    assert fused_refusal(paged) == "has hooks on its modules" and fused_step(paged) is None
    _, paged = _llama()
    assert fused_step(paged.train()) is None and fused_step(paged.eval()) is not None
    paged.forward = paged.forward  # compiled or wrapped (an instance attribute): HF's
    assert fused_step(paged) is None
    _, paged = _llama()
    paged.model.layers[0].mlp.forward = paged.model.layers[0].mlp.forward
    assert "replaced" in fused_refusal(paged)


@pytest.mark.parametrize("how", ["new parameter", "new storage"])
def test_weights_changed_after_the_first_step_are_followed(how):
    """The HF layers share the fused weights; a layer given new storage
    afterwards (a new parameter, or new data under the same one, as
    ``model.to(...)`` and ``half()`` give) is noticed and the fused weights
    rebuilt (never stale)."""
    reference, paged = _llama()
    run = Twin(paged)
    prompt = _prompt(6, 5)
    run.step([("a", prompt)])
    first = fused_step(paged)
    weight = torch.randn_like(paged.model.layers[2].self_attn.v_proj.weight)
    for model in (reference, paged):
        v_proj = model.model.layers[2].self_attn.v_proj
        if how == "new parameter":
            v_proj.weight = torch.nn.Parameter(weight.clone())
        else:
            v_proj.weight.data = weight.clone()
    assert fused_step(paged) is not first
    run.decode(["a"])  # each step checks the fused logits against HF's forward
    run.decode(["a"])


def test_storage_check_joins_checks_and_sees_new_or_absent_tensors():
    """A ``StorageCheck`` (and one joined of several) holds while its slots
    keep their storage, and fails once one gets new storage or none."""
    layers = [torch.nn.Linear(4, 4) for _ in range(3)]
    checks = [StorageCheck([(m._parameters, "weight")]) for m in layers]
    joined = StorageCheck.joined(checks)
    assert joined() and all(check() for check in checks)
    with torch.no_grad():
        layers[0].weight.mul_(2)  # in place: the same storage
    assert joined()
    layers[1].weight.data = layers[1].weight.data.clone()
    assert not joined() and not checks[1]() and checks[0]() and checks[2]()
    layers[1].weight = None
    assert not checks[1]() and not StorageCheck.joined(checks[1:])()
    with pytest.raises(ValueError, match="a tensor in every slot"):
        StorageCheck([(layers[1]._parameters, "weight")])


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "weights",
    ["float32", "int16", "lanes", "bf16", "kquants"],
    ids=["float32", "int16 activations", "int4 lanes", "bf16 panels", "K-quant lanes"],
)
def test_layer_stack_is_the_layers_bit_for_bit(weights, kv_dtype):
    """Steps of fewer than ``BF16_ROWS`` tokens on packed layers (decode
    rows, a short prefill chunk beside one) run as one ``decode_layers``
    call: the same logits, bit for bit, as layer by layer, the int4 layers
    on float32 or int16 activations (from their lanes too), or bf16 layers
    (bfloat16 panels), or a Q4_K_M file's layers (lanes of float32 scales,
    int4 q/k and int8 v side by side), over
    a float32 or a bfloat16 KV cache;
    a long prefill, and ``BF16_ROWS`` rows (the bfloat16 panels' count), run
    layer by layer; float32 layers, and
    int4 ones with and without int16 activations, never stack."""
    _stack_against_layers(weights, kv_dtype)


def test_layer_stack_on_one_thread_is_the_layers_bit_for_bit():
    """With one thread the stack's gang is the caller alone (its shares
    inline, its barriers none): still the layers' logits bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _stack_against_layers("int16", torch.float32)
    finally:
        torch.set_num_threads(threads)


def test_layer_stack_checks_every_layer_before_any_runs():
    """A layer the stack cannot run (the last one's norm weight of another
    width) is refused before the first runs: the KV cache as it was."""
    if layer_ops_or_why() is not None or kernel_or_why() is not None:
        pytest.skip("no layer ops or packed kernels here")
    _, paged = _llama(packed=True, int16=True)
    stack = fused_step(paged).stack
    streams, spec = Streams(64, 4, seed=3), hf.kv_spec(paged).cache_kwargs()
    cache = KVCache(num_pages=64, page_size=4, dtype=torch.float32, **spec)
    forward_step(paged, torch.tensor(_prompt(5, 1)), streams.plan([("r0", 5)]), cache)
    weights = stack._weights()
    weights[len(weights) - 14 + 7] = torch.ones(3)  # the last layer's post-attention norm
    stack._weights = lambda: weights
    before = [cache.layer(i).clone() for i in range(len(stack.layers))]
    with pytest.raises(RuntimeError, match=r"expected a norm weight \[64\]"):
        forward_step(paged, torch.tensor([7]), streams.decode_plan(["r0"]), cache)
    assert all(torch.equal(cache.layer(i), b) for i, b in enumerate(before))


def _stack_against_layers(
    weights: str, kv_dtype: torch.dtype, arch: str = "llama", **settings
) -> None:
    """``test_layer_stack_is_the_layers_bit_for_bit`` on a tiny model of ``arch``."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    assert "not packed" in LayerStack.refusal(fused_step(_llama(arch=arch, **settings)[1]).layers)
    int16, lanes = weights in ("int16", "lanes"), weights in ("lanes", "kquants")
    if lanes and (kernel_or_why() or not torch.ops.mstar_quant.lanes_rows()):
        pytest.skip("the kernels' build has no int4 lanes (no AVX512-VNNI)")
    kquants = weights == "kquants"
    _, paged = _llama(packed=True, int16=int16, bf16=weights == "bf16", lanes=lanes,
                      kquants=kquants, arch=arch, **settings)  # fmt: skip
    if kquants:
        assert all(isinstance(layer.qkv.module, SideBySide) for layer in fused_step(paged).layers)
    if int16 and arch == "llama":
        _, mixed = _llama(packed=True, int16=True)
        mlp = mixed.model.layers[1].mlp
        mlp.down_proj = PackedLinear(mlp.down_proj.packed(), None, None, False)
        assert "with and without int16" in LayerStack.refusal(fused_step(mixed).layers)
    with torch.no_grad():  # norms of their own (a fresh model's are all ones)
        for name, weight in paged.named_parameters():
            if "norm" in name:
                weight.uniform_(0.5, 1.5)
    stack_equals_layers(paged, kv_dtype)
    o_proj = paged.model.layers[1].self_attn.o_proj  # a bias given afterwards: read by the stack
    o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features), requires_grad=False)
    assert fused_step(paged).stack._biases()[4 + 1] is o_proj.bias


def stack_equals_layers(paged: torch.nn.Module, kv_dtype: torch.dtype = torch.float32) -> None:
    """Steps of prefills, decode rows from 1 to ``BF16_ROWS`` and a short
    chunk through ``paged`` (packed, on the plan) with and without its layer
    stack: the same logits bit for bit, the stack serving those of fewer
    than ``BF16_ROWS`` tokens."""
    fused = fused_step(paged)
    stack, served = fused.stack, []
    assert stack is not None

    def counted(*args):
        pending = stack(*args)
        served.append(pending is not None)
        return pending

    names = [f"r{i}" for i in range(BF16_ROWS)]
    logits = {}
    for use in (True, False):
        fused.stack = stack if use else None
        if use:
            fused.stack = counted
        streams, spec = Streams(64, 4, seed=3), hf.kv_spec(paged).cache_kwargs()
        cache = KVCache(num_pages=64, page_size=4, dtype=kv_dtype, **spec)
        prompts = [_prompt(3 + i, 20 + i) for i in range(len(names))]
        plan = streams.plan([(n, len(p)) for n, p in zip(names, prompts)])
        ids = torch.tensor([t for p in prompts for t in p])
        out = [forward_step(paged, ids, plan, cache)]
        for rows in (1, 2, 4, 3, BF16_ROWS - 1, BF16_ROWS, 1):
            ids = torch.tensor([int(out[-1][-1].argmax()) + i for i in range(rows)])
            plan = streams.decode_plan(names[:rows])
            out.append(forward_step(paged, ids, plan, cache))
        ids = torch.tensor([int(out[-1][-1].argmax()) + i for i in range(4)])
        plan = streams.plan([(names[0], 3), (names[1], 1)])  # a chunk of 3 queries, causal
        out.append(forward_step(paged, ids, plan, cache))
        logits[use] = out
    fused.stack = stack
    assert served == [False, True, True, True, True, True, False, True, True]
    for a, b in zip(logits[True], logits[False]):
        assert torch.equal(a, b)


def test_row_concat_shares_the_layers_weights():
    """q/k/v as one packed GEMM: the same outputs as the three layers, whose
    weights are now views of the concatenation (no second copy)."""
    if kernel_or_why() is not None:
        pytest.skip(f"packed kernels: {kernel_or_why()}")
    torch.manual_seed(1)
    layers = [PackedLinear(quantize_int4(torch.randn(n, 64))) for n in (64, 32, 32)]
    x = torch.randn(5, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.allclose(joined(x), alone, atol=1e-5)
    assert torch.allclose(torch.cat([m(x) for m in layers], dim=1), alone, atol=0)
    assert layers[1].qweight.data_ptr() == joined.module.qweight[64:].data_ptr()
    assert joined.current()
    layers[2].scales = layers[2].scales.clone()
    layers[2].qweight = layers[2].qweight.clone()
    assert not joined.current()


def test_row_concat_joins_bfloat16_panels_as_views():
    """Packed layers with bfloat16 panels join theirs too: many rows give
    the layers' own outputs, each layer's panels a view of the joined ones;
    layers with and without panels do not join."""
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)
    torch.manual_seed(2)
    packed = [quantize_int4(torch.randn(n, 64)) for n in (64, 32, 96)]
    layers = [PackedLinear(p, None, bf16_panels(p)) for p in packed]
    x = torch.randn(7, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.equal(joined(x), alone)
    assert layers[2].panels.data_ptr() == joined.module.panels[3:].data_ptr()
    assert torch.equal(layers[2].panels, bf16_panels(packed[2]))
    assert "different formats, arithmetic" in concat_refusal([layers[0], PackedLinear(packed[1])])


def test_row_concat_joins_int4_lanes_as_views():
    """int4 layers with lanes (16 rows an entry) join along them: few rows
    give the layers' own outputs, each layer's lanes a view of the joined
    ones, which are the lanes of the joined weights; layers with and
    without lanes do not join; layers that hold lanes and panels alone (no
    row-major copy) join and are checked by their lanes."""
    if (why := kernel_or_why()) is not None or not torch.ops.mstar_quant.lanes_rows():
        pytest.skip(why or "the kernels' build has no int4 lanes (no AVX512-VNNI)")
    torch.manual_seed(4)
    packed = [quantize_int4(torch.randn(n, 64)) for n in (64, 32, 48)]
    layers = [PackedLinear(p, None, None, True, p.lanes()) for p in packed]
    x = torch.randn(2, 64)
    alone = torch.cat([m(x) for m in layers], dim=1)
    joined = RowConcat(layers)
    assert torch.equal(joined(x), alone)
    assert layers[2].lanes.data_ptr() == joined.module.lanes[6:].data_ptr()
    assert torch.equal(joined.module.lanes, joined.module.packed().lanes())
    plain = PackedLinear(packed[1], None, None, True)
    assert "arithmetic or lanes" in concat_refusal([layers[0], plain])
    if bf16_or_why() is not None:
        return
    # with panels too, the layers hold no row-major copy: they join, and are checked, by their lanes
    alone = [PackedLinear(p, None, bf16_panels(p), True, p.lanes()) for p in packed[:2]]
    assert all(m.qweight is None for m in alone)
    x = torch.randn(3, 64)
    want = torch.cat([m(x) for m in alone], dim=1)
    joined = RowConcat(alone)
    assert joined.module.qweight is None and torch.equal(joined(x), want)
    assert torch.equal(joined.module.packed().qweight, torch.cat([p.qweight for p in packed[:2]]))
    assert alone[1].lanes.data_ptr() == joined.module.lanes[4:].data_ptr() and joined.current()
    alone[1].lanes = alone[1].lanes.clone()
    assert not joined.current()


def test_row_concat_joins_bf16_layers_panels_as_views():
    """bf16 layers (their qweight the panels, 32 rows an entry) join along
    their panels: the layers' own outputs at any row count, each layer's
    panels a view of the joined ones, checked as the packed ones are."""
    if (why := kernel_or_why() or bf16_or_why()) is not None:
        pytest.skip(why)
    torch.manual_seed(3)
    layers = [PackedLinear(pack_bf16(torch.randn(n, 64))) for n in (64, 32, 96)]
    joined = RowConcat(layers)
    for rows in (1, BF16_ROWS):
        x = torch.randn(rows, 64)
        assert torch.equal(joined(x), torch.cat([m(x) for m in layers], dim=1))
    assert layers[2].qweight.data_ptr() == joined.module.qweight[3:].data_ptr()
    assert layers[2].qweight.shape == (3, 32, 32, 2) and joined.current()
    layers[1].qweight = layers[1].qweight.clone()
    assert not joined.current()


def test_step_rotary_tables_are_hf_s_bit_for_bit():
    """``StepRotary``'s tables are HF's ``cos`` and ``sin`` with the first
    half of ``sin`` negated, bit for bit; the ``signs`` passed back in serve
    the next step, and ones of another width or dtype are made anew."""
    from mstar.models.llama.rotary import StepRotary

    config = transformers.LlamaConfig(**SIZES)
    rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.tensor([0, 1, 7, 4095, 123456])
    cos, sin = rotary_emb(torch.empty(0), positions[None])
    half = cos.shape[-1] // 2
    expected = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1)
    first = StepRotary(rotary_emb, positions, torch.float32)
    assert torch.equal(first.cos_rows.view(torch.int32), cos[0].view(torch.int32))
    assert torch.equal(first.sin_rows.view(torch.int32), expected.view(torch.int32))
    assert torch.equal(first.sin[:, 0], first.sin_rows) and first.cos.shape == (5, 1, 2 * half)
    again = StepRotary(rotary_emb, positions[:2], torch.float32, first.signs)
    assert again.signs is first.signs
    assert torch.equal(again.sin_rows.view(torch.int32), expected[:2].view(torch.int32))
    for signs in (first.signs[:-2], first.signs.double()):
        assert torch.equal(
            StepRotary(rotary_emb, positions, torch.float32, signs).signs, first.signs
        )


def test_rotary_table_rows_are_the_module_s_bit_for_bit():
    """``RotaryTable``'s gathered rows are ``StepRotary``'s at the same
    positions bit for bit (default and llama3 rope), grown past the largest
    position asked, made anew when ``inv_freq`` changes in place, None past
    ``TABLE_BYTES``; dynamic rope types are not served."""
    from mstar.models.llama import rotary as rotary_module
    from mstar.models.llama.rotary import RotaryTable, StepRotary

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 1024}  # fmt: skip
    for scaling in (None, llama3):
        config = transformers.LlamaConfig(**SIZES, rope_scaling=scaling)
        rotary_emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
        assert RotaryTable.serves(rotary_emb)
        table = RotaryTable(rotary_emb, n=8)
        for positions in ([0], [5, 6, 7], [3, 900, 4095, 7]):
            got = table(torch.tensor(positions))
            want = StepRotary(rotary_emb, torch.tensor(positions), torch.float32)
            assert torch.equal(got.cos_rows.view(torch.int32), want.cos_rows.view(torch.int32))
            assert torch.equal(got.sin_rows.view(torch.int32), want.sin_rows.view(torch.int32))
        assert len(table.cos) == 2 * 4095 + 2
    rotary_emb.inv_freq.mul_(0.5)  # in place: the tables follow
    got, want = table(torch.tensor([77])), StepRotary(rotary_emb, torch.tensor([77]), torch.float32)
    assert torch.equal(got.sin_rows, want.sin_rows)
    most = rotary_module.TABLE_BYTES // (8 * table.cos.shape[-1])
    assert table(torch.tensor([most])) is None and table(torch.tensor([most - 1])) is not None
    dynamic = transformers.LlamaConfig(
        **SIZES, rope_scaling={"rope_type": "dynamic", "factor": 2.0}
    )
    emb = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(dynamic)
    assert not RotaryTable.serves(emb)


def test_layer_ops_silu_mul_matches_torch_over_the_float_range():
    """silu(g) * u with the vectorized exponential: within a few float32 ulps of
    float64 over [-100, 100] (every lane position and the scalar tail: 1539
    columns), a NaN staying NaN."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    g = torch.cat([torch.linspace(-100, 100, 1539), torch.randn(1539) * 4]).view(2, 1539)
    u = torch.randn(2, 1539)
    got = torch.ops.mstar_layer.silu_mul(torch.cat([g, u], dim=1))
    want = torch.nn.functional.silu(g.double()) * u.double()
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-30)
    g[1, 5] = float("nan")
    assert torch.ops.mstar_layer.silu_mul(torch.cat([g, u], dim=1))[1, 5].isnan()


@pytest.mark.parametrize(
    "rows, heads, kv_heads, dim, atol",
    [
        (((7, 1), (3, 1)), 4, 2, 8, 1e-6),  # decode: one query a row
        (((5, 1), (9, 1), (2, 1)), 2, 1, 12, 1e-6),  # a head width of no whole 8 floats
        # 2^17+ multiply-adds in all: the rows spread over threads (``threaded``);
        # hundreds of keys summed in another order
        ((*((n, 1) for n in (300, 1, 257, 64, 190, 299, 128)), (5, 1)), 8, 2, 64, 1e-5),
        (((1500, 1), (1201, 1)), 8, 2, 64, 1e-5),  # fewer rows than threads: KV heads apart
        (((100, 1),), 9, 3, 64, 1e-5),  # one decode row, SmolLM2's heads
        (((700, 1),), 9, 3, 64, 1e-5),  # ... its keys in parts over the threads, merged
        (((900, 3),), 8, 2, 64, 1e-5),  # a chunk's three queries, each its own keys in parts
        (((9, 1),), 64, 8, 128, 1e-5),  # too few pages to part; eight heads a KV head
        (((30, 1), (0, 3)), 10, 2, 16, 1e-5),  # five heads a KV head, 16 floats each
        # a KV head each; four rows, the next row's pages asked for during each
        (((200, 1), (37, 1), (3, 1), (150, 1)), 4, 4, 64, 1e-5),
        # prefill: fresh prompts and chunks after a history, each query causal in its row,
        # beside decode rows; a row of one query among them
        (((0, 5), (7, 1), (0, 1), (13, 9), (4, 64)), 4, 2, 8, 1e-6),
        (((0, 37), (40, 21), (300, 3), (0, 64), (2, 1)), 9, 3, 64, 1e-5),
        # heads of whole 16 floats past 64 (AVX-512: a 64-float block, then 16 at a time)
        (((6, 1), (0, 7), (3, 2)), 4, 2, 80, 1e-5),
    ],
)
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_layer_ops_attention_matches_paged_attention(rows, heads, kv_heads, dim, atol, kv_dtype):
    """The layer ops' attention, from the q/k/v GEMM's output: rotary
    applied, keys and values written where ``KVCache.write`` puts them,
    each row's queries causal over its pages as ``paged_attention``'s; over
    a bfloat16 cache too (the new keys and values rounded into it alike,
    every key read back as float32)."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    from mstar.models.llama.attention import StepAttention
    from mstar.models.llama.rotary import StepRotary

    torch.manual_seed(2)
    config = transformers.LlamaConfig(
        hidden_size=heads * dim, num_attention_heads=heads, head_dim=dim
    )
    width = (heads + 2 * kv_heads) * dim
    tokens = sum(new for _, new in rows)
    positions = torch.cat([torch.arange(old, old + new) for old, new in rows])
    rotary = StepRotary(
        transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config),
        positions,
        torch.float32,
    )
    pages = sum(-(-(old + new) // 4) for old, new in rows) + 4
    streams = Streams(pages, 4, seed=5)
    caches = [KVCache(num_layers=1, num_pages=pages, page_size=4, num_kv_heads=kv_heads,
                      head_dim=dim, dtype=kv_dtype) for _ in range(2)]  # fmt: skip
    names = [f"r{i}" for i in range(len(rows))]
    history = [(name, old) for name, (old, _) in zip(names, rows) if old]
    plan = streams.plan(history)
    written = sum(old for _, old in history)
    k, v = torch.randn(written, kv_heads, dim), torch.randn(written, kv_heads, dim)
    for cache in caches:
        cache.write(0, plan, k, v)
    if all(new == 1 for _, new in rows):
        plan = streams.decode_plan(names)
    else:
        plan = streams.plan([(name, new) for name, (_, new) in zip(names, rows)])
    qkv = torch.randn(tokens, width)
    fast = StepAttention(plan, caches[0], 0.3, torch.device("cpu"), kernels=True)
    slow = StepAttention(plan, caches[1], 0.3, torch.device("cpu"), kernels=False)
    assert fast.rows is not None and slow.rows is None
    got = fast.fused(0, qkv, rotary, heads=heads)
    q_and_k = heads + kv_heads
    qk = rotary(qkv[:, : q_and_k * dim].view(tokens, q_and_k, dim))
    want = slow(
        0, qk[:, :heads], qk[:, heads:], qkv[:, q_and_k * dim :].view(tokens, kv_heads, dim)
    )
    written = caches[0].layer(0), caches[1].layer(0)
    if kv_dtype == torch.bfloat16:  # the same rounding (to nearest even) of the same keys
        rotated_apart = (written[0].float() - written[1].float()).abs().max()
        assert rotated_apart <= 2**-7 * written[1].float().abs().max()
    else:
        assert torch.allclose(*written, atol=1e-6)
    assert torch.allclose(got, want.reshape(tokens, -1), atol=atol)


def test_long_prefill_rows_attend_through_sdpa():
    """A row of more than ``KERNEL_PAIRS`` causal (query, key) pairs (a
    fresh prompt of 512 tokens) sends the step to SDPA over gathered pages,
    the op's rows unset; 511 tokens, or one query over more keys, do not."""
    if layer_ops_or_why() is not None:
        pytest.skip(f"layer ops: {layer_ops_or_why()}")
    from mstar.models.llama.attention import StepAttention

    streams = Streams(64 + 2, 16, seed=1)
    cache = KVCache(num_layers=1, num_pages=66, page_size=16, num_kv_heads=1, head_dim=8)
    for spans, served in (([("a", 511)], True), ([("b", 512)], False), ([("a", 1)], True)):
        step = StepAttention(streams.plan(spans), cache, 1.0, torch.device("cpu"), kernels=True)
        assert (step.rows is not None) == served and (step.schedule is None) == served


def _engine_runs(model: torch.nn.Module, tokenizer, prompts, params, **options):
    """Each prompt's completions through an engine on a copy of ``model``,
    fused and not: ``{fused: [completion outputs per prompt]}``."""
    from mstar.engine import Engine

    runs = {}
    for fused in (True, False):
        engine = Engine(copy.deepcopy(model), tokenizer, fused=fused, **options)
        runs[fused] = [c.outputs for c in engine.generate(prompts, params)]
        if fused:
            assert fused_step(engine.model) is not None
    return runs


def _same_runs(runs, tol: float) -> None:
    for fused_outs, hf_outs in zip(runs[True], runs[False]):
        for a, b in zip(fused_outs, hf_outs):
            assert a.token_ids == b.token_ids
            for ra, rb in zip(a.logprobs, b.logprobs):
                assert [x.token_id for x in ra.top] == [y.token_id for y in rb.top]
                assert max(abs(x.logprob - y.logprob) for x, y in zip(ra.top, rb.top)) <= tol


def test_engine_with_forks_and_prefix_reuse_matches_hf():
    """The engine's steps (prefill chunks beside decode rows, n=2 forks,
    prompts reusing a cached prefix): the same tokens and log-probabilities
    fused as through HF's forward."""
    from mstar.engine import SamplingParams

    _, paged = _llama()
    shared = _prompt(10, 6)
    prompts = [shared + _prompt(3, 7), shared + _prompt(5, 8), _prompt(7, 9)]
    params = SamplingParams(max_new_tokens=6, n=2, temperature=0.7, seed=1, logprobs=3)
    runs = _engine_runs(paged, None, prompts, params, num_pages=64, page_size=4,
                        token_budget=12, prefix_cache=True)  # fmt: skip
    _same_runs(runs, 1e-4)


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_smollm2_fused_matches_hf(smollm2, quantization):
    """SmolLM2 (float32, and its GGUF's own packed weights): the engine's
    greedy tokens and log-probabilities fused are those through HF's
    forward, and float32's are ``generate``'s."""
    from mstar.engine import SamplingParams
    from mstar.models.loader import load

    model, tok = smollm2 if quantization == "none" else load("smollm2", quantization="gguf")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=3)
    runs = _engine_runs(model, tok, prompts, params, num_pages=32)
    _same_runs(runs, 1e-3)
    if quantization == "none":
        for prompt, outs in zip(prompts, runs[True]):
            ids = tok(prompt, return_tensors="pt").input_ids
            want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
            assert outs[0].token_ids == want.tolist()
