"""Engine replicas on Ray Serve behind one OpenAI endpoint.

Two deployments. ``EngineReplica`` (``num_replicas`` of them, or Ray's
autoscaling) is one ``Engine`` (tensor-parallel when asked) inside the very
app ``mstar-kv serve`` runs (``create_app``): the front hands it each HTTP
request whole (scope and body) and relays the ASGI messages the app sends,
so the API, its errors, streaming, disconnect-aborts and metrics are that
app's. ``Front`` is the HTTP ingress: it reads the body, computes the
prompt's page keys (the route, see ``mstar.serve.router``), and calls a
replica through a handle whose request router picks it. A replica that dies
mid-request ends that request with an OpenAI error (an error event then
``[DONE]`` when streamed); Ray restarts it, and routes later requests to
the live ones meanwhile. ``GET /metrics`` merges every replica's figures,
each sample labelled ``replica``; ``GET /v1/replicas`` lists each one's
requests and prefix-cache counts.

``build_app`` returns the application (for ``serve.run``); ``app_builder``
is the same for ``serve run mstar.serve.replicas:app_builder key=value ...``
and Ray Serve's YAML config; ``mstar-kv serve --replicas N`` runs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ray import serve
from ray.exceptions import RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from mstar.serve.access import DEFAULT_MAX_BODY_BYTES, Access
from mstar.serve.errors import APIError
from mstar.serve.kv_events import EventsConfig
from mstar.serve.responses import DONE, event
from mstar.serve.router import route_keys, router_class

log = logging.getLogger(__name__)
SCOPE_FIELDS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path",
                "query_string", "headers", "server", "client")  # fmt: skip


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica's engine and server: ``mstar-kv serve``'s options, by their names."""

    model: str = "smollm2"
    seed: int = 0
    device: str = "cpu"
    pages: int | None = None
    page_size: int = 16
    budget: int = 256
    max_waiting: int = 256
    no_prefix_cache: bool = False
    tensor_parallel_size: int = 1
    served_model_name: str | None = None
    # the Python API's defaults (exact, eager); `serve --replicas` passes its own
    dtype: str = "float32"
    enforce_eager: bool = True
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    speculative: str | None = None
    num_speculative_tokens: int = 4
    kv_disk: str | None = None  # replica i keeps its pages under kv_disk/replica-i
    kv_disk_size: str = "8G"
    kv_remote: str | None = None  # one store every replica reads
    kv_offload: str = "lazy"
    kv_events: EventsConfig | None = None
    # on a network (``mstar.serve.access``): the front and each replica enforce them
    api_key: tuple[str, ...] = ()
    protect_metrics: bool = False
    shared_prefix_cache: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_model_len: int | None = None

    def access(self) -> Access:
        """The ``Access`` these options describe."""
        return Access(
            api_keys=tuple(self.api_key), protect_metrics=self.protect_metrics,
            shared_prefix_cache=self.shared_prefix_cache, max_body_bytes=self.max_body_bytes,
        )  # fmt: skip


@dataclass(frozen=True)
class Scaling:
    """How many replicas and how they are routed: ``autoscaling_config``
    (Ray's, as a dict) replaces ``replicas`` when set; ``ray_actor_options``
    (Ray's: ``num_cpus``, ``num_gpus``, ...) applies to each replica."""

    replicas: int = 2
    router: str = "prefix"
    balance_threshold: int = 8
    autoscaling_config: dict | None = None
    ray_actor_options: dict = field(default_factory=dict)
    max_ongoing_requests: int = 1024


class EngineReplica:
    """One engine in ``create_app``'s app, driven in-process over ASGI."""

    async def __init__(self, config: ReplicaConfig) -> None:
        from mstar.serve.app import create_app
        from mstar.serve.options import build_engine, model_name
        from mstar.serve.startup import compile_in_background

        self.rank = _rank()
        args = argparse.Namespace(**{**asdict(config), "kv_events": None})
        compiling = not config.enforce_eager and config.tensor_parallel_size == 1
        # eager at once; compiled swapped in when ready (unless the fused forward runs)
        engine, mode = build_engine(args, enforce_eager=True, compiling_later=compiling)
        print(f"mstar-kv replica {self.rank}: {mode}", flush=True)
        if compiling and not engine.fused:
            compile_in_background(
                engine, lambda line: print(f"mstar-kv replica {self.rank}: {line}", flush=True)
            )
        self.publisher = None
        if config.kv_events is not None:
            from mstar.serve.kv_events import KVEventPublisher, attach

            medium = "GPU" if config.device.startswith("cuda") else "CPU"
            self.publisher = KVEventPublisher(config.kv_events, self.rank, medium)
            attach(engine, self.publisher)
        self.tiers = _tiers(engine, config, self.rank, self.publisher)
        self.app = create_app(
            engine, model_name=model_name(args), max_waiting=config.max_waiting,
            access=config.access(),
        )  # fmt: skip
        self._life = self.app.router.lifespan_context(self.app)
        await self._life.__aenter__()

    async def http(self, scope: dict, body: bytes, route: Any = None) -> AsyncIterator[dict]:
        """The ASGI messages the app sends for one request (``route`` is the router's)."""
        sent: asyncio.Queue[dict] = asyncio.Queue()
        gone = asyncio.Event()
        unread = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if unread:
                return unread.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(scope, receive, sent.put))
        try:
            while True:
                message = await _next_or_end(sent, task)
                if message is None:
                    return
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body"):
                    return
        finally:  # done, or the caller went away (Ray cancels this generator)
            gone.set()
            with contextlib.suppress(asyncio.CancelledError, TimeoutError):
                await asyncio.wait_for(task, 5.0)

    async def stats(self, *_: Any) -> dict:
        """This replica's rank, requests and prefix-cache counts (the
        arguments are the router's)."""
        aengine = self.app.state.engine
        prefix = await aengine.run(lambda e: e.mgr.prefix_stats())
        import ray

        return {"rank": self.rank, "id": serve.get_replica_context().replica_id.unique_id,
                "node": ray.util.get_node_ip_address(), "running": aengine.num_running,
                "waiting": aengine.num_waiting, **prefix}  # fmt: skip

    async def metrics(self, *_: Any) -> tuple[int, str]:
        """This replica's rank and ``/metrics`` text."""
        async for message in self.http(_scope("GET", "/metrics"), b""):
            if message["type"] == "http.response.body":
                return self.rank, message["body"].decode()
        raise RuntimeError("expected a /metrics body, got none")

    def check_health(self) -> None:
        if not self.app.state.engine.serving:
            raise RuntimeError("the engine thread is not running")

    async def __del__(self) -> None:
        await self._life.__aexit__(None, None, None)
        if self.tiers is not None:
            from mstar.serve.kv_tiers import close_tiers

            close_tiers(self.tiers)
        if self.publisher is not None:
            self.publisher.close()


class Front:
    """The HTTP ingress: each request to the replica its router picks."""

    def __init__(self, replicas: DeploymentHandle, config: ReplicaConfig) -> None:
        from mstar.engine.resources.kv.keys import ChainHasher

        self.replicas = replicas
        self.streams = replicas.options(stream=True)
        self.hasher = None if config.no_prefix_cache else ChainHasher(config.page_size)
        self.tokenizer = _tokenizer(config.model)
        self.access = config.access()

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        try:
            if self.access.protects(path):
                self.access.key_of(request.headers.raw)
            body = await self._body(request)
        except APIError as err:
            return err.response()
        if request.method == "GET" and path == "/metrics":
            from prometheus_client import CONTENT_TYPE_LATEST

            return Response(
                merge_metrics(await self._each("metrics")), media_type=CONTENT_TYPE_LATEST
            )
        if request.method == "GET" and path == "/v1/replicas":
            stats = sorted(await self._each("stats"), key=lambda s: s["rank"])
            return JSONResponse({"object": "list", "data": stats})
        scope = {k: request.scope[k] for k in SCOPE_FIELDS if k in request.scope}
        scope["root_path"] = ""
        gen = self.streams.http.remote(scope, body, self._route(path, body))
        try:
            start = await gen.__anext__()
        except RayError as err:
            gen.cancel()
            return _failure(err).response()
        except BaseException:
            gen.cancel()
            raise
        return Relay(start, gen)

    async def _body(self, request: Request) -> bytes:
        """The request's body, read no further than ``max_body_bytes`` (then 413)."""
        limit, chunks, size = self.access.max_body_bytes, [], 0
        async for chunk in request.stream():
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413, f"the request body is over {size} bytes; this server takes at most {limit}",
                    code="request_too_large",
                )  # fmt: skip
        return b"".join(chunks)

    async def _each(self, method: str) -> list:
        """``method``'s result from every replica (asked in turn by replica id)."""
        out, seen = [], set()
        for k in range(1024):
            result = await getattr(self.replicas, method).remote(None, None, k)
            rank = result["rank"] if isinstance(result, dict) else result[0]
            if rank in seen:
                break
            seen.add(rank)
            out.append(result)
        return out

    def _route(self, path: str, body: bytes) -> bytes | None:
        """The prompt's page keys; None when there is no prompt to key (the
        replica answers what is wrong with the request)."""
        if self.hasher is None:
            return None
        try:
            request = json.loads(body)
            if path.endswith("/chat/completions"):
                from mstar.engine.prompts import chat_ids

                ids = chat_ids(self.tokenizer, request["messages"])
            elif path.endswith("/completions"):
                prompt = request["prompt"]
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            else:
                return None
            return route_keys(self.hasher, ids)
        except Exception:  # a bad request: any replica refuses it the same
            return None


class Relay(Response):
    """A replica's response, relayed message by message; a replica lost
    mid-stream ends it with an error event and ``[DONE]``."""

    def __init__(self, start: dict, rest: Any) -> None:
        super().__init__()
        self.start, self.rest = start, rest

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(self.start)
        sse = any(
            k == b"content-type" and v.startswith(b"text/event-stream")
            for k, v in self.start.get("headers", ())
        )
        try:
            async for message in self.rest:
                await send(message)
        except RayError as err:
            log.error("a replica failed mid-response: %r", err)
            tail = event(_failure(err).body()) + DONE if sse else ""
            await send({"type": "http.response.body", "body": tail.encode(), "more_body": False})
        finally:
            self.rest.cancel()


def merge_metrics(replies: list[tuple[int, str]]) -> bytes:
    """Prometheus text of every replica's metrics, each sample labelled ``replica``."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[Any, list[str]]] = {}
    for rank, text in sorted(replies):
        for family in text_string_to_metric_families(text):
            _, lines = families.setdefault(family.name, (family, []))
            for s in family.samples:
                labels = {"replica": str(rank), **s.labels}
                inner = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{s.name}{{{inner}}} {s.value}")
    out = []
    for name, (family, lines) in families.items():
        out += [f"# HELP {name} {family.documentation}", f"# TYPE {name} {family.type}", *lines]
    return ("\n".join(out) + "\n").encode()


def build_app(config: ReplicaConfig, scaling: Scaling | None = None) -> Any:
    """The Ray Serve application: ``Front`` over ``EngineReplica``s."""
    scaling = scaling or Scaling()
    router = RequestRouterConfig(
        request_router_class=router_class(scaling.router),
        request_router_kwargs=(
            {"capacity": config.pages or 1 << 16, "balance_threshold": scaling.balance_threshold}
            if scaling.router == "prefix" else {}
        ),
    )  # fmt: skip
    options: dict[str, Any] = {"autoscaling_config": scaling.autoscaling_config}
    if scaling.autoscaling_config is None:
        options = {"num_replicas": scaling.replicas}
    engines = serve.deployment(EngineReplica).options(
        name="EngineReplica", ray_actor_options=scaling.ray_actor_options,
        max_ongoing_requests=scaling.max_ongoing_requests, request_router_config=router,
        health_check_period_s=2, health_check_timeout_s=30, **options,
    )  # fmt: skip
    front = serve.deployment(Front).options(
        name="Front", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=scaling.max_ongoing_requests,
    )  # fmt: skip
    return front.bind(engines.bind(config), config)


def app_builder(args: dict[str, str]) -> Any:
    """``build_app`` from ``serve run``'s ``key=value`` arguments (or YAML
    ``args``): see ``parse_args``."""
    return build_app(*parse_args(args))


_PATHS = ("kv_disk", "kv_remote")  # str-or-None fields taken as they are


def parse_args(args: dict[str, Any]) -> tuple[ReplicaConfig, Scaling]:
    """``ReplicaConfig``'s and ``Scaling``'s fields by name (strings are read
    as JSON where the field is not a string), plus ``kv_events_endpoint``
    and ``kv_events_replay_endpoint``; ``ValueError`` naming an unknown one."""
    config, scaling = ReplicaConfig(), Scaling()
    args = dict(args)
    events = args.pop("kv_events_endpoint", None)
    replay = args.pop("kv_events_replay_endpoint", None)
    for key, value in args.items():
        target = config if key in ReplicaConfig.__dataclass_fields__ else scaling
        if key not in target.__dataclass_fields__ or key == "kv_events":
            raise ValueError(f"expected an mstar-kv replicas option, got {key!r}")
        default = getattr(target, key)
        if key == "api_key" and isinstance(value, str):  # comma-separated, as $MSTAR_KV_API_KEY
            value = tuple(k.strip() for k in value.split(",") if k.strip())
        elif isinstance(value, str) and not isinstance(default, str) and key not in _PATHS:
            value = json.loads(value) if value not in ("", "None") else None
        if target is config:
            config = replace(config, **{key: value})
        else:
            scaling = replace(scaling, **{key: value})
    if events:
        config = replace(config, kv_events=EventsConfig(events, replay))
    return config, scaling


async def _next_or_end(sent: asyncio.Queue, task: asyncio.Task) -> dict | None:
    """The app's next message, or None once it has ended sending none."""
    if not sent.empty() or task.done():
        return sent.get_nowait() if not sent.empty() else _reraise(task)
    getter = asyncio.ensure_future(sent.get())
    await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
    if getter.done():
        return getter.result()
    getter.cancel()
    return sent.get_nowait() if not sent.empty() else _reraise(task)


def _reraise(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()


def _failure(err: BaseException) -> APIError:
    return APIError(
        500, f"the replica serving this request failed: {type(err).__name__}",
        code="replica_failed",
    )  # fmt: skip


def _scope(method: str, path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [], "server": None, "client": None}  # fmt: skip


def _last_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else repr(err)


def _tiers(engine: Any, config: ReplicaConfig, rank: int, publisher: Any) -> Any:
    """The replica's KV tiers (None without ``kv_disk``/``kv_remote``); their
    stored/removed pages go to the KV events ``publisher`` when there is one."""
    from mstar.serve.kv_tiers import tier_options

    options = tier_options(config, rank)
    if options is None:
        return None
    from mstar.engine.resources.kv.tiers import attach

    tiers = attach(engine, **options)
    tiers.io.events = publisher
    return tiers


def _rank() -> int:
    rank = serve.get_replica_context().rank
    return rank if isinstance(rank, int) else rank.rank


def _tokenizer(model: str) -> Any:
    """The model's tokenizer alone (None for the random model or a folder without one)."""
    if model == "random":
        return None
    from mstar.models.loader import tokenizer_of

    return tokenizer_of(model)


def run_replicas(args: argparse.Namespace) -> int:
    """``mstar-kv serve --replicas N``: serve through Ray Serve until
    SIGINT/SIGTERM, then shut the application (and a Ray started here) down."""
    import signal
    import threading

    import ray

    from mstar.serve.kv_events import offset_port
    from mstar.serve.kv_tiers import tier_options
    from mstar.serve.options import UsageError

    if args.replicas < 1:
        raise UsageError(f"--replicas must be >= 1, got {args.replicas}")
    if getattr(args, "allowed_origins", None):
        raise UsageError("--allowed-origins is not supported with --replicas")
    try:
        autoscaling = json.loads(args.autoscaling_config) if args.autoscaling_config else None
        actor_options = json.loads(args.replica_options)
    except json.JSONDecodeError as err:
        raise UsageError(f"--autoscaling-config/--replica-options: not JSON: {err}") from err
    events = None
    if args.kv_events_endpoint:
        if args.no_prefix_cache:
            raise UsageError("--kv-events-endpoint needs the prefix cache (drop --no-prefix-cache)")
        events = EventsConfig(args.kv_events_endpoint, args.kv_events_replay_endpoint)
        try:
            offset_port(events.endpoint, 0)
            if events.replay_endpoint:
                offset_port(events.replay_endpoint, 0)
        except ValueError as err:
            raise UsageError(f"--kv-events-endpoint: {err}") from err
    try:
        tier_options(args)
    except ValueError as err:
        raise UsageError(str(err)) from err
    fields = {f: getattr(args, f) for f in ReplicaConfig.__dataclass_fields__ if f != "kv_events"}
    config = ReplicaConfig(**fields, kv_events=events)
    scaling = Scaling(
        replicas=args.replicas, router=args.router, balance_threshold=args.balance_threshold,
        autoscaling_config=autoscaling, ray_actor_options=actor_options,
    )  # fmt: skip
    ray.init(address=args.ray_address, include_dashboard=False, log_to_driver=True)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        try:
            serve.run(build_app(config, scaling), name="mstar-kv", route_prefix="/")
        except RuntimeError as err:  # a replica's constructor raised: its last line says why
            raise UsageError(f"the replicas did not start: {_last_line(err)}") from err
        print(
            f"mstar-kv serve: {args.replicas} replicas of {args.model} on Ray Serve,"
            f" http://{args.host}:{args.port}/v1 (router {args.router}, api keys {len(config.api_key)}"
            f"{', KV events on ' + args.kv_events_endpoint if events else ''})",
            flush=True,
        )
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        stop.wait()
        serve.shutdown()
    finally:
        ray.shutdown()
    return 0
