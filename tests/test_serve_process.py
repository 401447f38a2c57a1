"""``mstar-kv serve`` as a process: it says where it listens, serves, and on
SIGINT/SIGTERM stops accepting, ends its in-flight stream and exits 0."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
import pytest

pytest.importorskip("fastapi")

from servers import wait_until

from mstar.serve import free_port

START_S = 120


def up(base: str) -> bool:
    try:
        return httpx.get(f"{base}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_serve_exits_0_on_a_signal_and_ends_in_flight_streams(sig):
    port = free_port()
    cmd = [sys.executable, "-m", "mstar.cli", "serve", "--model", "random", "--port", str(port),
           "--pages", "64", "--page-size", "8", "--grace", "1"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        assert wait_until(lambda: up(base) or proc.poll() is not None, timeout=START_S)
        assert proc.poll() is None, proc.communicate()[0]
        body = {"model": "random", "prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0, "stream": True,
                "return_token_ids": True}  # fmt: skip
        lines: list[str] = []
        first = threading.Event()

        def read() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        first.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first.wait(60)
        proc.send_signal(sig)
        reader.join(timeout=60)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    out = proc.communicate()[0]
    assert f"mstar-kv serve: random on http://127.0.0.1:{port}/v1" in out
    assert not reader.is_alive() and lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert "error" in last or last["choices"][0]["finish_reason"] == "length"
    assert not up(base)


def test_serve_with_a_key_and_a_context_cap_as_a_process(monkeypatch):
    port = free_port()
    monkeypatch.setenv("MSTAR_KV_API_KEY", "from-env")
    cmd = [sys.executable, "-m", "mstar.cli", "serve", "--model", "random", "--port", str(port),
           "--pages", "64", "--page-size", "8", "--api-key", "k1", "--max-model-len", "64"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    body = {"model": "random", "prompt": [1, 2, 3], "max_tokens": 100}
    try:
        assert wait_until(lambda: up(base) or proc.poll() is not None, timeout=START_S)
        assert proc.poll() is None, proc.communicate()[0]
        post = lambda key: httpx.post(  # noqa: E731
            f"{base}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )  # fmt: skip
        assert post("k2").status_code == 401
        for key in ("k1", "from-env"):
            r = post(key)
            assert r.status_code == 400 and "maximum context length is 64" in r.text
        body["max_tokens"] = 4
        assert post("k1").status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    out = proc.communicate()[0].splitlines()
    first = next(line for line in out if line.startswith("mstar-kv serve: random"))  # short
    assert first.startswith(f"mstar-kv serve: random on http://127.0.0.1:{port}/v1 device=cpu ")
    assert " max_len=64 prefix_cache=per-key api_keys=2 " in first and "KV pages of" not in first


@pytest.mark.parametrize(
    "args, message",
    [
        (["serve", "--budget", "0"], "--budget must be >= 1"),
        (["serve", "--max-waiting", "0"], "--max-waiting must be >= 1"),
        (["serve", "--pages", "0"], "--pages must be >= 1"),
        (["serve", "--model", "random", "--device", "tpu"], "--device tpu"),
        (["serve", "--model", "/no/such/model"], "--model /no/such/model"),
        (["serve", "--api-key", " "], "--api-key: expected a key"),
        (["serve", "--ssl-keyfile", "k.pem"], "--ssl-keyfile and --ssl-certfile go together"),
        (["serve", "--ssl-keyfile", "/no/k", "--ssl-certfile", "/no/c"], "--ssl-keyfile /no/k"),
        (["serve", "--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
        (["serve", "--model", "random", "--max-model-len", "1"], "--max-model-len must be >= 2"),
        (["serve", "--model", "random", "--max-model-len", "99999999"], "over the model's"),
        (["serve", "--replicas", "2", "--allowed-origins", "*"], "not supported with --replicas"),
        (["bench", "--serve", "--rates", "burst,0"], "--rates"),
        (["bench", "--serve", "--no-self"], "--no-self needs at least one --url"),
        (["bench", "--startup", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    ],
)
def test_serve_and_bench_serve_reject_impossible_options_in_one_line(capsys, args, message):
    from mstar.cli import main

    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("drops", [1, 2])
def test_bench_serve_sends_again_once_when_a_kept_alive_connection_drops(drops):
    """A connection the server closed while idle drops before any answer:
    the request is sent once more, and a second drop is its error."""
    import asyncio

    from mstar.bench.serve import one_request

    calls = []
    sse = 'data: {"choices": [{"delta": {"content": "Hi"}}]}\n\ndata: [DONE]\n\n'

    def answer(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) <= drops:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, text=sse, headers={"content-type": "text/event-stream"})

    async def run():
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as client:
            return await one_request(client, "http://peer/v1", {"messages": []})

    sample = asyncio.run(run())
    assert len(calls) == 2
    if drops == 1:
        assert sample.error is None and sample.ttft is not None and sample.tokens == 1
    else:
        assert sample.ttft is None and sample.error.startswith("RemoteProtocolError")


def test_bench_serve_names_each_peer_as_it_names_itself():
    """llama.cpp by its /props (slots: its one-user speed depends on them),
    vLLM by /version, our server by /health; a server saying none of them is
    named as such in the table, not guessed."""
    from mstar.bench.serve import format_serve, peer_of

    answers = {
        "llama": {"/props": {"total_slots": 32, "model_ftype": "Q4_1", "build_info": "b1-0c1e570"}},
        "vllm": {"/props": None, "/version": {"version": "0.32.0"}},
        "ours": {"/health": {"status": "ok", "forward": "eager"}},
        "other": {"/props": ["not", "an", "object"], "/version": "text"},
    }

    def answer(request: httpx.Request) -> httpx.Response:
        body = answers[request.url.host].get(request.url.path)
        if body is None:
            return httpx.Response(404, json={"error": "not found"})
        if isinstance(body, str):
            return httpx.Response(200, text=body)
        return httpx.Response(200, json=body)

    said = {host: peer_of(f"http://{host}/v1", httpx.MockTransport(answer)) for host in answers}
    assert said == {
        "llama": "llama.cpp server b1-0c1e570: 32 slots, Q4_1 weights",
        "vllm": "vLLM 0.32.0",
        "ours": "mstar-kv serve (eager forward)",
        "other": None,
    }
    result = {"requests": 1, "max_tokens": 1, "rows": [], "peak_rss_bytes": {}, "peers": said}
    assert "llama: llama.cpp server b1-0c1e570: 32 slots, Q4_1 weights" in format_serve(result)
