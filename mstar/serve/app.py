"""The OpenAI-compatible app over one ``Engine``: ``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health`` and ``/metrics``.

The engine runs in an ``AsyncEngine`` started and stopped with the app's
lifespan. A client that disconnects has its request aborted before the next
step, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from mstar.engine import Completion, Engine, RequestTooLarge, SamplingParams
from mstar.engine.async_engine import AsyncEngine, Overloaded, RequestFailed, RequestStream
from mstar.engine.prompts import token_ids
from mstar.serve import errors
from mstar.serve.access import KEY_SCOPE, Access, Guard
from mstar.serve.errors import APIError
from mstar.serve.metrics import ServerMetrics
from mstar.serve.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ParamError,
    param_named,
    sampling_params,
)
from mstar.serve.responses import DONE, Call, event, events, merged
from mstar.serve.tools.chat import ChatTools
from mstar.serve.tools.plan import ToolPlan

T = TypeVar("T")
log = logging.getLogger(__name__)
COMPLETION_MAX_TOKENS = 16  # the OpenAI default for /v1/completions
METRICS_WAIT_S = 1.0


def create_app(
    engine: Engine, *, model_name: str, max_waiting: int | None = None, retry_after: int = 1,
    tool_call_parser: str = "auto", access: Access | None = None,
    allowed_origins: Sequence[str] = (),
) -> FastAPI:  # fmt: skip
    """The app serving ``engine`` as ``model_name``. Past ``max_waiting``
    requests without a first token, a request gets 503 with ``Retry-After:
    retry_after``. Chat tool calls are read by ``tool_call_parser``
    (``mstar.serve.tools.PARSERS``; ``auto``: the chat template's format).
    ``access``: API keys, the largest body and whose requests share cached
    KV (``mstar.serve.access``); ``allowed_origins``: browsers' origins
    answered with CORS headers (none by default; ``*``: any)."""
    access = access or Access()
    tools = ChatTools(engine.tokenizer, tool_call_parser)
    aengine = AsyncEngine(engine, max_waiting=max_waiting)
    metrics = ServerMetrics(aengine)
    aengine.on_step = metrics.on_step
    front = Front(aengine, metrics, model_name, retry_after)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        aengine.start()
        try:
            yield
        finally:
            await aengine.stop()

    app = FastAPI(title="mstar-kv", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.tools = aengine, metrics, tools
    errors.install(app)
    app.add_middleware(JSONBodies)
    app.add_middleware(Guard, access=access)  # (outside JSONBodies: a key first)
    if allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )  # fmt: skip
    created = int(time.time())

    @app.get("/health")
    async def health() -> dict:
        """200 while serving, with the forward running (eager until a compiled
        one is swapped in); before the app runs, ``serve`` answers 503 "starting"."""
        if not aengine.serving:
            raise APIError(503, "the engine is not running")
        return {"status": "ok", "forward": aengine.engine.compiled or "eager"}

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": model_name, "object": "model", "created": created, "owned_by": "mstar-kv"}
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def scrape() -> Response:
        """Engine figures as of now; the last ones read if a step runs long."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(aengine.run(metrics.read_engine), METRICS_WAIT_S)
        return Response(metrics.text(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        front.check(body)
        max_tokens = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        nothing = body.echo and max_tokens == 0  # the prompt (and its logprobs) alone
        params = sampling_params(body, 1 if nothing else max_tokens)
        call = front.call("text_completion", "cmpl", body)
        call.nothing = nothing
        call.namespace = access.namespace(request.scope.get(KEY_SCOPE), body.cache_salt)
        prompts = body.prompts()
        calls = [replace(call, echo=front.prompt_text(p) if body.echo else None) for p in prompts]
        if len(prompts) == 1:
            return await front.respond(
                request, calls[0], fixed(prompts[0], params), param="prompt", streamed=body.stream
            )
        if body.stream:
            raise APIError(400, "stream with several prompts is not supported", param="stream")
        return await front.respond_many(request, calls, prompts, params)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        front.check(body)
        render, planned = chat_render(tools, body)
        call = front.call("chat.completion", "chatcmpl", body)
        call.tools = tools.reader(planned)
        call.namespace = access.namespace(request.scope.get(KEY_SCOPE), body.cache_salt)

        def prepare(e: Engine) -> tuple[list[int], SamplingParams]:
            ids = render(e)
            max_tokens = next(
                (m for m in (body.max_completion_tokens, body.max_tokens) if m is not None),
                front.room(len(ids)),
            )
            return ids, tools.params(sampling_params(body, max_tokens), planned)

        return await front.respond(request, call, prepare, param="messages", streamed=body.stream)

    return app


def chat_render(
    tools: ChatTools, body: ChatCompletionRequest
) -> tuple[Callable[[Engine], list[int]], ToolPlan | None]:
    """A chat body's prompt, rendered by the returned function on the
    engine thread (in the same visit as its add: ``AsyncEngine.add_prepared``),
    and its tool plan; its messages and tools checked (and the calls'
    grammar compiled) before anything is queued; a body without tools or
    calls renders as before (``Engine.encode_chat``). A bad message raises
    an ``APIError`` naming ``messages``."""
    if body.with_tools:
        messages, planned = tools.plan(body)

        def ids(e: Engine) -> list[int]:
            tools.compile(e, planned)
            return tools.ids(messages, planned)
    else:
        plain, planned = [m.as_dict(i) for i, m in enumerate(body.messages)], None

        def ids(e: Engine) -> list[int]:
            return e.encode_chat(plain)

    def render(e: Engine) -> list[int]:
        try:
            return ids(e)
        except ParamError:
            raise
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), param="messages") from err

    return render, planned


def fixed(prompt: Any, params: SamplingParams) -> Callable[[Engine], tuple[Any, SamplingParams]]:
    """A request's ``prepare`` (``AsyncEngine.add_prepared``) of a prompt and params at hand."""
    return lambda _: (prompt, params)


class Front:
    """What the endpoints share: checks, submitting, collecting, streaming."""

    def __init__(
        self, aengine: AsyncEngine, metrics: ServerMetrics, model_name: str, retry_after: int
    ) -> None:
        self.aengine, self.metrics, self.model_name = aengine, metrics, model_name
        self.retry_after = retry_after
        self.context = aengine.engine.max_len or 1 << 62  # tokens a request may span
        self.names = aengine.engine.pipeline.names

    def check(self, body: Any) -> None:
        if body.model != self.model_name:
            raise APIError(
                404,
                f"the model {body.model!r} does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )
        body.check_supported()

    def check_context(self, prompt_len: int, max_tokens: int, param: str) -> None:
        """An ``APIError`` 400 (``context_length_exceeded``) naming the numbers
        when ``prompt_len`` tokens of ``param`` and ``max_tokens`` new ones
        do not fit the model's context (``--max-model-len``); its param is
        ``param`` when the prompt alone leaves no room, else ``max_tokens``."""
        where, named = "messages" if param == "messages" else "prompt", param
        if prompt_len >= self.context:
            message = (
                f"This model's maximum context length is {self.context} tokens. However, your"
                f" {where} resulted in {prompt_len} tokens, leaving no room for a completion."
                f" Please reduce the length of the {where}."
            )
        elif prompt_len + max_tokens > self.context:
            message = (
                f"This model's maximum context length is {self.context} tokens. However, you"
                f" requested {prompt_len + max_tokens} tokens ({prompt_len} in the {where},"
                f" {max_tokens} in the completion). Please reduce the length of the {where}"
                " or completion."
            )
            named = "max_tokens"
        else:
            return
        raise APIError(400, message, param=named, code="context_length_exceeded")

    def room(self, prompt_len: int) -> int:
        """Chat's default ``max_tokens``: the most new tokens the context
        leaves whose peak fits the pool alone (``Engine.peak_pages``: a
        windowed model's pages stop growing, a hybrid's groups add up), at
        least 1 (``add_request`` then refuses what cannot fit)."""
        engine = self.aengine.engine

        def fits(n: int) -> bool:
            need = engine.peak_pages(prompt_len, SamplingParams(max_new_tokens=n))
            return need <= engine.mgr.num_pages

        lo, hi = 1, max(1, self.context - prompt_len)
        if fits(hi):
            return hi
        while lo < hi - 1:  # fits(lo) or lo == 1; not fits(hi)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def call(self, kind: Any, prefix: str, body: Any) -> Call:
        return Call(
            kind,
            f"{prefix}-{uuid.uuid4().hex}",
            self.model_name,
            include_usage=body.include_usage,
            return_token_ids=body.return_token_ids,
            names=self.names,
        )

    def prompt_text(self, prompt: str | list[int]) -> str:
        """A prompt's text to echo: itself, or its ids decoded ("" without a tokenizer)."""
        tokenizer = self.aengine.engine.tokenizer
        if isinstance(prompt, str) or tokenizer is None:
            return prompt if isinstance(prompt, str) else ""
        return tokenizer.decode(prompt)

    async def respond(
        self,
        request: Request,
        call: Call,
        prepare: Callable[[Engine], tuple[Any, SamplingParams]],
        *,
        param: str,
        streamed: bool,
    ) -> Response:
        """Serve one call, its prompt and params from ``prepare`` (on the
        engine thread): ``param`` names the prompt's field in errors."""
        stream = await self.submit(call.id, prepare, param, call.namespace)
        if streamed:
            return EventStream(self.sse(call, stream), media_type="text/event-stream")
        done = await until_disconnect(request.receive, lambda: self.collect(stream))
        if done is None:
            return Response(status_code=499)  # nobody reads it
        return JSONResponse(call.whole(done))

    async def respond_many(
        self, request: Request, calls: list[Call], prompts: list[Any], params: SamplingParams
    ) -> Response:
        """Serve several prompts of one call (not streamed): a request each,
        their choices in prompt order, ``index`` running over them all."""
        streams: list[RequestStream] = []
        try:
            for i, (call, prompt) in enumerate(zip(calls, prompts)):
                prepare = fixed(prompt, params)
                streams.append(
                    await self.submit(f"{call.id}-{i}", prepare, "prompt", call.namespace)
                )
        except BaseException:
            for stream in streams:
                self.aengine.abort(stream.request_id)
            raise

        async def all_of_them() -> list[Completion]:
            try:
                async with asyncio.TaskGroup() as group:  # one fails: the others are cancelled
                    tasks = [group.create_task(self.collect(s)) for s in streams]
            except ExceptionGroup as failed:
                raise failed.exceptions[0] from None  # (an APIError: the response)
            return [t.result() for t in tasks]

        done = await until_disconnect(request.receive, all_of_them)
        if done is None:
            return Response(status_code=499)
        return JSONResponse(merged([call.whole(c) for call, c in zip(calls, done)]))

    async def submit(
        self,
        rid: str,
        prepare: Callable[[Engine], tuple[Any, SamplingParams]],
        param: str,
        namespace: str = "",
    ) -> RequestStream:
        """Queue request ``rid`` (its prompt's KV cached in ``namespace``),
        its prompt and params from ``prepare``; refused with an ``APIError``
        naming ``param`` (the prompt's field) or the field at fault."""

        def checked(e: Engine) -> tuple[list[int], SamplingParams]:
            prompt, params = prepare(e)
            ids = token_ids(rid, prompt, e.tokenizer, e.intake.vocab_size)
            self.check_context(len(ids), params.max_new_tokens, param)
            return ids, params

        try:
            return await self.aengine.add_prepared(
                checked, request_id=rid, cache_namespace=namespace
            )
        except ParamError:
            raise  # (a bad field from ``prepare``: it names itself)
        except Overloaded as err:
            raise APIError(
                503, f"the server is overloaded: {err}; retry later",
                code="overloaded", headers={"Retry-After": str(self.retry_after)},
            ) from err  # fmt: skip
        except RequestTooLarge as err:
            named = param_named(str(err), param)  # the prompt, when it alone is too large
            raise APIError(400, str(err), param=named, code="request_too_large") from err
        except (TypeError, ValueError) as err:
            raise APIError(400, str(err), param=param_named(str(err), param)) from err

    async def tracked(self, stream: RequestStream) -> AsyncIterator[Completion]:
        """``stream``'s completions, counted in the metrics; one log line
        when it ends (finished, failed or aborted)."""
        generated, prompt, outcome = 0, 0, "aborted"
        try:
            async for c in stream:
                if not prompt and stream.first_output is not None:  # once, at the first token
                    prompt = len(c.prompt_token_ids)
                    self.metrics.ttft.observe(stream.first_output - stream.created)
                    self.metrics.prompt_tokens.inc(prompt)
                now = sum(len(o.token_ids) for o in c.outputs)
                self.metrics.generation_tokens.inc(now - generated)
                generated = now
                if c.finished:
                    outcome = "finished " + ",".join(str(o.finish_reason) for o in c.outputs)
                yield c
        except RequestFailed:
            outcome = "failed"
            raise
        finally:
            first = stream.first_output
            log.info(
                "%s: %s; %d prompt + %d generated tokens; first token %s; %.3f s",
                stream.request_id, outcome, prompt, generated,
                "none" if first is None else f"{first - stream.created:.3f} s",
                time.monotonic() - stream.created,
            )  # fmt: skip

    async def collect(self, stream: RequestStream) -> Completion:
        last = None
        try:
            async for c in self.tracked(stream):
                last = c
        except RequestFailed as err:
            raise APIError(500, str(err), code="engine_error") from err
        finally:
            self.aengine.abort(stream.request_id)  # a no-op once finished
        assert last is not None and last.finished
        return last

    async def sse(self, call: Call, stream: RequestStream) -> AsyncIterator[str]:
        try:
            async for text in events(call, self.tracked(stream)):
                yield text
        except RequestFailed as err:
            yield event(APIError(500, str(err), code="engine_error").body())
        finally:
            self.aengine.abort(stream.request_id)  # a no-op once finished
        yield DONE


class JSONBodies:
    """ASGI middleware: a POST whose Content-Type is not JSON gets a 400
    saying so (as ``curl -d`` without ``-H 'Content-Type: application/json'``
    sends a form), before any endpoint parses it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            given = dict(scope["headers"]).get(b"content-type", b"").decode("latin-1")
            media = given.split(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                err = APIError(
                    400, "expected a JSON body (Content-Type: application/json), got"
                    f" {f'Content-Type: {given}' if given else 'no Content-Type'}",
                    code="unsupported_content_type",
                )  # fmt: skip
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class GracefulServer(uvicorn.Server):
    """uvicorn that, on shutdown, stops accepting, gives the requests in
    flight ``timeout_graceful_shutdown`` seconds, then ends the rest (their
    streams with an error event) before closing connections."""

    def __init__(self, config: uvicorn.Config, aengine: AsyncEngine) -> None:
        super().__init__(config)
        self.aengine = aengine

    async def shutdown(self, sockets: Any = None) -> None:
        for server in self.servers:
            server.close()
        await self.aengine.drain(self.config.timeout_graceful_shutdown or 0.0)
        await super().shutdown(sockets)


class EventStream(StreamingResponse):
    """A streamed response that stops (closing its iterator) as soon as the
    client disconnects, not only at the next chunk it cannot send."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def body() -> None:
            try:
                await self.stream_response(send)
            except OSError:
                pass  # the client is gone
            finally:
                await self.body_iterator.aclose()

        await until_disconnect(receive, body)


async def until_disconnect(receive: Receive, work: Callable[[], Awaitable[T]]) -> T | None:
    """``await work()``, cancelled when the client disconnects (then None)."""
    result: list[T] = []
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        result.append(await work())
        group.cancel_scope.cancel()
    return result[0] if result else None
