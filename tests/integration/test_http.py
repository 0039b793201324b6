"""The service shell: health, readiness, metrics, bearer token, body limit, JSON errors."""

from __future__ import annotations

from fastapi import Depends
from fastapi.testclient import TestClient
from pydantic import BaseModel

from services.http import create_app


class Echo(BaseModel):
    value: int


def make_client(ready=(True, "ready")):
    app = create_app("test", token="tok", ready=lambda: ready, max_body_bytes=1000)

    @app.post("/v1/echo", dependencies=[Depends(app.state.require_token)])
    def echo(body: Echo) -> Echo:
        return body

    @app.get("/boom")
    def boom():
        raise RuntimeError("secret detail")

    return TestClient(app, raise_server_exceptions=False)


def test_health_ready_metrics():
    client = make_client()
    assert client.get("/healthz").json() == {"status": "ok", "service": "test"}
    assert client.get("/readyz").status_code == 200
    metrics = client.get("/metrics")
    assert metrics.status_code == 200 and "dapo_learner_step" in metrics.text


def test_not_ready_is_503_with_reason():
    response = make_client(ready=(False, "loading weights")).get("/readyz")
    assert response.status_code == 503 and response.json()["reason"] == "loading weights"


def test_token_required_for_state_changes():
    client = make_client()
    assert client.post("/v1/echo", json={"value": 1}).status_code == 401
    wrong = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and wrong.json() == {"error": "wrong bearer token"}
    ok = client.post("/v1/echo", json={"value": 1}, headers={"Authorization": "Bearer tok"})
    assert ok.status_code == 200 and ok.json() == {"value": 1}


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
    response = make_client().get("/boom")
    assert response.status_code == 500
    assert response.json() == {"error": "internal error: RuntimeError"}


def test_unknown_route_and_undecodable_body_get_json_errors():
    client = make_client()
    assert client.get("/no/such/route").json() == {"error": "Not Found"}
    response = client.post("/v1/echo", content=b"\xff\xfe", headers={"Authorization": "Bearer tok",
                                                                       "Content-Type": "application/json"})
    assert response.status_code in (400, 422) and "error" in response.json()
