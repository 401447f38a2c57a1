"""``paged_attention`` on SmolLM2's attention shape (9 query heads, 3 KV
heads, head dim 64, pages of 16) against the implementation it replaced
(every row padded to the step's longest query, every row's pages gathered
into one padded buffer) and against a packed HF-style sdpa: one
``scaled_dot_product_attention`` over the step's keys laid out contiguously,
with a block-diagonal causal mask built ahead (the peer, not a floor: it
reads no pages)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from mstar.bench import Row, time_us
from mstar.engine.resources.attn.options import AttentionOptions
from mstar.engine.resources.attn.paged import AttentionSchedule, paged_attention
from mstar.engine.resources.kv.plan import PagedIndptrs

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 9, 3, 64, 16

# (name, rows as (stored context, new tokens)): decode rows at ~300 tokens of
# context, and the mixed step issue 10 measured (15 decode rows + a 115-token chunk).
CASES = [
    ("decode 16 x ~300", [(290 + 2 * i, 1) for i in range(16)]),
    ("mixed 15 decode + 115 chunk", [(290 + 2 * i, 1) for i in range(15)] + [(0, 115)]),
    ("mixed 15 decode + 115 chunk @200", [(290 + 2 * i, 1) for i in range(15)] + [(200, 115)]),
    ("prefill 4 x 64", [(0, 64)] * 4),
]


def padded_attention(
    q: torch.Tensor, kv_layer: torch.Tensor, indptrs: PagedIndptrs, sm_scale: float
) -> torch.Tensor:
    """The replaced implementation (causal only): all rows padded to the
    longest query and the most pages, one batched computation."""
    total_q, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    qo_indptr, kv_indptr = indptrs.qo_indptr.long(), indptrs.paged_kv_indptr.long()
    qo_len, num_pages = qo_indptr.diff(), kv_indptr.diff()
    kv_len = (num_pages - 1) * page_size + indptrs.paged_kv_last_page_len.long()
    qi = torch.arange(int(qo_len.max()))
    q_valid = qi < qo_len[:, None]
    q_tok = (qo_indptr[:-1, None] + qi).clamp_max(total_q - 1)
    max_pages = int(num_pages.max())
    slot = (kv_indptr[:-1, None] + torch.arange(max_pages)).clamp_max(kv_indptr[-1] - 1)
    kv = kv_layer[indptrs.paged_kv_indices.long()[slot]]
    rows, width = len(qo_len), max_pages * page_size
    k = kv[:, :, 0].reshape(rows, width, num_kv_heads, head_dim).transpose(1, 2)[:, :, None]
    v = kv[:, :, 1].reshape(rows, width, num_kv_heads, head_dim).transpose(1, 2)[:, :, None]
    group = num_heads // num_kv_heads
    qp = q[q_tok].view(rows, -1, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    scores = (qp.float() @ k.float().transpose(-1, -2)) * sm_scale
    key = torch.arange(width)
    query = (kv_len - qo_len)[:, None] + qi
    visible = (key < kv_len[:, None, None]) & (key <= query[..., None])
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    rows_out = (weights @ v.float()).permute(0, 3, 1, 2, 4).reshape(rows, -1, num_heads, head_dim)
    out = torch.zeros_like(q)
    out[q_tok[q_valid]] = rows_out[q_valid].to(q.dtype)
    return out


class Case:
    """One step's queries, a layer of pages holding the rows' keys (pages
    shuffled), the plan's index arrays, and the same keys packed for sdpa."""

    def __init__(self, rows: list[tuple[int, int]], seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        kv_lens = [h + n for h, n in rows]
        pages = [-(-n // PAGE_SIZE) for n in kv_lens]
        order = torch.randperm(sum(pages), generator=gen).tolist()
        self.layer = torch.randn(sum(pages), 2, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
        counts = [n for _, n in rows]
        self.q = torch.randn(sum(counts), HEADS, HEAD_DIM, generator=gen)
        self.indptrs = PagedIndptrs(
            torch.tensor(np.cumsum([0, *counts]), dtype=torch.int32),
            torch.tensor(np.cumsum([0, *pages]), dtype=torch.int32),
            torch.tensor(order, dtype=torch.int32),
            torch.tensor([(n - 1) % PAGE_SIZE + 1 for n in kv_lens], dtype=torch.int32),
        )
        # Packed: each row's keys contiguous, a mask allowing its own causal block.
        keys, taken = [], 0
        for n, p in zip(kv_lens, pages):
            keys.append(self.layer[order[taken : taken + p]].transpose(0, 1).flatten(1, 2)[:, :n])
            taken += p
        packed = torch.cat(keys, dim=1)  # [2, sum kv, H_kv, D]
        self.k, self.v = (t.transpose(0, 1)[None] for t in packed)  # [1, H_kv, S, D]
        self.mask = torch.zeros(sum(counts), sum(kv_lens), dtype=torch.bool)
        q0 = k0 = 0
        for (h, n), kv in zip(rows, kv_lens):
            i = torch.arange(n)[:, None]
            self.mask[q0 : q0 + n, k0 : k0 + kv] = torch.arange(kv) <= h + i
            q0, k0 = q0 + n, k0 + kv
        self.scale = HEAD_DIM**-0.5
        self.options = AttentionOptions(sm_scale=self.scale)
        self.schedule = AttentionSchedule(self.indptrs, PAGE_SIZE)

    def ours(self) -> torch.Tensor:
        return paged_attention(self.q, self.layer, self.indptrs, self.options)

    def ours_scheduled(self) -> torch.Tensor:
        """As a layer of ``forward_step`` runs: the step's schedule built by
        an earlier layer."""
        return paged_attention(
            self.q, self.layer, self.indptrs, self.options, schedule=self.schedule
        )

    def old(self) -> torch.Tensor:
        return padded_attention(self.q, self.layer, self.indptrs, self.scale)

    def sdpa(self) -> torch.Tensor:
        q = self.q.transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(
            q, self.k, self.v, attn_mask=self.mask, scale=self.scale, enable_gqa=True
        )
        return out[0].transpose(0, 1)


def run() -> list[Row]:
    """One row per case, µs per layer call: ours (the step's schedule shared,
    as in ``forward_step``), the replaced implementation as the baseline, and
    packed sdpa in the floor column."""
    rows = []
    for name, spec in CASES:
        case = Case(spec)
        torch.testing.assert_close(case.ours(), case.old(), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(case.ours(), case.sdpa(), atol=1e-4, rtol=1e-4)
        rows.append(
            Row(
                "paged_attention",
                name,
                time_us(case.ours_scheduled, target_s=0.05),
                time_us(case.old, target_s=0.05),
                floor_us=time_us(case.sdpa, target_s=0.05),
                params={"rows": len(spec), "tokens": sum(n for _, n in spec)},
            )
        )
    return rows


def main() -> None:
    """Print ms per layer call: ours with the step's schedule shared and
    with its own, the replaced implementation, packed sdpa."""
    head = ("case", "ours ms", "own sched ms", "old ms", "old/ours", "sdpa ms", "ours/sdpa")
    body = []
    for r, (_, spec) in zip(run(), CASES):
        own = time_us(Case(spec).ours, target_s=0.05)
        body.append(
            (
                r.config,
                f"{r.ours_us / 1e3:.3f}",
                f"{own / 1e3:.3f}",
                f"{r.baseline_us / 1e3:.3f}",
                f"{r.speedup:.1f}x",
                f"{r.floor_us / 1e3:.3f}",
                f"{r.over_floor:.2f}x",
            )
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    for line in [head, tuple("-" * w for w in widths), *body]:
        cells = enumerate(zip(line, widths))
        print("  ".join(x.ljust(w) if i == 0 else x.rjust(w) for i, (x, w) in cells))
    print(
        f"SmolLM2 attention shape: {HEADS} q heads, {KV_HEADS} kv heads, head dim {HEAD_DIM},"
        f" page {PAGE_SIZE}; one layer call; torch threads {torch.get_num_threads()}"
    )


if __name__ == "__main__":
    main()
