"""The reward HTTP API in process (ASGI): scoring, the token, the pool share, limits and errors, OpenAPI, and
schemathesis (no 5xx)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import negative_data_rejection

from reward.app import MAX_RESPONSE_CHARS, PoolShare, create_reward_app
from reward.sandbox import VerifierPool
from reward.scoring import Scorer
from services.config import load_settings

TOKEN = "reward-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def app():
    cfg = load_settings("tiny-cpu", reward={"max_batch": 8, "timeout_s": 2.0}, max_body_mb=0.5, token=TOKEN,
                        http_docs=True)  # the OpenAPI document is tested below (off by default)
    with VerifierPool(workers=2, timeout_s=cfg.reward.timeout_s, memory_mb=cfg.reward.memory_mb) as pool:
        yield create_reward_app(cfg, Scorer(pool, cfg.reward))


@pytest.fixture(scope="module")
def client(app):
    with TestClient(app, headers=AUTH) as c:
        yield c


def test_scoring_takes_the_token(app):
    with TestClient(app) as anonymous:
        body = [{"response": "Answer: 1", "ground_truth": "1"}]
        assert anonymous.post("/v1/score", json=body).status_code == 401
        assert anonymous.post("/v1/score", json=body, headers={"Authorization": "Bearer nope"}).status_code == 403
        assert anonymous.get("/healthz").status_code == 200  # the ops endpoints stay open
        assert anonymous.get("/openapi.json").status_code == 200  # asked for (http_docs): open, for /docs to read


def test_a_reward_worker_given_only_the_tokens_sha256_admits_the_operator_and_no_weights_token():
    """As `dapo run` starts it: no token held, the operator's admitted by its digest, a generator's weights token
    refused."""
    import hashlib

    cfg = load_settings("tiny-cpu", token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest(), weights_token="w" * 32)
    with VerifierPool(workers=1, timeout_s=2.0, memory_mb=cfg.reward.memory_mb) as pool:
        with TestClient(create_reward_app(cfg, Scorer(pool, cfg.reward))) as worker:
            body = [{"response": "Answer: 1", "ground_truth": "1"}]
            assert worker.post("/v1/score", json=body, headers=AUTH).json()[0]["correct"] is True
            weights = {"Authorization": "Bearer " + "w" * 32}
            assert worker.post("/v1/score", json=body, headers=weights).status_code == 403


def test_pool_share_bounds_the_verifications_in_the_pool():
    """However many requests run at once, at most `places` of their items are in the pool."""

    class CountingScorer:  # the Scorer's submit/collect, counting the items in the pool
        def __init__(self):
            self.lock, self.inside, self.most = threading.Lock(), 0, 0

        def submit(self, items):
            future = Future()
            with self.lock:
                self.inside += len(items)
                self.most = max(self.most, self.inside)

            def finish():
                time.sleep(0.005)
                with self.lock:
                    self.inside -= len(items)
                future.set_result(["verdict"] * len(items))

            threading.Thread(target=finish).start()
            return future

        def collect(self, items, future):
            return future.result()

    scorer = CountingScorer()
    share = PoolShare(scorer, places=2)
    results = []
    threads = [threading.Thread(target=lambda: results.append(share.score(list(range(12))))) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [len(r) for r in results] == [12, 12, 12] and scorer.most == 2


def test_a_pool_that_refuses_an_item_keeps_every_place():
    class RefusingScorer:
        def submit(self, items):
            raise RuntimeError("pool closed")

    share = PoolShare(RefusingScorer(), places=1)
    errors = []

    def score_twice():  # the second call would wait for ever on a place the first one leaked
        for _ in range(2):
            try:
                share.score([1])
            except RuntimeError as err:
                errors.append(str(err))

    thread = threading.Thread(target=score_twice, daemon=True)
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and errors == ["pool closed"] * 2


def test_score_a_batch(client):
    body = [
        {"response": "work...\n**Answer:** 025", "ground_truth": "25"},
        {"response": "\\boxed{3} then \\boxed{5}", "ground_truth": "3"},
        {"response": "Answer: 7", "ground_truth": "7", "response_tokens": 60, "max_tokens": 64},
        {"response": "cut off at 3+4 = 7 and", "ground_truth": "7", "response_tokens": 64, "max_tokens": 64},
    ]
    reply = client.post("/v1/score", json=body)
    assert reply.status_code == 200, reply.text
    scores = reply.json()
    assert [s["correct"] for s in scores] == [True, False, True, False]
    assert [s["rule"] for s in scores] == ["answer_line", "boxed", "answer_line", "none"]
    assert scores[0]["reward"] == 1.0 and scores[0]["extracted"] == "025"
    assert scores[1]["reward"] == -1.0
    # tiny-cpu: overlong_buffer 16, so 60 of 64 tokens is 12 tokens into the buffer: 1 - 12/16.
    assert scores[2]["reward"] == pytest.approx(0.25) and not scores[2]["overlong"]
    assert scores[3]["reward"] == pytest.approx(-2.0) and scores[3]["overlong"]
    assert client.post("/v1/score", json=[]).json() == []
    metrics = client.get("/metrics").text
    assert 'dapo_reward_verifications_total{correct="true",rule="answer_line"}' in metrics
    # the gauge of the last scored group is the stream path's: a request's items (scored one at a time, the last
    # one wrong) do not set it to 0 or 1
    from prometheus_client import REGISTRY

    from services import metrics as gauges

    gauges.REWARD_ACCURACY.set(0.5)
    client.post("/v1/score", json=body)
    assert REGISTRY.get_sample_value("dapo_reward_accuracy") == 0.5


def test_limits_and_errors_are_clear_4xx(client):
    too_many = client.post("/v1/score", json=[{"response": "Answer: 1", "ground_truth": "1"}] * 9)
    assert too_many.status_code == 413 and "max_batch" in too_many.json()["error"]
    huge = client.post("/v1/score", json=[{"response": "x" * 600_000, "ground_truth": "1"}])
    assert huge.status_code == 413 and "exceeds the limit" in huge.json()["error"]
    missing = client.post("/v1/score", json=[{"response": "Answer: 1"}])
    assert missing.status_code == 422 and missing.json()["details"][0]["loc"][-1] == "ground_truth"
    unknown = client.post("/v1/score", json=[{"response": "a", "ground_truth": "1", "extra": 1}])
    assert unknown.status_code == 422
    negative = client.post("/v1/score", json=[{"response": "a", "ground_truth": "1", "response_tokens": -1}])
    assert negative.status_code == 422
    not_a_list = client.post("/v1/score", json={"response": "a", "ground_truth": "1"})
    assert not_a_list.status_code == 422
    not_json = client.post("/v1/score", content=b"\xff\xfe", headers={"content-type": "application/json"})
    assert not_json.status_code == 422
    assert client.get("/v1/score").status_code == 405


def test_openapi_documents_the_endpoint(client):
    spec = client.get("/openapi.json").json()
    operation = spec["paths"]["/v1/score"]["post"]
    assert {"200", "401", "403", "413", "422"} <= set(operation["responses"])
    item = spec["components"]["schemas"]["ScoreRequestItem"]
    assert item["properties"]["response"]["maxLength"] == MAX_RESPONSE_CHARS
    assert set(item["required"]) == {"response", "ground_truth"}
    assert "Score" in spec["components"]["schemas"]


def test_readiness_reports_the_pool(client):
    ready = client.get("/readyz")
    assert ready.status_code == 200 and "verifier processes ready" in ready.json()["reason"]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_schemathesis_finds_no_server_error(app, mode):
    """Every default schemathesis check (no 5xx, documented status codes, responses fit the schema, valid data
    accepted) except one: a batch over maxItems is rejected with 413, which that check does not count as a
    rejection."""
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    strategy = schema["/v1/score"]["POST"].as_strategy(generation_mode=mode)

    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call_and_validate(headers=AUTH, excluded_checks=[negative_data_rejection])
        assert response.status_code < 500

    run()
