"""benchmarks/bases.py's pure parts: the per-base report, its goals' verdict, and results that accumulate."""

from __future__ import annotations

from benchmarks import bases
from benchmarks.runs import Curve


def curve(seed: int, minutes, accuracy, label="project") -> Curve:
    return Curve(label, seed, list(range(len(minutes))), list(minutes), list(accuracy), 1.0, 0)


def test_report_puts_both_systems_side_by_side_and_judges_each_base_by_its_worst_seed():
    runs = {
        "weak": {"project": [curve(21, [0, 2, 5], [0.18, 0.30, 0.45]), curve(22, [0, 2, 5], [0.17, 0.25, 0.35])],
                 "trl-small": [curve(21, [0, 2, 5], [0.16, 0.30, 0.38], "trl-small"),
                               curve(22, [0, 2, 5], [0.17, 0.30, 0.40], "trl-small")]},
    }
    text = bases.report(runs, "cmd")
    assert "| weak | tiny.seed=1 tiny.warmup_target_accuracy=0.2 | 21 | 18.0 / 16.0 | +12.0 / +27.0 | +14.0 / +22.0 | +5.0 |" in text  # noqa: E501
    assert "| 22 | 17.0 / 17.0 | +8.0 / +18.0 | +13.0 / +23.0 | -5.0 |" in text
    assert "**+22.5 / +18.0** at 5" in text  # median and worst of the project's gains at 5 minutes
    assert "weak: worst seed +18.0 at 5 minutes (missed), ahead of TRL on 1 of 2 seeds" in text


def test_a_gain_is_what_the_run_had_measured_by_the_minute():
    c = curve(0, [0, 1.5, 4.0, 6.0], [0.2, 0.3, 0.4, 0.5])
    assert c.gain(2.0) == 0.3 - 0.2
    assert abs(c.gain(5.0) - 0.2) < 1e-12  # the 6-minute evaluation is not counted at 5


def test_results_round_trip_so_a_later_command_only_adds_missing_seeds(tmp_path):
    runs = {"mid": {"project": [curve(22, [0, 1], [0.2, 0.3]), curve(21, [0, 1], [0.2, 0.25])]}}
    bases.save("cmd", runs, tmp_path / "bases.json")
    command, back = bases.load(tmp_path / "bases.json")
    assert command == "cmd"
    assert [c.seed for c in back["mid"]["project"]] == [21, 22]
    assert back["mid"]["project"][1].accuracy == [0.2, 0.3]
    assert bases.load(tmp_path / "absent.json") == ("", {})
