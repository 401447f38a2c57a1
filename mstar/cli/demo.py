"""The demo workload served through ``mstar.engine.Engine``, and its checker.

Requests arrive over steps (continuous batching): greedy chat prompts, one
asking for ``n`` sampled answers (seeded), one guided (classifier-free
guidance against an empty question), on a pool small enough to force
preemption. ``check`` recomputes every output with the model alone.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch

from mstar.engine import Completion, Engine, SamplingParams
from mstar.engine.prompts import chat_prompt
from mstar.engine.sampling.params import make_generator, sample_token

CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Name three primary colors.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "What is a prime number?",
    "Suggest a name for a pet goldfish.",
    "How many legs does a spider have?",
    "Write one sentence about autumn.",
    "What does a compiler do?",
    "Recommend a book for a long flight.",
    "What is the boiling point of water?",
)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, n=3, seed=0)
GUIDANCE = 1.5


@dataclass(frozen=True)
class DemoRequest:
    """One request of the workload, added to the engine at step ``arrival``."""

    id: str
    prompt: list[int]
    params: SamplingParams
    arrival: int
    question: str | None = None
    uncond: list[int] | None = None
    guidance_scale: float = 1.0


def chat_workload(
    tokenizer, num_requests: int, max_new_tokens: int, seed: int
) -> list[DemoRequest]:
    """Chat questions arriving 0-2 steps apart; request 1 is guided (when
    there are at least three), request 2 samples ``n = 3`` answers, the
    rest are greedy."""
    rng = random.Random(seed)
    greedy = SamplingParams(max_new_tokens=max_new_tokens)
    sampled = replace(SAMPLED, max_new_tokens=max_new_tokens)
    empty = chat_prompt(tokenizer, "")
    requests, arrival = [], 0
    for i in range(num_requests):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        guided = i == 1 and num_requests >= 3
        requests.append(
            DemoRequest(
                f"req{i}",
                chat_prompt(tokenizer, question),
                sampled if i == 2 else greedy,
                arrival,
                question,
                uncond=empty if guided else None,
                guidance_scale=GUIDANCE if guided else 1.0,
            )
        )
        arrival += rng.randint(0, 2)
    return requests


def random_workload(vocab: int, num_requests: int, seed: int) -> list[DemoRequest]:
    """Random prompts of 5-48 tokens arriving 1-3 steps apart, 4-16 new
    tokens; about one in six samples 2-3 answers, request 1 is guided."""
    rng = random.Random(seed)
    requests = []
    for i in range(num_requests):
        prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(5, 48))]
        params = SamplingParams(max_new_tokens=rng.randint(4, 16))
        uncond, scale = None, 1.0
        if i % 6 == 2:
            params = SamplingParams(
                max_new_tokens=params.max_new_tokens, temperature=0.8, n=rng.randint(2, 3), seed=i
            )
        if i == 1 and num_requests >= 3:
            uncond, scale = [rng.randrange(1, vocab) for _ in range(rng.randint(3, 12))], GUIDANCE
        requests.append(
            DemoRequest(f"req{i}", prompt, params, i * rng.randint(1, 3), None, uncond, scale)
        )
    return requests


def serve(
    engine: Engine,
    workload: list[DemoRequest],
    progress: Callable[[Engine, int], None] | None = None,
) -> dict[str, Completion]:
    """Add each request at its arrival step and step until all are done;
    ``progress(engine, step_index)`` after each step."""
    waiting = sorted(workload, key=lambda r: r.arrival)
    done: dict[str, Completion] = {}
    step_index = 0
    while waiting or engine.has_unfinished():
        while waiting and waiting[0].arrival <= step_index:
            r = waiting.pop(0)
            engine.add_request(
                r.prompt,
                r.params,
                request_id=r.id,
                uncond_prompt=r.uncond,
                guidance_scale=r.guidance_scale,
            )
        done.update((c.request_id, c) for c in engine.step() if c.finished)
        step_index += 1
        if progress is not None:
            progress(engine, step_index)
    return done


@torch.no_grad()
def check(
    reference: torch.nn.Module,
    workload: list[DemoRequest],
    done: dict[str, Completion],
    eos_ids: Collection[int],
    progress: Callable[[], None] | None = None,
) -> list[tuple[str, bool]]:
    """Every output recomputed by the model alone: greedy ones by HF
    ``generate`` (attention mask, EOS), sampled ones by replaying the sampler
    over the model's logits, guided ones by the model's forward on both
    prompts each step. Returns (what, passed) per output; ``progress()``
    is called after each."""
    device = next(reference.parameters()).device
    results = []
    for r in workload:
        for out in done[r.id].outputs:
            got, params = out.token_ids, r.params
            stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
            if r.uncond is not None:
                want = _guided(reference, r, stop, device)
            elif params.greedy:
                ids = torch.tensor([r.prompt], device=device)
                want = reference.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=params.max_new_tokens,
                    do_sample=False,
                    eos_token_id=sorted(stop) or None,
                    pad_token_id=min(stop, default=0),
                )[0, len(r.prompt) :].tolist()
            else:
                want = _replayed(reference, r.prompt, got, params, out.index, device)
            ends = [i for i, t in enumerate(got) if t in stop]
            ended_right = (
                ends == [len(got) - 1]
                if out.finish_reason == "stop"
                else (not ends and len(got) == params.max_new_tokens)
            )
            results.append((f"{r.id}/{out.index}", got == want and ended_right))
            if progress is not None:
                progress()
    return results


def _guided(reference, r: DemoRequest, stop: set[int], device) -> list[int]:
    want: list[int] = []
    while len(want) < r.params.max_new_tokens and not (want and want[-1] in stop):
        c = reference(torch.tensor([r.prompt + want], device=device)).logits[0, -1]
        u = reference(torch.tensor([r.uncond + want], device=device)).logits[0, -1]
        want.append(int((u + r.guidance_scale * (c - u)).argmax()))
    return want


def _replayed(reference, prompt, tokens, params: SamplingParams, index: int, device) -> list[int]:
    """The tokens the sampler draws, with sample ``index``'s fresh generator,
    from the model's logits over ``prompt + tokens``."""
    logits = reference(torch.tensor([prompt + tokens], device=device)).logits[0]
    generator = make_generator(params, index, torch.device(device))
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
    return [sample_token(row, params, generator) for row in rows]
