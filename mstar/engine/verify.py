"""The start-up mode check: the engine's forward, in whatever mode it runs
(dtype x compiled x quantization), against the eager float32 forward.

``check_mode`` runs a few fixed prompts greedily through the engine (its
own steps: a prefill, then one-token decode steps), recording each step's
top log-probabilities, and scores the same tokens with ``reference``, a
float32 eager forward over the whole sequence (teacher-forced on the
engine's own tokens). The mode agrees when

- every greedy token is the reference's argmax, or the reference's margin
  between its argmax and the engine's token is under ``flip_margin`` (a
  near tie, which rounding may flip), and
- at every step the top tokens' log-probabilities are within ``logprob_abs``
  of the reference's.

``Tolerance.of(dtype, compiled)`` holds the per-mode bounds (docs/engine.md
gives the measurements they come from). A new mode plugs in with its own
tolerance and the reference its weights dequantize to
(``float32_reference``).
"""

from __future__ import annotations

import copy
import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mstar.cpu.build import code_digest
from mstar.cpu.cachedir import cache_root
from mstar.cpu.quant.arena import trim_heap

__all__ = [
    "ModeCheck",
    "ModeMismatch",
    "Tolerance",
    "check_mode",
    "float32_reference",
    "is_packed",
    "record_check",
    "record_key",
    "recorded_check",
]

PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "How do I sort a list in Python?",
)
NEW_TOKENS = 8
RECORDS = "checks"  # under the cache folder: passed checks, by ``record_key``
TOP = 5  # the top log-probabilities compared at each step

Reference = Callable[[Sequence[int]], torch.Tensor]  # token ids -> [T, V] float32 logprobs


class ModeMismatch(ValueError):
    """The engine's mode disagrees with the eager float32 forward (the
    message says where); the mode must not serve."""


@dataclass(frozen=True)
class Tolerance:
    """How far a mode may stray from eager float32: ``logprob_abs``, the
    most any top token's log-probability may differ; ``flip_margin``, the
    reference's top-2 margin under which a greedy token may differ."""

    logprob_abs: float
    flip_margin: float

    @staticmethod
    def of(exact: bool) -> Tolerance:
        """The bound for float32 arithmetic (``exact``: the same sums
        reordered, as a compiled forward or packed weights on float32
        activations do; measured ~3e-5) or for any other mode (half-precision
        weights, a config's quantization: measured up to 0.32 on SmolLM2 in
        bfloat16; a flip allowed within 0.5 of a tie)."""
        if exact:
            return Tolerance(logprob_abs=1e-3, flip_margin=1e-3)
        return Tolerance(logprob_abs=1.0, flip_margin=0.5)


@dataclass(frozen=True)
class ModeCheck:
    """What ``check_mode`` found: the worst log-probability difference, the
    greedy tokens compared and flipped (within the margin), and why the mode
    disagrees (None: it agrees)."""

    worst: float
    tokens: int
    flips: int
    failure: str | None
    recorded: bool = False  # read from a record (``recorded_check``), not run at this load

    @property
    def ok(self) -> bool:
        return self.failure is None

    def describe(self) -> str:
        when = "; recorded at an earlier load of these files, build and settings" * self.recorded
        if self.failure is not None:
            return self.failure + when
        flips = f", {self.flips} near-tie flips" if self.flips else ""
        return f"agrees with eager float32 ({self.tokens} greedy tokens{flips}, max |dlogprob| {self.worst:.1g}{when})"


def record_key(model: Any, settings: str) -> str | None:
    """A name for a check of ``model`` in the mode ``settings`` describes
    on this CPU and build: the files it was loaded from
    (``model.mstar_source``, as ``mstar.models.loader.load`` sets it: each
    file's name, size and modification time), ``settings``, the CPU, and
    mstar's code (``code_digest``); None for a model not loaded by mstar
    (one built or changed in memory): those are checked at every load."""
    from mstar.cpu.info import cpu_info

    if getattr(model, "mstar_source", None) is None:
        return None
    source = Path(model.mstar_source)
    files = sorted(source.iterdir()) if source.is_dir() else [source]
    parts = [str(source.resolve()), settings, cpu_info().describe()]
    parts += [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.is_file()]
    return code_digest(*parts)


def recorded_check(key: str | None) -> ModeCheck | None:
    """The check recorded under ``key`` (``record_check``), or None."""
    path = cache_root() / RECORDS / f"{key}.json"
    if key is None or not path.exists():
        return None
    return ModeCheck(**json.loads(path.read_text()), recorded=True)


def record_check(key: str | None, check: ModeCheck) -> None:
    """Keep ``check`` under ``key`` for later loads (written aside, then
    renamed into place): a passed one, or a failed one (the same files, code,
    CPU and settings fail alike: a later load moves on to the next mode at
    once, as a model refusing int8 rows does)."""
    if key is None:
        return
    folder = cache_root() / RECORDS
    folder.mkdir(parents=True, exist_ok=True)
    fields = {"worst": check.worst, "tokens": check.tokens, "flips": check.flips,
              "failure": check.failure}  # fmt: skip
    scratch = folder / f".{key}.{os.getpid()}"
    scratch.write_text(json.dumps(fields))
    scratch.replace(folder / f"{key}.json")


def float32_reference(model: Any) -> Reference:
    """An eager float32 forward over ``model``'s weights, as a function of
    token ids returning log-probabilities; the model itself unchanged. It
    shares the model's float32, integer and packed tensors (only
    half-precision weights are copied, upcast): each packed layer dequantizes its weights
    as it runs, so one layer's float32 weights exist at a time, not the
    model's. Free it by dropping the function."""
    from mstar.models.llama.step import FUSED_ATTRIBUTE

    memo = _shared(model)
    # not copied: a compiled forward, and the fused step, whose joined weights are no
    # tensor of the model's (a copy of an 8B's took 4 GB); the reference runs neither
    attrs = ("forward", "_mstar_eager_forward", FUSED_ATTRIBUTE)
    skipped = [a for a in attrs if a in vars(model)]
    memo.update({id(vars(model)[a]): None for a in skipped})
    reference = copy.deepcopy(model, memo=memo)
    for attr in skipped:
        vars(reference).pop(attr)
    reference = reference.float().eval()
    reference.set_attn_implementation("sdpa")

    def forward(ids: Sequence[int]) -> torch.Tensor:
        with torch.inference_mode():
            tensor = torch.tensor([list(ids)], device=next(reference.parameters()).device)
            return torch.log_softmax(reference(tensor).logits[0].float(), dim=-1)

    return forward


class Dequantizing(torch.nn.Module):
    """A packed layer as the reference runs it: float32 ``F.linear`` on its
    weights dequantized at each call, ``ROWS_AT_ONCE`` output rows at a
    time (``weight_rows``), each slice freed after and the heap trimmed. It holds the layer's
    method, not the layer: ``.float()`` on the reference must not upcast
    a bf16 layer's panels into copies."""

    ROWS_AT_ONCE = 256  # 8 MiB of float32 at K = 8192 (1024: a 1B Q6_K load peaked 0.13 GiB higher)

    def __init__(self, packed: torch.nn.Module) -> None:
        super().__init__()
        self.weight_rows, self.rows = packed.weight_rows, packed.out_features
        # a plain attribute, not a parameter: ``.float()`` on the reference leaves it
        self.bias = None if packed.bias is None else packed.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        slices = [
            F.linear(x, self.weight_rows(start, min(start + self.ROWS_AT_ONCE, self.rows)))
            for start in range(0, self.rows, self.ROWS_AT_ONCE)
        ]
        y = torch.cat(slices, dim=-1)
        trim_heap()  # the slices' pages back to the OS: glibc kept ~0.35 GB of a 1B's
        return y if self.bias is None else y + self.bias


def _shared(model: Any) -> dict[int, Any]:
    """A ``deepcopy`` memo: each packed layer enters the copy as
    ``Dequantizing`` over the layer itself (never copied), and the float32
    tensors and those of no float dtype (a quantized embedding's blocks,
    which ``.float()`` leaves) as they are (the reference reads them, never
    writes)."""
    packed = {id(m): Dequantizing(m) for m in model.modules() if is_packed(m)}
    shared = {
        id(t): t
        for t in (*model.parameters(), *model.buffers())
        if t.dtype == torch.float32 or not t.is_floating_point()
    }
    return {**shared, **packed}


def is_packed(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a linear layer on packed weights
    (``mstar.cpu.quant``): one with ``dequantized()``, its float32 ``nn.Linear``."""
    return callable(getattr(module, "dequantized", None))


def check_prompts(engine: Any, params: Any) -> list[list[int]]:
    """The fixed prompts as ids (chats through the tokenizer, else seeded
    ids), each cut from the left to what a small pool holds alone."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        rng = random.Random(0)
        vocab = engine.model.config.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(12)] for _ in PROMPTS]
    elif getattr(tokenizer, "chat_template", None) is not None:
        prompts = [engine.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    else:
        prompts = [tokenizer.encode(p) for p in PROMPTS]
    for i, prompt in enumerate(prompts):
        while len(prompt) > 1 and engine.peak_pages(len(prompt), params) > engine.mgr.num_pages:
            prompt = prompt[len(prompt) // 2 :]
        prompts[i] = prompt
    return prompts


def check_params() -> Any:
    """The check's sampling: ``NEW_TOKENS`` greedy tokens, the ``TOP`` log-probabilities."""
    from mstar.engine.sampling.params import SamplingParams

    return SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)


def check_mode(engine: Any, reference: Reference, tolerance: Tolerance) -> ModeCheck:
    """Greedy tokens and top log-probabilities of ``engine`` on the fixed
    prompts against ``reference`` (see the module). Leaves the engine's
    counters as they were; nothing stays queued."""
    params = check_params()
    stats = copy.deepcopy(engine.stats)
    prompts = check_prompts(engine, params)
    try:
        done = engine.generate(prompts, params)
    finally:
        engine.stats = stats
    worst, tokens, flips = 0.0, 0, 0
    for number, (completion, prompt) in enumerate(zip(done, prompts), 1):
        out = completion.outputs[0]
        ref = reference([*prompt, *out.token_ids[:-1]])[len(prompt) - 1 :]
        for step, (token, record) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[step]
            best = int(row.argmax())
            tokens += 1
            margin = float(row[best] - row[token])
            if token != best:
                if margin >= tolerance.flip_margin:
                    return ModeCheck(worst, tokens, flips, (
                        f"greedy token {step + 1} of check prompt {number} is {token}, eager"
                        f" float32's is {best} by a margin of {margin:.3g} (>= {tolerance.flip_margin:g})"
                    ))  # fmt: skip
                flips += 1
            for lp in record.top:
                diff = abs(lp.logprob - float(row[lp.token_id]))
                worst = max(worst, diff)
                if diff > tolerance.logprob_abs:
                    return ModeCheck(worst, tokens, flips, (
                        f"token {lp.token_id}'s logprob at step {step + 1} of check prompt"
                        f" {number} is {lp.logprob:.4g}, eager float32's {float(row[lp.token_id]):.4g}"
                        f" (|diff| {diff:.3g} > {tolerance.logprob_abs:g})"
                    ))  # fmt: skip
    return ModeCheck(worst, tokens, flips, None)
