"""benchmarks/shapes.py's pure parts: parsing a shape, its overrides, and the report."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import shapes
from benchmarks.runs import Curve
from cli.main import parse_overrides
from services.config import load_settings


def test_a_shape_becomes_the_learner_overrides_with_evaluations_at_equal_trained_groups():
    shape = shapes.Shape.parse("16x4x2:1e-4")
    assert (shape.prompts, shape.mini_batches, shape.epochs, shape.lr) == (16, 4, 2, 1e-4)
    sets = shape.overrides(eval_groups=96)
    assert "learner.eval_every=6" in sets and "learner.optimizer.lr=0.0001" in sets
    assert "learner.eval_every=3" in shapes.Shape.parse("32x2x2").overrides(96)
    settings = load_settings("tiny-cpu", **parse_overrides(sets))  # the overrides are valid settings
    assert (settings.learner.batch.prompts_per_step, settings.learner.batch.mini_batches,
            settings.learner.batch.epochs) == (16, 4, 2)
    assert settings.learner.batch.warmup_steps == 0  # P groups from the first step
    warm = shapes.Shape.parse("16x4x2+learner.batch.warmup_steps=4").overrides(96)
    assert load_settings("tiny-cpu", **parse_overrides(warm)).learner.batch.warmup_steps == 4


def test_a_shape_carries_further_settings_of_its_own_runs():
    shape = shapes.Shape.parse("32x4x2:1.5e-4+learner.batch.oversample_margin=1.5")
    assert shape.label == "32x4x2:0.00015+learner.batch.oversample_margin=1.5"
    assert shape.run_name == "32x4x2-lr0.00015-learner.batch.oversample_margin=1.5"
    sets = shape.overrides(eval_groups=96)
    assert sets[-2:] == ["learner.optimizer.lr=0.00015", "learner.batch.oversample_margin=1.5"]
    assert load_settings("tiny-cpu", **parse_overrides(sets)).learner.batch.oversample_margin == 1.5
    assert shapes.Shape.parse("32x4x2").label != shape.label  # side by side: two rows, two run directories
    assert shape.samples(16) == 16 and shapes.Shape.parse("64x4x2+sampling.n=8").samples(16) == 8  # group size


@pytest.mark.parametrize("bad", ["16x4", "16x4x2:fast", "axbxc", "16x4x2+learner.batch.oversample_margin"])
def test_a_malformed_shape_is_refused_with_the_expected_form(bad):
    with pytest.raises(argparse.ArgumentTypeError, match="PxMxE"):
        shapes.Shape.parse(bad)


def test_report_gives_each_shape_its_update_rate_and_minutes_to_each_target(monkeypatch):
    monkeypatch.setattr(shapes, "TARGETS", (0.30, 0.35))
    small, big = shapes.Shape.parse("16x2x2"), shapes.Shape.parse("32x2x2")
    results = {
        "16x2x2": [Curve("16x2x2", 0, [0, 6], [0.0, 0.5], [0.2, 0.31], 1.5, 0, wait_seconds=0.4, refills=0.25)],
        "32x2x2": [Curve("32x2x2", 0, [0, 3], [0.0, 0.5], [0.2, 0.25], 3.0, 0)],
    }
    text = shapes.report([small, big], results, n=16, command="cmd")
    assert "| 16x2x2 | 128 | 1.50 | 0.40 | 0.25 | 160 | 20.0 | 31.0 | 0.50 | never |" in text
    assert "| 32x2x2 | 256 | 3.00 | 0.00 | 0.00 | 80 | 20.0 | 25.0 | never | never |" in text
    assert "| 16x2x2 | 0 | 1.50 | 0.40 | 0.25 | 20.0 | 31.0 | 2 | 0.50 | never |" in text
