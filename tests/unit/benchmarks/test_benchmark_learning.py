"""benchmarks/learning.py's pure parts: gains at minutes of training across seeds, and the reference curves."""

from __future__ import annotations

import pytest

from benchmarks.learning import headline, reference, report
from benchmarks.runs import Curve


def curve(seed: int, accuracy: list[float], minutes: list[float]) -> Curve:
    return Curve(label="t", seed=seed, steps=[10 * k for k in range(len(accuracy))], minutes=minutes,
                 accuracy=accuracy, step_seconds=4.0, returncode=0)


CURVES = [
    curve(1, [0.20, 0.40, 0.55, 0.60], [0.0, 2.0, 5.0, 10.0]),
    curve(2, [0.25, 0.30, 0.50, 0.70], [0.0, 2.5, 5.5, 9.8]),
]


def test_gains_at_each_mark_are_what_each_seed_had_measured_by_then():
    text = report(CURVES, "cmd")
    assert "| 1 | 20.0 | +20.0 | +35.0 | +40.0 |" in text  # at 2, 5 and 10 minutes
    assert "| 2 | 25.0 | +0.0 | +5.0 | +45.0 |" in text  # 2.5 and 5.5 come after the marks: step 0, then 2.5's
    assert "| **median** | 22.5 | **+10.0** | **+20.0** | **+42.5** |" in text
    assert "| **worst** | 20.0 | **+0.0** | **+5.0** | **+40.0** |" in text


def test_marks_past_the_runs_are_left_out():
    short = [curve(1, [0.2, 0.3], [0.0, 3.0])]
    assert "gain at 2 min" in report(short, "cmd") and "gain at 5 min" not in report(short, "cmd")


def test_reference_is_by_step_over_the_steps_every_seed_measured():
    ref = reference([*CURVES, curve(3, [0.2, 0.3], [0.0, 2.0])], "cmd")
    assert ref["steps"] == [0, 10] and ref["seeds"] == [1, 2, 3]
    assert ref["worst"] == [0.2, 0.3] and ref["best"] == [0.25, 0.4] and ref["median"] == [0.2, 0.3]


def test_between_evaluations_the_curve_is_read_linearly():
    first = CURVES[0]
    assert first.interpolated(3.5) == pytest.approx(0.475) and first.interpolated(12.0) == 0.60
    assert "| median, between evaluations¹ | | +12.0 | +28.3 | +42.5 |" in report(CURVES, "cmd")


def test_headline_states_median_and_worst_and_judges_each_goal():
    text = headline(CURVES, "cmd")
    assert "| median of 2 seeds | **+10.0** | **+20.0** | **+42.5** |" in text
    assert "| worst seed | **+0.0** | **+5.0** | **+40.0** |" in text
    assert "2 cores" in text and "4.0 to 4.0 s a step" in text
    assert "median +35 at 5 minutes: +20.0, missed by 15.0" in text
    assert "worst +30 at 5 minutes: +5.0, missed by 25.0" in text
    assert "median +40 at 10 minutes: +42.5, met" in text
