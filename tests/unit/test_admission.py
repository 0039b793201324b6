"""Admission checks of a scored group of the task as issued (learner/workset.py `shape_error`), and the quarantine
rule: what reaches an update is something the trainer can use."""

from __future__ import annotations

import math

import msgpack
import pytest

from learner.workset import QUARANTINE_AFTER, provenance_error, quarantine_reason, shape_error
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup, from_wire, to_wire

VOCAB = 100
SIGNED = lambda group: None  # noqa: E731 (Streams.rollout_refusal of a rollout as its generator signed it)
FORGED = lambda group: "forged: bad signature under generator-0 (the rollout's own signature)"  # noqa: E731
TASK = PromptTask(task_id="train-1", prompt_id="p1", prompt="1+1=", prompt_token_ids=[5, 6], ground_truth="2",
                  sampling=SamplingParams(n=2, max_tokens=4))


def group(token_ids=(1, 2), logprobs=(-0.1, -0.2), reward=1.0, samples=2) -> ScoredGroup:
    made = [Sample(token_ids=list(token_ids), logprobs=list(logprobs), text="2", finish_reason="stop")
            for _ in range(samples)]
    scores = [Score(reward=reward, correct=True, overlong=False, rule="answer_line") for _ in range(samples)]
    return ScoredGroup(rollout=RolloutGroup(task=TASK, policy_version=0, generator_id="g", samples=made),
                       scores=scores)


def test_a_group_the_trainer_can_use_passes():
    assert shape_error(group(), VOCAB) is None
    assert shape_error(group(token_ids=(0, VOCAB - 1, 3, 4), logprobs=(0.0, -1.0, -2.0, -3.0)), VOCAB) is None
    assert shape_error(group(token_ids=(), logprobs=()), VOCAB) is None  # an empty response (abort)
    assert provenance_error(group(), TASK, VOCAB, SIGNED) is None


@pytest.mark.parametrize(
    "bad, reason",
    [
        (group(token_ids=(1, 10**9)), "sample 0 token id 1000000000 at position 1 is outside the vocabulary [0, 100)"),
        (group(token_ids=(-5, 2)), "sample 0 token id -5 at position 0 is outside the vocabulary [0, 100)"),
        (group(token_ids=(1, VOCAB)), "sample 0 token id 100 at position 1 is outside the vocabulary [0, 100)"),
        (group(token_ids=range(5), logprobs=[-0.1] * 5), "sample 0 has 5 tokens, more than the task's max_tokens 4"),
        (group(logprobs=(-0.1, math.nan)), "sample 0 has a logprob that is not a finite number"),
        (group(logprobs=(-math.inf, -0.1)), "sample 0 has a logprob that is not a finite number"),
        (group(logprobs=(-0.1, 2.5)), "sample 0 has the logprob 2.5, above 0 (not a log-probability)"),
        (group(reward=math.nan), "sample 0 has the reward nan, not a finite number"),
        (group(reward=math.inf), "sample 0 has the reward inf, not a finite number"),
        (group(reward=1.7e308), "sample 0 has the reward 1.7e+308, beyond any rule's (at most 1e+06 in size)"),
        (group(logprobs=(-0.1,)), "sample 0 has 2 token ids and 1 logprobs"),
        (group(samples=3), "asked for n=2 samples; the group has 3 samples and 3 scores"),
    ],
)
def test_a_group_the_trainer_cannot_use_is_malformed_with_the_exact_reason(bad, reason):
    assert shape_error(bad, VOCAB) == f"malformed: task train-1 {reason}"
    assert provenance_error(bad, TASK, VOCAB, SIGNED) == shape_error(bad, VOCAB)  # the task matches: the shape decides


def test_provenance_comes_before_the_shape():
    bad = group(token_ids=(-5, 2))
    assert provenance_error(bad, None, VOCAB, FORGED).startswith("provenance: unknown task id")
    other = TASK.model_copy(update={"ground_truth": "3"})
    assert provenance_error(bad, other, VOCAB, FORGED) == (
        "provenance: task train-1 does not match the task as issued (differs in ground_truth)")


def test_a_rollout_not_as_its_generator_signed_it_is_forged_before_its_shape_is_read():
    """A reward worker that altered the samples must not get the task given up by making them malformed: a forged
    group retires nothing (its task is issued again at its deadline)."""
    assert provenance_error(group(token_ids=(-5, 2)), TASK, VOCAB, FORGED) == FORGED(None)
    assert provenance_error(group(), TASK, VOCAB, FORGED) == FORGED(None)


def test_a_group_is_quarantined_after_one_retry_with_the_error():
    assert quarantine_reason(None) is None
    assert quarantine_reason({"failures": QUARANTINE_AFTER - 1, "reason": "IndexError: index out of range"}) is None
    assert quarantine_reason({"failures": QUARANTINE_AFTER, "reason": "IndexError: index out of range"}) == (
        "quarantined: 2 updates failed with this group in their batch (the last: IndexError: index out of range)")


@pytest.mark.parametrize("where", ["sample", "prompt"])
@pytest.mark.parametrize("token_id", [2**31, -(2**31) - 1])
def test_token_ids_wider_than_the_wire_are_unparseable_not_a_crash_where_the_group_is_re_encoded(where, token_id):
    """A signed entry whose ids come as a msgpack list, not int32 bytes: one beyond int32 parsed, then raised where
    the learner (and a reward worker) re-encode the group to check its signature, a crash on every restart until the
    entry and the honest groups read with it were dead-lettered. Now it is unparseable (a dead letter of its own)."""
    wire = msgpack.unpackb(to_wire(group()), raw=False)
    if where == "sample":
        wire["rollout"]["samples"][0]["token_ids"] = [1, token_id]
    else:
        wire["rollout"]["task"]["prompt_token_ids"] = [5, token_id]
    with pytest.raises(ValueError, match="int32"):
        from_wire(ScoredGroup, msgpack.packb(wire, use_bin_type=True))
    wire = msgpack.unpackb(to_wire(group()), raw=False)
    wire["rollout"]["samples"][0]["token_ids"] = [1, 2**31 - 1]  # the widest that fits: parses and encodes again
    assert to_wire(from_wire(ScoredGroup, msgpack.packb(wire, use_bin_type=True)))


@pytest.mark.parametrize("field", ["generated_at", "generator_busy_s", "scored_at"])
@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_a_worker_clock_that_is_not_a_finite_number_is_unparseable(field, value):
    """One group with generated_at = inf wrote NaN wait times into metrics.jsonl (not JSON) and the gauges."""
    wire = msgpack.unpackb(to_wire(group()), raw=False)
    (wire if field == "scored_at" else wire["rollout"])[field] = value
    with pytest.raises(ValueError, match="finite"):
        from_wire(ScoredGroup, msgpack.packb(wire, use_bin_type=True))
