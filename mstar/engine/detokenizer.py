"""A sample's text, token by token: incremental detokenizing and stop strings.

``tokenizers.decoders.DecodeStream`` turns each new token into the text it
completes (nothing while a multi-byte character is still split), so a token
costs the same however long the output is. Text that could still be the
start of a stop string is held back until decided; a stop string found ends
the text before it.
"""

from __future__ import annotations

import codecs
from typing import Any

from tokenizers.decoders import DecodeStream

from mstar.engine.sampling.logprobs import TokenNames

SKIP_SPECIAL_TOKENS = True  # as vLLM and the OpenAI API: no <|im_end|> in the text
UNFINISHED = "\ufffd"  # what a decode shows for the bytes of a split character


class TextStream:
    """The text of one sample. ``add(token)`` feeds a generated token and
    says whether a stop string has been reached; ``close()`` flushes what is
    left once the sample ends otherwise. ``text`` only ever grows, and holds
    only decided text: ``text`` after ``close()`` is the sample's final text."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self._tokenizer, self._backend = tokenizer, tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=SKIP_SPECIAL_TOKENS)
        self._stop = stop
        self._pending: list[int] = []  # fed, their text not out yet (a split character)
        self._context: list[int] = []  # the ids of the last text out, to decode after
        self._held = ""  # could still be the start of a stop string
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> bool:
        """Feed ``token``; True when the text has reached a stop string (the
        text then ends before it, and the stream takes no more tokens)."""
        assert not self.stopped, "a stopped text takes no more tokens"
        piece = self._stream.step(self._backend, token)
        self._pending.append(token)
        if piece is None:
            return False
        self._context, self._pending = self._pending, []
        return self._extend(piece)

    def close(self) -> bool:
        """The sample ended: flush what the tokens still pending complete, a
        character they leave unfinished left out (as incremental detokenizers
        do: no trailing U+FFFD for it), and the held text. True when that
        reached a stop string."""
        stopped = self.stopped
        if self._pending and not stopped:
            base = self._decode(self._context)
            full = self._decode(self._context + self._pending)
            piece = full[len(base) :] if full.startswith(base) else full
            if piece.endswith(UNFINISHED) and self._ends_inside_a_character():
                piece = piece[: -len(UNFINISHED)]
            stopped = self._extend(piece)
            self._pending = []
        if not stopped:
            self.text += self._held
            self._held = ""
        return stopped

    def _ends_inside_a_character(self) -> bool:
        """True when the pending tokens' bytes end with an unfinished UTF-8
        sequence (a byte-level BPE's tokens map to exact bytes; others'
        decode whole, so never)."""
        raw = b"".join(TokenNames(self._tokenizer).bytes(t) for t in self._pending)
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        decoder.decode(raw, final=False)
        return bool(decoder.getstate()[0])

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=SKIP_SPECIAL_TOKENS)

    def _extend(self, piece: str) -> bool:
        undecided = self._held + piece
        found = [i for i in (undecided.find(s) for s in self._stop) if i >= 0]
        if found:
            self.text += undecided[: min(found)]
            self._held, self.stopped = "", True
            return True
        keep = _stop_prefix_len(undecided, self._stop)
        self.text += undecided[: len(undecided) - keep]
        self._held = undecided[len(undecided) - keep :]
        return False


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that some stop string starts with."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
