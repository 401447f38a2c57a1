"""Structured outputs through xgrammar: what a sample's text must match
(``StructuredOutputs``), and an engine's grammars (``Grammars``).

Each grammar is compiled once per spec (cached) against the engine's
tokenizer; each sample gets its own ``GrammarMatcher``, advanced with every
token it accepts (a recompute after preemption feeds tokens already
accepted, so the matcher needs no rollback). Each step fills one bitmask row
per constrained logits row and masks the rows that refuse a token in one
select.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one of: ``json`` (a JSON schema, a dict or its text),
    ``json_object`` (any JSON object), ``regex``, ``choice`` (one of these
    strings), ``grammar`` (EBNF, xgrammar's dialect) or ``structural_tag``
    (xgrammar's structural tag, a dict or its JSON text: free text and tagged
    regions such as tool calls). JSON is compact (no whitespace between
    tokens; a structural tag's own JSON regions set their whitespace). A sample that stops at ``max_new_tokens``
    may be cut short of a match; one that stops at EOS always matches."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        for name in ("json", "structural_tag"):
            if isinstance(getattr(self, name), dict):  # keeps key order
                object.__setattr__(self, name, json.dumps(getattr(self, name)))
        if self.choice is not None:
            if isinstance(self.choice, str) or not isinstance(self.choice, Sequence):
                raise TypeError(f"expected choice a list of str, got {self.choice!r:.60}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise TypeError(f"expected json_object a bool, got {self.json_object!r}")
        for name in ("json", "regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"expected structured_outputs.{name} a str, got {value!r:.60}")
        if self.choice is not None and not (
            self.choice and all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(f"expected choice non-empty strings, got {self.choice!r:.60}")
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                f"expected structured_outputs to set exactly one of {KINDS}, got {kinds or 'none'}"
            )

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))


class Grammars:
    """One engine's grammar compiler over its tokenizer and vocabulary
    (logits width), ending a match at ``stop_ids``, built at the first
    request that needs it; compiled grammars cached per spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int]) -> None:
        self._tokenizer, self._stop_ids = tokenizer, sorted(stop_ids)
        self._xgr: Any = None
        self._compiler: Any = None
        self._compiled: dict[StructuredOutputs, Any] = {}
        self._one: Any = None
        self.vocab_size = vocab_size

    def matcher(self, spec: StructuredOutputs) -> Any:
        """A fresh matcher of ``spec``'s grammar; ``ValueError`` naming the
        problem when it does not compile (or xgrammar is not installed)."""
        compiled = self._compiled.get(spec)
        if compiled is None:
            compiled = self._compiled[spec] = self._compile(spec)
        return self._xgr.GrammarMatcher(compiled)

    def _start(self) -> Any:
        if self._compiler is None:
            try:
                import xgrammar
            except ImportError:
                raise ValueError(
                    "structured_outputs need xgrammar: pip install 'mstar-kv[serve]'"
                ) from None
            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_ids or None
            )
            self._xgr, self._compiler = xgrammar, xgrammar.GrammarCompiler(info, max_threads=1)
            self._one = xgrammar.allocate_token_bitmask(1, self.vocab_size)  # allowed()'s row
        return self._compiler

    def _compile(self, spec: StructuredOutputs) -> Any:
        c, kind = self._start(), spec.kind
        try:
            if kind == "json":
                return c.compile_json_schema(spec.json, any_whitespace=False)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec.regex)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(map(json.dumps, spec.choice)))
            if kind == "structural_tag":
                return c.compile_structural_tag(spec.structural_tag)
            return c.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as err:
            problem = str(err).strip().splitlines()[-1] if str(err).strip() else repr(err)
            raise ValueError(f"invalid structured_outputs {kind}: {problem}") from None

    def mask(self, logits: torch.Tensor, matchers: Sequence[Any]) -> torch.Tensor:
        """``logits`` ``[R, vocab]`` with the tokens each row's matcher (None:
        unconstrained) refuses at -inf: one bitmask fill per constrained row,
        one select over the rows that refuse any token (``masked``); a float32
        copy when a row refuses any, else ``logits`` itself (a matcher in free
        text, as ``auto`` tool calls before their start, costs its fill alone)."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return logits
        bitmask = self._xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for k, i in enumerate(rows):
            matchers[i].fill_next_token_bitmask(bitmask, k)
        refusing = (bitmask != -1).any(dim=1).tolist()  # -1: every bit set
        if not any(refusing):
            return logits
        keep = [k for k, refuses in enumerate(refusing) if refuses]
        return masked(logits, [rows[k] for k in keep], bitmask[keep])

    def allowed(self, matcher: Any) -> np.ndarray:
        """The ids ``matcher`` allows next, ascending (int64). Unpacks only
        the bitmask's non-zero words: where a greedy draw is refused, a few
        tokens are usually allowed."""
        matcher.fill_next_token_bitmask(self._one, 0)
        words = self._one.numpy()[0]
        at = np.flatnonzero(words)
        bits = np.flatnonzero(np.unpackbits(words[at].view(np.uint8), bitorder="little"))
        ids = at[bits // 32] * 32 + bits % 32
        return ids[ids < self.vocab_size]


def masked(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A float32 copy of ``logits`` ``[R, vocab]`` whose rows ``rows`` (sorted)
    are at -inf where ``bitmask`` (xgrammar's: one int32 row per entry of
    ``rows``, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is
    allowed) refuses. The bits are unpacked by numpy (the words' bytes in
    little-endian order, as on x86 and ARM) and selected in one
    ``torch.where``: xgrammar's CPU apply writes a row's -inf one token at a
    time, about 10x slower on a row that refuses most of a 49152-token
    vocabulary; any device (the unpacked mask is copied to ``logits``')."""
    vocab = logits.shape[-1]
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=vocab, bitorder="little")
    allowed = torch.from_numpy(bits).view(torch.bool).to(logits.device)
    every = len(rows) == len(logits)
    picked = torch.where(allowed, (logits if every else logits[rows]).float(), float("-inf"))
    if every:
        return picked
    out = logits.float().clone()
    out[rows] = picked
    return out


def accept(matcher: Any, token: int, request_id: str) -> None:
    """Advance ``matcher`` by the token sampled under its mask."""
    if not matcher.accept_token(token):
        raise RuntimeError(f"request {request_id!r}: the grammar refused token {token} it allowed")
