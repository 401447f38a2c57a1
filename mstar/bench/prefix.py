"""The prefix cache's lookup: ``PagePool.page_keys`` + ``lookup`` of a prompt
against cached pages, against the straightforward way (a hashlib digest per
page, chained, then a dict lookup per page until the first miss)."""

from __future__ import annotations

import hashlib

import numpy as np

from mstar.bench import Row, time_us
from mstar.engine.resources.kv.pages import PagePool

PAGE_SIZE = 16


def baseline_match(tokens: np.ndarray, page_size: int, cache: dict[bytes, int]) -> list[int]:
    """The pages of the longest cached run of ``tokens``' full pages: one
    chained blake2b digest and one dict lookup per page."""
    pages, key = [], b""
    for i in range(len(tokens) // page_size):
        page = tokens[i * page_size : (i + 1) * page_size]
        key = hashlib.blake2b(key + page.tobytes(), digest_size=16).digest()
        hit = cache.get(key)
        if hit is None:
            break
        pages.append(hit)
    return pages


def run(prompts=((4096, 3504), (1024, 512), (256, 128))) -> list[Row]:
    """Per (prompt tokens, cached tokens): the prompt less its last token
    (``match_prefix`` leaves one to compute) matched against a pool holding
    the cached prefix's pages, cached-unowned."""
    rows = []
    rng = np.random.default_rng(0)
    for length, cached in prompts:
        tokens = rng.integers(0, 50_000, size=length, dtype=np.int64)
        n = cached // PAGE_SIZE
        pool = PagePool(4 * n + 64, PAGE_SIZE)
        filler = pool.alloc(64)  # cached pages need not be the first ones
        pages = pool.alloc(n)
        pool.register(pages, pool.page_keys(tokens[:cached]))
        pool.release(pages)
        pool.release(filler)
        cache, key = {}, b""
        for i, page in enumerate(pages.tolist()):
            chunk = tokens[i * PAGE_SIZE : (i + 1) * PAGE_SIZE]
            key = hashlib.blake2b(key + chunk.tobytes(), digest_size=16).digest()
            cache[key] = page
        query = tokens[: length - 1]

        def ours(q=query, p=pool):
            return p.lookup(p.page_keys(q))

        got = ours()
        assert got.tolist() == pages.tolist() == baseline_match(query, PAGE_SIZE, cache)
        rows.append(
            Row(
                "prefix match",
                f"{length}-token prompt, {cached} cached ({n} pages of {PAGE_SIZE})",
                time_us(ours),
                time_us(lambda q=query, c=cache: baseline_match(q, PAGE_SIZE, c)),
                params={"tokens": length, "cached": cached},
            )
        )
    return rows
