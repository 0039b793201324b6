"""benchmarks/peer_trl.py's pure parts: TRL's batch shape, the reward it gets, and the time-to-accuracy report."""

from __future__ import annotations

from benchmarks import peer_trl
from benchmarks.runs import Curve
from services.config import load_settings


def curve(seed: int, minutes, accuracy, label="project") -> Curve:
    return Curve(label, seed, list(range(len(minutes))), list(minutes), list(accuracy), 1.0, 0)


def test_matched_trl_generates_the_projects_batch_and_updates_as_often():
    settings = load_settings("tiny-cpu")
    cfg, n = settings.learner, settings.sampling.n
    shape = peer_trl.trl_shape("matched", cfg, n)
    assert shape["per_device_train_batch_size"] * shape["steps_per_generation"] == cfg.batch.prompts_per_step * n
    assert shape["steps_per_generation"] == cfg.batch.mini_batches and shape["num_iterations"] == cfg.batch.epochs
    small = peer_trl.trl_shape("small", cfg, n)
    assert (small["per_device_train_batch_size"], small["num_generations"]) == (16, 8)


def test_trl_is_rewarded_by_the_projects_rule():
    settings = load_settings("tiny-cpu", reward={"overlong_buffer": 16})
    reward = peer_trl.reward_function(settings)
    got = reward(prompts=["p"] * 3, completions=["1+2=3\nAnswer: 3", "Answer: 4", "Answer: 3"],
                 completion_ids=[[5] * 10, [5] * 10, [5] * 60], ground_truth=["3", "3", "3"])
    assert got[:2] == [1.0, -1.0]
    assert got[2] == 1.0 - 12 / 16  # 12 tokens into the 16-token buffer before max_tokens 64 (Eq. 13)


def test_the_median_seed_decides_and_a_seed_that_never_got_there_is_slowest():
    runs = [curve(0, [0, 1, 2], [0.2, 0.31, 0.36]), curve(1, [0, 1, 2], [0.2, 0.25, 0.32]),
            curve(2, [0, 1, 2], [0.2, 0.22, 0.25])]
    assert peer_trl.median_minutes(runs, 0.30) == 2
    assert peer_trl.median_minutes(runs, 0.35) is None  # only one seed of three got there
    assert peer_trl.median_minutes(runs[:2], 0.30) == 2  # even count: the slower middle seed


def test_report_states_the_ratio_against_each_trl_setting_and_the_goal(monkeypatch):
    monkeypatch.setattr(peer_trl, "TARGETS", (0.30, 0.35, 0.40, 0.45))
    results = {
        "project": [curve(0, [0, 0.5, 1.0], [0.2, 0.31, 0.36])],
        "trl-small": [curve(0, [0, 1.0, 2.0], [0.2, 0.30, 0.33], "trl-small")],
    }
    text = peer_trl.report(results, "cmd")
    assert "| trl-small | 0.50 | TRL never | neither | neither |" in text
    assert f"goal: at most {peer_trl.GOAL}" in text
    assert "| project | 0 | 20.0 | 36.0 | 3 | 0.50 | 1.00 | never | never |" in text
