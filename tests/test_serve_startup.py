"""``serve`` from its first seconds (``mstar.serve.startup``): a port in use
refused before anything loads, ``503 starting`` while the engine is built,
the compiled forward swapped in behind a serving engine, a POST body
that is not JSON refused with a 400 that says so; and ``bench --startup``,
which times all that on real processes."""

from __future__ import annotations

import copy
import json
import socket
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from servers import ServerThread

from mstar.cli import main
from mstar.engine import Engine, SamplingParams
from mstar.models import compiled as compiled_module
from mstar.models.seeded import build_model
from mstar.serve import free_port
from mstar.serve.app import create_app
from mstar.serve.startup import Starting, bind, compile_in_background

POOL = {"num_pages": 48, "page_size": 8, "token_budget": 64}
COMPILE_S = 900  # a compile on a loaded 2-core machine


@pytest.fixture(scope="module")
def paged():
    return build_model(0)[1]


def test_a_port_in_use_is_refused_before_the_model_loads(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model loaded")

    monkeypatch.setattr("mstar.serve.options.build_engine", never)
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert main(["serve", "--model", "random", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"mstar-kv serve: error: --port {port}: 127.0.0.1:{port} is in use"


@pytest.mark.parametrize("command", [["serve"], ["generate", "hi"]])
def test_a_missing_model_file_is_not_found_in_one_line(capsys, command):
    assert main([*command, "--model", "/no/such/model.gguf"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "--model /no/such/model.gguf: not found (expected smollm2, a GGUF file or a folder)"
    )
    assert len(err.splitlines()) == 1


def test_generate_refuses_an_impossible_request_before_compiling(capsys, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("compiled before checking the request")

    monkeypatch.delenv("MSTAR_KV_ENFORCE_EAGER", raising=False)
    monkeypatch.setattr("mstar.engine.engine.runs_fused", lambda model: False)  # one to compile
    monkeypatch.setattr("mstar.cli.commands.compile_now", never)
    assert main(["generate", "hi", "--max-new-tokens", "100000000"]) == 2
    assert "exceeds the model's max_position_embeddings" in capsys.readouterr().err


def test_while_starting_every_request_gets_503_and_the_socket_stays_for_the_server():
    sock = bind("127.0.0.1", free_port())
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with sock:
        with Starting(sock):
            health = httpx.get(f"{base}/health", timeout=10)
            chat = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=10)
        assert (health.status_code, health.json()) == (503, {"status": "starting"})
        assert chat.status_code == 503 and chat.headers["retry-after"] == "1"
        assert chat.json()["error"]["code"] == "starting"
        sock.settimeout(0.2)
        with pytest.raises(TimeoutError):  # still listening, nobody answering now
            sock.accept()


def test_the_compiled_forward_is_swapped_in_behind_a_serving_engine(paged):
    engine = Engine(copy.deepcopy(paged), **POOL)
    eager_model = engine.model
    said: list[str] = []
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    before = engine.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids
    thread = compile_in_background(engine, said.append)
    while thread.is_alive():  # serving meanwhile, on whichever forward is in
        assert engine.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids == before
        thread.join(timeout=1.0 if len(said) == 0 else 0)
        assert thread.is_alive() or said, "the compile thread ended without a word"
    assert said and said[0].startswith("forward compiled ("), said
    assert "swapped in" in said[0]
    assert engine.model is not eager_model and "forward" in vars(engine.model)
    assert engine.compiled.startswith("compiled") and engine.mode_check.ok
    assert engine.generate([[1, 2, 3, 4]], params)[0].outputs[0].token_ids == before


def test_a_compile_that_fails_leaves_the_engine_eager_and_says_why(paged, monkeypatch):
    def failing(fn, **options):
        def run(*args, **kwargs):
            raise RuntimeError("no backend here")

        return run

    monkeypatch.setattr(compiled_module.torch, "compile", failing)
    engine = Engine(copy.deepcopy(paged), **POOL)
    eager_model, said = engine.model, []
    compile_in_background(engine, said.append).join(timeout=COMPILE_S)
    assert said == [
        "forward stays eager: the forward does not compile (RuntimeError: no backend here)"
    ]
    assert engine.model is eager_model and engine.compiled is None


@pytest.mark.parametrize(
    "headers",
    [{"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}, {}],
)
def test_a_body_that_is_not_json_gets_400_saying_so(paged, headers):
    with ServerThread(create_app(Engine(copy.deepcopy(paged), **POOL), model_name="random")) as srv:
        r = httpx.post(
            f"{srv.url}/completions", content=b'{"model": "random", "prompt": [1, 2], "max_tokens": 2}',
            headers=headers, timeout=30,
        )  # fmt: skip
        ok = httpx.post(
            f"{srv.url}/completions",
            json={"model": "random", "prompt": [1, 2], "max_tokens": 2},
            timeout=30,
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "unsupported_content_type" and error["type"] == "invalid_request_error"
    assert "expected a JSON body (Content-Type: application/json)" in error["message"]
    assert (headers.get("content-type") or "no Content-Type") in error["message"]
    assert ok.status_code == 200, ok.text


def test_serve_threads_are_not_left_behind():
    assert not [t for t in threading.enumerate() if t.name == "mstar-compile" and t.is_alive()]


@pytest.mark.parametrize("fused", [True, False])
def test_serve_compiles_in_the_background_only_an_unfused_forward(fused, monkeypatch):
    """``serve``'s engine (built eager, ``compiling_later``) says it compiles
    behind the eager forward only when that forward is not the fused one
    (faster eager than HF's compiled forward)."""
    import argparse

    from mstar.serve.options import build_engine

    if not fused:
        monkeypatch.setattr("mstar.engine.engine.runs_fused", lambda model: False)
    args = argparse.Namespace(
        model="random", seed=0, device="cpu", dtype="float32", pages=48, page_size=8,
        budget=64, no_prefix_cache=False, tensor_parallel_size=1, enforce_eager=False,
        speculative=None, num_speculative_tokens=4, quantization="none", kv_cache_dtype="auto",
    )  # fmt: skip
    engine, line = build_engine(args, enforce_eager=True, compiling_later=True)
    assert engine.fused == fused and engine.compiled is None
    assert ("forward eager, fused layers (faster than compiled)" in line) == fused
    assert ("forward eager, compiling in the background" in line) == (not fused)


def test_bench_startup_times_two_starts_to_a_chat_and_a_port_in_use(smollm2, tmp_path, capsys):
    """Two SmolLM2 servers, one after the other, each from its first answer
    (503) to ready to a chat answered; a third on the second's port exits 2
    saying so; the table prints it all with the CPU. (Run on the current
    cache: a first start on an empty one converts the model and builds the
    kernels, the same path with more to do.)"""
    out = tmp_path / "startup.json"
    argv = ["bench", "--startup", "--startup-cache", "current", "--max-tokens", "4"]
    assert main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [row["start"] for row in rows] == [
        "first (the current cache)", "second (the same cache)", "port in use"
    ]  # fmt: skip
    for row in rows[:2]:
        assert 0 < row["health_s"] <= row["ready_s"] < row["chat_s"]
        assert row["answer"].strip() and row["mode"].startswith("mstar-kv serve: smollm2 on ")
    assert rows[2]["exit_code"] == 2 and rows[2]["said"].endswith("is in use")
    table = capsys.readouterr().out
    assert "CPU: " in table and "exit 2 at" in table and rows[0]["mode"] in table
