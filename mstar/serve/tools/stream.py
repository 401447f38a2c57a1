"""Reading one choice's calls out of its text: whole (``read``), or as it
streams (``CallStream``), so that the streamed pieces add up to what
``read`` gives the whole text."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from mstar.serve.tools.calls import ParsedCall, json_at, new_call_id
from mstar.serve.tools.format import ToolFormat


@dataclass(frozen=True)
class CallReader:
    """A format's parser over a request's function names; ``forced``: the
    grammar allows calls alone (``tool_choice`` ``required`` or named)."""

    fmt: ToolFormat
    names: Collection[str]
    forced: bool = False

    def read(self, text: str, reason: str | None = None) -> tuple[str | None, list[ParsedCall]]:
        """``(content, calls)`` of a whole text that ended for ``reason``. A
        first call cut by ``max_tokens`` (``length``) comes with its arguments
        so far, never as content; one cut after complete calls is dropped (the
        model finished those, not it); ``forced``, a call made twice comes once."""
        split = self.fmt.split(text, self.names)
        content, calls = split.message()
        before, rest = split.content, split.rest
        if self.forced and not rest and not split.calls:  # (a call's first characters)
            at = len(text) - _held(text, self.fmt.start)
            before, rest = text[:at], text[at:]
        unfinished = self._unfinished(rest, bool(split.calls)) if reason == "length" else None
        if unfinished is not None:
            cut = None if split.calls else self._cut(unfinished)
            calls = [*calls, cut] if cut is not None else calls
            content = before if before.strip() else None
        return content, self.distinct(calls)

    def distinct(self, calls: Sequence[ParsedCall]) -> list[ParsedCall]:
        """``calls`` (forced: each distinct one once, in order; a prefix of
        the calls gives a prefix of the result, so streams can count on it)."""
        return list(dict.fromkeys(calls)) if self.forced else list(calls)

    def _begins(self) -> dict[str, str]:
        """Each function's call up to its arguments ({} for a format read,
        never written under a grammar)."""
        try:
            return {name: self.fmt.call_begin(name) for name in self.names}
        except NotImplementedError:
            return {}

    def _unfinished(self, rest: str, after_calls: bool) -> str | None:
        """When ``rest`` (after the calls read, if ``after_calls``) is markup
        the text ended inside (the calls' opening or separator, a call begun),
        the call's text ("" when none has begun); else None."""
        body = rest.lstrip()
        marks = [self.fmt.separator.strip()] if after_calls else [self.fmt.opening]
        for mark in (m for m in marks if m):
            if mark.startswith(body):
                return "" if body else None
            if body.startswith(mark):
                body = body[len(mark) :].lstrip()
                if not body:
                    return ""
        begins = self._begins().values()
        if body and any(body.startswith(b) or b.startswith(body) for b in begins):
            return body
        return None

    def _cut(self, body: str) -> ParsedCall | None:
        """The call ``body`` begins (``_unfinished``): its name and arguments
        so far (the end marker's start left out); None while its name is
        not known (more than one function could follow)."""
        if not body:
            return None
        begins = self._begins()
        for name, begin in begins.items():
            if body.startswith(begin):
                return ParsedCall(name, self._arguments(body[len(begin) :]))
        could = [name for name, begin in begins.items() if begin.startswith(body)]
        return ParsedCall(could[0], "") if len(could) == 1 else None

    def _arguments(self, text: str) -> str:
        """A cut call's arguments: ``text`` up to the end of the arguments'
        object when it is complete (the end marker may have begun after it)."""
        whole = json_at(text, 0)
        return text[: whole[1]] if whole is not None else text

    def message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of ``text`` and its finish reason
        (``tool_calls`` when it stopped after calls)."""
        content, calls = self.read(text, reason)
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

    def feed(self, delta: str, reason: str | None) -> tuple[str, list[tuple[int, str, ParsedCall]]]:
        """The content and the ``(index, id, call)`` calls ``delta`` completes
        (``reason``: the choice's finish reason, None while it runs)."""
        self.text += delta
        split = self.reader.fmt.split(self.text, self.reader.names)
        done = self.reader.distinct(split.calls)
        if reason is not None:
            content, done = self.reader.read(self.text, reason)
            content = content or ""
        elif self.reader.fmt.find_start(self.text) >= 0:
            content = split.content
        else:
            content = self.text[: len(self.text) - _held(self.text, self.reader.fmt.start)]
        new = content[self.sent :] if len(content) > self.sent else ""
        self.sent += len(new)
        calls = []
        for call in done[self.calls :]:
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
