"""What to generate (``SamplingParams``) and how one token is chosen."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import torch

from mstar.engine.sampling.structured import StructuredOutputs

SEED_LIMIT = 2**63  # seed + sample index must fit a generator's 64-bit seed
MAX_LOGPROBS = 20  # as the OpenAI API's top_logprobs
LOGPROBS = f"None or in [0, {MAX_LOGPROBS}]"
MAX_BIAS = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings, checked at construction (``TypeError``
    for a wrong type, bools not being ints; ``ValueError`` for a bad range;
    the message names the field and the value).

    ``temperature == 0`` is greedy (``top_p``/``top_k`` then unused); otherwise
    logits are divided by ``temperature``, cut to the ``top_k`` most likely
    (0: all) and to the smallest set whose probability reaches ``top_p``, and
    sampled. ``seed`` makes sampling reproducible: sample ``i`` of a request
    draws from its own generator seeded ``seed + i``. A sample ends at an EOS
    token (unless ``ignore_eos``), at one of ``stop_token_ids``, after
    ``max_new_tokens``, or when its text reaches one of ``stop`` (a str or a
    sequence of non-empty str, kept as a tuple; it may span tokens): the text
    then ends before it.

    Before sampling (``mstar.engine.sampling.penalties``, batched over a step's rows):
    ``logit_bias`` (token id -> value in [-100, 100], added), HF's
    ``repetition_penalty`` over prompt + generated tokens (a seen token's
    logit divided by it when positive, multiplied when not), OpenAI's
    ``presence_penalty``/``frequency_penalty`` over generated tokens (in
    [-2, 2]: minus ``presence * (count > 0) + frequency * count``).
    ``min_p`` drops tokens less likely than ``min_p`` times the most likely
    (after temperature). ``logprobs=k`` records each sampled token's
    log-probability and the ``k`` most likely (``mstar.engine.sampling.logprobs``),
    ``prompt_logprobs=k`` those of every prompt token but the first.
    ``structured_outputs`` constrains each sample's text to a JSON schema, a
    regex, a choice or a grammar (``mstar.engine.sampling.structured``; needs a tokenizer).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "top_k", "n"):
            object.__setattr__(self, name, _int(name, getattr(self, name)))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, _int(name, value))
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputs):
            raise TypeError(f"expected structured_outputs a StructuredOutputs, got {so!r:.60}")
        if so is not None and self.ignore_eos:
            raise ValueError(
                "expected ignore_eos False with structured_outputs (a match ends at EOS)"
            )
        reals = ("temperature", "top_p", "presence_penalty", "frequency_penalty")
        for name in (*reals, "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"expected {name} a real number, got {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"expected {name} finite, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.seed is not None:
            object.__setattr__(self, "seed", _int("seed", self.seed))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"expected ignore_eos a bool, got {self.ignore_eos!r}")
        object.__setattr__(self, "stop_token_ids", _stop_token_ids(self.stop_token_ids))
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("n", self.n >= 1, ">= 1"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, LOGPROBS),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
                LOGPROBS,
            ),
            ("presence_penalty", -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", -2 <= self.frequency_penalty <= 2, "in [-2, 2]"),
            ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
            ("min_p", 0 <= self.min_p <= 1, "in [0, 1]"),
            (
                "seed",
                self.seed is None or 0 <= self.seed < SEED_LIMIT - self.n,
                "in [0, 2**63 - n)",
            ),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"expected {name} {want}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        """True when logits change before sampling (biases or penalties)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1
        )


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _int(name: str, value: object) -> int:
    if not _is_int(value):
        raise TypeError(f"expected {name} an int, got {value!r}")
    return int(value)


def _stop_token_ids(ids: object) -> tuple[int, ...]:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise TypeError(f"expected stop_token_ids a sequence of ints, got {ids!r}")
    if not all(_is_int(t) for t in ids):
        raise TypeError(f"expected stop_token_ids ints, got {ids!r}")
    if any(t < 0 for t in ids):
        raise ValueError(f"expected stop_token_ids >= 0, got {ids!r}")
    return tuple(int(t) for t in ids)


def _stop_strings(stop: object) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
        raise TypeError(f"expected stop a str or a sequence of str, got {stop!r}")
    if not all(stop):
        raise ValueError(f"expected stop strings non-empty, got {stop!r}")
    return tuple(stop)


def _logit_bias(bias: object) -> tuple[tuple[int, float], ...]:
    """A mapping (or pairs) of token id -> bias in [-100, 100], as sorted pairs."""
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    if isinstance(pairs, str | bytes) or not isinstance(pairs, Iterable):
        raise TypeError(f"expected logit_bias a mapping of token id to number, got {bias!r:.60}")
    out = {}
    for pair in pairs:
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise TypeError(
                f"expected logit_bias a mapping of token id to number, got {bias!r:.60}"
            )
        token, value = pair
        if not _is_int(token) or isinstance(value, bool) or not isinstance(value, Real):
            raise TypeError(f"expected logit_bias int ids to numbers, got {token!r}: {value!r}")
        if token < 0 or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ValueError(
                f"expected logit_bias ids >= 0 and values in [-100, 100], got {token!r}: {value!r}"
            )
        out[int(token)] = float(value)
    return tuple(sorted(out.items()))


def make_generator(params: SamplingParams, sample: int, device: torch.device) -> torch.Generator:
    """Sample ``sample``'s generator: seeded ``seed + sample``, or from fresh entropy."""
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed + sample)
    return generator


def sample_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token from ``logits`` ``[vocab]`` (any float dtype) under ``params``."""
    if params.greedy:
        return greedy_token(logits)
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.numel():
        kth = scores.topk(params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1:
        ordered, order = scores.sort(descending=True)
        probs = ordered.softmax(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= params.top_p
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = scores.softmax(-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0)
    return draw(probs, generator)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One index drawn with probability ``probs[i] / probs.sum()`` (``probs``
    ``[vocab]``, >= 0, some > 0) by inverting the float64 cumulative sum at
    one uniform number: one random draw a token (``torch.multinomial`` on
    the CPU spends ~1.5 ms a row over 49152 tokens, this ~0.1 ms). A token
    of probability 0 adds no width to the cumulative sum, so it is never drawn."""
    cdf = probs.double().cumsum(0)
    u = torch.rand((), dtype=torch.float64, generator=generator, device=probs.device)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if index >= len(cdf):  # u * total rounded up to the total: the last token drawable
        index = int(torch.nonzero(probs)[-1])
    return index


def greedy_token(logits: torch.Tensor) -> int:
    """The index of ``logits``' maximum, the first of equal ones (``argmax``'s):
    numpy's on a CPU float32 row (vectorized, ~10x torch's over 49152 logits)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return int(logits.detach().numpy().argmax())
    return int(logits.argmax())
