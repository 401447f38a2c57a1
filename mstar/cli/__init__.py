"""The command line, ``mstar-kv``: its commands (``commands``: ``demo``,
``generate``, ``bench``; ``serve``'s options and runs in ``serve``), the demo's
workloads and report. The top room: it may import every other, none imports it."""

from mstar.cli.commands import main

__all__ = ["main"]
