"""Reward shaping: DAPO's rule reward and the soft overlong punishment (Eq. 13)."""

from __future__ import annotations

import pytest

from reward.shaping import shape
from reward.verify import Verdict
from services.config import RewardConfig
from services.messages import Sample, Score
from services.rewards import is_overlong, overlong_penalty, rule_reward, score_error

RIGHT = Verdict(True, "7", "answer_line", "equals 7")
WRONG = Verdict(False, "8", "answer_line", "8 != 7")


def test_rule_reward_is_plus_minus_one():
    assert rule_reward(True) == 1.0
    assert rule_reward(False) == -1.0


@pytest.mark.parametrize(
    "length,expected",
    [
        (0, 0.0),
        (16_384, 0.0),  # exactly L_max - L_cache: still no penalty
        (16_385, -1 / 4096),  # first token into the buffer
        (18_432, -0.5),  # half way through the buffer
        (20_479, -4095 / 4096),
        (20_480, -1.0),  # exactly L_max
        (20_481, -1.0),  # beyond L_max (cannot happen with vLLM's max_tokens, but defined by Eq. 13)
        (99_999, -1.0),
    ],
)
def test_eq13_with_the_paper_lengths(length, expected):
    # The paper: L_max = 20480, L_cache = 4096.
    assert overlong_penalty(length, 20_480, 4_096) == pytest.approx(expected)


def test_penalty_is_linear_and_monotone_in_the_buffer():
    values = [overlong_penalty(n, 100, 20) for n in range(80, 101)]
    steps = [b - a for a, b in zip(values, values[1:])]
    assert all(step == pytest.approx(-1 / 20) for step in steps)


def test_factor_scales_the_penalty():
    assert overlong_penalty(90, 100, 20, factor=0.5) == pytest.approx(-0.25)
    assert overlong_penalty(150, 100, 20, factor=2.0) == pytest.approx(-2.0)


def test_buffer_edge_cases():
    assert overlong_penalty(100, 100, 0) == 0.0  # no buffer: only beyond L_max is punished
    assert overlong_penalty(101, 100, 0) == -1.0
    assert overlong_penalty(50, 100, 400) == pytest.approx(-0.5)  # a buffer longer than L_max ramps from 0
    with pytest.raises(ValueError):
        overlong_penalty(10, 0, 4)


def test_overlong_flag():
    assert is_overlong(64, 64, "length")
    assert not is_overlong(64, 64, "stop")  # the engine knows best: EOS as the last allowed token
    assert is_overlong(64, 64)  # without a finish reason, reaching max_tokens means truncated
    assert not is_overlong(63, 64)
    assert not is_overlong(None, 64)


def test_shape_adds_the_penalty_to_the_rule_reward():
    score = shape(RIGHT, length=18_432, max_tokens=20_480, cfg=RewardConfig(overlong_buffer=4_096))
    assert score.reward == pytest.approx(0.5) and score.correct and not score.overlong
    assert "overlong penalty" in score.detail
    score = shape(WRONG, length=20_480, max_tokens=20_480, finish_reason="length",
                  cfg=RewardConfig(overlong_buffer=4_096))
    assert score.reward == pytest.approx(-2.0) and score.overlong and not score.correct
    assert score.extracted == "8" and score.rule == "answer_line"


def test_shape_without_soft_overlong_or_lengths():
    assert shape(RIGHT, length=20_480, max_tokens=20_480, cfg=RewardConfig(soft_overlong=False)).reward == 1.0
    assert shape(WRONG, length=None, max_tokens=None).reward == -1.0
    flagged = shape(RIGHT, length=20_480, max_tokens=20_480, finish_reason="length",
                    cfg=RewardConfig(soft_overlong=False))
    assert flagged.overlong and flagged.reward == 1.0  # the flag is independent of the penalty switch


@pytest.mark.parametrize("reward_settings, expected", [
    ({}, 1.0 - 12 / 16),  # tiny-cpu: L_cache 16, factor 1
    ({"overlong_penalty": 0.5}, 1.0 - 0.5 * 12 / 16),
    ({"overlong_buffer": 32}, 1.0 - 28 / 32),
    ({"soft_overlong": False}, 1.0),  # the ablation rows without the soft punishment
])
def test_the_reward_settings_reach_the_score_a_worker_writes(reward_settings, expected):
    """reward/scoring.py `shaped`, what the stream worker and /v1/score score with: each of the shaping settings."""
    from reward.scoring import ScoreItem, shaped
    from services.config import load_settings

    config = load_settings("tiny-cpu", reward=reward_settings).reward
    item = ScoreItem("Answer: 7", "7", length=60, max_tokens=64, finish_reason="stop")
    score = shaped(RIGHT, item, config)
    assert score.reward == pytest.approx(expected) and score.correct and not score.overlong


def _scored(length: int, finish: str, verdict: Verdict, cfg: RewardConfig) -> tuple[Score, Sample]:
    sample = Sample(token_ids=[5] * length, logprobs=[-1.0] * length, text="x", finish_reason=finish)
    return shape(verdict, length=length, max_tokens=64, finish_reason=finish, cfg=cfg), sample


@pytest.mark.parametrize("worker, learner, refused", [
    ({}, {}, None),
    ({"overlong_buffer": 32}, {}, "has the reward 0.125 for a correct 60-token response (max_tokens 64); these "
                                  "reward settings give 0.25"),
    ({"soft_overlong": False}, {}, "these reward settings give 0.25 (soft_overlong True"),
    ({}, {"overlong_penalty": 0.5}, "these reward settings give 0.625"),
    ({}, {"answer_rule": "dapo"}, "decided by the rule 'answer_line', not one of answer_rule 'dapo''s"),
])
def test_the_learner_refuses_a_score_made_under_other_reward_settings(worker, learner, refused):
    """A reward worker started with another overlong buffer, the punishment off or the other answer rule would train
    the policy on another reward: the learner checks each score against its own settings (services/rewards.py)."""
    worker_cfg, learner_cfg = (RewardConfig(**{"overlong_buffer": 16, **settings}) for settings in (worker, learner))
    score, sample = _scored(60, "stop", RIGHT, worker_cfg)
    error = score_error(score, sample, 64, learner_cfg)
    assert error is None if refused is None else refused in error


def test_a_score_must_flag_exactly_the_truncated_responses():
    cfg = RewardConfig(overlong_buffer=16)
    score, sample = _scored(64, "length", WRONG, cfg)
    assert score.overlong and score_error(score, sample, 64, cfg) is None
    unflagged = score.model_copy(update={"overlong": False})  # out of overlong filtering's reach
    assert "flagged overlong=False for a response that finished with 'length'" in score_error(unflagged, sample, 64,
                                                                                             cfg)
