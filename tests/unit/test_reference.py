"""A run's held-out curve against the shipped model's reference curves (cli/report.py), step by step."""

from __future__ import annotations

from cli.report import against_reference

REFERENCE = {"command": "python -m benchmarks.learning ...", "seeds": [11, 12, 13],
             "steps": [0, 10, 20], "worst": [0.22, 0.35, 0.45], "median": [0.24, 0.38, 0.50],
             "best": [0.26, 0.41, 0.55]}


def rows(*points: tuple[int, float]) -> list[dict]:
    return [{"step": step, "eval_accuracy": accuracy} for step, accuracy in points] + [{"step": 25}]


def test_the_last_step_both_measured_decides():
    result = against_reference(rows((0, 0.2), (10, 0.30), (20, 0.47)), REFERENCE)
    assert result["step"] == 20 and result["verdict"].startswith("within")


def test_a_run_below_the_worst_seed_says_so_plainly():
    result = against_reference(rows((0, 0.2), (10, 0.36), (20, 0.40)), REFERENCE)
    assert result["verdict"].startswith("below: 40.0% at step 20 against 45.0%")
    assert "same base model" in result["verdict"]


def test_the_tolerance_covers_evaluation_noise():
    assert against_reference(rows((20, 0.425)), REFERENCE)["verdict"].startswith("within")
    assert against_reference(rows((20, 0.60)), REFERENCE)["verdict"].startswith("above")


def test_no_shared_step_is_no_verdict():
    result = against_reference(rows((0, 0.2), (15, 0.5)), REFERENCE)
    assert "no evaluation" in result["verdict"] and "step" not in result


def test_the_summary_reads_the_last_step_from_the_step_rows_not_a_redone_evaluations_line():
    """A run stopped during its final evaluation and resumed writes that evaluation on a line of its own."""
    from cli.report import summary

    rows = [{"step": 0, "eval_accuracy": 0.1, "time": 0.0},
            {"step": 1, "groups_trained": 4, "reward_all": 0.25, "world_size": 2, "time": 5.0},
            {"step": 1, "version": 1, "eval_accuracy": 0.3, "time": 9.0}]
    result = summary(rows)
    assert result["reward_all_last"] == 0.25 and result["learner_world_size"] == 2
    assert result["eval_accuracy_last"] == 0.3 and result["steps"] == 1


def test_dapo_report_writes_the_plots_and_summary_of_any_run_folder_keeping_what_only_the_launcher_knew(
        tmp_path, capsys):
    """A run a deployment runs (or one still going) gets the report `dapo run` writes at its end."""
    import json

    from cli.main import main

    assert main(["report", "--set", f"run_dir={tmp_path}"]) == 65  # nothing recorded: said, not a traceback
    assert "no step recorded" in capsys.readouterr().err
    rows = [{"step": 0, "eval_accuracy": 0.1, "time": 0.0},
            {"step": 1, "groups_trained": 4, "reward_all": 0.25, "time": 5.0},
            {"step": 2, "groups_trained": 4, "reward_all": 0.5, "time": 9.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (tmp_path / "summary.json").write_text(json.dumps({"cpu_seconds": {"learner-0": 12.0}, "steps": 1}))
    assert main(["report", "--set", f"run_dir={tmp_path}"]) == 0
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["steps"] == 2 and written["cpu_seconds"] == {"learner-0": 12.0}
    assert any((tmp_path / "plots").iterdir())
