"""Where a step's time goes: the generators' activity clocks, the split of the learner's wait, the live view."""

from __future__ import annotations

import pytest

from cli.launcher import step_breakdown
from learner.records import PHASES, GeneratorClocks, wait_split, with_delivery
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup


def group(generator: str, busy: float, reload: float, idle: float, *, created: float = 100.0,
          generated: float | None = None, scored: float | None = None) -> ScoredGroup:
    task = PromptTask(prompt_id="p", prompt="1+1=", ground_truth="2", created_at=created)
    generated = created + 1.0 if generated is None else generated
    rollout = RolloutGroup(task=task, policy_version=0, generator_id=generator, generated_at=generated,
                           samples=[Sample(token_ids=[1], logprobs=[-0.1], text="2", finish_reason="stop")],
                           generator_busy_s=busy, generator_reload_s=reload, generator_idle_s=idle)
    return ScoredGroup(rollout=rollout, scores=[Score(reward=1.0, correct=True, overlong=False, rule="answer_line")],
                       scored_at=generated + 0.5 if scored is None else scored)


def test_generator_clocks_sum_the_differences_between_steps_over_generators():
    clocks = GeneratorClocks()
    clocks.observe(group("g0", 10, 1, 5, generated=1016))  # baselines: their time before is not this step's
    clocks.observe(group("g1", 3, 0, 2, generated=1005))
    assert clocks.take() == {"generator_busy_seconds": 0.0, "generator_reload_seconds": 0.0,
                             "generator_idle_seconds": 0.0}
    clocks.observe(group("g0", 14, 2, 6, generated=1022))
    clocks.observe(group("g0", 12, 1, 6, generated=1019))  # an older group arriving late changes nothing
    clocks.observe(group("g1", 8, 0, 2, generated=1010))
    assert clocks.take() == {"generator_busy_seconds": 9.0, "generator_reload_seconds": 1.0,
                             "generator_idle_seconds": 1.0}
    clocks.observe(group("g0", 1, 0, 1, generated=1200))  # a restarted g0: a new baseline, not a negative step
    clocks.observe(group("g0", 4, 0, 2, generated=1204))
    assert clocks.take()["generator_busy_seconds"] == 3.0


def test_the_wait_is_split_by_the_batch_latencies():
    groups = [group("g", 0, 0, 0, created=0.0, generated=3.0, scored=4.0),
              group("g", 0, 0, 0, created=0.0, generated=5.0, scored=6.0)]
    split = wait_split(10.0, groups)  # generation 8 s, verification 2 s in all
    assert split == pytest.approx({"wait_generation_seconds": 8.0, "wait_verification_seconds": 2.0})
    assert wait_split(4.0, []) == {"wait_generation_seconds": 4.0, "wait_verification_seconds": 0.0}


def test_a_step_that_sees_two_deliveries_end_names_the_newest_and_lists_both():
    gather = {"publish_gather_seconds": 0.2, "publish_bytes": 8.0}
    assert with_delivery(gather, {}) == gather  # nothing ended in the step
    background = {"delivered_version": 3, "delivery_seconds": 1.5, "broadcast_members": 2}
    on_the_path = {"delivered_version": 4, "delivery_seconds": 0.5}  # no round: no member took part
    step = with_delivery(with_delivery(gather, background), on_the_path)
    # the older round's figures are not left beside the newer version
    assert step == {**gather, **on_the_path, "deliveries": [background, on_the_path]}
    assert gather == {"publish_gather_seconds": 0.2, "publish_bytes": 8.0}  # not changed in place


def test_the_live_view_shows_where_the_last_step_went():
    assert step_breakdown({}) == "-"
    row = {f"{phase}_seconds": float(i) for i, phase in enumerate(PHASES)} | {"step_seconds": 30.0}
    text = step_breakdown(row)
    assert "total 30.0" in text and "gen 1.0 / verify 2.0" in text and "publish 7.0" in text
    assert "eval 9.0 (after a drain of 8.0)" in text and "generators busy 11.0 / idle 13.0" in text


def test_the_status_table_follows_metrics_jsonl_reading_only_what_was_appended(tmp_path, monkeypatch):
    """The newest row and the first and newest evaluations, a line being written taken once whole, a file cut by a
    resume read again from its start, each line parsed once (the table is redrawn every second)."""
    import json

    from learner.records import Progress, truncate_jsonl

    path = tmp_path / "metrics.jsonl"
    progress = Progress(path)
    assert progress.read().last == {} and progress.first_eval is None  # no file yet
    rows = [{"step": 1, "eval_accuracy": 0.1}, {"step": 2}, {"step": 3, "eval_accuracy": 0.3}]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"step": 4, "rew')
    progress.read()
    assert (progress.last, progress.first_eval, progress.last_eval) == (rows[2], rows[0], rows[2])
    with path.open("a") as f:
        f.write('ard_all": 0.5}\n')
    parsed, original = [], json.loads
    with monkeypatch.context() as patch:
        patch.setattr(json, "loads", lambda line: parsed.append(line) or original(line))
        progress.read()
    assert progress.last == {"step": 4, "reward_all": 0.5} and len(parsed) == 1
    truncate_jsonl(path, 2)  # a resume from step 2's checkpoint
    with path.open("a") as f:
        f.write(json.dumps({"step": 3}) + "\n")
    progress.read()
    assert (progress.last, progress.first_eval, progress.last_eval) == ({"step": 3}, rows[0], rows[0])
