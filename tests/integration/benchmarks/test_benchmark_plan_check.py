"""benchmarks/plan_check.py runs end to end (on a CPU here, with the tiny preset: the same code the device run
takes, without a peak to measure) and reports the plan against the measured peak."""

from __future__ import annotations

from benchmarks.plan_check import check, report


def test_the_check_plans_and_runs_the_same_update_and_reports_it():
    result = check("tiny-cpu", "h100", compiled=False)
    assert result["plan_gib"] > 0 and result["plan_by_category_gib"]["activations"] > 0
    assert result["longest_row"] <= result["micro_batch_tokens"]
    assert [row["compiled"] for row in result["measured"]] == [False]
    assert result["measured"][0]["allocated_gib"] is None  # no CUDA here: the update ran, nothing to measure
    assert "| uncompiled | n/a (no GPU)" in report(result, "python -m benchmarks.plan_check --preset tiny-cpu")


def test_the_report_says_whether_the_plan_is_within_15_percent():
    def row(compiled: bool, allocated: float, reserved: float) -> dict:
        return {"compiled": compiled, "allocated_gib": allocated, "reserved_gib": reserved,
                "plan_over_measured": 40 / allocated}

    result = {"device": "NVIDIA H200", "torch": "2.9", "preset": "p", "micro_batch_tokens": 16384,
              "longest_row": 4096, "plan_gib": 40.0, "plan_runtime_gib": 2.0,
              "measured": [row(False, 36.0, 38.0), row(True, 30.0, 31.0)]}
    text = report(result, "cmd")
    assert "| uncompiled | 36.00 | 38.00 | 1.111 | yes |" in text
    assert "| compiled | 30.00 | 31.00 | 1.333 | no |" in text
