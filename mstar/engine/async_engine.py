"""``AsyncEngine``: an ``Engine`` served to asyncio code.

One thread owns the engine: between steps it runs the calls coroutines
submitted (``add_request``, ``abort``, ``run``), then steps while any request
is unfinished, and sleeps when none is. Each step's completions go back to
the event loop in one batch, where every request's ``RequestStream`` yields
them in order. Engine access is serialized by construction: only that thread
touches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from mstar.engine import Completion, Engine, SamplingParams, StepFailed
from mstar.engine.engine import Prompt

T = TypeVar("T")
DRAIN_POLL_S = 0.05
log = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    """More requests wait for their first token than the engine takes."""


class RequestFailed(RuntimeError):
    """The engine failed while serving this request (the cause is chained)."""


class RequestStream:
    """A request's completions as the engine produces them, in order; ends
    after the finished one. Raises ``RequestFailed`` when a step serving it
    failed. Fed by the ``AsyncEngine`` on the event loop."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.created = time.monotonic()
        self.first_output: float | None = None  # monotonic time of the first token out
        self.finished = False
        self._queue: asyncio.Queue[Completion | BaseException] = asyncio.Queue()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Completion:
        if self.finished and self._queue.empty():
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def _put(self, item: Completion | BaseException) -> None:
        got_tokens = isinstance(item, Completion) and any(o.token_ids for o in item.outputs)
        if self.first_output is None and got_tokens:
            self.first_output = time.monotonic()
        self.finished = isinstance(item, BaseException) or item.finished
        self._queue.put_nowait(item)


class AsyncEngine:
    """Serves ``engine`` from the running event loop (``start`` inside it).

    ``max_waiting``: at most this many requests may wait for their first
    token; ``add_request`` raises ``Overloaded`` beyond. ``on_step(engine,
    seconds)`` runs on the engine thread after each step (for metrics).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int | None = None,
        on_step: Callable[[Engine, float], None] | None = None,
    ) -> None:
        if max_waiting is not None and max_waiting < 1:
            raise ValueError(f"expected max_waiting >= 1 or None, got {max_waiting}")
        self.engine, self.max_waiting, self.on_step = engine, max_waiting, on_step
        self._streams: dict[str, RequestStream] = {}  # event loop side
        self._live: set[str] = set()  # engine thread side: added, not finished
        self._calls: list[tuple[Callable[[Engine], Any], Future]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = self._draining = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will use it."""
        if self._thread is not None:
            raise RuntimeError("expected a stopped AsyncEngine, got a started one")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._serve, name="mstar-engine", daemon=True)
        self._thread.start()

    async def drain(self, grace: float) -> None:
        """Refuse new requests, give those in flight ``grace`` seconds to
        finish, then ``stop``."""
        self._draining = True
        deadline = time.monotonic() + grace
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        await self.stop()

    async def stop(self) -> None:
        """Abort what is still running (its streams fail) and stop the thread."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    # --- calls from coroutines ----------------------------------------------------------

    @property
    def serving(self) -> bool:
        """True while the engine thread runs and takes requests."""
        return self._thread is not None and self._thread.is_alive() and not self._draining

    @property
    def num_waiting(self) -> int:
        """Requests added that have no output yet."""
        return sum(s.first_output is None for s in self._streams.values())

    @property
    def num_running(self) -> int:
        """Requests producing outputs, not finished yet."""
        return len(self._streams) - self.num_waiting

    async def run(self, fn: Callable[[Engine], T]) -> T:
        """``fn(engine)`` on the engine thread between steps; its result or exception."""
        future: Future = Future()
        with self._lock:
            if self._stopping or self._thread is None:
                raise RuntimeError("expected a running AsyncEngine, got a stopped one")
            self._calls.append((fn, future))
        self._wake.set()
        return await asyncio.wrap_future(future)

    async def add_request(
        self, prompt: Prompt, params: SamplingParams, *, request_id: str, cache_namespace: str = ""
    ) -> RequestStream:
        """Queue a request (``cache_namespace`` as ``Engine.add_request``'s);
        its stream yields its completions. Raises what ``Engine.add_request``
        raises (nothing is queued then), or ``Overloaded`` when
        ``max_waiting`` requests already wait."""
        return await self.add_prepared(
            lambda _: (prompt, params), request_id=request_id, cache_namespace=cache_namespace
        )

    async def add_prepared(
        self,
        prepare: Callable[[Engine], tuple[Prompt, SamplingParams]],
        *,
        request_id: str,
        cache_namespace: str = "",
    ) -> RequestStream:
        """``add_request`` of the prompt and params ``prepare(engine)`` makes
        on the engine thread, in the same visit as the add (no step runs
        between them: a chat template rendered where the tokenizer is used),
        its prompt's KV cached in ``cache_namespace`` (``Engine.add_request``).
        What ``prepare`` raises propagates; nothing is queued then."""
        if self._draining:
            raise Overloaded("the server is shutting down")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting} requests are waiting (max {self.max_waiting})")
        if request_id in self._streams:
            raise ValueError(f"expected a new request id, got {request_id!r} (running)")
        stream = self._streams[request_id] = RequestStream(request_id)  # before any output
        try:
            await self.run(lambda e: self._add(e, *prepare(e), request_id, cache_namespace))
        except BaseException:
            self.abort(request_id)  # cancelled: it may be in the engine already
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (a no-op once it has finished): its stream ends
        here, and the engine thread aborts it before the next step. Returns
        at once, so a cancelled coroutine can call it."""
        if self._streams.pop(request_id, None) is None:
            return
        with self._lock:
            if self._stopping or self._thread is None:
                return  # stop() aborts it
            self._calls.append((lambda e: self._abort(e, request_id), Future()))
        self._wake.set()

    # --- the engine thread --------------------------------------------------------------

    def _serve(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished() and not self._stopping:
                self._wake.wait()
            self._wake.clear()
            with self._lock:
                calls, self._calls = self._calls, []
            for fn, future in calls:
                _resolve(future, fn, engine)
            if self._stopping:
                self._shut_down()
                return
            if engine.has_unfinished():
                self._step()

    def _add(
        self, engine: Engine, prompt: Prompt, params: SamplingParams, rid: str, namespace: str
    ) -> None:
        engine.add_request(prompt, params, request_id=rid, cache_namespace=namespace)
        self._live.add(rid)

    def _abort(self, engine: Engine, rid: str) -> None:
        if rid in self._live:  # else finished meanwhile
            self._live.discard(rid)
            with contextlib.suppress(KeyError):  # gone with a failed step
                engine.abort(rid)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            out: list[tuple[str, Completion | BaseException]] = [
                (c.request_id, c) for c in self.engine.step()
            ]
        except StepFailed as err:  # those requests are gone from the engine, the others go on
            log.error("step failed for %s: %r", ", ".join(err.request_ids), err.__cause__)
            failure = RequestFailed(f"the engine failed: {err.__cause__ or err}")
            failure.__cause__ = err
            out = [(rid, failure) for rid in err.request_ids]
        except Exception as err:  # a defect, not a failed forward: fail all, keep serving
            log.exception("step raised")
            failure = RequestFailed(f"the engine failed: {err!r}")
            failure.__cause__ = err
            out = [(rid, failure) for rid in self._live]
            for rid in list(self._live):
                self._abort(self.engine, rid)
        self._live.difference_update(
            rid for rid, item in out if not isinstance(item, Completion) or item.finished
        )
        if self.on_step is not None:
            try:
                self.on_step(self.engine, time.perf_counter() - t0)
            except Exception:  # an observer's fault must not stop the engine
                log.exception("on_step raised")
        self._send(out)

    def _shut_down(self) -> None:
        """Abort every request left, failing its stream; refuse later calls."""
        with self._lock:
            calls, self._calls = self._calls, []
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the engine is shutting down"))
        failure = RequestFailed("the server is shutting down")
        ids = sorted(self._live)
        for rid in ids:
            self._abort(self.engine, rid)
        self._send([(rid, failure) for rid in ids])

    def _send(self, out: list[tuple[str, Completion | BaseException]]) -> None:
        if out and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, out)

    def _deliver(self, out: list[tuple[str, Completion | BaseException]]) -> None:
        """On the event loop: hand each item to its stream (gone once aborted)."""
        for rid, item in out:
            stream = self._streams.get(rid)
            if stream is None:
                continue
            stream._put(item)
            if stream.finished:
                del self._streams[rid]


def _resolve(future: Future, fn: Callable[[Engine], Any], engine: Engine) -> None:
    if not future.set_running_or_notify_cancel():
        return  # its caller gave up waiting
    try:
        future.set_result(fn(engine))
    except Exception as err:
        future.set_exception(err)
