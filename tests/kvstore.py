"""A real Valkey/Redis server for the KV tier tests: Debian's valkey-server
or redis-server from PATH on 127.0.0.1 and a free port, stopped by the test
(the fixture) that started it."""

from __future__ import annotations

import shutil
import subprocess
import time

from mstar.serve import free_port

START_TIMEOUT_S = 10.0


def server_binary() -> str | None:
    """valkey-server or redis-server on PATH, or None."""
    return shutil.which("valkey-server") or shutil.which("redis-server")


class StoreServer:
    """A throwaway server (no persistence) at ``url``; ``stop`` ends it."""

    def __init__(self, binary: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        args = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--maxmemory", "512mb",
                "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        self.client = redis.Redis(port=self.port, socket_timeout=1)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                self.client.ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{binary} did not start on port {self.port}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
