"""The local disk tier: one file per page under a directory, in a byte budget.

Files are written to a temporary name and renamed, so a reader never sees
half a page and a crash leaves at most a stray ``*.tmp`` (removed at the
next start). The index (name -> size, least recently used first) is read
back from the directory at start, oldest modification time first, so the
cache survives a restart; a read touches the file's time. A put that
would exceed the budget evicts least recently used pages first; a page
larger than the budget is not stored. Thread-safe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

log = logging.getLogger(__name__)

_SUFFIX = ".kvpage"


class DiskStore:
    """Pages as files under ``path`` (made if missing), at most ``budget`` bytes."""

    medium = "DISK"
    local = True  # answers contains() at once, on any thread

    def __init__(self, path: str | os.PathLike[str], budget: int) -> None:
        if budget < 1:
            raise ValueError(f"expected a disk budget >= 1 byte, got {budget}")
        self.path, self.budget = os.fspath(path), int(budget)
        os.makedirs(self.path, exist_ok=True)
        self._lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # file name -> bytes, LRU first
        self.used = 0
        self.evicted: list[str] = []  # keys evicted since the last ``take_evicted``
        found = []
        for entry in os.scandir(self.path):
            if entry.name.endswith(".tmp"):
                os.unlink(entry.path)
            elif entry.name.endswith(_SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self._index[name] = size
            self.used += size
        with self._lock:
            self._fit(0)

    def put(self, keys: Sequence[str], values: Sequence[bytes]) -> int:
        """Store each value under its key (replacing one there); the bytes written."""
        written = 0
        for key, value in zip(keys, values):
            if len(value) > self.budget:
                continue
            name = key.replace(":", "_") + _SUFFIX
            tmp = os.path.join(self.path, f"{name}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(value)
            with self._lock:
                self._drop(name)
                self._fit(len(value))
                os.replace(tmp, os.path.join(self.path, name))
                self._index[name] = len(value)
                self.used += len(value)
            written += len(value)
        return written

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value, or None where absent."""
        out: list[bytes | None] = []
        for key in keys:
            name = key.replace(":", "_") + _SUFFIX
            with self._lock:
                if name not in self._index:
                    out.append(None)
                    continue
                self._index.move_to_end(name)
            full = os.path.join(self.path, name)
            try:
                with open(full, "rb") as f:
                    out.append(f.read())
                os.utime(full)  # least recently used survives a restart
            except FileNotFoundError:  # evicted meanwhile
                out.append(None)
        return out

    def contains(self, keys: Sequence[str]) -> list[bool]:
        with self._lock:
            return [key.replace(":", "_") + _SUFFIX in self._index for key in keys]

    def discard(self, keys: Sequence[str]) -> None:
        """Delete each key's file (a value that did not check out)."""
        with self._lock:
            for key in keys:
                name = key.replace(":", "_") + _SUFFIX
                if name in self._index:
                    self._drop(name)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(self.path, name))

    def take_evicted(self) -> list[str]:
        """Keys evicted for the budget since the last call."""
        with self._lock:
            out, self.evicted = self.evicted, []
        return out

    def describe(self) -> str:
        return f"disk {self.path} ({self.used} of {self.budget} bytes used)"

    def close(self) -> None:
        pass

    def _drop(self, name: str) -> None:
        size = self._index.pop(name, None)
        if size is not None:
            self.used -= size

    def _fit(self, incoming: int) -> None:
        """Evict least recently used files until ``incoming`` more bytes fit."""
        while self._index and self.used + incoming > self.budget:
            name, size = self._index.popitem(last=False)
            self.used -= size
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(self.path, name))
            self.evicted.append(name[: -len(_SUFFIX)].replace("_", ":"))
