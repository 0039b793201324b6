"""Batch assembly (learner/batch.py): sizing from the ratio, refills and their limit, carry-over, staleness, pacing."""

from __future__ import annotations

import itertools
import math

import pytest

from learner.batch import BatchAssembler, InformativeRatio, RecentIds, RefillLimitReached, task_id_of, warmed_up_target
from learner.policy import PolicyVersion
from services.config import load_settings
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup

_ids = itertools.count()


def group(rewards: list[float], version: int = 0, task_id: str | None = None) -> ScoredGroup:
    """A scored group with the given per-sample rewards, sampled with policy `version`."""
    task = PromptTask(task_id=task_id or f"t{next(_ids)}", prompt_id="p", prompt="1+1=?", ground_truth="2")
    samples = [Sample(token_ids=[1, 2], logprobs=[-0.5, -0.5], text="Answer: 2", finish_reason="stop") for _ in rewards]
    scores = [Score(reward=r, correct=r > 0, overlong=False, rule="answer_line") for r in rewards]
    return ScoredGroup(rollout=RolloutGroup(task=task, policy_version=version, generator_id="g", samples=samples),
                       scores=scores)


MIXED = [1.0, -1.0, -1.0, 1.0]  # informative: some right, some wrong
ALL_WRONG = [-1.0] * 4
ALL_RIGHT = [1.0] * 4


def push(assembler: BatchAssembler, count: int, version: int = 0) -> list[str]:
    ids = [f"t{next(_ids)}" for _ in range(count)]
    assembler.issued(ids, version)
    return ids


def arrive(assembler: BatchAssembler, ids: list[str], rewards_for, version: int = 0, policy: int | None = None):
    """The groups of `ids` come back scored; rewards_for(i) gives the rewards of the i-th."""
    return [
        assembler.admit(group(rewards_for(i), version if policy is None else policy, task_id=t), version)
        for i, t in enumerate(ids)
    ]


def with_ratio(value: float, weight: float = 1e6) -> InformativeRatio:
    """A ratio estimate that has already seen plenty of evidence for `value`."""
    ratio = InformativeRatio(memory=1e9, prior_weight=1e-9)
    ratio.usable, ratio.seen = value * weight, weight
    return ratio


# -- sizing ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ratio, expected", [(0.5, 16), (0.25, 32), (0.8, 10), (1.0, 8), (0.05, 32)])
def test_first_push_is_sized_from_the_ratio_within_the_oversample_bounds(ratio, expected):
    a = BatchAssembler(8, max_staleness=0, oversample_min=1.0, oversample_max=4.0, ratio=with_ratio(ratio))
    push_ = a.plan(0)
    # ceil(B / r), bounded to [1, 4] x B: 0.05 would ask for 160 prompts; the bound keeps it at 32
    assert push_.count == expected and not push_.refill


def test_ratio_estimate_follows_observations_and_sizing_follows_it():
    a = BatchAssembler(4, max_staleness=0, ratio=InformativeRatio(memory=1e9))
    assert a.plan(0).count == 8  # prior 0.5 -> twice B
    ids = push(a, 8)
    arrive(a, ids, lambda i: MIXED if i % 4 == 0 else ALL_RIGHT)  # 2 of 8 informative
    assert a.ratio.value == pytest.approx((2 + 1) / (8 + 2))  # prior 0.5 with weight 2
    assert a.status(0) == "wait"
    refill = a.plan(0)  # 2 in hand, nothing in flight: need 2 more at r = 0.3 -> ceil(2 / 0.3) = 7
    assert refill.refill and refill.count == math.ceil(2 / a.ratio.value) == 7
    assert a.refills == 1


def test_oversample_min_hedge_is_pushed_even_in_synchronous_mode():
    a = BatchAssembler(10, max_staleness=0, oversample_min=1.5, ratio=with_ratio(1.0))
    assert a.plan(0).count == 15


def test_oversample_margin_pushes_beyond_the_expected_need_also_ahead_of_training():
    plain = BatchAssembler(10, max_staleness=1, ratio=with_ratio(0.8))
    margin = BatchAssembler(10, max_staleness=1, oversample_margin=1.2, ratio=with_ratio(0.8))
    assert plain.plan(0).count == 13 and margin.plan(0).count == 15  # ceil(10 / 0.8) against ceil(1.2 * 10 / 0.8)
    ahead = BatchAssembler(10, max_staleness=1, oversample_margin=1.2, ratio=with_ratio(0.8))
    assert ahead.plan(0, ahead=True).count == 15  # the pacing bound widens with the margin: not clipped to 13
    with pytest.raises(ValueError, match="oversample_margin"):
        BatchAssembler(10, oversample_margin=0.9)


def test_ratio_state_round_trip_and_decay():
    r = InformativeRatio(memory=10)
    for usable in [True] * 50:
        r.observe(usable)
    high = r.value
    for usable in [False] * 50:
        r.observe(usable)
    assert high > 0.9 and r.value < 0.1  # old evidence is forgotten
    clone = InformativeRatio(memory=10)
    clone.load_state(r.state())
    assert clone.value == r.value


# -- batch warm-up ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("warmup, targets", [(0, [64, 64, 64]), (1, [64, 64, 64]), (4, [16, 32, 48, 64, 64]),
                                             (3, [22, 43, 64, 64]), (200, [1, 1, 1])])
def test_batch_warm_up_grows_the_target_linearly_to_b(warmup, targets):
    assert [warmed_up_target(64, warmup, t) for t in range(1, len(targets) + 1)] == targets


def test_each_taken_batch_advances_the_warm_up_and_a_resume_picks_it_up():
    a = BatchAssembler(8, warmup_steps=4, max_staleness=0, ratio=with_ratio(1.0))
    sizes = []
    for version in range(5):
        assert a.plan(version).count == a.target  # r = 1: the first push is the step's own target
        arrive(a, push(a, a.target, version), lambda i: MIXED, version=version)
        assert a.status(version) == "train"
        sizes.append(len(a.take_batch(version).groups))
    assert sizes == [2, 4, 6, 8, 8]
    resumed = BatchAssembler(8, warmup_steps=4, ratio=with_ratio(1.0))
    resumed.start_at(3)
    assert resumed.target == 6
    with pytest.raises(ValueError, match="warmup_steps"):
        BatchAssembler(8, warmup_steps=-1)


def test_pacing_under_the_warm_up_allows_the_sum_of_the_coming_targets():
    a = BatchAssembler(8, warmup_steps=4, max_staleness=2, ratio=with_ratio(1.0))
    assert a.supply_cap(ahead=False) == pytest.approx(2 + 4 + 6)  # steps 1, 2 and 3 can use what is pushed at v0
    assert a.plan(0).count == 2  # the first step needs only its own 2 groups
    arrive(a, push(a, 2), lambda i: MIXED)
    a.take_batch(0)
    assert a.supply_cap(ahead=True) == pytest.approx(4 + 6)  # steps 2 and 3, pushed ahead of training step 1
    assert a.plan(0, ahead=True).count == 4


def test_the_warm_up_comes_from_the_config():
    settings = load_settings("tiny-cpu", learner={"batch": {"prompts_per_step": 64, "warmup_steps": 4}})
    assert BatchAssembler.from_settings(settings.learner).target == 16


# -- refills and their limit -----------------------------------------------------------------------------------
def test_no_refill_while_the_prompts_in_flight_could_still_fill_the_batch():
    a = BatchAssembler(4, max_staleness=0, ratio=with_ratio(0.5))
    ids = push(a, a.plan(0).count)  # 8
    arrive(a, ids[:4], lambda i: ALL_WRONG)  # 0 in hand, 4 in flight: best case still 4
    assert a.plan(0).count == 0 and a.refills == 0
    arrive(a, ids[4:5], lambda i: ALL_WRONG)  # now 3 in flight: 4 is out of reach -> refill at once
    refill = a.plan(0)
    assert refill.refill and refill.count > 0 and a.refills == 1


def test_refills_until_the_batch_is_full_then_train():
    a = BatchAssembler(4, max_staleness=0, max_refills=5, ratio=with_ratio(0.5, weight=4))
    rounds = 0
    while a.status(0) != "train":
        ids = push(a, a.plan(0).count)
        assert ids, "a step that is short and has nothing in flight must push"
        arrive(a, ids, lambda i: MIXED if i == 0 else ALL_WRONG)  # one informative group per round
        rounds += 1
    batch = a.take_batch(0)
    assert len(batch.groups) == 4 and batch.refills == rounds - 1 and not batch.refill_limit_hit
    assert batch.stats.informative == 4 and batch.stats.uninformative == batch.stats.scored - 4


def test_refill_limit_train_takes_what_is_in_hand_and_says_so():
    a = BatchAssembler(4, max_staleness=0, max_refills=1, ratio=with_ratio(0.5))
    ids = push(a, a.plan(0).count)
    arrive(a, ids, lambda i: MIXED if i == 0 else ALL_WRONG)
    ids = push(a, a.plan(0).count)
    assert a.refills == 1
    assert a.status(0) == "wait"  # the refill is still in flight
    arrive(a, ids, lambda i: ALL_RIGHT)
    assert a.plan(0).count == 0  # no refill beyond the limit
    assert a.status(0) == "limit"
    batch = a.take_at_limit(0, "train")
    assert len(batch.groups) == 1 and batch.refill_limit_hit and batch.short_by == 3 and batch.refills == 1
    assert a.status(0) == "wait" and a.refills == 0  # the next step starts afresh


def test_refill_limit_stop_raises_a_clear_error():
    a = BatchAssembler(4, max_staleness=0, max_refills=0, ratio=with_ratio(0.5))
    ids = push(a, a.plan(0).count)
    arrive(a, ids, lambda i: ALL_WRONG)
    assert a.plan(0).count == 0 and a.status(0) == "limit"
    with pytest.raises(RefillLimitReached, match=r"only 0 of 4 informative groups.*max_refills=0"):
        a.take_at_limit(0, "stop")


def test_dead_prompts_stop_counting_as_in_flight():
    a = BatchAssembler(2, max_staleness=0, max_refills=0, ratio=with_ratio(1.0))
    ids = push(a, a.plan(0).count)
    arrive(a, ids[:1], lambda i: MIXED)
    assert a.status(0) == "wait"
    assert a.lost(ids[1:] + ["unknown"]) == 1
    assert a.status(0) == "limit" and a.stats.lost == 1


# -- carry-over, dedupe, order ---------------------------------------------------------------------------------
def test_surplus_informative_groups_are_carried_to_the_next_step():
    a = BatchAssembler(4, max_staleness=1, ratio=with_ratio(1.0))
    ids = push(a, 6)
    arrive(a, ids, lambda i: MIXED)
    assert a.status(0) == "train"
    first = a.take_batch(0)
    assert first.task_ids == ids[:4] and a.carried_ids == ids[4:]
    assert a.plan(1).count == 2  # only the deficit is pushed for the next step
    second_ids = push(a, 2, version=1)
    arrive(a, second_ids, lambda i: MIXED, version=1)
    assert a.take_batch(1).task_ids == ids[4:] + second_ids


def test_oldest_policy_is_trained_first():
    a = BatchAssembler(2, max_staleness=2, ratio=with_ratio(1.0))
    newer = a.admit(group(MIXED, version=2, task_id="new"), 2)
    older = a.admit(group(MIXED, version=1, task_id="old"), 2)
    a.admit(group(MIXED, version=2, task_id="new2"), 2)
    assert newer == older == "informative"
    assert a.take_batch(2).task_ids == ["old", "new"]


def test_a_surplus_is_cut_in_push_order_not_arrival_order():
    # The last groups to come back are the slowest to generate (the longest responses): cutting the surplus by
    # arrival would drop long responses at every step; the cut follows the order the prompts were pushed.
    a = BatchAssembler(2, max_staleness=0, ratio=with_ratio(1.0))
    pushed = [group(MIXED, task_id=f"pushed{k}") for k in range(3)]
    for k, g in enumerate(pushed):
        g.rollout.task.created_at = 1000.0 + k
    for g in reversed(pushed):  # the first pushed is the longest: it arrives last
        assert a.admit(g, 0) == "informative"
    assert a.take_batch(0).task_ids == ["pushed0", "pushed1"]


def test_duplicates_are_admitted_once():
    a = BatchAssembler(2, ratio=with_ratio(1.0))
    g = group(MIXED, task_id="same")
    assert a.admit(g, 0) == "informative"
    assert a.admit(g, 0) == "duplicate"
    assert len(a.ready) == 1 and a.stats.duplicates == 1 and a.stats.scored == 1


def test_a_retracted_group_is_in_flight_again_and_counted_once_when_it_comes_back():
    # The service could not take the group over (reclaimed meanwhile): a synchronous step waits for it again.
    a = BatchAssembler(2, max_staleness=0, ratio=with_ratio(1.0))
    first, second = push(a, 2)
    arrive(a, [first], lambda i: MIXED)
    (admitted,) = [g for _, _, g in a.ready]
    observed = a.ratio.state()
    a.retract(admitted)
    assert first in a.in_flight and not a.ready and a.stats.scored == a.stats.informative == a.stats.samples == 0
    assert a.ratio.state() == {"usable": observed["usable"] - 1, "seen": observed["seen"] - 1}  # observed once only
    arrive(a, [second], lambda i: MIXED)
    assert a.status(0) == "wait"
    assert a.admit(admitted, 0) == "informative" and a.status(0) == "train"
    batch = a.take_batch(0)
    assert len(batch.groups) == 2 and batch.stats.scored == 2 and batch.stats.reward_all == pytest.approx(0.0)


def test_recent_ids_forget_the_oldest():
    ids = RecentIds(2)
    for t in "abc":
        ids.add(t)
    assert "a" not in ids and "b" in ids and "c" in ids and len(ids) == 2


def _all_correct_with_one_overlong() -> ScoredGroup:
    g = group([1.0] * 4)
    g.scores[-1] = g.scores[-1].model_copy(update={"reward": 1.0 - 12 / 4096, "overlong": True})
    return g


def test_dynamic_sampling_filters_on_accuracy_by_default():
    # All correct, one response penalised by the soft overlong buffer: reward spread, no accuracy spread.
    a = BatchAssembler(4)
    assert a.filter_metric == "acc"
    assert a.admit(_all_correct_with_one_overlong(), 0) == "uninformative"
    assert a.admit(group(MIXED), 0) == "informative"
    reward = BatchAssembler(4, filter_metric="reward")
    assert reward.admit(_all_correct_with_one_overlong(), 0) == "informative"


def test_filter_metric_comes_from_the_config():
    settings = load_settings("tiny-cpu", learner={"batch": {"filter_metric": "reward"}})
    assert BatchAssembler.from_settings(settings.learner).filter_metric == "reward"
    assert BatchAssembler.from_settings(load_settings("tiny-cpu").learner).filter_metric == "acc"


def test_without_dynamic_sampling_every_group_counts():
    a = BatchAssembler(4, dynamic_sampling=False)
    ids = push(a, 4)
    arrive(a, ids, lambda i: ALL_WRONG)
    assert a.status(0) == "train" and a.take_batch(0).stats.uninformative == 0
    assert a.ratio.value > 0.5  # every group was usable


@pytest.mark.parametrize("staleness", [0, 2])
def test_without_dynamic_sampling_each_step_pushes_its_b_prompts_and_trains_them_all(staleness):
    # The GRPO baseline (ablation row 1) samples B prompts a step: no margin, no over-sampling to throw away.
    a = BatchAssembler(8, dynamic_sampling=False, max_staleness=staleness, oversample_margin=1.25)
    pushed = trained = 0
    for version in range(4):
        ids = push(a, a.plan(version).count, version)
        pushed += len(ids)
        arrive(a, ids, lambda i: ALL_WRONG if i % 2 else MIXED, version)
        assert a.status(version) == "train" and a.plan(version).count == 0  # no refill
        batch = a.take_batch(version)
        trained += len(batch.groups)
        assert batch.stats.stale_dropped == 0 and batch.stats.uninformative == 0
    assert pushed == trained == 4 * 8


def test_unfiltered_and_filtered_rewards_are_both_recorded():
    a = BatchAssembler(1, ratio=with_ratio(1.0))
    arrive(a, push(a, 3), lambda i: [ALL_RIGHT, ALL_WRONG, MIXED][i])
    batch = a.take_batch(0)
    assert batch.stats.reward_all == pytest.approx(0.0) and batch.stats.accuracy_all == pytest.approx(0.5)
    assert [s.reward for g in batch.groups for s in g.scores] == MIXED


# -- staleness -------------------------------------------------------------------------------------------------
def test_groups_older_than_max_staleness_are_dropped_and_counted():
    a = BatchAssembler(2, max_staleness=1, ratio=with_ratio(1.0))
    assert a.admit(group(MIXED, version=3), 5) == "stale"  # lag 2 > 1
    assert a.admit(group(MIXED, version=4), 5) == "informative"  # lag 1
    assert a.admit(group(MIXED, version=6), 5) == "stale"  # ahead of the learner: another lineage
    assert a.stats.stale_dropped == 2 and a.stats.informative == 1


def test_carried_groups_age_out_when_the_batch_is_taken():
    a = BatchAssembler(2, max_staleness=1, ratio=with_ratio(1.0))
    for t in ["a", "b", "c"]:
        a.admit(group(MIXED, version=0, task_id=t), 0)
    a.take_batch(0)  # trains a, b; carries c (policy 0)
    a.admit(group(MIXED, version=1, task_id="d"), 1)
    a.admit(group(MIXED, version=1, task_id="e"), 2)
    batch = a.take_batch(2)  # at version 2, c (lag 2) is too old
    assert [task_id_of(g) for g in batch.stale_at_take] == ["c"]
    assert batch.task_ids == ["d", "e"] and batch.stats.stale_dropped == 1


def test_synchronous_mode_drops_every_carried_group_at_the_next_version():
    a = BatchAssembler(1, max_staleness=0, ratio=with_ratio(1.0))
    arrive(a, push(a, 2), lambda i: MIXED)
    a.take_batch(0)
    assert len(a.ready) == 1 and a.in_hand(1) == 0 and a.status(1) == "wait"  # one carried, unusable at v1
    assert a.plan(1).count == 1  # so the next step pushes for all of B
    a.admit(group(MIXED, version=1, task_id="fresh"), 1)
    assert a.take_batch(1).task_ids == ["fresh"]  # ...but it was sampled by version 0


# -- pacing ----------------------------------------------------------------------------------------------------
def test_synchronous_mode_never_pushes_ahead_of_training():
    a = BatchAssembler(4, max_staleness=0, ratio=with_ratio(0.5))
    arrive(a, push(a, a.plan(0).count), lambda i: MIXED)
    a.take_batch(0)
    assert a.plan(0, ahead=True).count == 0
    assert a.plan(1).count == 8  # after publishing: the next step's first push (the carried 4 are too old)


def test_asynchronous_mode_pushes_the_next_step_before_training_within_the_bound():
    a = BatchAssembler(4, max_staleness=1, ratio=with_ratio(0.5))
    ids = push(a, a.plan(0).count)  # 8 prompts, supply 4
    arrive(a, ids[:6], lambda i: MIXED)  # 6 in hand, 2 still in flight
    a.take_batch(0)  # 2 carried + 2 in flight (expected 1): supply 3
    ahead = a.plan(0, ahead=True)
    assert not ahead.refill and ahead.count == 2  # deficit 1 at r = 0.5
    # the bound when pushing ahead is k * B = 4 expected groups: never more, whatever the deficit says
    assert a.supply(1) + ahead.count * a.ratio.value <= a.supply_cap(ahead=True) + a.ratio.value


def test_pacing_caps_pushes_when_the_pipeline_already_holds_what_the_bound_allows():
    a = BatchAssembler(4, max_staleness=1, ratio=with_ratio(0.5), oversample_max=8)
    push(a, 16)  # supply 8 = (k + 1) * B: as many as versions V and V + 1 can train on
    assert a.admission_room(0) == 0
    a.plan(0)  # first allocation: nothing
    assert a.admission_room(0, ahead=True) == 0
    # even a certain shortfall cannot push beyond the bound: 16 in flight means the best case is already >= B
    assert a.plan(0).count == 0 and a.refills == 0


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_simulated_pipeline_keeps_the_bound_with_few_drops(staleness):
    """Generators sample each task with the newest weights when they take it; its group arrives one tick later.

    Pacing keeps the pipeline short enough that few groups age out, every trained group is within the bound,
    and the expected supply never exceeds what the bound allows by more than one prompt.
    """
    import random

    rng = random.Random(staleness)
    a = BatchAssembler(8, max_staleness=staleness, ratio=InformativeRatio(memory=64))
    version, queue, generating = 0, [], []
    trained = stale = scored = 0

    def tick():
        nonlocal generating, stale, scored
        for task_id, sampled_by in generating:  # groups sampled last tick arrive now
            verdict = a.admit(group(MIXED if rng.random() < 0.4 else ALL_RIGHT, sampled_by, task_id), version)
            stale += verdict == "stale"
            scored += 1
        generating = [(queue.pop(0), version) for _ in range(min(len(queue), 6))]

    def push_checked(ahead: bool):
        count = a.plan(version, ahead=ahead).count
        queue.extend(push(a, count, version))
        train_version = version + 1 if ahead else version
        if count:
            assert a.supply(train_version) <= a.supply_cap(ahead) + a.ratio.value + 1e-9

    for _ in range(40):  # steps
        while a.status(version) == "wait":
            push_checked(ahead=False)
            tick()
        batch = a.take_batch(version) if a.status(version) == "train" else a.take_at_limit(version, "train")
        assert all(0 <= version - g.rollout.policy_version <= staleness for g in batch.groups)
        trained += len(batch.groups)
        push_checked(ahead=True)
        tick()  # generation overlaps training
        version += 1
    assert trained >= 8 * 40 * 0.95
    if staleness > 0:
        assert stale <= 0.05 * scored, (stale, scored)


def test_a_version_jump_at_resume_keeps_the_restored_policy_fresh():
    """A checkpoint of v7 republished as v9 (generators had seen v8): v7 samples are on-policy at v9."""
    policy = PolicyVersion(7)
    a = BatchAssembler(4, max_staleness=1, ratio=with_ratio(1.0), policy=policy)
    policy.republish_as(9)
    assert a.lag(group(MIXED, version=7), 9) == 0  # the restored policy itself
    assert a.lag(group(MIXED, version=6), 9) == 1
    assert a.lag(group(MIXED, version=8), 9) == 1  # the discarded sibling: its raw age
    assert a.lag(group(MIXED, version=7), 10) == 1 and a.too_stale(group(MIXED, version=6), 10)
    clone = BatchAssembler(4, max_staleness=1, policy=PolicyVersion.from_state(policy.state()))
    assert clone.lag(group(MIXED, version=7), 9) == 0  # jumps survive the next checkpoint
    with pytest.raises(ValueError):
        policy.republish_as(9)  # never backwards


def test_synchronous_mode_waits_for_every_prompt_in_flight_before_training():
    for k, expected in ((0, "wait"), (1, "train")):
        a = BatchAssembler(2, max_staleness=k, ratio=with_ratio(1.0))
        ids = push(a, 3)
        arrive(a, ids[:2], lambda i: MIXED)  # B in hand, one prompt still in flight
        assert a.status(0) == expected, k
        arrive(a, ids[2:], lambda i: MIXED)
        assert a.status(0) == "train"
        assert len(a.take_batch(0).groups) == 2 and len(a.ready) == 1  # the surplus is carried (k=0: to age out)


@pytest.mark.parametrize("informative_every", [4, 10])
def test_a_low_informative_ratio_fills_the_batch_in_a_few_refill_rounds_at_the_default_bound(informative_every):
    """The paper's B of 512 at an informative ratio of 1/4 or 1/10 (late in a run, most groups all right): a
    bound of 4 covered 4 r of what was missing a round, so the shortfall only shrank geometrically, and at 1/10
    all 10 refill rounds ran and the step trained short."""
    bound = load_settings("dapo-qwen2.5-32b").learner.batch.oversample_max
    a = BatchAssembler(512, max_staleness=0, oversample_max=bound, ratio=with_ratio(1 / informative_every))
    arrivals = itertools.count()
    while a.status(0) == "wait":
        ids = push(a, a.plan(0).count)
        arrive(a, ids, lambda i: MIXED if next(arrivals) % informative_every == 0 else ALL_RIGHT)
    assert a.status(0) == "train" and a.refills <= 2
