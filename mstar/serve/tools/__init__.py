"""Tool calling: the request's tools checked and planned (``plan``), the
prompt rendered through the chat template or the fallback (``render``), and
generated text read into calls by one parser per model family's format."""

from __future__ import annotations

from mstar.serve.tools.format import ToolFormat
from mstar.serve.tools.hermes import Hermes
from mstar.serve.tools.llama3_json import Llama3Json
from mstar.serve.tools.mistral import Mistral
from mstar.serve.tools.pythonic import Pythonic

PARSERS = ("auto", "hermes", "llama3_json", "mistral", "pythonic")
_FORMATS = {f.name: f for f in (Hermes, Llama3Json, Mistral, Pythonic)}
# what in a chat template tells its family's format, checked in this order
_MARKS = (
    ("<tool_call>", "hermes"),
    ("[TOOL_CALLS]", "mistral"),
    ("func_name1(", "pythonic"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters"', "llama3_json"),
)


def tool_format(parser: str, chat_template: str | None) -> ToolFormat:
    """The format ``parser`` names; ``auto``: the one ``chat_template``
    writes, hermes when it names none (the fallback prompt's format)."""
    if parser not in PARSERS:
        raise ValueError(f"expected a tool-call parser among {PARSERS}, got {parser!r}")
    if parser == "auto":
        template = chat_template or ""
        parser = next((name for mark, name in _MARKS if mark in template), "hermes")
    return _FORMATS[parser]()
