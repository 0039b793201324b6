"""Reward shaping: the DAPO rule reward plus the soft overlong punishment. Pure functions.

Rule reward (DAPO paper, Eq. 1 of section 2.4): +1 if the final answer equals the ground truth, else -1.

Soft overlong punishment (Eq. 13), with L_max the longest allowed response (the task's
`sampling.max_tokens`) and L_cache the buffer (`reward.overlong_buffer`):

    R_length(y) = 0                                  if |y| <= L_max - L_cache
                = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
                = -1                                 if L_max < |y|

It is added to the rule reward, scaled by `reward.overlong_penalty` (the paper uses 1).
The overlong flag marks a truncated response, so the learner can mask it out of the loss instead
(overlong filtering, section 3.4).
"""

from __future__ import annotations

from reward.verify import Verdict
from services.messages import Score


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


def is_overlong(length: int | None, max_tokens: int | None, finish_reason: str | None = None) -> bool:
    """Truncated at max_tokens: the engine says so (finish_reason == "length"), or the length shows it."""
    if finish_reason is not None:
        return finish_reason == "length"
    return length is not None and max_tokens is not None and length >= max_tokens


def shape(
    verdict: Verdict,
    *,
    length: int | None,
    max_tokens: int | None,
    finish_reason: str | None = None,
    overlong_buffer: int = 4096,
    overlong_factor: float = 1.0,
    soft_overlong: bool = True,
) -> Score:
    """The Score for one response: rule reward, plus the soft overlong penalty when lengths are known."""
    reward = rule_reward(verdict.correct)
    detail = verdict.detail
    if soft_overlong and length is not None and max_tokens is not None:
        penalty = overlong_penalty(length, max_tokens, overlong_buffer, overlong_factor)
        if penalty:
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
