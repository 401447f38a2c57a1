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
from mstar.cpu.quant import without_int8_rows  # noqa: E402
from mstar.cpu.quant.at_load import quantize_int4, quantize_int8  # noqa: E402
from mstar.cpu.quant.kernels import bf16_or_why, kernel_or_why  # noqa: E402
from mstar.cpu.quant.linear import BF16_ROWS, PackedLinear  # noqa: E402
from mstar.cpu.quant.packed import Packed, pack_bf16  # noqa: E402
from mstar.engine.resources.kv.cache import KVCache  # noqa: E402
from mstar.models import hf  # noqa: E402
from mstar.models.hf import forward_step, register  # noqa: E402
from mstar.models.llama import step as llama_step  # noqa: E402
from mstar.models.llama.fused_linear import (  # noqa: E402
    SideBySide,
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

    def check(
        self, reference: torch.nn.Module, name: str, prompt_len: int, tol: float = TOL
    ) -> None:
        """The stream's logits against one full forward (within ``tol``), its
        greedy tokens against ``generate``."""
        tokens = torch.tensor([self.tokens[name]])
        with torch.no_grad():
            expected = reference(tokens, use_cache=False).logits[0]
        err = (torch.cat(self.logits[name]) - expected).abs().max().item()
        assert err <= tol, f"{name}: max abs logit error {err}"
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


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "weights",
    ["float32", "int16", "lanes", "bf16", "kquants", "kquants-mlp"],
    ids=[
        "float32",
        "int16 activations",
        "int4 lanes",
        "bf16 panels",
        "K-quant lanes",
        "K-quant lanes, int8 rows outside the attention",
    ],
)
def test_layer_stack_is_the_layers_bit_for_bit(weights, kv_dtype):
    """Steps of fewer than ``BF16_ROWS`` tokens on packed layers (decode
    rows, a short prefill chunk beside one) run as one ``decode_layers``
    call: the same logits, bit for bit, as layer by layer, the int4 layers
    on float32 or int16 activations (from their lanes too), or bf16 layers
    (bfloat16 panels), or a Q4_K_M file's layers (lanes of float32 scales,
    int4 q/k and int8 v side by side; 2+ rows on int8 activations, or outside
    the attention), over a float32 or a bfloat16 KV cache;
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
    kquants = weights.startswith("kquants")
    _, paged = _llama(packed=True, int16=int16, bf16=weights == "bf16", lanes=lanes,
                      kquants=kquants, arch=arch, **settings)  # fmt: skip
    if weights == "kquants-mlp":
        paged.mstar_quantization = "K-quants"
        assert without_int8_rows(paged, "self_attn")
    if kquants:
        assert all(isinstance(layer.qkv.module, SideBySide) for layer in fused_step(paged).layers)
        # down is int8 pairs of float32 scales here (not Q6_K's factors): no int8 rows
        slots = (0b0100 if weights == "kquants-mlp" else 0b0111) * bool(
            torch.ops.mstar_quant.int8_lane_rows()
        )
        assert fused_step(paged).stack.int8_slots == slots
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
