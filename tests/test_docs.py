"""The README and docs/ cannot rot: every relative link (and its #anchor)
resolves, and the README's Python quick starts marked for testing run, on a
seeded tiny Llama where SmolLM2 would be too slow.

A fenced ```python block runs when the line before it is one of:
``<!-- test: run -->`` (as written), ``<!-- test: tiny -->`` (with
``Engine.from_pretrained("smollm2")`` replaced by an engine on the tiny
model), ``<!-- test: server -->`` (with the server it talks to started on a
free port, serving the tiny model)."""

from __future__ import annotations

import contextlib
import io
import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
BLOCK = re.compile(r"<!-- test: (\w+) -->\n```python\n(.*?)^```", re.S | re.M)
FROM_PRETRAINED = 'Engine.from_pretrained("smollm2")'
SERVER_URL = "http://127.0.0.1:8000/v1"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces to hyphens."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor (outside code fences), with GitHub's -1, -2
    suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", text).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for m in LINK.finditer(FENCE.sub("", page.read_text()))]


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or #anchor does not exist."""
    bad = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not ours to check
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (
            anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text())
        ):
            bad.append(target)
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_link_check_catches_a_missing_file_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text(
        "[ok](a.md#two-words) [top](a.md#top) [gone](c.md) [bad](a.md#not-a-heading)"
        " [web](https://example.com/x.md)"
    )
    assert broken_links(page) == ["c.md", "a.md#not-a-heading"]


def blocks(kind: str) -> list[str]:
    return [code for k, code in BLOCK.findall((ROOT / "README.md").read_text()) if k == kind]


def test_the_readme_marks_its_quick_starts():
    assert [len(blocks(k)) for k in ("run", "tiny", "server")] == [1, 1, 1]
    assert FROM_PRETRAINED in blocks("tiny")[0]
    assert SERVER_URL in blocks("server")[0]


def run(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    return out.getvalue()


@pytest.fixture(scope="module")
def tiny_engine(smollm2):
    """An engine on a tiny seeded Llama over SmolLM2's tokenizer (its chat template)."""
    from mstar.engine import Engine
    from mstar.models.seeded import build_model

    tok = smollm2[1]
    model = build_model(seed=0, vocab_size=len(tok))[1]
    return Engine(model, tok, num_pages=64, page_size=8, token_budget=32)


def test_the_plan_layer_quick_start_runs():
    assert "tensor([18, 19,  0,  1])" in run(blocks("run")[0])


def test_the_python_quick_start_runs_on_the_tiny_model(tiny_engine, monkeypatch):
    from mstar.engine import Engine

    monkeypatch.setattr(Engine, "from_pretrained", staticmethod(lambda name: tiny_engine))
    out = run(blocks("tiny")[0])
    assert "stop" in out or "length" in out


def test_the_server_quick_start_runs_against_a_served_tiny_model(tiny_engine):
    pytest.importorskip("openai")
    pytest.importorskip("fastapi")
    from servers import ServerThread

    from mstar.serve.app import create_app

    with ServerThread(create_app(tiny_engine, model_name="smollm2")) as srv:
        run(blocks("server")[0].replace(SERVER_URL, srv.url))
