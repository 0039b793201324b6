"""The service shell: health, readiness, metrics, bearer token (before the body), body limit, JSON errors, docs
off, probes that never wait for busy handlers, the connection limit."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from pydantic import BaseModel

from services.config import DEFAULT_TOKEN, load_settings
from services.http import Server, callers, create_app, free_port, guarded_protocol, token_refusal
from tests.servers import ServerThread

AUTH = {"Authorization": "Bearer tok"}


class Echo(BaseModel):
    value: int


def make_app(ready=(True, "ready"), **kwargs):
    app = create_app("test", token="tok", ready=lambda: ready, **{"max_body_bytes": 1000, **kwargs})

    @app.post("/v1/echo")
    def echo(body: Echo) -> Echo:
        return body

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret detail")

    return app


def make_client(ready=(True, "ready"), **kwargs):
    return TestClient(make_app(ready, **kwargs), raise_server_exceptions=False)


def test_health_ready_metrics():
    client = make_client()
    assert client.get("/healthz").json() == {"status": "ok", "service": "test"}
    assert client.get("/readyz").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "dapo_learner_step" in metrics.text


def test_not_ready_is_503_with_reason():
    response = make_client(ready=(False, "loading weights")).get("/readyz")
    assert response.status_code == 503 and response.json()["reason"] == "loading weights"


def test_token_required_everywhere_but_the_probes_and_the_scrape():
    client = make_client()
    assert client.post("/v1/echo", json={"value": 1}).status_code == 401
    for path in ("/boom", "/no/such/route", "/docs", "/openapi.json"):
        missing = client.get(path)
        assert missing.status_code == 401 and missing.json() == {"error": "missing bearer token"}
        assert missing.headers["www-authenticate"] == "Bearer"
    basic = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Basic dG9rOg=="})
    assert basic.status_code == 401
    wrong = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json() == {"error": "wrong bearer token"}
    ok = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Bearer tok"})
    assert ok.status_code == 200 and ok.json() == {"value": 1}


def test_token_refusal_reads_the_header_alone():
    assert token_refusal(None, "tok") == (401, "missing bearer token")
    assert token_refusal(b"Bearer ", "tok") == (401, "missing bearer token")
    assert token_refusal(b"bearer tok", "tok") is None  # the scheme is case-insensitive (RFC 7235)
    assert token_refusal(b"Bearer tok2", "tok") == (403, "wrong bearer token")
    assert token_refusal(b"Bearer \xff", "tok") == (403, "wrong bearer token")


def test_a_token_per_audience_opens_only_what_its_holder_needs():
    """The learner admits the operator's token everywhere and the weights token to GET /v1/weights/... only; a
    service given only the operator token's sha256 (generators, reward workers under `dapo run`) admits the operator
    without holding the token."""
    settings = load_settings("tiny-cpu", token="operator-token-0123456789abcdef", weights_token="w" * 32)
    learner = callers(settings, weights_readers=True)
    operator, weights = b"Bearer operator-token-0123456789abcdef", b"Bearer " + b"w" * 32
    for method, path in (("GET", "/v1/status"), ("POST", "/v1/weights/sync"), ("GET", "/v1/weights/latest")):
        assert token_refusal(operator, learner, method, path) is None
    assert token_refusal(weights, learner, "GET", "/v1/weights/latest") is None
    assert token_refusal(weights, learner, "GET", "/v1/weights/3/model.safetensors") is None
    for method, path in (("GET", "/v1/status"), ("POST", "/v1/weights/latest"), ("GET", "/v1/score")):
        assert token_refusal(weights, learner, method, path) == (403, "this token opens only GET /v1/weights/..."), path
    assert token_refusal(weights, callers(settings), "GET", "/v1/weights/latest") == (403, "wrong bearer token")
    digest_only = load_settings("tiny-cpu", token_sha256=hashlib.sha256(b"operator-token-0123456789abcdef").hexdigest())
    worker = callers(digest_only)
    assert digest_only.token.get_secret_value() == DEFAULT_TOKEN  # the worker holds no operator token
    assert token_refusal(operator, worker, "POST", "/v1/score") is None
    assert token_refusal(f"Bearer {DEFAULT_TOKEN}".encode(), worker, "POST", "/v1/score") == (403, "wrong bearer token")
    assert token_refusal(weights, worker, "POST", "/v1/score") == (403, "wrong bearer token")
    client = TestClient(create_app("learner", token=learner))  # through the gate, on the headers
    assert client.get("/v1/anything", headers={"Authorization": weights.decode()}).status_code == 403
    assert client.get("/v1/anything", headers={"Authorization": operator.decode()}).status_code == 404


def test_docs_only_when_asked_for():
    client = make_client()
    assert client.get("/docs", headers=AUTH).status_code == 404
    assert client.get("/openapi.json", headers=AUTH).status_code == 404
    asked = make_client(docs=True)
    assert asked.get("/openapi.json").status_code == 200 and asked.get("/docs").status_code == 200
    assert asked.post("/v1/echo", json={"value": 1}).status_code == 401  # the rest still takes the token


def test_the_body_of_a_request_without_the_token_is_never_read():
    """The gate answers from the headers: the application never receives a byte of the body (an unauthenticated
    64 MB JSON array would otherwise be buffered and parsed before its 401)."""
    app = make_app(max_body_bytes=64 * 2**20)
    reads, sent = [], []

    async def receive():
        reads.append(1)
        return {"type": "http.request", "body": b"[" + b"{}," * 1000 + b"{}]", "more_body": False}

    async def send(message):
        sent.append(message)

    for headers in ([], [(b"authorization", b"Bearer nope")]):
        sent.clear()
        scope = {"type": "http", "method": "POST", "path": "/v1/echo", "raw_path": b"/v1/echo", "query_string": b"",
                 "root_path": "", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
                 "http_version": "1.1", "asgi": {"version": "3.0"},
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"67108864"), *headers]}
        asyncio.run(app(scope, receive, send))
        assert sent[0]["status"] in (401, 403) and not reads


def test_a_server_answers_401_to_a_64_mb_body_before_it_is_sent():
    """Over a real socket: the headers of a 64 MB upload, no body; the 401 comes back at once."""
    with ServerThread(make_app(max_body_bytes=64 * 2**20)) as server, \
            socket.create_connection((server.host, server.port), timeout=5) as sock:
        started = time.perf_counter()
        sock.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 67108864\r\n\r\n[{},")
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 401") and time.perf_counter() - started < 1.0


def test_probes_answer_while_every_worker_thread_is_busy():
    """Synchronous handlers hold the shared worker threads (40); /healthz and /readyz do not wait for them."""
    release = threading.Event()
    app = make_app()

    @app.get("/v1/slow")
    def slow() -> dict:
        release.wait(30)
        return {}

    with ServerThread(app) as server, ThreadPoolExecutor(48) as pool:
        busy = [pool.submit(httpx.get, f"{server.url}/v1/slow", headers=AUTH, timeout=60) for _ in range(48)]
        time.sleep(1.0)  # every worker thread is taken by now
        try:
            assert not any(f.done() for f in busy)
            started = time.perf_counter()
            assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
            assert httpx.get(f"{server.url}/readyz", timeout=5).status_code == 200
            assert time.perf_counter() - started < 2.0
        finally:
            release.set()
        assert all(f.result().status_code == 200 for f in busy)


def test_connections_beyond_the_limit_get_503():
    """uvicorn's limit counts the connection being answered: 2 = one served at a time."""
    release = threading.Event()
    app = make_app()

    @app.get("/v1/slow")
    async def slow() -> dict:
        await asyncio.get_running_loop().run_in_executor(None, release.wait, 30)
        return {}

    with ServerThread(app, limit_concurrency=2) as server, ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.get, f"{server.url}/v1/slow", headers=AUTH, timeout=60)
        time.sleep(0.5)
        try:
            assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 503
        finally:
            release.set()
        assert held.result().status_code == 200


def test_a_signal_reaches_the_service_at_once_and_requests_in_flight_get_the_graceful_timeout():
    """uvicorn holds the process's signals while it serves and gives them back only once the requests in flight
    have ended: the reward worker went on claiming groups for as long as a /v1/score ran, past the pod's grace."""
    told = threading.Event()
    app = make_app()

    @app.get("/v1/slow")
    async def slow() -> dict:
        await asyncio.sleep(30)
        return {}

    server = Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning",
                                   timeout_graceful_shutdown=1), on_exit=told.set)
    serving = threading.Thread(target=server.run, daemon=True)
    serving.start()
    while not server.started:
        time.sleep(0.05)
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(httpx.get, f"http://127.0.0.1:{server.config.port}/v1/slow", headers=AUTH, timeout=60)
        time.sleep(0.5)
        server.handle_exit(signal.SIGTERM, None)
        assert told.is_set()
        serving.join(timeout=10)
        assert not serving.is_alive()  # the request in flight did not hold the stop past the graceful timeout
        assert held.result().status_code == 500


def test_half_sent_requests_are_closed_at_the_head_deadline_and_the_probes_answer_again():
    """Slowloris: connections that send a request head a byte at a time hold every slot, and uvicorn alone answers
    503 to everything, /healthz included, for as long as they last. With the head deadline the server closes them
    and the probes answer again; a whole request, and the next one on the same kept-alive connection, still do."""
    app = make_app()
    for protocol, answered in ((None, 503), (guarded_protocol(1.0), 200)):
        config = {"http": protocol} if protocol else {}
        with ServerThread(app, limit_concurrency=3, **config) as server:
            host, port = server.url.removeprefix("http://").split(":")
            loris = [socket.create_connection((host, int(port))) for _ in range(3)]
            for sock in loris:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never ends its head
            time.sleep(1.5)
            try:
                assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == answered
                if protocol:
                    for sock in loris:
                        sock.settimeout(2)
                        assert sock.recv(1024) == b""  # closed by the server
                    with httpx.Client(timeout=5) as client:  # one kept-alive connection, two requests
                        assert [client.get(f"{server.url}/healthz").status_code for _ in range(2)] == [200, 200]
            finally:
                for sock in loris:
                    sock.close()


def test_a_request_body_that_stops_coming_is_closed_at_the_deadline_and_a_slow_steady_one_is_not():
    """A chunked POST to /healthz (no token needed) that never sends a chunk, or a client cut off mid-upload, held its
    connection for ever once its head was whole: four addresses' worth filled every slot, and the probes answered
    503 until the service was restarted. The head deadline now runs again from each byte of the body."""
    app = make_app()
    with ServerThread(app, limit_concurrency=10, http=guarded_protocol(1.0)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        stalled = socket.create_connection((host, int(port)))
        steady = socket.create_connection((host, int(port)))
        try:
            stalled.sendall(b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            steady.sendall(b"POST /v1/echo HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok\r\n"
                           b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
            for chunk in (b'{"value"', b': 7', b"}"):  # 2.1 s in all, never 1 s without a byte
                time.sleep(0.7)
                steady.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            steady.sendall(b"0\r\n\r\n")
            steady.settimeout(5)
            assert steady.recv(1024).startswith(b"HTTP/1.1 200")
            stalled.settimeout(5)
            assert stalled.recv(1024) == b""  # closed by the server, no answer
        finally:
            stalled.close()
            steady.close()


def test_one_client_address_holds_at_most_its_share_of_the_connections():
    """http_max_connections_per_client: one address's connection beyond its share is closed at once, the ones it
    holds stay open, and a slot it gives back can be taken again."""
    app = make_app()
    with ServerThread(app, limit_concurrency=10, http=guarded_protocol(30.0, per_client=2)) as server:
        host, port = server.url.removeprefix("http://").split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            extra = socket.create_connection((host, int(port)))
            extra.settimeout(5)
            assert extra.recv(1024) == b""  # closed by the server at once
            extra.close()
            for sock in held:
                sock.settimeout(0.5)
                with pytest.raises(socket.timeout):  # still open
                    sock.recv(1024)
            held.pop().close()
            time.sleep(0.3)
            with httpx.Client(timeout=5) as client:
                assert client.get(f"{server.url}/healthz").status_code == 200
        finally:
            for sock in held:
                sock.close()


def test_bad_body_is_422_with_details():
    response = make_client().post("/v1/echo", json={"value": "x"}, headers={"Authorization": "Bearer tok"})
    assert response.status_code == 422
    body = response.json()
    assert body["error"] == "invalid request" and body["details"][0]["loc"] == ["body", "value"]


def test_body_limit_with_and_without_content_length():
    client = make_client()
    headers = {"Authorization": "Bearer tok", "Content-Type": "application/json"}
    big = b'{"value": 1, "pad": "' + b"x" * 2000 + b'"}'
    response = client.post("/v1/echo", content=big, headers=headers)
    assert response.status_code == 413 and "exceeds the limit" in response.json()["error"]
    chunked = client.post("/v1/echo", content=iter([big[:500], big[500:]]), headers=headers)
    assert chunked.status_code == 413


def test_unhandled_error_is_json_500_without_internals():
    response = make_client().get("/boom", headers=AUTH)
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError"}


def test_unknown_route_and_undecodable_body_get_json_errors():
    client = make_client()
    assert client.get("/no/such/route", headers=AUTH).json() == {"error": "Not Found"}
    response = client.post("/v1/echo", content=b"\xff\xfe", headers={"Authorization": "Bearer tok",
                                                                       "Content-Type": "application/json"})
    assert response.status_code in (400, 422) and "error" in response.json()
