"""The reward service's HTTP API: `POST /v1/score` scores a batch of responses (plus /healthz /readyz /metrics).

Scoring changes no state but spends the verifier pool the stream worker needs, so it takes the bearer token,
and its verifications hold at most `reward.http_pool_share` of the pool's places at once (`PoolShare`): a large
request waits its turn instead of queueing every group of the stream worker behind it. Limits, each answered
with a clear 4xx: the request body (`max_body_mb`, 413), the batch size (`reward.max_batch`, 413), one response
(`MAX_RESPONSE_CHARS`, 422) and one ground truth (`MAX_GROUND_TRUTH_CHARS`, 422).
"""

from __future__ import annotations

import threading
from typing import Callable

from fastapi import Body, FastAPI, HTTPException
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from reward.sandbox import VerifierUnavailable
from reward.scoring import ScoreItem, Scorer
from services.config import Settings
from services.http import callers, create_app
from services.messages import Score

MAX_RESPONSE_CHARS = 1_000_000  # ~250k tokens: longer than any L_max in the presets
MAX_GROUND_TRUTH_CHARS = 10_000


class ScoreRequestItem(BaseModel):
    """One response to score against its ground truth."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [{"response": "... so x = 7.\n\nAnswer: 7", "ground_truth": "7", "response_tokens": 812,
                          "max_tokens": 20480}]
        },
    )

    response: str = Field(max_length=MAX_RESPONSE_CHARS, description="The model's response text (untrusted).")
    ground_truth: str = Field(max_length=MAX_GROUND_TRUTH_CHARS, description="The reference answer.")
    response_tokens: int | None = Field(
        None, ge=0, le=10_000_000, description="Response length in tokens (for the overlong penalty and flag)."
    )
    max_tokens: int | None = Field(
        None, ge=1, le=10_000_000, description="L_max, the sampling max_tokens the response was generated with."
    )


class ErrorBody(BaseModel):
    error: str


class PoolShare:
    """Scores items with at most `places` of them in the verifier pool at once, over all requests together
    (thread safe): the pool's other places, and its queue, stay with the stream worker."""

    def __init__(self, scorer: Scorer, places: int):
        self.scorer = scorer
        self._places = threading.BoundedSemaphore(places)

    def score(self, items: list[ScoreItem]) -> list[Score]:
        pending = []
        for item in items:
            self._places.acquire()
            try:
                future = self.scorer.submit([item])
            except BaseException:
                self._places.release()  # a pool that refused the item (closing, broken) holds no place of it
                raise
            future.add_done_callback(lambda _: self._places.release())
            pending.append(future)
        return [score for item, future in zip(items, pending) for score in self.scorer.collect([item], future)]


def create_reward_app(
    settings: Settings, scorer: Scorer, ready: Callable[[], tuple[bool, str]] | None = None
) -> FastAPI:
    """The HTTP app around a Scorer (whose pool the caller starts and closes)."""

    def default_ready() -> tuple[bool, str]:
        pool = scorer.pool
        if pool.broken:
            return False, pool.broken
        n = pool.ready_workers()
        return (n > 0, f"{n}/{pool.size} verifier processes ready")

    app = create_app(
        "reward",
        token=callers(settings),
        ready=ready or default_ready,
        max_body_bytes=int(settings.max_body_mb * 1024 * 1024),
        docs=settings.http_docs,
    )
    max_batch = settings.reward.max_batch
    share = PoolShare(scorer, settings.reward.http_pool_share)

    @app.post(
        "/v1/score",
        response_model=list[Score],
        tags=["reward"],
        summary="Score a batch of responses",
        responses={
            400: {"description": "The body is not readable (e.g. not UTF-8)."},
            401: {"model": ErrorBody, "description": "No bearer token."},
            403: {"model": ErrorBody, "description": "Wrong bearer token."},
            413: {"model": ErrorBody, "description": "Body or batch larger than the configured limits."},
            422: {"description": "The request does not fit the schema (a field missing, too long, wrong type)."},
            503: {"model": ErrorBody, "description": "The verifier pool failed meanwhile (it restarts): retry."},
        },
    )
    async def score(
        items: list[ScoreRequestItem] = Body(
            ...,
            description=f"The responses to score, at most {max_batch} per request (`reward.max_batch`).",
            # Documented, but enforced in the handler: a too large batch is a 413, not a schema error.
            json_schema_extra={"maxItems": max_batch},
        ),
    ) -> list[Score]:
        """Verify each response's final answer against its ground truth (in the sandboxed verifier pool) and
        shape the reward: +1 / -1 by the rule, plus DAPO's soft overlong penalty when `response_tokens` and
        `max_tokens` are given. `overlong` is true when `response_tokens >= max_tokens`. `rule` says what
        decided: answer_line, boxed, math_verify (`reward.answer_rule: robust`), dapo_minerva (`dapo`, the paper's
        string match), none (no final answer), timeout or error (the sandbox)."""
        if len(items) > max_batch:
            raise HTTPException(413, f"batch of {len(items)} items exceeds reward.max_batch = {max_batch}")
        batch = [ScoreItem(i.response, i.ground_truth, i.response_tokens, i.max_tokens) for i in items]
        # The pool blocks while it works: keep the event loop free for /healthz and /metrics meanwhile.
        try:
            return await run_in_threadpool(share.score, batch)
        except VerifierUnavailable as err:
            raise HTTPException(503, f"{err}; retry the request") from err

    return app
