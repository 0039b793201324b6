"""The learning benchmarks' bookkeeping (benchmarks/runs.py, benchmarks/ablation.py): curves, seeds, rows."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks import ablation  # noqa: E402
from benchmarks.runs import Curve, grid, median_and_worst, read_curve, replace_section  # noqa: E402


def curve(seed: int, steps, minutes, accuracy) -> Curve:
    return Curve("t", seed, list(steps), list(minutes), list(accuracy), 1.0, 0)


def test_read_curve_measures_minutes_from_the_step_zero_record(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.2, "time": 100.0},
            {"step": 1, "eval_accuracy": None, "step_seconds": 4.0, "wait_seconds": 1.0, "refills": 1, "time": 104.0},
            {"step": 2, "eval_accuracy": 0.3, "step_seconds": 8.0, "wait_seconds": 0.5, "refills": 0, "time": 160.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = read_curve("t", 3, path)
    assert (c.steps, c.minutes, c.accuracy, c.step_seconds, c.base) == ([0, 2], [0.0, 1.0], [0.2, 0.3], 6.0, 0.2)
    assert (c.wait_seconds, c.refills) == (0.75, 0.5)  # means over the trained steps (not the step-0 record)


def test_training_minutes_leave_out_the_evaluations_after_step_zero(tmp_path):
    rows = [{"step": 0, "eval_accuracy": 0.2, "eval_seconds": 50.0, "time": 100.0},  # before the clock starts
            {"step": 1, "eval_accuracy": 0.25, "eval_seconds": 30.0, "time": 160.0},
            {"step": 2, "eval_accuracy": None, "time": 210.0},
            {"step": 3, "eval_accuracy": 0.3, "eval_seconds": 15.0, "time": 250.0}]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_curve("t", 0, path).minutes == [0.0, 1.0, 2.0]


def test_accuracy_at_a_minute_is_what_the_run_had_measured_by_then():
    c = curve(0, [0, 5, 10], [0.0, 1.0, 2.0], [0.2, 0.3, 0.25])
    assert [c.at_minute(m) for m in (0.0, 0.99, 1.0, 1.5, 2.0, 9.0)] == [0.2, 0.2, 0.3, 0.3, 0.25, 0.25]


def test_max_drop_counts_only_falls_after_the_given_step():
    c = curve(0, [0, 5, 10, 15, 20, 25], range(6), [0.3, 0.1, 0.4, 0.33, 0.36, 0.30])
    assert c.max_drop(after_step=10) == pytest.approx(0.07)  # 0.40 -> 0.33 (0.3 -> 0.1 is before step 10)
    assert curve(0, [0, 10, 20], range(3), [0.1, 0.2, 0.3]).max_drop() == 0.0


def test_median_and_worst_over_seeds_on_a_common_grid():
    a = curve(0, [0, 5], [0.0, 1.0], [0.2, 0.4])
    b = curve(1, [0, 5], [0.0, 2.0], [0.1, 0.5])
    c = curve(2, [0, 5], [0.0, 0.5], [0.3, 0.3])
    minutes = grid([a, b, c], points=3)
    assert minutes == [0.0, 0.25, 0.5]  # up to the shortest run's last evaluation
    median, worst = median_and_worst([a, b, c], [0.0, 1.0, 2.0])
    assert median == [0.2, 0.3, 0.4] and worst == [0.1, 0.1, 0.3]


def test_replace_section_rewrites_only_its_block(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# Bench\n\nintro\n")
    replace_section(readme, "learning", "first")
    replace_section(readme, "other", "x")
    replace_section(readme, "learning", "second")
    text = readme.read_text()
    assert "first" not in text and text.count("second") == 1 and "intro" in text and "x" in text
    assert text.index("second") < text.index("<!-- other:begin -->")


def test_ablation_rows_carry_only_their_switches_onto_the_tiny_preset():
    assert ablation.rows() == sorted(ablation.PAPER_AIME)
    grpo = dict(item.split("=", 1) for item in ablation.row_switches("1-grpo"))
    assert grpo == {"learner.loss.clip_high": "0.2", "learner.loss.loss_agg": "sample",
                    "learner.batch.dynamic_sampling": "false", "learner.batch.filter_metric": "acc",
                    "learner.loss.overlong_filter": "false", "reward.soft_overlong": "false"}
    full = dict(item.split("=", 1) for item in ablation.row_switches("6-dynamic-sampling"))
    assert full["learner.batch.dynamic_sampling"] == "true" and full["learner.loss.clip_high"] == "0.28"
    assert not any(key.startswith(("run_dir", "redis", "model", "data")) for key in full)


def test_ablation_runs_seed_by_seed_with_the_rows_reversed_on_alternate_seeds():
    """A drift of the machine's speed over the ladder must not turn into a trend down the rows."""
    order = ablation.run_order(["a", "b", "c"], [0, 1, 2])
    assert order == [("a", 0), ("b", 0), ("c", 0), ("c", 1), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("c", 2)]
    # with an even number of seeds every row's mean position in time is the same
    positions = {row: [i for i, (r, _) in enumerate(ablation.run_order(["a", "b", "c"], [0, 1])) if r == row]
                 for row in "abc"}
    assert len({sum(p) for p in positions.values()}) == 1
