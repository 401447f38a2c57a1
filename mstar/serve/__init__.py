"""``mstar-kv serve``: the engine behind an OpenAI-compatible HTTP API
(FastAPI + uvicorn): ``create_app(engine, model_name=...)``."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
