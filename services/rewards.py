"""What a score says under the run's reward settings: the rule reward, the soft overlong punishment, and the rules
each answer rule decides by. Pure functions.

The reward role computes scores with these (reward/shaping.py); the learner checks each score it trains on
against its own `reward` settings with the same functions (`score_error`): a reward worker started with other
settings (another overlong buffer, the punishment off, the other answer rule) would otherwise train the policy on
another reward, silently.

Rule reward (DAPO paper, Eq. 1 of section 2.4): +1 if the final answer equals the ground truth, else -1.

Soft overlong punishment (Eq. 13), with L_max the longest allowed response (the task's
`sampling.max_tokens`) and L_cache the buffer (`reward.overlong_buffer`):

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if L_max < |y|

It is added to the rule reward, scaled by `reward.overlong_penalty` (the paper uses 1).
The overlong flag marks a truncated response, so the learner can leave it out of the loss instead (overlong
filtering, section 3.4: learner/trainer.py never runs it).
"""

from __future__ import annotations

import math

from services.config import RewardConfig
from services.messages import Sample, Score

# Rule names (the `rule` field of Score).
RULE_ANSWER_LINE = "answer_line"
RULE_BOXED = "boxed"
RULE_MATH_VERIFY = "math_verify"
RULE_DAPO = "dapo_minerva"  # only under `reward.answer_rule: dapo` (reward.reference): the paper's string match
RULE_NONE = "none"
RULE_TIMEOUT = "timeout"
RULE_ERROR = "error"
RULES = (RULE_ANSWER_LINE, RULE_BOXED, RULE_MATH_VERIFY, RULE_DAPO, RULE_NONE, RULE_TIMEOUT, RULE_ERROR)
# The rules each `reward.answer_rule` decides by: a score by another rule was verified under the other setting.
RULES_OF = {
    "robust": (RULE_ANSWER_LINE, RULE_BOXED, RULE_MATH_VERIFY, RULE_NONE, RULE_TIMEOUT, RULE_ERROR),
    "dapo": (RULE_DAPO, RULE_NONE, RULE_TIMEOUT, RULE_ERROR),
}


def rule_reward(correct: bool) -> float:
    """DAPO's rule: +1 for a correct final answer, -1 otherwise."""
    return 1.0 if correct else -1.0


def overlong_penalty(length: int, max_tokens: int, buffer: int, factor: float = 1.0) -> float:
    """Eq. 13: 0 up to L_max - L_cache, then linearly down to -factor at L_max, -factor beyond."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    buffer = max(0, min(buffer, max_tokens))  # a buffer longer than L_max starts the ramp at length 0
    if length > max_tokens:
        return -factor
    start = max_tokens - buffer
    if length <= start:
        return 0.0
    return factor * (start - length) / buffer


def shaping_penalty(length: int | None, max_tokens: int | None, cfg: RewardConfig) -> float:
    """The soft overlong punishment under `cfg`: 0 when it is off or a length is unknown."""
    if not cfg.soft_overlong or length is None or max_tokens is None:
        return 0.0
    return overlong_penalty(length, max_tokens, cfg.overlong_buffer, cfg.overlong_penalty)


def is_overlong(length: int | None, max_tokens: int | None, finish_reason: str | None = None) -> bool:
    """Truncated at max_tokens: the engine says so (finish_reason == "length"), or the length shows it."""
    if finish_reason is not None:
        return finish_reason == "length"
    return length is not None and max_tokens is not None and length >= max_tokens


def score_error(score: Score, sample: Sample, max_tokens: int, cfg: RewardConfig) -> str | None:
    """Why `score` is not what `cfg` gives the sample (None: it is): its reward is not the rule reward of its
    verdict plus the overlong punishment for the sample's length, its overlong flag not the sample's finish, or it
    was decided by a rule of the other answer rule."""
    length = len(sample.token_ids)
    expected = rule_reward(score.correct) + shaping_penalty(length, max_tokens, cfg)
    if not math.isclose(score.reward, expected, rel_tol=1e-9, abs_tol=1e-9):
        return (f"has the reward {score.reward:g} for a {'correct' if score.correct else 'wrong'} {length}-token "
                f"response (max_tokens {max_tokens}); these reward settings give {expected:g} (soft_overlong "
                f"{cfg.soft_overlong}, overlong_buffer {cfg.overlong_buffer}, overlong_penalty {cfg.overlong_penalty})")
    if score.overlong != is_overlong(length, max_tokens, sample.finish_reason):
        return f"is flagged overlong={score.overlong} for a response that finished with {sample.finish_reason!r}"
    if score.rule not in RULES_OF[cfg.answer_rule]:
        return f"was decided by the rule {score.rule!r}, not one of answer_rule {cfg.answer_rule!r}'s"
    return None
