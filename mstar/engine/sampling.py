"""What to generate (``SamplingParams``) and how one token is chosen."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings.

    ``temperature == 0`` is greedy (``top_p``/``top_k`` then unused); otherwise
    logits are divided by ``temperature``, cut to the ``top_k`` most likely
    (0: all) and to the smallest set whose probability reaches ``top_p``, and
    sampled. ``seed`` makes sampling reproducible: sample ``i`` of a request
    draws from its own generator seeded ``seed + i``. A sample ends at an EOS
    token (unless ``ignore_eos``), at one of ``stop_token_ids``, or after
    ``max_new_tokens``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        checks = [
            ("max_new_tokens", self.max_new_tokens >= 1, ">= 1"),
            ("temperature", self.temperature >= 0, ">= 0"),
            ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
            ("top_k", self.top_k >= 0, ">= 0"),
            ("n", self.n >= 1, ">= 1"),
        ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"expected {name} {want}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
        return int(logits.argmax())
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
    return int(torch.multinomial(probs, 1, generator=generator))
