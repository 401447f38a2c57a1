"""Who may call a server and how much one request may send: API keys
(``Authorization: Bearer KEY`` on every ``/v1/*`` route, ``/metrics`` too
when protected), the largest request body, and the prefix-cache namespace
a request's key and ``cache_salt`` give it (tenants never share KV unless
told to)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mstar.serve.errors import APIError

KEY_ENV = "MSTAR_KV_API_KEY"  # comma-separated keys, beside --api-key
DEFAULT_MAX_BODY_BYTES = 8 << 20
KEY_SCOPE = "mstar.api_key"  # the ASGI scope entry holding the key a request presented


def api_keys(flags: Iterable[str] | None, environ: Mapping[str, str]) -> tuple[str, ...]:
    """The keys of ``--api-key`` (each flag one key) and of ``$MSTAR_KV_API_KEY``
    (comma-separated), in order, blanks around them dropped; ``ValueError``
    for a flag that is blank."""
    keys = []
    for flag in flags or ():
        if not flag.strip():
            raise ValueError("--api-key: expected a key, got an empty string")
        keys.append(flag.strip())
    keys += [k.strip() for k in environ.get(KEY_ENV, "").split(",") if k.strip()]
    return tuple(dict.fromkeys(keys))


@dataclass(frozen=True)
class Access:
    """A server's access rules: no ``api_keys``, no key asked for; the
    largest body ``max_body_bytes``; ``shared_prefix_cache``: requests of
    different keys share cached KV (by default each key has its own)."""

    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    shared_prefix_cache: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES

    def protects(self, path: str) -> bool:
        """Whether ``path`` needs a key: with keys on, every path (``/v1/*``,
        the API's schema and docs) but ``/health``, and ``/metrics`` unless
        ``protect_metrics``."""
        if not self.api_keys or path == "/health":
            return False
        return path != "/metrics" or self.protect_metrics

    def key_of(self, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The key an ``Authorization: Bearer KEY`` header among ``headers``
        (ASGI's) presents, when it is one of ``api_keys`` (their digests each
        compared in constant time, all of them every time, so neither a key's
        characters nor its length show in the time taken); else an
        ``APIError`` 401."""
        given = _bearer(headers)
        digest, found = hashlib.sha256(given.encode()).digest(), None
        for key in self.api_keys:
            if hmac.compare_digest(digest, hashlib.sha256(key.encode()).digest()) and found is None:
                found = key
        if found is None:
            raise APIError(
                401,
                "missing API key: send the header 'Authorization: Bearer KEY'"
                if not given
                else "incorrect API key provided",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        return found

    def namespace(self, key: str | None, salt: str | None) -> str:
        """The prefix-cache namespace of a request that presented ``key`` (None:
        keys off) with ``cache_salt`` ``salt``: the key's own unless the cache
        is shared, and the salt's; "" (everyone's) with neither. Keys and
        salts are hashed, never stored."""
        parts = []
        if key is not None and not self.shared_prefix_cache:
            parts.append("key:" + _digest(key))
        if salt is not None:
            parts.append("salt:" + _digest(salt))
        return "|".join(parts)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _bearer(headers: Iterable[tuple[bytes, bytes]]) -> str:
    """The token of the ``Authorization: Bearer`` header ("" when there is none)."""
    value = dict(headers).get(b"authorization", b"").decode("latin-1").strip()
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Guard:
    """ASGI middleware enforcing an ``Access``: a protected path without a
    right key gets 401 (the key it presented goes into the scope as
    ``KEY_SCOPE``); a body over ``max_body_bytes`` gets 413, read no further."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            if self.access.protects(scope["path"]):
                scope[KEY_SCOPE] = self.access.key_of(scope["headers"])
            if scope["method"] in ("POST", "PUT", "PATCH"):
                receive = await self._bounded(scope, receive)
        except APIError as err:
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def _bounded(self, scope: Scope, receive: Receive) -> Receive:
        """``receive`` with the whole body read first (413 past the limit)."""
        limit = self.access.max_body_bytes
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            raise _too_large(int(length), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return _replay([message], receive)  # (the client is gone)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                raise _too_large(size, limit, at_least=True)
            if not message.get("more_body", False):
                break
        body = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        return _replay([body], receive)


def _too_large(size: int, limit: int, at_least: bool = False) -> APIError:
    return APIError(
        413,
        f"the request body is {'over ' if at_least else ''}{size} bytes;"
        f" this server takes at most {limit} (--max-body-bytes)",
        code="request_too_large",
    )


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A ``receive`` that returns ``messages`` first, then ``receive``'s."""
    pending = list(messages)

    async def replayed() -> Any:
        return pending.pop(0) if pending else await receive()

    return replayed
