"""Small contracts of a request, the same in Python and over HTTP: a prompt
too long alone is refused naming the prompt (not max_tokens); an empty chat
and an empty stop string are refused in both; ``serve`` without its extra
exits 2 in one line; a windowed model's recompute peaks at its window; the
server logs a line per request."""

from __future__ import annotations

import copy
import logging
import sys

import httpx
import pytest
import torch

from mstar.cli import main
from mstar.engine import Engine, RequestTooLarge, SamplingParams
from mstar.models.seeded import build_model

pytest.importorskip("fastapi")
from servers import ServerThread

from mstar.serve.app import create_app

POOL = {"num_pages": 4, "page_size": 8, "token_budget": 16}


@pytest.fixture(scope="module")
def tiny():
    return build_model(0)[0]


def engine_of(model, max_len: int | None = None, tokenizer=None) -> Engine:
    model = copy.deepcopy(model)
    if max_len is not None:
        model.config.max_position_embeddings = max_len
    return Engine(model, tokenizer, **POOL)


def post(srv: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{srv.url}/{path}", json={"model": "m", **body}, timeout=60)


@pytest.mark.parametrize(
    "max_len, prompt_len, error",
    [(24, 24, ValueError), (None, 40, RequestTooLarge)],  # context; pool (4 pages of 8)
    ids=["context", "pool"],
)
def test_a_prompt_too_long_alone_is_refused_naming_the_prompt(tiny, max_len, prompt_len, error):
    prompt = [5] * prompt_len
    engine = engine_of(tiny, max_len)
    with pytest.raises(error, match="the prompt alone") as caught:
        engine.add_request(prompt, SamplingParams(max_new_tokens=4))
    assert "max_new_tokens" not in str(caught.value)
    with ServerThread(create_app(engine_of(tiny, max_len), model_name="m")) as srv:
        r = post(srv, "completions", {"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt"
    assert "max_tokens" not in r.json()["error"]["message"]
    assert "max_new_tokens" not in r.json()["error"]["message"]


def test_a_prompt_that_fits_alone_names_max_tokens(tiny):
    with ServerThread(create_app(engine_of(tiny, 24), model_name="m")) as srv:
        r = post(srv, "completions", {"prompt": [5] * 20, "max_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_an_empty_stop_string_is_refused_in_python_and_over_http(tiny):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop="")
    with ServerThread(create_app(engine_of(tiny), model_name="m")) as srv:
        r = post(srv, "completions", {"prompt": [1, 2], "max_tokens": 2, "stop": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"


def test_an_empty_chat_is_refused_in_python_and_over_http(tiny, smollm2):
    tokenizer = smollm2[1]
    model = build_model(0, vocab_size=len(tokenizer))[0]
    with pytest.raises(ValueError, match="at least one message"):
        engine_of(model, tokenizer=tokenizer).chat([])
    with ServerThread(create_app(engine_of(model, tokenizer=tokenizer), model_name="m")) as srv:
        r = post(srv, "chat/completions", {"messages": [], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


@pytest.mark.parametrize("command", [["serve", "--model", "random"], ["bench", "--serve"]])
def test_serve_without_the_serve_extra_exits_2_in_one_line(monkeypatch, capsys, command):
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    monkeypatch.setitem(sys.modules, "httpx", None)
    monkeypatch.delitem(sys.modules, "mstar.bench.serve", raising=False)  # (imported earlier)
    assert main(command) == 2
    err = capsys.readouterr().err
    assert "pip install 'mstar-kv[serve]'" in err and err.count("\n") == 1


def test_a_windowed_recompute_peaks_at_its_window():
    """40 + 160 tokens, window 32, 10 pages of 16: chunks capped at the
    window, so a recompute after preemption holds about the window's pages
    (not one chunk of prompt + output); five such requests (preempting one
    another) equal HF generate."""
    from test_architectures import _pair

    reference, paged = _pair("MistralConfig", {"sliding_window": 32})
    engine = Engine(paged, prefix_cache=False, num_pages=10, page_size=16)
    params = SamplingParams(max_new_tokens=160)
    assert engine.peak_pages(40, params) <= 6
    prompts = [[(11 * i + 3 * j) % 120 + 1 for j in range(40)] for i in range(5)]
    got = engine.generate(prompts, params)
    want = reference.generate(torch.tensor(prompts), max_new_tokens=160, do_sample=False)
    assert [c.outputs[0].token_ids for c in got] == want[:, 40:].tolist()
    assert engine.stats.preemptions > 0 and engine.mgr.num_free_pages == 10


def test_the_server_logs_a_line_per_request(tiny, caplog):
    caplog.set_level(logging.INFO, logger="mstar.serve.app")
    with ServerThread(create_app(engine_of(tiny), model_name="m")) as srv:
        for streamed in (False, True):
            body = {"prompt": [1, 2, 3], "max_tokens": 3, "stream": streamed}
            assert post(srv, "completions", body).status_code == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "mstar.serve.app"]
    assert len(lines) == 2, lines
    for line in lines:
        assert line.startswith("cmpl-") and "finished length; 3 prompt + 3 generated" in line
