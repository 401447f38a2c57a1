"""The tool-call parsers, without a server: each format reads back the
calls it writes, text that looks like a call but is not one stays content,
a stream read piece by piece adds up to the whole text read at once, each
format's grammar accepts the calls it writes and refuses others, ``auto``
picks the template's format, and the plan refuses bad tool fields."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.serve.protocol import ChatCompletionRequest, ParamError
from mstar.serve.tools import tool_format
from mstar.serve.tools.calls import ParsedCall
from mstar.serve.tools.hermes import Hermes
from mstar.serve.tools.llama3_json import Llama3Json
from mstar.serve.tools.mistral import Mistral
from mstar.serve.tools.pythonic import Pythonic
from mstar.serve.tools.stream import CallReader, CallStream

FORMATS = [Hermes(), Llama3Json(), Mistral(), Pythonic()]
NAMES = {"get_weather", "add"}
CALLS = [
    ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ParsedCall("add", '{"a": 1, "b": [2, 3.5], "c": null, "d": "x\\"y"}'),
]


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_each_format_reads_back_the_calls_it_writes_after_content(fmt):
    for calls in ([CALLS[0]], CALLS):
        text = fmt.write(calls)
        assert fmt.split(text, NAMES).message() == (None, calls)
        before = "Let me look that up. "
        assert fmt.split(before + text + "\n", NAMES).message() == (before, calls)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_what_looks_like_a_call_but_is_not_stays_content(fmt):
    good = fmt.write([CALLS[0]])
    bad = [
        good.replace("get_weather", "unknown_tool"),  # a name not among the tools
        good[: len(good) // 2],  # cut short
        good.replace('"city"', "city").replace("city=", "ci ty="),  # not JSON / Python
        fmt.start + " plain words",
    ]
    for text in bad:
        assert fmt.split(text, NAMES).message() == (text, []), text


def test_a_bad_call_after_a_good_one_is_content_after_it():
    fmt = Hermes()
    text = fmt.write([CALLS[0]]) + '\n<tool_call>\n{"name": "add", "arguments": 3}\n</tool_call>'
    content, calls = fmt.split(text, NAMES).message()
    assert calls == [CALLS[0]] and content.startswith("\n<tool_call>")


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=lambda f: f.name)
def test_a_call_cut_by_max_tokens_comes_with_its_arguments_so_far_never_as_content(fmt):
    """The first call cut: its name (once known) and arguments so far. A call
    cut after complete ones: dropped, never partial, never content
    (langchain's required tool choice read one complete call and an empty
    second one)."""
    text = fmt.write(CALLS)
    second = text.index(fmt.call_begin("add"))
    for reader in (CallReader(fmt, NAMES, forced=True), CallReader(fmt, NAMES)):
        for cut in range(second, len(text)):  # the second whole once its format reads it so
            content, calls = reader.read(text[:cut], "length")
            assert content is None and calls in ([CALLS[0]], CALLS), (cut, calls)
        assert reader.read(text[:second], "length") == (None, [CALLS[0]])
        first = fmt.write([CALLS[1]])
        at = first.index(fmt.call_begin("add"))
        for cut in range(at + len(fmt.call_begin("add")), len(first)):
            content, calls = reader.read(first[:cut], "length")
            assert content is None and len(calls) == 1 and calls[0].name == "add", cut
            assert CALLS[1].arguments.startswith(calls[0].arguments), calls[0]
        named = CallReader(fmt, {"add"}, forced=True)  # a named choice: its name is known
        assert named.read(first[: at + 3], "length") == (None, [ParsedCall("add", "")])
        assert named.read(first[:2], "length")[0] is None


def test_a_forced_choice_never_gives_the_same_call_twice():
    fmt = Hermes()
    text = fmt.write([CALLS[0], CALLS[0], CALLS[1], CALLS[0]])
    assert CallReader(fmt, NAMES, forced=True).read(text, "stop") == (None, CALLS)
    assert CallReader(fmt, NAMES).read(text, "stop")[1] == [CALLS[0], CALLS[0], CALLS[1], CALLS[0]]
    stream, calls = CallStream(CallReader(fmt, NAMES, forced=True)), []
    for k in range(0, len(text), 7):
        calls += [c for _, _, c in stream.feed(text[k : k + 7], None)[1]]
    calls += [c for _, _, c in stream.feed("", "stop")[1]]
    assert calls == CALLS


def test_pythonic_literals_become_json():
    text = "[add(a=1, b=(2, 3.5), c=None, d='x\"y'), get_weather(city='Paris', unit='celsius')]"
    calls = Pythonic().split(text, NAMES).calls
    assert [json.loads(c.arguments) for c in calls] == [
        {"a": 1, "b": [2, 3.5], "c": None, "d": 'x"y'},
        {"city": "Paris", "unit": "celsius"},
    ]
    assert Pythonic().split("[add(1)]", NAMES).calls == ()  # positional: not a call


@settings(max_examples=60, deadline=None)
@given(
    fmt=st.sampled_from(FORMATS),
    before=st.sampled_from(["", "Sure: ", "a < b [x] {y} "]),
    n=st.integers(1, 2),
    after=st.sampled_from(["", "\n", " and more text", "<tool_call>{bad"]),
    cuts=st.lists(st.integers(0, 400), max_size=12),
    end=st.integers(0, 400),
    reason=st.sampled_from(["stop", "length"]),
    forced=st.booleans(),
)
def test_streamed_pieces_add_up_to_the_whole_text_read_at_once(
    fmt, before, n, after, cuts, end, reason, forced
):
    text = before + fmt.write(CALLS[:n]) + after
    text = text if reason == "stop" else text[:end]  # (cut by max_tokens anywhere)
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    reader = CallReader(fmt, NAMES, forced)
    stream, content, calls = CallStream(reader), "", []
    for k, (a, b) in enumerate(itertools.pairwise(bounds)):
        piece, new = stream.feed(text[a:b], reason if k == len(bounds) - 2 else None)
        content += piece
        calls += [call for _, _, call in new]
    whole_content, whole_calls = reader.read(text, reason)
    assert calls == whole_calls
    assert content == (whole_content or "")


@pytest.mark.parametrize(
    "template, name",
    [
        ("{{ '<tool_call>' }}", "hermes"),
        ("[TOOL_CALLS] {{ x }}", "mistral"),
        ("<|python_tag|>", "llama3_json"),
        ("[func_name1(params_name1=params_value1)]", "pythonic"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_auto_picks_the_templates_format(template, name):
    assert tool_format("auto", template).name == name
    assert tool_format("mistral", template).name == "mistral"
    with pytest.raises(ValueError, match="tool-call parser"):
        tool_format("qwen", template)


@pytest.mark.parametrize("fmt", FORMATS[:3], ids=lambda f: f.name)
def test_each_formats_grammar_accepts_its_calls_and_refuses_others(fmt, tok):
    xgr = pytest.importorskip("xgrammar")
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    schemas = [("get_weather", {"type": "object", "properties": {"city": {"type": "string"},
               "unit": {"enum": ["celsius"]}}, "required": ["city", "unit"]}),
               ("add", {"type": "object"})]  # fmt: skip
    for required in (True, False):
        grammar = compiler.compile_structural_tag(
            json.dumps(fmt.structural_tag(schemas, required, parallel=True))
        )
        prefix = "" if required else "Some text first. "
        for calls in ([CALLS[0]], CALLS):
            assert xgr.GrammarMatcher(grammar).accept_string(prefix + fmt.write(calls))
        wrong = fmt.write([ParsedCall("get_weather", '{"city": "Paris", "unit": "kelvin"}')])
        assert not xgr.GrammarMatcher(grammar).accept_string(prefix + wrong)
    single = compiler.compile_structural_tag(
        json.dumps(fmt.structural_tag(schemas, True, parallel=False))
    )
    assert not xgr.GrammarMatcher(single).accept_string(fmt.write(CALLS))
    assert Pythonic().structural_tag(schemas, True, True) is None


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def test_pythonic_cannot_constrain_a_required_call():
    from mstar.serve.tools.chat import ChatTools

    tools = ChatTools(None, "pythonic")
    one = [{"type": "function", "function": {"name": "add"}}]
    assert tools.plan(body(tools=one, tool_choice="auto"))[1].structured() is None
    with pytest.raises(ParamError, match="grammar") as err:
        tools.plan(body(tools=one, tool_choice="required"))
    assert err.value.param == "tool_choice"


def test_a_forced_choice_is_read_as_forced_a_named_one_by_its_name():
    pytest.importorskip("xgrammar")
    from mstar.serve.tools.chat import ChatTools

    tools = ChatTools(None, "hermes")
    two = [{"type": "function", "function": {"name": n}} for n in ("add", "get_weather")]
    named = {"type": "function", "function": {"name": "add"}}
    readers = {
        str(choice): tools.reader(tools.plan(body(tools=two, tool_choice=choice))[1])
        for choice in ("auto", "required", named)
    }
    assert not readers["auto"].forced and readers["auto"].names == {"add", "get_weather"}
    assert readers["required"].forced and readers["required"].names == {"add", "get_weather"}
    assert readers[str(named)].forced and readers[str(named)].names == {"add"}


def test_a_matcher_in_free_text_leaves_the_logits_untouched(tok):
    """``auto`` before a call's start allows every token: no copy, no apply;
    once the start is written, the row is masked."""
    import torch

    from mstar.engine.sampling.structured import Grammars, StructuredOutputs

    grammars = Grammars(tok, len(tok), [tok.convert_tokens_to_ids("<|im_end|>")])
    tag = Hermes().structural_tag([("add", {"type": "object"})], False, True)
    matcher = grammars.matcher(StructuredOutputs(structural_tag=tag))
    logits = torch.randn(2, len(tok))
    assert grammars.mask(logits, [matcher, None]) is logits
    assert matcher.accept_string("Sure. <tool_call>")
    masked = grammars.mask(logits, [matcher, None])
    assert masked is not logits and torch.isinf(masked[0]).sum() > len(tok) // 2
    assert torch.equal(masked[1], logits[1])


def test_a_template_that_refuses_the_conversation_is_a_value_error(tok):
    import copy

    from mstar.serve.tools.render import ToolPrompt

    strict = copy.deepcopy(tok)
    strict.chat_template = (
        "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{{ m.content }}{% endfor %}{{ tools }}"
    )
    prompt = ToolPrompt(strict, Hermes())
    assert prompt.native
    tool = {"role": "tool", "content": "1", "tool_calls": [], "tool_call_id": "c"}
    with pytest.raises(ValueError, match="no tools"):
        prompt.ids([tool], None)
