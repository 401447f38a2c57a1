"""What a user may pass as a prompt or a chat, checked before anything is queued.

A prompt is a str (tokenized as is) or a sequence of token ids; ``bytes``,
floats, bools and nested lists are not. A chat is a list of OpenAI-style
messages, rendered by the tokenizer's chat template.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

ROLES = ("system", "user", "assistant")
NOT_A_SEQUENCE = (str, bytes, bytearray, memoryview)


def _is_token(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def prompt_list(prompts: object) -> list[Any]:
    """``prompts`` as a list of prompts: a str or a sequence of ints is one
    prompt, any other sequence a list of them (each checked by ``token_ids``)."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, NOT_A_SEQUENCE) or not isinstance(prompts, Sequence):
        raise TypeError(
            "expected a prompt (a str or a sequence of ints) or a list of prompts,"
            f" got {type(prompts).__name__}"
        )
    if prompts and all(_is_token(t) for t in prompts):
        return [prompts]
    return list(prompts)


def chat_list(conversations: object) -> Sequence[Any]:
    """``conversations`` as a sequence of conversations: a list of messages
    (its first a dict) is one, any other non-empty sequence holds them (each
    checked by ``chat_ids``)."""
    if isinstance(conversations, NOT_A_SEQUENCE) or not isinstance(conversations, Sequence):
        raise TypeError(
            "expected a conversation (a list of messages) or a list of them,"
            f" got {type(conversations).__name__}"
        )
    if not conversations:
        raise ValueError("expected at least one message, got []")
    return [conversations] if isinstance(conversations[0], Mapping) else conversations


def token_ids(rid: str, prompt: object, tokenizer: Any, vocab: int) -> list[int]:
    """The non-empty token ids of ``prompt`` (each in ``[0, vocab)``), or a
    ``TypeError``/``ValueError`` naming request ``rid``."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"request {rid!r}: expected token ids (no tokenizer), got a str")
        if not prompt:
            raise ValueError(f"request {rid!r}: expected a non-empty prompt, got ''")
        _check_text(f"request {rid!r}: prompt", prompt)
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, NOT_A_SEQUENCE) or not isinstance(prompt, Sequence):
        raise TypeError(
            f"request {rid!r}: expected a prompt a str or a sequence of ints,"
            f" got {type(prompt).__name__} {prompt!r:.60}"
        )
    else:
        bad = [t for t in prompt if not _is_token(t)]
        if bad:
            raise TypeError(
                f"request {rid!r}: expected a prompt of int token ids,"
                f" got {type(bad[0]).__name__} {bad[0]!r:.60}"
            )
        ids = [int(t) for t in prompt]
    if not ids or not all(0 <= t < vocab for t in ids):
        raise ValueError(
            f"request {rid!r}: expected a non-empty prompt of ids in [0, {vocab}), got {ids[:8]}"
        )
    return ids


def chat_ids(tokenizer: Any, messages: object) -> list[int]:
    """``messages`` (``[{"role": "system"|"user"|"assistant", "content": str}, ...]``)
    through the tokenizer's chat template, the generation prompt added."""
    if tokenizer is None:
        raise ValueError("expected a tokenizer with a chat template for chat, got no tokenizer")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("expected a tokenizer with a chat template for chat, got none in it")
    if isinstance(messages, NOT_A_SEQUENCE) or not isinstance(messages, Sequence):
        raise TypeError(f"expected messages a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("expected at least one message, got []")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(f"expected messages[{i}] a dict, got {type(message).__name__}")
        if set(message) != {"role", "content"}:
            raise ValueError(
                f"expected messages[{i}] with the keys role and content, got {sorted(message)}"
            )
        if message["role"] not in ROLES:
            raise ValueError(f"expected messages[{i}].role one of {ROLES}, got {message['role']!r}")
        if not isinstance(message["content"], str):
            raise TypeError(
                f"expected messages[{i}].content a str, got {type(message['content']).__name__}"
            )
        _check_text(f"messages[{i}].content", message["content"])
    rendered = [{"role": m["role"], "content": m["content"]} for m in messages]
    ids = tokenizer.apply_chat_template(rendered, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, Mapping) else ids)


def _check_text(what: str, text: str) -> None:
    """Refuse text that is not valid Unicode (a lone surrogate, e.g. from a
    command-line argument that was not UTF-8)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(
            f"expected {what} valid UTF-8 text, got an unpaired surrogate at {err.start}"
        ) from None


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """``text`` as a user turn in the tokenizer's chat template, ready for the answer."""
    return chat_ids(tokenizer, [{"role": "user", "content": text}])
