"""The scoring step shared by the stream worker and the HTTP API: sandboxed verdicts, shaping, metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

from reward.sandbox import Verification, VerifierPool
from reward.shaping import shape
from reward.verify import RULE_ERROR, RULE_TIMEOUT, Verdict
from services import metrics
from services.config import RewardConfig
from services.messages import RolloutGroup, Score


@dataclass(frozen=True)
class ScoreItem:
    """One response to score. Lengths are in tokens; without them no overlong shaping applies."""

    response: str
    ground_truth: str
    length: int | None = None
    max_tokens: int | None = None
    finish_reason: str | None = None


class Scorer:
    """Verify items in the pool, shape the rewards, and record the REWARD_* metrics."""

    def __init__(self, pool: VerifierPool, cfg: RewardConfig):
        if pool.rule != cfg.answer_rule:  # the pool's children apply the rule: one built by hand must agree
            raise ValueError(f"the verifier pool applies answer rule {pool.rule!r}, "
                             f"but reward.answer_rule is {cfg.answer_rule!r}")
        self.pool = pool
        self.cfg = cfg

    def submit(self, items: list[ScoreItem]) -> Verification:
        """Queue items for verification (so several groups can be in flight at once); cancellable."""
        return self.pool.submit_many([(item.response, item.ground_truth) for item in items])

    def collect(self, items: list[ScoreItem], pending: Verification, started: float | None = None) -> list[Score]:
        """Wait for the verdicts of `submit(items)` and turn them into Scores."""
        verdicts: list[Verdict] = pending.result()
        scores = [shaped(verdict, item, self.cfg) for item, verdict in zip(items, verdicts, strict=True)]
        record_metrics(verdicts, None if started is None else time.perf_counter() - started)
        return scores

    def score(self, items: list[ScoreItem]) -> list[Score]:
        started = time.perf_counter()
        return self.collect(items, self.submit(items), started)

    def score_group(self, group: RolloutGroup) -> list[Score]:
        return self.score(group_items(group))


def shaped(verdict: Verdict, item: ScoreItem, cfg: RewardConfig) -> Score:
    """The Score of one verified item under the reward settings: rule reward plus the soft overlong punishment."""
    return shape(verdict, length=item.length, max_tokens=item.max_tokens, finish_reason=item.finish_reason, cfg=cfg)


def group_items(group: RolloutGroup) -> list[ScoreItem]:
    """A rollout group's samples as score items: L_max is the task's own sampling.max_tokens."""
    max_tokens = group.task.sampling.max_tokens
    return [
        ScoreItem(s.text, group.task.ground_truth, len(s.token_ids), max_tokens, s.finish_reason)
        for s in group.samples
    ]


def record_metrics(verdicts: list[Verdict], seconds: float | None) -> None:
    for v in verdicts:
        metrics.REWARD_VERIFICATIONS.labels(v.rule, "true" if v.correct else "false").inc()
        if v.rule == RULE_TIMEOUT:
            metrics.REWARD_TIMEOUTS.inc()
        elif v.rule == RULE_ERROR:
            metrics.REWARD_ERRORS.inc()
    if seconds is not None and verdicts:  # a group, timed (/v1/score collects its items one at a time: none is one)
        metrics.REWARD_ACCURACY.set(sum(v.correct for v in verdicts) / len(verdicts))
        metrics.REWARD_SECONDS.observe(seconds)
