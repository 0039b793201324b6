"""Key rotation under load (services/keys.py): every role's key is rotated while entries signed under the old kids
are in every stream and in the learner's `held`; none is lost, new entries verify for processes started before the
rotation; once the old kids are retired, an entry still signed under one is dead-lettered with the reason."""

from __future__ import annotations

import pytest

from services import keys
from services.keys import ROLES, keys_dir, retire, rotate
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup
from services.redis_local import connect
from services.streams import Streams


def task(i: int) -> PromptTask:
    return PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt=f"{i}+1=", ground_truth=str(i + 1))


def rollout(t: PromptTask) -> RolloutGroup:
    sample = Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], text="Answer: 1", finish_reason="stop")
    return RolloutGroup(task=t, policy_version=0, generator_id="g", samples=[sample])


def scored(group: RolloutGroup) -> ScoredGroup:
    return ScoredGroup(rollout=group, scores=[Score(reward=1.0, correct=True, overlong=False, rule="answer_line")])


@pytest.fixture(autouse=True)
def keyring_sees_changes_at_once(monkeypatch):
    monkeypatch.setattr(keys, "KEYRING_REFRESH_S", 0.0)


def test_a_rotation_loses_no_entry_signed_under_the_old_kids_and_a_retired_kid_is_refused(settings):
    client = connect(settings)
    before = {role: Streams(client, settings, signs_as=(role,)) for role in ROLES}  # processes started before
    old_kids = {role: streams.signers[role].kid for role, streams in before.items()}
    prompts_by = {role: s.stream("prompts", PromptTask) for role, s in before.items()}
    for i in range(4):
        prompts_by["learner"].produce(task(i))
    in_hand = prompts_by["generator"].consume("g-old", count=1, block_ms=0)  # one task taken, in flight
    before["generator"].stream("rollouts", RolloutGroup).produce(rollout(task(10)))
    before["reward"].stream("scored", ScoredGroup).produce(scored(rollout(task(11))))
    held = before["learner"].stream("held", ScoredGroup)
    held.produce(scored(rollout(task(12))))

    new_kids = {role: rotate(keys_dir(settings), role) for role in ROLES}
    after = {role: Streams(client, settings, signs_as=(role,)) for role in ROLES}  # the restarted processes
    assert {role: s.signers[role].kid for role, s in after.items()} == new_kids != old_kids
    after["learner"].stream("prompts", PromptTask).produce(task(4))
    after["generator"].stream("rollouts", RolloutGroup).produce(rollout(task(13)))
    after["reward"].stream("scored", ScoredGroup).produce(scored(rollout(task(14))))

    # Old-kid entries read by new processes, new-kid entries read by old ones (their keyring finds the new kid).
    assert prompts_by["generator"].forward(in_hand[0], before["generator"].stream("rollouts", RolloutGroup),
                                           rollout(in_hand[0].message))
    got = after["generator"].stream("prompts", PromptTask).consume("g-new", count=10, block_ms=0)
    assert [d.message.task_id for d in got] == ["t1", "t2", "t3", "t4"]
    rolled = before["reward"].stream("rollouts", RolloutGroup).consume("r-old", count=10, block_ms=0)
    assert sorted(d.message.task.task_id for d in rolled) == ["t0", "t10", "t13"]
    learned = before["learner"].stream("scored", ScoredGroup).consume("l-old", count=10, block_ms=0)
    assert sorted(d.message.rollout.task.task_id for d in learned) == ["t11", "t14"]
    assert [after["learner"].stream("held", ScoredGroup).forged(fields) for _, fields in held.entries()] == [None]
    assert before["learner"].dead_letters() == []  # nothing lost, none refused

    # Retire the old kids while entries signed under them are still in the streams (a replay, or a straggler).
    prompts_by["learner"].produce(task(20))
    before["reward"].stream("scored", ScoredGroup).produce(scored(rollout(task(21))))
    for role in ROLES:
        retire(keys_dir(settings), old_kids[role])
    assert after["generator"].stream("prompts", PromptTask).consume("g-new", count=10, block_ms=0) == []
    assert after["learner"].stream("scored", ScoredGroup).consume("l-new", count=10, block_ms=0) == []
    assert after["learner"].stream("held", ScoredGroup).forged(next(held.entries())[1]).startswith(
        f"forged: key id '{old_kids['learner']}' is not in the keyring")
    letters = {d["task_id"]: d["reason"] for d in after["learner"].dead_letters()}
    assert letters == {
        "t20": f"forged: key id '{old_kids['learner']}' is not in the keyring (retired by a rotation, or never issued)",
        "t21": f"forged: key id '{old_kids['reward']}' is not in the keyring (retired by a rotation, or never issued)",
    }
    # Letters the consuming roles signed under their new keys: the learner trusts them.
    assert len(after["learner"].dead_letters_after("0-0")[1]) == 2
