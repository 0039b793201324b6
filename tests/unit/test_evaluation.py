"""The held-out figure the paper reports, avg@n (learner/evaluation.py EvalRound), on groups with known scores."""

from __future__ import annotations

from learner.evaluation import EvalRound
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup


def group(task_id: str, correct: list[bool], version: int = 3) -> ScoredGroup:
    task = PromptTask(task_id=task_id, prompt_id=task_id, prompt="q", ground_truth="1", split="eval",
                      sampling=SamplingParams(n=len(correct), max_tokens=8))
    samples = [Sample(token_ids=[1], logprobs=[-0.1], text="Answer: 1", finish_reason="stop") for _ in correct]
    scores = [Score(reward=1.0 if c else -1.0, correct=c, overlong=False, rule="answer_line") for c in correct]
    return ScoredGroup(rollout=RolloutGroup(task=task, policy_version=version, generator_id="g", samples=samples),
                       scores=scores)


def test_avg_at_n_is_the_mean_over_problems_of_their_share_of_correct_samples():
    round_ = EvalRound(step=5, version=3, expected={"a", "b", "c", "d"})
    assert round_.add(group("a", [True, False, False, False]))  # 1/4
    assert round_.add(group("b", [False] * 4))  # 0
    assert not round_.add(group("a", [True] * 4))  # a duplicate: counted once
    assert not round_.add(group("x", [True] * 4))  # not this round's
    assert round_.mark_lost(["c", "b", "zz"]) == 1  # only the one still awaited
    assert not round_.add(group("c", [True] * 4))  # lost: its late group does not count
    assert not round_.done
    assert round_.add(group("d", [True, True, False, False]))  # 1/2
    assert round_.done
    summary = round_.summary()
    assert summary["eval_accuracy"] == (0.25 + 0.0 + 0.5) / 3  # avg@4 over the problems received
    assert summary["eval_pass_at_n"] == 2 / 3  # a and d solved at least once
    assert (summary["eval_problems"], summary["eval_samples"], summary["eval_lost"]) == (3, 12, 1)


def test_a_round_with_every_task_lost_has_no_accuracy_not_zero():
    round_ = EvalRound(step=1, version=1, expected={"a"})
    round_.mark_lost(["a"])
    assert round_.done and round_.accuracy is None and round_.pass_at_n is None
