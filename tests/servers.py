"""A real server for the serve tests: uvicorn in a thread on 127.0.0.1, a
free port, stopped by the test (the fixture) that started it."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from mstar.serve import free_port
from mstar.serve.app import GracefulServer

START_TIMEOUT_S = 30.0


class ServerThread:
    """``app`` served by uvicorn in a daemon thread; ``url`` is its ``/v1``."""

    def __init__(self, app: Any, grace: float = 5.0, config: Any = None) -> None:
        """``config``: a function of the port giving the ``uvicorn.Config`` (default: plain)."""
        self.app = app
        self.port = free_port()
        if config is None:
            config = uvicorn.Config(
                app, host="127.0.0.1", port=self.port, log_level="warning",
                timeout_graceful_shutdown=grace,
            )  # fmt: skip
        else:
            config = config(self.port)
        self.server = GracefulServer(config, app.state.engine)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = f"{self.base}/v1"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        assert not self.thread.is_alive(), "the server did not stop"


def wait_until(predicate: Any, timeout: float = 10.0, every: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true (then True) or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return bool(predicate())


async def stream_token_ids(api: Any, prompt: Any, **create: Any) -> list[int]:
    """The token ids of one streamed completion (``create`` as for
    ``api.completions.create``; its ``extra_body`` must ask ``return_token_ids``),
    chunk after chunk; every chunk must carry a choice."""
    stream = await api.completions.create(prompt=prompt, stream=True, **create)
    ids: list[int] = []
    async for chunk in stream:
        ids += chunk.choices[0].model_extra["token_ids"]
    return ids
