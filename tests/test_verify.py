"""The start-up mode check (``mstar.engine.verify``): every mode this CPU
offers agrees with eager float32, and a mode that does not is caught and
falls back (compiled -> eager, half precision -> float32) saying why."""

from __future__ import annotations

import copy
import os
from dataclasses import replace

import pytest
import torch

from mstar.engine import Engine, SamplingParams
from mstar.engine.verify import ModeMismatch, Tolerance, check_mode, float32_reference
from mstar.models import compiled as compiled_module
from mstar.models.seeded import build_model

OPTIONS = {"num_pages": 64, "page_size": 8, "token_budget": 32}


@pytest.fixture(scope="module")
def paged():
    return build_model(seed=0)[1]


def _perturbed(forward, by: float = 3.0):
    """``forward`` with its logits of token 7 raised by ``by``: a wrong mode."""

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        out.logits[..., 7] += by
        return out

    return run


@pytest.mark.parametrize(
    "dtype, compile, kv",
    [
        (torch.float32, True, "auto"),
        (torch.bfloat16, False, "auto"),
        (torch.bfloat16, True, "auto"),
        (torch.float32, True, "bfloat16"),
    ],
    ids=["float32-compiled", "bfloat16-eager", "bfloat16-compiled", "float32-compiled-bf16-kv"],
)
def test_every_mode_agrees_with_eager_float32(paged, dtype, compile, kv):
    engine = Engine(copy.deepcopy(paged).to(dtype), compile=compile, kv_cache_dtype=kv, **OPTIONS)
    if compile:
        assert engine.compiled.startswith("compiled"), engine.compiled
    check = engine.mode_check
    assert check is not None and check.ok, check
    assert check.tokens == 24 and engine.stats.steps == 0 and not engine.has_unfinished()
    if engine.cache.dtype == torch.float32:  # the same arithmetic, reordered: (nearly) exact
        assert check.worst < 1e-3 and check.flips == 0, check
    else:  # keys and values rounded to bfloat16: close, not exact
        assert engine.cache.dtype == torch.bfloat16 and 0 < check.worst < 0.05, check
    assert engine.dtype == dtype


def test_float32_eager_is_the_reference_and_not_checked(paged):
    engine = Engine(copy.deepcopy(paged), **OPTIONS)
    assert engine.compiled is None and engine.mode_check is None


def test_a_compiled_forward_that_disagrees_falls_back_to_eager(paged, monkeypatch):
    real = compiled_module.torch.compile
    monkeypatch.setattr(
        compiled_module.torch,
        "compile",
        lambda fn, **options: _perturbed(real(fn, backend="eager")),
    )
    engine = Engine(copy.deepcopy(paged), compile=True, **OPTIONS)
    assert engine.compiled.startswith("eager: compiled float32 disagrees with eager float32 (")
    assert "logprob" in engine.compiled or "greedy token" in engine.compiled
    assert "forward" not in vars(engine.model)  # its own eager forward again
    assert engine.mode_check is None and engine.stats.steps == 0


def test_a_half_precision_mode_that_disagrees_is_refused(paged, monkeypatch):
    model = copy.deepcopy(paged).to(torch.bfloat16)
    model.forward = _perturbed(model.forward, by=30.0)
    with pytest.raises(ModeMismatch, match="bfloat16 disagrees with eager float32: token 7's"):
        Engine(model, **OPTIONS)


def test_the_check_allows_a_flip_only_at_a_near_tie(paged):
    engine = Engine(copy.deepcopy(paged), **OPTIONS)
    reference = float32_reference(engine.model)
    assert check_mode(engine, reference, Tolerance(1e-3, 1e-3)).ok
    engine.model.forward = _perturbed(engine.model.forward, by=30.0)  # token 7 wins every step
    tight = check_mode(engine, reference, Tolerance(1e9, 1e-3))
    assert not tight.ok and "greedy token 1 of check prompt 1 is 7" in tight.failure
    assert check_mode(engine, reference, Tolerance(1e9, 1e9)).flips == 24
    close = check_mode(engine, reference, Tolerance(1e-3, 1e9))
    assert not close.ok and "logprob" in close.failure and "|diff|" in close.failure


def _serve_args(**overrides):
    import argparse

    args = dict(
        model="random", seed=0, device="cpu", dtype="bfloat16", pages=64, page_size=8,
        budget=32, no_prefix_cache=False, tensor_parallel_size=1, enforce_eager=True,
        speculative=None, num_speculative_tokens=4, quantization="none", kv_cache_dtype="auto",
    )  # fmt: skip
    return argparse.Namespace(**{**args, **overrides})


def test_the_cli_serves_float32_when_half_precision_disagrees_and_says_why(monkeypatch):
    from mstar.engine import build
    from mstar.engine.verify import ModeCheck
    from mstar.serve.options import build_engine

    real = build.check_mode

    def made_up(engine, reference, tolerance):
        if tolerance == Tolerance.of(exact=False):
            return ModeCheck(2.0, 1, 0, "made up")
        return real(engine, reference, tolerance)

    monkeypatch.setattr(build, "check_mode", made_up)
    engine, line = build_engine(_serve_args())
    assert engine.dtype == torch.float32 and engine.mode_check is None
    assert line.startswith(
        "float32 (bfloat16 refused: bfloat16 disagrees with eager float32: made up) weights"
    ), line


def test_the_start_up_line_names_the_check_and_speculation():
    from mstar.serve.options import build_engine

    engine, line = build_engine(_serve_args(speculative="ngram", num_speculative_tokens=3))
    assert engine.dtype == torch.bfloat16
    assert "checked: agrees with eager float32 (24 greedy tokens" in line, line
    assert line.endswith("speculative ngram (up to 3 draft tokens)"), line


def test_a_half_kv_cache_that_disagrees_falls_back_to_float32_throughout(monkeypatch):
    """A bfloat16 KV cache under float32 weights whose check fails: served
    over a float32 cache (the exact mode), the line saying why."""
    from mstar.engine import build
    from mstar.engine.verify import ModeCheck
    from mstar.serve.options import build_engine

    real = build.check_mode

    def made_up(engine, reference, tolerance):
        if engine.cache.dtype == torch.bfloat16:
            return ModeCheck(2.0, 1, 0, "made up")
        return real(engine, reference, tolerance)

    monkeypatch.setattr(build, "check_mode", made_up)
    engine, line = build_engine(_serve_args(dtype="float32", kv_cache_dtype="bfloat16"))
    assert engine.cache.dtype == torch.float32 and engine.mode_check is None
    assert line.startswith(
        "float32 (float32 refused: bfloat16 KV cache disagrees with eager float32: made up) weights"
    ), line
    assert not line.endswith("KV cache"), line


def test_a_half_kv_cache_is_checked_and_named_on_the_start_up_line():
    """``--kv-cache-dtype bfloat16`` under float32 weights: not exact, so
    checked against eager float32; the line names the cache."""
    from mstar.serve.options import build_engine

    engine, line = build_engine(_serve_args(dtype="float32", kv_cache_dtype="bfloat16"))
    assert engine.dtype == torch.float32 and engine.cache.dtype == torch.bfloat16
    assert "checked: agrees with eager float32 (24 greedy tokens" in line, line
    assert line.endswith(", bfloat16 KV cache"), line


@pytest.fixture(scope="module")
def packed_kernels():
    from mstar.cpu.quant.kernels import kernel_or_why

    if (why := kernel_or_why()) is not None:
        pytest.skip(f"the packed kernels are not built here: {why}")


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_a_packed_mode_is_checked_exactly_against_its_dequantized_weights(
    paged, packed_kernels, mode
):
    from mstar.cpu.quant import QuantChoice, quantize_model

    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice(mode, "as asked"))
    engine = Engine(model, **OPTIONS)
    check = engine.mode_check
    assert check is not None and check.ok, check
    # the reference is the packed weights dequantized, not the float weights
    # they came from: float32 arithmetic reordered, held to the exact bound
    assert check.worst < 1e-3 and check.flips == 0, check


def test_bfloat16_arithmetic_on_packed_weights_is_checked_at_the_half_precision_bound(
    paged, packed_kernels
):
    from mstar.cpu.quant import QuantChoice, quantize_model
    from mstar.cpu.quant.kernels import bf16_or_why
    from mstar.engine.build import float32_arithmetic, weights_mode

    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    assert not float32_arithmetic(model)
    # the panels where the CPU has AVX512-BF16; int16 activations on any
    arithmetic = "bfloat16+int16" if bf16_or_why() is None else "int16"
    assert weights_mode(model) == f"packed int4 ({arithmetic} arithmetic)"
    engine = Engine(model, **OPTIONS)
    check = engine.mode_check
    assert check is not None and check.ok, check
    assert 1e-6 < check.worst < Tolerance.of(exact=False).logprob_abs, check


def test_a_packed_kernel_that_disagrees_is_refused(paged, packed_kernels, monkeypatch):
    from mstar.cpu.quant import QuantChoice, quantize_model
    from mstar.cpu.quant.linear import PackedLinear

    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice("int8", "as asked"))
    real = PackedLinear.forward
    # off by 1e-2 per output: a kernel bug far below a half-precision bound
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: real(self, x) + 1e-2)
    with pytest.raises(ModeMismatch, match="packed int8 disagrees with eager float32"):
        Engine(model, **OPTIONS)


def test_int8_rows_that_disagree_in_attention_stay_outside_it(paged, packed_kernels, monkeypatch):
    """A model whose check fails with int8 rows in its attention's linear
    layers but passes with them on its MLP alone serves so: the stack rounds
    gate/up and down (slots 2, 3) to int8, not q/k/v and o, with a warning."""
    import mstar.cpu.quant as quant
    import mstar.engine.build as build
    from mstar.cpu.quant import QuantChoice, quantize_model
    from mstar.cpu.quant.linear import PackedLinear
    from mstar.models.llama.step import fused_step

    if not torch.ops.mstar_quant.int8_lane_rows():
        pytest.skip("the kernels' build has no int8 rows (no AVX512-VNNI)")
    monkeypatch.setattr(quant, "HELD_PANELS_BYTES", 0)
    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    real = build.check_mode
    named = [(n, m) for n, m in model.named_modules() if isinstance(m, PackedLinear)]

    def refusing_attention_int8(engine, reference, tolerance):
        found = real(engine, reference, tolerance)
        if any(m.int8_rows for n, m in named if "self_attn" in n):
            return replace(found, failure="made up")
        return found

    monkeypatch.setattr(build, "check_mode", refusing_attention_int8)
    tiles = r"bfloat16\+" * (torch.ops.mstar_quant.amx_rows() > 0)  # AMX: 32+ rows on its tiles
    serving = (
        rf"serving packed int4 \(bfloat16\+int16 arithmetic\), packed int4 \({tiles}int16\+int8"
    )
    with pytest.warns(UserWarning, match="made up; " + serving):
        engine = Engine(model, **OPTIONS)
    assert engine.mode_check.ok and "int8 rows dropped in self_attn" in model.mstar_quantization
    assert not any(m.int8_rows for n, m in named if "self_attn" in n)
    assert all(m.int8_rows for n, m in named if ".mlp." in n)
    assert fused_step(model).stack.int8_slots == 0b1100
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8]]  # two rows a decode step: the stack's int8 rows
    assert all(len(c.outputs[0].token_ids) == 6 for c in engine.generate(prompts, params))


def test_int8_rows_that_disagree_are_dropped_for_the_panels_before_float32(
    paged, packed_kernels, monkeypatch
):
    """A model with int8 rows (lanes held without panels) whose check fails
    is checked again without them: it serves bfloat16 panels from the lanes
    (the fused step's joined layers and stack rebuilt without them), with a
    warning and its description saying so; without int8 rows to drop, the
    failure stands."""
    import mstar.cpu.quant as quant
    import mstar.engine.build as build
    from mstar.cpu.quant import QuantChoice, quantize_model
    from mstar.cpu.quant.linear import PackedLinear
    from mstar.models.llama.step import fused_step

    if not torch.ops.mstar_quant.int8_lane_rows():
        pytest.skip("the kernels' build has no int8 rows (no AVX512-VNNI)")
    monkeypatch.setattr(quant, "HELD_PANELS_BYTES", 0)
    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert all(m.int8_rows for m in layers) and fused_step(model).stack.int8_slots == 0b1111
    real = build.check_mode

    def refusing_int8(engine, reference, tolerance):
        found = real(engine, reference, tolerance)
        if any(m.int8_rows for m in engine.model.modules() if isinstance(m, PackedLinear)):
            return replace(found, failure="made up")
        return found

    monkeypatch.setattr(build, "check_mode", refusing_int8)
    with pytest.warns(UserWarning, match="int8 arithmetic.* made up; serving packed int4"):
        engine = Engine(model, **OPTIONS)
    assert engine.mode_check.ok and not any(m.int8_rows for m in layers)
    fused = fused_step(model)
    assert not fused.stack.int8_slots
    assert not any(getattr(layer.qkv.module, "int8_rows", 0) for layer in fused.layers)
    assert model.mstar_quantization.endswith("int8 rows dropped: 2+ rows on int16 activations"
                                             " up to the lanes' rows, then bfloat16 panels from the lanes")  # fmt: skip
    plain = copy.deepcopy(paged)  # panels held: no int8 rows to drop, the failure stands
    monkeypatch.setattr(quant, "HELD_PANELS_BYTES", 512 << 20)
    quantize_model(plain, QuantChoice("int4", "as asked", "bfloat16"))
    monkeypatch.setattr(build, "check_mode", lambda *args: replace(real(*args), failure="made up"))
    with pytest.raises(ModeMismatch, match="made up"):
        Engine(plain, **OPTIONS)


def test_a_refused_mode_falls_back_to_float32_arithmetic_on_packed_weights_first():
    """bfloat16 arithmetic on packed weights that disagrees: the same packed
    weights in float32 arithmetic; if those disagree too, or the weights are
    not packed, float32 float weights."""
    from mstar.engine.build import float32_unless_checked

    calls = []

    def load(refuse):
        def run(dtype, quantization, kv_cache_dtype):
            calls.append((dtype, quantization))
            if refuse(dtype, quantization):
                raise ModeMismatch(f"{dtype} {quantization} made up")
            return (dtype, quantization, kv_cache_dtype)

        return run

    half = load(lambda d, q: d != torch.float32)
    built, (err, instead) = float32_unless_checked(half, torch.bfloat16, "gguf", packed=True)
    assert (
        built == (torch.float32, "gguf", None)
        and instead == "float32 arithmetic on the packed weights"
    )
    assert str(err) == "torch.bfloat16 gguf made up"
    calls.clear()
    built, (_, instead) = float32_unless_checked(half, torch.bfloat16, "none", packed=False)
    assert calls == [(torch.bfloat16, "none"), (torch.float32, "none")]
    assert instead == "float32 weights"
    calls.clear()
    packed_too = load(lambda d, q: q != "none")
    built, (_, instead) = float32_unless_checked(packed_too, torch.bfloat16, "int4", packed=True)
    assert calls == [(torch.bfloat16, "int4"), (torch.float32, "int4"), (torch.float32, "none")]
    assert built == (torch.float32, "none", "auto") and instead == "float32 weights"
    assert float32_unless_checked(half, torch.float32, "int4", packed=True) == (
        (torch.float32, "int4", None),
        None,
    )


def test_the_reference_shares_the_packed_and_float32_tensors_and_dequantizes_per_layer(
    paged, packed_kernels, monkeypatch
):
    """The reference copies no packed or float32 tensor (a 1B model's
    float32 copy was its load's peak), and scores exactly as a model whose
    packed layers were dequantized whole, though it dequantizes each a
    slice of rows at a time."""
    from mstar.cpu.quant import QuantChoice, quantize_model
    from mstar.engine.verify import Dequantizing, is_packed
    from mstar.models.llama.step import fused_step

    model = copy.deepcopy(paged)
    quantize_model(model, QuantChoice("int4", "as asked", "bfloat16"))
    assert fused_step(model) is not None  # built, as a step before the check builds it
    before = {n: t.data_ptr() for n, t in model.state_dict().items()}
    monkeypatch.setattr(Dequantizing, "ROWS_AT_ONCE", 32)  # the head's 256 rows in 8 slices
    reference = float32_reference(model)
    (held,) = [c.cell_contents for c in reference.__closure__]
    assert "_mstar_fused" not in vars(held)  # its joined weights not copied
    layers = [m.weight_rows.__self__ for m in held.modules() if isinstance(m, Dequantizing)]
    assert len(layers) == 15  # 2 layers x 7 products and the head
    packed = {t.data_ptr() for m in layers for t in m.state_dict().values()}
    shared = packed | {t.data_ptr() for t in held.state_dict().values()}
    assert set(before.values()) <= shared  # nothing of the model's copied
    assert {n: t.data_ptr() for n, t in model.state_dict().items()} == before
    whole = copy.deepcopy(model)
    for name, module in list(whole.named_modules()):
        if is_packed(module):
            whole.set_submodule(name, module.dequantized())
    whole.set_attn_implementation("sdpa")
    ids = [3, 17, 42, 5, 9]
    with torch.inference_mode():
        want = torch.log_softmax(whole(torch.tensor([ids])).logits[0], dim=-1)
    assert torch.equal(reference(ids), want)


def test_a_passed_check_is_recorded_and_read_at_the_next_load_of_the_same_files(
    packed_kernels, tmp_path, monkeypatch
):
    """A load from files records its passed check (keyed by the files, the
    mode, the code, the CPU, the prompts as the pool cuts them); the next
    load of the same files in the same settings reads it instead of
    checking; other settings, or the file
    touched, check again; a model built in memory is checked every time."""
    from gguf_files import write_llama_gguf

    from mstar.engine import build

    monkeypatch.setenv("MSTAR_KV_CACHE", str(tmp_path / "cache"))
    path = write_llama_gguf(tmp_path / "q8.gguf", lambda *_: "Q8_0")
    runs = []
    real = build.check_mode
    monkeypatch.setattr(build, "check_mode", lambda *a: runs.append(1) or real(*a))

    def loaded(**options):
        with Engine.from_pretrained(str(path), quantization="auto", **options) as engine:
            return engine.mode_check

    first = loaded()
    assert len(runs) == 1 and first.ok and not first.recorded
    again = loaded()
    assert (
        len(runs) == 1
        and again.recorded
        and (again.worst, again.tokens) == (first.worst, first.tokens)
    )
    assert "recorded at an earlier load" in again.describe()
    assert not loaded(page_size=8).recorded and len(runs) == 2  # other settings
    assert loaded(num_pages=96).recorded and len(runs) == 2  # a pool the prompts fit alike
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert not loaded().recorded and len(runs) == 3  # the file touched
    for _ in range(2):  # in memory: never recorded
        Engine(build_model(seed=0)[1].to(torch.bfloat16), **OPTIONS).close()
    assert len(runs) == 5


def test_a_failed_check_is_recorded_too(tmp_path, monkeypatch):
    """A failed check is kept as a passed one is: a later load of the same
    files and settings moves on to the next mode without running it again."""
    from mstar.engine.verify import ModeCheck, record_check, recorded_check

    monkeypatch.setenv("MSTAR_KV_CACHE", str(tmp_path))
    failed = ModeCheck(0.7, 3, 0, "greedy token 1 of check prompt 3 is 5")
    record_check("some-key", failed)
    again = recorded_check("some-key")
    assert again == replace(failed, recorded=True) and not again.ok
    assert again.describe().startswith(failed.failure) and "recorded" in again.describe()
    assert recorded_check("another-key") is None
