"""``mstar-kv demo --window mistral|gemma2``: a tiny seeded sliding-window
model (no download) served twice on the same pool, keeping every page (the
prefix cache on) and releasing the pages behind the window (off): the pages
each KV group holds at its peak, the preemptions, and whether the outputs
agree (with ``--check``, against HF ``generate`` too).

Mistral windows every layer, so its streams hold their window alone and the
pool serves more at once; Gemma 2 alternates windowed and full layers (two KV
groups of 2 layers on one pool of the same memory: 2 x ``--pages`` pages of
2 layers), so its windowed group holds its window while the full group takes
what the windowed one gave back, beyond the ``--pages`` a pool of its own
would have had.
"""

from __future__ import annotations

import random

import torch

from mstar.cli.demo import DemoRequest, check, serve
from mstar.engine import Engine, SamplingParams
from mstar.engine.resources.groups import KVGroups
from mstar.models.seeded import build_model

WINDOW = 16
CONFIGS = {
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "gemma2": (
        "Gemma2Config",
        {
            "layer_types": ["sliding_attention", "full_attention"] * 2,
            "sliding_window": WINDOW,
            "attn_logit_softcapping": 50.0,
            "head_dim": 16,
        },
    ),
}


def build_windowed(kind: str, seed: int, device: str | torch.device = "cpu"):
    """A seeded tiny 4-layer ``kind`` model with a window of ``WINDOW``
    tokens, and a twin for the engine (``mstar.models.seeded.build_model``)."""
    class_name, settings = CONFIGS[kind]
    return build_model(
        seed, device, config_class=class_name, num_hidden_layers=4,
        max_position_embeddings=1024, **settings,
    )  # fmt: skip


def long_workload(vocab: int, num_requests: int, max_new_tokens: int, seed: int):
    """Greedy requests of 20-40 random prompt tokens, all arriving at once."""
    rng = random.Random(seed)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    return [
        DemoRequest(
            f"req{i}", [rng.randrange(1, vocab) for _ in range(rng.randint(20, 40))], params, 0
        )
        for i in range(num_requests)
    ]


def run_window_demo(
    kind: str,
    *,
    requests: int,
    max_new_tokens: int,
    pages: int,
    page_size: int,
    budget: int,
    seed: int,
    device: str | torch.device = "cpu",
    verify: bool = False,
) -> int:
    """Serve the workload keeping every page, then releasing; print the
    table. 0 when the outputs agree (and pass ``check`` with ``verify``)."""
    reference, model = build_windowed(kind, seed, device)
    workload = long_workload(model.config.vocab_size, requests, max_new_tokens, seed)
    print(
        f"mstar-kv demo --window {kind}: a tiny seeded {model.config.model_type}, window"
        f" {WINDOW}, {requests} requests x {max_new_tokens} new tokens, a pool of {pages}"
        f" pages of {page_size}"
    )
    print("| engine | KV group (window: layers) | peak pages (of the pool) | preemptions | steps |")
    print("|---|---|---:|---:|---:|")
    outputs = []
    for name, prefix_cache in (("keeps every page", True), ("releases behind the window", False)):
        engine = Engine(
            model, num_pages=pages, page_size=page_size, token_budget=budget,
            prefix_cache=prefix_cache,
        )  # fmt: skip
        done, peaks = _serve_counting(engine, workload)
        outputs.append({rid: c.outputs[0].token_ids for rid, c in done.items()})
        stats, pool = engine.stats, _pool(engine)
        for i, (group, peak) in enumerate(zip(_groups(engine), peaks)):
            row = (name, stats.preemptions, stats.steps) if i == 0 else ("", "", "")
            print(f"| {row[0]} | {group} | {peak} of {pool} | {row[1]} | {row[2]} |")
        if isinstance(engine.mgr, KVGroups):
            print(f"| | all groups, one pool | {stats.peak_pages} of {pool} | | |")
    same = outputs[0] == outputs[1]
    print(f"outputs equal between the two engines: {'yes' if same else 'NO'}")
    if not verify:
        return 0 if same else 1
    results = check(reference, workload, done, engine.eos_token_ids)
    failed = [what for what, ok in results if not ok]
    print(f"against HF generate: {len(results) - len(failed)} passed, {len(failed)} failed")
    return 0 if same and not failed else 1


def _groups(engine: Engine) -> list[str]:
    """Each KV group's window and layers."""
    if not isinstance(engine.mgr, KVGroups):
        return [f"{engine.mgr.window or 'none (every page)'}: all layers"]
    return [
        f"{window or 'full'}: {', '.join(map(str, layers))}"
        for window, layers in zip(engine.mgr.windows, engine.mgr.layers)
    ]


def _pool(engine: Engine) -> str:
    """The pool's pages, and the layers each covers."""
    if not isinstance(engine.mgr, KVGroups):
        return f"{engine.mgr.num_pages} (every layer)"
    return f"{engine.mgr.num_pages} ({engine.mgr.size} layers)"


def _serve_counting(engine: Engine, workload: list[DemoRequest]) -> tuple[dict, list[int]]:
    """``serve``, and the most pages each KV group held after any step."""
    mgr = engine.mgr
    peaks = [0] * (len(mgr.managers) if isinstance(mgr, KVGroups) else 1)

    def record(e: Engine, _: int) -> None:
        held = (
            mgr.group_pages() if isinstance(mgr, KVGroups) else [mgr.num_pages - mgr.num_free_pages]
        )
        peaks[:] = map(max, peaks, held)

    return serve(engine, workload, record), peaks
