"""Reading one choice's calls out of its text: whole (``read``), or as it
streams (``CallStream``), so that the streamed pieces add up to what
``read`` gives the whole text."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from mstar.serve.tools.calls import ParsedCall, new_call_id
from mstar.serve.tools.format import ToolFormat


@dataclass(frozen=True)
class CallReader:
    """A format's parser over a request's function names."""

    fmt: ToolFormat
    names: Collection[str]

    def read(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a whole text."""
        return self.fmt.split(text, self.names).message()

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of ``text`` and its finish reason
        (``tool_calls`` when it stopped after calls)."""
        content, calls = self.read(text)
        message: dict = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
        return message, finish_reason(reason, bool(calls))


def finish_reason(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


@dataclass
class CallStream:
    """One streamed choice: content as it is known not to open a call
    (a tail that may be the start of one held back), each call once it is
    complete, and the rest at the end."""

    reader: CallReader
    text: str = ""
    sent: int = 0  # content characters sent
    calls: int = 0  # calls sent
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[tuple[int, str, ParsedCall]]]:
        """The content and the ``(index, id, call)`` calls ``delta`` completes."""
        self.text += delta
        split = self.reader.fmt.split(self.text, self.reader.names)
        if finished:
            content = split.message()[0] or ""
        elif self.reader.fmt.find_start(self.text) >= 0:
            content = split.content
        else:
            content = self.text[: len(self.text) - _held(self.text, self.reader.fmt.start)]
        new = content[self.sent :] if len(content) > self.sent else ""
        self.sent += len(new)
        calls = []
        for call in split.calls[self.calls :]:
            self.ids.append(new_call_id())
            calls.append((self.calls, self.ids[-1], call))
            self.calls += 1
        return new, calls


def _held(text: str, start: str) -> int:
    """The length of the longest end of ``text`` that begins ``start``."""
    for n in range(min(len(start) - 1, len(text)), 0, -1):
        if start.startswith(text[-n:]):
            return n
    return 0
