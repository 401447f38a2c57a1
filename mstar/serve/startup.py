"""``serve`` from its first seconds: the port bound before anything loads
(one in use is reported at once), ``503 starting`` answered on it while the
engine is built, and the compiled forward swapped in when it is ready.

``compile_in_background`` compiles a copy of the model behind an engine of
its own (a small pool, on a thread; the serving engine keeps answering on its
eager forward meanwhile), checks it against eager float32 there
(``mstar.engine.verify``), then sets ``engine.model`` to it: one attribute
assignment, which the engine reads once per step, so the swap lands between
steps. A compile that fails or disagrees leaves the engine eager and says why.
"""

from __future__ import annotations

import copy
import http.server
import json
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)
BACKLOG = 2048
SHADOW_PAGES = 64  # the compiling engine's pool: the warm-up and the mode check fit it


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``; ``OSError`` when it is taken."""
    return socket.create_server((host, port), backlog=BACKLOG)


class Starting:
    """Answers every request on ``sock`` with ``503`` (``{"status":
    "starting"}``, an OpenAI error body, ``Retry-After: 1``) from ``start``
    until ``stop`` (over TLS with ``tls``, as the real server will); the
    socket stays open for the real server."""

    def __init__(self, sock: socket.socket, tls: ssl.SSLContext | None = None) -> None:
        self.server = _QuietServer(
            sock.getsockname()[:2], _StartingHandler, bind_and_activate=False
        )
        self.server.tls = tls
        self.server.socket.close()
        self.server.socket = sock
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def __enter__(self) -> Starting:
        self.thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.thread.join()


class _QuietServer(http.server.HTTPServer):
    tls: ssl.SSLContext | None = None
    handshake_s = 5.0  # a client slower to shake hands is dropped (one at a time here)

    def get_request(self) -> tuple[socket.socket, Any]:
        conn, address = super().get_request()
        if self.tls is not None:  # (a failed handshake raises an OSError: dropped)
            conn.settimeout(self.handshake_s)
            conn = self.tls.wrap_socket(conn, server_side=True)
        return conn, address

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up waiting: nothing to report


class _StartingHandler(http.server.BaseHTTPRequestHandler):
    def _starting(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = {"status": "starting"} if self.path.startswith("/health") else {
            "error": {"message": "the server is starting; retry shortly",
                      "type": "server_overloaded", "param": None, "code": "starting"}
        }  # fmt: skip
        data = json.dumps(body).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", "1")
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _starting

    def log_message(self, format: str, *args: Any) -> None:
        pass  # no access log while starting


def compile_in_background(engine: Any, on_done: Callable[[str], None]) -> threading.Thread:
    """Compile a copy of ``engine.model`` on a thread (lower priority than
    serving), check it, and swap it in (see the module); ``on_done(line)``
    says what happened."""
    started = time.monotonic()

    def work() -> None:
        from mstar.engine import Engine

        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # serving goes first
        try:
            shadow = Engine(
                copy.deepcopy(engine.model), engine.tokenizer, num_pages=SHADOW_PAGES,
                page_size=engine.mgr.page_size, token_budget=engine.budget, prefix_cache=False,
                compile=True,
            )  # fmt: skip
        except Exception as failed:  # a compile that fails leaves the engine eager
            on_done(f"forward stays eager: the compile failed ({type(failed).__name__}: {failed})")
            return
        if not shadow.compiled.startswith("compiled"):
            on_done(f"forward stays eager: {shadow.compiled.removeprefix('eager: ')}")
            return
        engine.model = shadow.model  # read once per step: the next step runs compiled
        engine.compiled, engine.mode_check = shadow.compiled, shadow.mode_check
        on_done(
            f"forward {shadow.compiled}, swapped in {time.monotonic() - started:.0f} s after start"
        )

    thread = threading.Thread(target=work, name="mstar-compile", daemon=True)
    thread.start()
    return thread
