"""The KV tiers' model identity (``codec.model_identity``: every weight's
bytes, SHA-256) on SmolLM2-135M, once per quantization named:

    OMP_WAIT_POLICY=PASSIVE python benchmarks/identity_cost.py none gguf

Loads the model each way, then times ``model_identity`` five times and
prints the weights' bytes and the min and median seconds.
"""

from __future__ import annotations

import sys
import time
from types import SimpleNamespace

import torch

from mstar.engine.resources.kv.tiers.codec import model_identity, model_tensors
from mstar.models.loader import load

# SmolLM2-135M's cache geometry (the identity hashes it; its cost is nil)
CACHE = SimpleNamespace(
    dtype=torch.float32, num_layers=30, num_kv_heads=3, head_dim=64, v_head_dim=64
)


def main(quantizations: list[str]) -> None:
    for q in quantizations or ["none", "gguf"]:
        model, _ = load("smollm2", dtype=torch.float32, quantization=q)
        size = sum(t.numel() * t.element_size() for _, t in model_tensors(model))
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            model_identity(model, CACHE, 16)
            times.append(time.perf_counter() - t0)
        times.sort()
        print(f"{q}: {size / 1e6:.0f} MB, min {times[0]:.3f} s, median {times[2]:.3f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
