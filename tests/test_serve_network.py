"""A server on a network (issue 61): API keys on every ``/v1`` route (401
with the OpenAI error body, ``/health`` and ``/metrics`` open unless
protected), HTTPS, CORS, the largest body (413), the context as a 400
naming the numbers, and tenants apart in the prefix cache (per key, per
``cache_salt``), read from ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import copy
import datetime
import ipaddress
import json
import ssl

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")

from servers import ServerThread  # noqa: E402

from mstar.cli.serve import access_of, origins, server_config  # noqa: E402
from mstar.engine import Engine  # noqa: E402
from mstar.models.seeded import build_model  # noqa: E402
from mstar.serve import access as access_module  # noqa: E402
from mstar.serve.access import Access, api_keys  # noqa: E402
from mstar.serve.app import create_app  # noqa: E402
from mstar.serve.options import cap_context  # noqa: E402

MODEL = "random"
POOL = {"num_pages": 48, "page_size": 8, "token_budget": 64}
LONG = [(11 * j) % 250 + 1 for j in range(40)]  # 5 pages of 8
KEYS = ("key-a", "key-b")


@pytest.fixture(scope="module")
def tiny():
    return build_model(0)[0]


def app_of(tiny, **kwargs):
    engine = Engine(copy.deepcopy(tiny), **POOL)
    return create_app(engine, model_name=MODEL, **kwargs)


def client(srv: ServerThread, key: str = "none", **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url, api_key=key, max_retries=0, timeout=60, **kwargs)


def cached(api: openai.OpenAI, prompt: list[int], **extra) -> int:
    """The cached prompt tokens of one completion of ``prompt``."""
    got = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body=extra or None
    )
    return got.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def keyed(tiny):
    with ServerThread(app_of(tiny, access=Access(api_keys=KEYS))) as srv:
        yield srv


def test_v1_routes_need_a_key_the_rest_stay_open(keyed):
    for key in ("wrong", "key-", "key-ab"):
        with pytest.raises(openai.AuthenticationError) as err:
            client(keyed, key).completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        assert err.value.status_code == 401
        body = err.value.response.json()
        assert body["error"]["code"] == "invalid_api_key"
        assert body["error"]["type"] == "invalid_request_error"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    for path in ("/v1/models", "/v1/chat/completions", "/v1/anything", "/openapi.json", "/docs"):
        r = httpx.post(f"{keyed.base}{path}", json={}, timeout=30)
        assert r.status_code == 401, path
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{keyed.url}/models", headers={"Authorization": "Basic key-a"}, timeout=30)
    assert r.status_code == 401
    for key in KEYS:  # every key works
        got = client(keyed, key).completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        assert got.usage.completion_tokens == 2
    assert httpx.get(f"{keyed.base}/health", timeout=30).status_code == 200
    assert httpx.get(f"{keyed.base}/metrics", timeout=30).status_code == 200


def test_protect_metrics_asks_for_a_key_there(tiny):
    access = Access(api_keys=KEYS, protect_metrics=True)
    with ServerThread(app_of(tiny, access=access)) as srv:
        assert httpx.get(f"{srv.base}/metrics", timeout=30).status_code == 401
        auth = {"Authorization": "Bearer key-b"}
        assert httpx.get(f"{srv.base}/metrics", headers=auth, timeout=30).status_code == 200
        assert httpx.get(f"{srv.base}/health", timeout=30).status_code == 200


def test_keys_are_compared_in_constant_time_every_one_of_them(monkeypatch):
    seen = []

    def spy(a: bytes, b: bytes) -> bool:
        seen.append((a, b))
        return a == b

    monkeypatch.setattr(access_module.hmac, "compare_digest", spy)
    access = Access(api_keys=("k1", "k2", "k3"))
    assert access.key_of([(b"authorization", b"Bearer k1")]) == "k1"
    assert len(seen) == 3  # every key, no early exit on a match
    assert {len(a) for a, _ in seen} == {len(b) for _, b in seen} == {32}  # digests: one length


def test_keys_come_from_the_flags_and_the_environment():
    env = {"MSTAR_KV_API_KEY": " e1, e2 ,,k1"}
    assert api_keys(["k1", "k2"], env) == ("k1", "k2", "e1", "e2")
    assert api_keys(None, {}) == ()
    with pytest.raises(ValueError, match="--api-key"):
        api_keys([" "], {})


def test_each_key_has_its_own_prefix_cache(keyed):
    a, b = client(keyed, "key-a"), client(keyed, "key-b")
    prompt = [LONG[0] + 1, *LONG[1:]]  # (no other test's)
    assert cached(a, prompt) == 0
    assert cached(b, prompt) == 0  # key-a's KV is not key-b's
    assert cached(a, prompt) >= 32  # key-a's own, reused
    assert cached(b, prompt) >= 32


def test_shared_prefix_cache_shares_across_keys(tiny):
    access = Access(api_keys=KEYS, shared_prefix_cache=True)
    with ServerThread(app_of(tiny, access=access)) as srv:
        assert cached(client(srv, "key-a"), LONG) == 0
        assert cached(client(srv, "key-b"), LONG) >= 32


@pytest.fixture(scope="module")
def open_server(tiny):
    with ServerThread(app_of(tiny)) as srv:
        yield srv


def test_cache_salt_keeps_requests_apart_without_keys(open_server):
    api = client(open_server)
    prompt = [LONG[0] + 2, *LONG[1:]]
    assert cached(api, prompt, cache_salt="tenant-1") == 0
    assert cached(api, prompt, cache_salt="tenant-2") == 0
    assert cached(api, prompt) == 0  # unsalted: a namespace of its own
    assert cached(api, prompt, cache_salt="tenant-1") >= 32
    assert cached(api, prompt) >= 32
    r = httpx.post(
        f"{open_server.url}/completions",
        json={"model": MODEL, "prompt": prompt, "cache_salt": ""},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_cached_tokens_are_in_the_streamed_usage_chunk(open_server):
    api = client(open_server)
    prompt = [LONG[0] + 3, *LONG[1:]]
    cached(api, prompt)
    stream = api.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens >= 32


def test_several_prompts_sum_their_cached_tokens(open_server):
    api = client(open_server)
    prompt = [LONG[0] + 4, *LONG[1:]]
    cached(api, prompt)
    got = api.completions.create(model=MODEL, prompt=[prompt, prompt], max_tokens=2)
    assert got.usage.prompt_tokens_details.cached_tokens >= 64
    assert got.usage.prompt_tokens == 80


def test_a_body_over_the_limit_gets_413(tiny):
    with ServerThread(app_of(tiny, access=Access(max_body_bytes=1000))) as srv:
        big = json.dumps({"model": MODEL, "prompt": [1] * 600}).encode()
        r = httpx.post(
            f"{srv.url}/completions", content=big,
            headers={"content-type": "application/json"}, timeout=30,
        )  # fmt: skip
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "request_too_large"
        assert "1000" in r.json()["error"]["message"]

        def chunked():  # no Content-Length: counted as it comes
            yield big[:500]
            yield big[500:]

        r = httpx.post(
            f"{srv.url}/completions", content=chunked(),
            headers={"content-type": "application/json"}, timeout=30,
        )  # fmt: skip
        assert r.status_code == 413
        small = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2}
        assert httpx.post(f"{srv.url}/completions", json=small, timeout=30).status_code == 200


def test_max_tokens_over_the_context_names_the_numbers(tiny):
    engine = Engine(copy.deepcopy(tiny), **POOL)
    cap_context(engine, 32)
    with ServerThread(create_app(engine, model_name=MODEL)) as srv:
        api = client(srv)
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=20)
        error = err.value.response.json()["error"]
        assert error["message"].startswith(
            "This model's maximum context length is 32 tokens. However, you requested 40"
            " tokens (20 in the prompt, 20 in the completion)."
        )
        assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=MODEL, prompt=[1] * 32, max_tokens=1)
        assert "your prompt resulted in 32 tokens" in err.value.response.json()["error"]["message"]
        got = api.completions.create(model=MODEL, prompt=[1] * 20, max_tokens=12)
        assert got.usage.total_tokens == 32


def _self_signed(folder) -> tuple[str, str]:
    """A key and a certificate for 127.0.0.1, as PEM files in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(hours=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    keyfile, certfile = folder / "key.pem", folder / "cert.pem"
    keyfile.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(keyfile), str(certfile)


def serve_args(*flags: str):
    """``mstar-kv serve``'s options parsed from ``flags``."""
    import argparse

    from mstar.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *flags])


def test_https_with_the_ssl_options_and_a_key(tiny, tmp_path, monkeypatch):
    pytest.importorskip("cryptography")
    keyfile, certfile = _self_signed(tmp_path)
    monkeypatch.setenv("MSTAR_KV_API_KEY", "env-key")
    args = serve_args("--ssl-keyfile", keyfile, "--ssl-certfile", certfile, "--api-key", "k")
    app = app_of(tiny, access=access_of(args))
    with ServerThread(app, config=lambda port: server_config(args, app, port=port)) as srv:
        base = f"https://127.0.0.1:{srv.port}/v1"
        http = httpx.Client(verify=ssl.create_default_context(cafile=certfile))
        api = openai.OpenAI(base_url=base, api_key="env-key", http_client=http, max_retries=0)
        got = api.completions.create(model=MODEL, prompt=[1, 2], max_tokens=2)
        assert got.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(
                base_url=base, api_key="no", http_client=http, max_retries=0
            ).models.list()
        with pytest.raises(httpx.ConnectError):  # an unknown certificate is refused
            httpx.get(f"https://127.0.0.1:{srv.port}/health", timeout=30)


def test_cors_answers_only_the_allowed_origins_preflight_without_a_key(tiny):
    args = serve_args("--allowed-origins", "https://a.example,https://b.example")
    allowed = origins(args)
    assert allowed == ["https://a.example", "https://b.example"]
    app = app_of(tiny, access=Access(api_keys=KEYS), allowed_origins=allowed)
    with ServerThread(app) as srv:
        for origin, ok in (("https://b.example", True), ("https://evil.example", False)):
            r = httpx.options(
                f"{srv.url}/chat/completions", timeout=30,
                headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type"},
            )  # fmt: skip
            assert (r.headers.get("access-control-allow-origin") == origin) is ok
            assert r.status_code == (200 if ok else 400)
    with ServerThread(app_of(tiny)) as srv:  # default: none
        r = httpx.get(f"{srv.url}/models", headers={"Origin": "https://a.example"}, timeout=30)
        assert "access-control-allow-origin" not in r.headers


class FakeReplicas:
    """A stand-in for the replicas' handle: records each request it is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def options(self, **_):
        return self

    @property
    def http(self):
        return self

    def remote(self, scope, body, route):
        self.sent.append(body)

        async def messages():
            yield {"type": "http.response.start", "status": 200, "headers": []}
            yield {"type": "http.response.body", "body": b"{}", "more_body": False}

        return messages()


def test_the_replicas_front_asks_for_a_key_and_bounds_the_body():
    pytest.importorskip("ray.serve")
    import asyncio

    from starlette.requests import Request

    from mstar.serve.replicas import Front, ReplicaConfig, parse_args

    config = ReplicaConfig(model=MODEL, no_prefix_cache=True, api_key=KEYS, max_body_bytes=100)
    assert parse_args({"api_key": "key-a, key-b"})[0].api_key == KEYS
    replicas = FakeReplicas()
    front = Front(replicas, config)

    def call(path: str, body: bytes, key: str | None = None) -> int:
        headers = [(b"content-type", b"application/json")]
        headers += [] if key is None else [(b"authorization", f"Bearer {key}".encode())]
        scope = {"type": "http", "method": "POST", "path": path, "headers": headers,
                 "query_string": b"", "http_version": "1.1", "scheme": "http"}  # fmt: skip
        parts = [body[:60], body[60:]]

        async def receive():
            chunk = parts.pop(0) if parts else b""
            return {"type": "http.request", "body": chunk, "more_body": bool(parts)}

        return asyncio.run(front(Request(scope, receive))).status_code

    small = json.dumps({"model": MODEL, "prompt": [1, 2]}).encode()
    assert call("/v1/completions", small) == 401
    assert call("/v1/replicas", b"", "nope") == 401
    assert call("/v1/completions", b"x" * 101, "key-a") == 413
    assert replicas.sent == []  # none of them reached a replica
    assert call("/v1/completions", small, "key-b") == 200
    assert replicas.sent == [small]


def test_while_starting_https_answers_503_and_bad_tls_files_are_refused(tmp_path, capsys):
    pytest.importorskip("cryptography")
    from mstar.cli import main
    from mstar.cli.serve import tls_context
    from mstar.serve import free_port
    from mstar.serve.startup import Starting, bind

    keyfile, certfile = _self_signed(tmp_path)
    tls = tls_context(serve_args("--ssl-keyfile", keyfile, "--ssl-certfile", certfile))
    sock = bind("127.0.0.1", free_port())
    trust = ssl.create_default_context(cafile=certfile)
    with sock, Starting(sock, tls):
        r = httpx.get(f"https://127.0.0.1:{sock.getsockname()[1]}/health", verify=trust, timeout=10)
    assert (r.status_code, r.json()) == (503, {"status": "starting"})
    other = tmp_path / "other"
    other.mkdir()
    other_key, _ = _self_signed(other)  # not the certificate's key
    assert main(["serve", "--ssl-keyfile", other_key, "--ssl-certfile", certfile]) == 2
    err = capsys.readouterr().err
    assert "--ssl-certfile/--ssl-keyfile do not load" in err and err.count("\n") == 1


BODY_FIELDS = {
    "model": st.sampled_from([MODEL, "other", ""]) | st.none() | st.integers(),
    "prompt": st.lists(st.integers(-2, 300), max_size=6) | st.text(max_size=8) | st.none(),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "developer", "system", "bot"]) | st.integers()},
            optional={"content": st.text(max_size=6) | st.none() | st.integers()},
        ),
        max_size=2,
    )
    | st.text(max_size=4),
    "max_tokens": st.integers(-2, 3) | st.just(10**6) | st.text(max_size=2),
    "temperature": st.floats(-1, 6) | st.just(float("nan")) | st.text(max_size=2),
    "top_p": st.floats(-0.5, 1.5) | st.none(),
    "n": st.integers(-1, 3),
    "cache_salt": st.text(max_size=4) | st.integers() | st.none(),
    "stream": st.booleans(),
}


@pytest.fixture(scope="module")
def guarded(tiny, tmp_path_factory):
    """A server with a key and TLS on (its certificate trusted by ``http``)."""
    pytest.importorskip("cryptography")
    keyfile, certfile = _self_signed(tmp_path_factory.mktemp("tls"))
    args = serve_args("--ssl-keyfile", keyfile, "--ssl-certfile", certfile, "--api-key", "k")
    app = app_of(tiny, access=access_of(args))
    with ServerThread(app, config=lambda port: server_config(args, app, port=port)) as srv:
        http = httpx.Client(verify=ssl.create_default_context(cafile=certfile), timeout=60)
        yield f"https://127.0.0.1:{srv.port}/v1", http
        http.close()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    route=st.sampled_from(["/completions", "/chat/completions", "/models", "/nope"]),
    auth=st.sampled_from(["Bearer k", "Bearer wrong", "", "Basic k", "Bearer k2", "bearer k"]),
    body=st.fixed_dictionaries({}, optional=BODY_FIELDS) | st.text(max_size=8),
)
def test_fuzzed_requests_with_a_key_and_tls_never_get_a_5xx(guarded, route, auth, body):
    """Random bodies and authorization headers over TLS: a 2xx, or a 4xx
    with the OpenAI error body (401 whenever the key is not the right one)."""
    base, http = guarded
    headers = {"Authorization": auth} if auth else {}
    content = json.dumps(body) if isinstance(body, dict) else body
    method = "GET" if route == "/models" else "POST"
    with http.stream(method, base + route, headers=headers, content=content) as r:
        r.read()
    assert r.status_code < 500, r.text
    if auth not in ("Bearer k", "bearer k"):  # the scheme is case-insensitive (RFC 7235)
        assert r.status_code == 401, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}, r.text
