"""A verdict as a Score: the rule reward plus the soft overlong punishment (services/rewards.py: the formulas,
shared with the learner, which checks every score against them)."""

from __future__ import annotations

from reward.verify import Verdict
from services.config import RewardConfig
from services.messages import Score
from services.rewards import is_overlong, rule_reward, shaping_penalty


def shape(
    verdict: Verdict,
    *,
    length: int | None,
    max_tokens: int | None,
    finish_reason: str | None = None,
    cfg: RewardConfig = RewardConfig(),
) -> Score:
    """The Score for one response under the reward settings `cfg`: rule reward, plus the soft overlong penalty
    when lengths are known."""
    reward = rule_reward(verdict.correct)
    detail = verdict.detail
    if penalty := shaping_penalty(length, max_tokens, cfg):
        reward += penalty
        detail = f"{detail}; overlong penalty {penalty:.4f} ({length}/{max_tokens} tokens)".lstrip("; ")
    return Score(
        reward=reward,
        correct=verdict.correct,
        overlong=is_overlong(length, max_tokens, finish_reason),
        extracted=verdict.extracted,
        rule=verdict.rule,
        detail=detail,
    )
