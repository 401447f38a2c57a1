"""Pages as bytes: the store key that says where a page is valid, and a
checked value that says what it holds.

A page's store key is ``mstar-kv:<identity>:<chain key>``: ``identity``
hashes what makes KV bytes mean the same elsewhere (the model's config,
every weight's and buffer's name, shape, dtype and bytes, the cache dtype
and geometry, the page size, the KV group), the chain key is the
prefix cache's 64-bit key of the page (``kv/keys.py``). A value carries the
identity again, the chain key, the namespace and *every* token of the
chain up to the page's end, then the page's KV, then a CRC-32 of all that.
``decode`` takes a value for a miss (``None``) unless every field checks
out against what was asked, so a colliding chain key, a page of another
model or a truncated or flipped byte is never read as KV.
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_MAGIC = b"MKV1"
_HEAD = struct.Struct("<4s16sQIII")  # magic, identity, chain key, namespace bytes, tokens, kv
_CRC = struct.Struct("<I")


def model_identity(model: Any, cache: Any, page_size: int, group: str = "all") -> bytes:
    """16 bytes naming where a KV page is valid: ``model``'s config, each
    weight's and buffer's name, shape, dtype and *every* byte (packed ones as
    packed), ``cache``'s dtype and geometry (a ``KVCache``), ``page_size`` and
    the KV ``group``. Reads all the weights once (SHA-256: about 0.35 s for
    SmolLM2-135M in float32 on one Zen 3 core, see docs/kv-tiers.md)."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    as_dict = getattr(config, "to_dict", None)
    text = json.dumps(as_dict(), sort_keys=True, default=str) if as_dict else repr(config)
    h.update(text.encode())
    for name, t in model_tensors(model):
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(_raw_bytes(t))
    geometry = (
        cache.dtype, cache.num_layers, page_size, cache.num_kv_heads, cache.head_dim,
        cache.v_head_dim, group,
    )  # fmt: skip
    h.update(repr(geometry).encode())
    return h.digest()[:16]


def model_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """``model``'s parameters then buffers by name, each tensor once."""
    seen: set[int] = set()
    out = []
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """``t``'s bytes (uint8, on the CPU; a view when already contiguous there)."""
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.contiguous().view(torch.uint8).cpu().numpy()


def store_key(identity: bytes, key: int) -> str:
    """The store's name for the page keyed ``key`` (a chain key) under ``identity``."""
    return f"mstar-kv:{identity.hex()}:{key:016x}"


@dataclass(frozen=True)
class PageRecord:
    """One page to store or as loaded: its chain key, namespace, the chain's
    tokens from position 0 to the page's end (int64), and its KV bytes."""

    key: int
    namespace: str
    chain: np.ndarray
    kv: bytes


def encode(identity: bytes, page: PageRecord) -> bytes:
    """The value stored for ``page``."""
    ns = page.namespace.encode()
    tokens = np.ascontiguousarray(page.chain, dtype="<i8").tobytes()
    body = b"".join(
        (_HEAD.pack(_MAGIC, identity, page.key, len(ns), len(page.chain), len(page.kv)), ns,
         tokens, page.kv)
    )  # fmt: skip
    return body + _CRC.pack(zlib.crc32(body))


def decode(
    value: bytes | None, identity: bytes, key: int, namespace: str, chain: np.ndarray, kv_len: int
) -> tuple[bytes | None, str]:
    """``(kv bytes, "")`` when ``value`` is the page keyed ``key`` under
    ``identity`` in ``namespace`` whose chain is ``chain`` (int64, from
    position 0), with ``kv_len`` bytes of KV; else ``(None, why)`` — a miss."""
    if value is None:
        return None, "absent"
    if len(value) < _HEAD.size + _CRC.size:
        return None, f"short value ({len(value)} bytes)"
    body, (crc,) = memoryview(value)[: -_CRC.size], _CRC.unpack(value[-_CRC.size :])
    if zlib.crc32(body) != crc:
        return None, "checksum mismatch"
    magic, ident, got_key, ns_len, n_tokens, n_kv = _HEAD.unpack_from(value)
    if magic != _MAGIC or ident != identity or got_key != key:
        return None, "another model's, format's or key's page"
    at = _HEAD.size
    if bytes(body[at : at + ns_len]) != namespace.encode():
        return None, "another namespace"
    at += ns_len
    want = np.ascontiguousarray(chain, dtype="<i8").tobytes()
    if n_tokens != len(chain) or bytes(body[at : at + 8 * n_tokens]) != want:
        return None, "another token chain (a key collision)"
    at += 8 * n_tokens
    if n_kv != kv_len or len(body) - at != kv_len:
        return None, f"expected {kv_len} bytes of KV, got {len(body) - at}"
    return bytes(body[at:]), ""
