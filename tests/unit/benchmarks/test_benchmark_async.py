"""benchmarks/async.py's arithmetic on a synthetic metrics.jsonl (the runs themselves are the benchmark)."""

from __future__ import annotations

import argparse
import importlib
import json

bench = importlib.import_module("benchmarks.async")  # `async` is a keyword: no import statement can name it


def write_run(path, step_seconds, wait, accuracy):
    rows = [{"step": 0, "time": 0.0, "eval_accuracy": 0.2}]
    t = 0.0
    for step, seconds in enumerate(step_seconds, start=1):
        rows.append({"step": step, "started": t, "time": t + seconds, "step_seconds": seconds, "staleness": 0.0,
                     "wait_seconds": wait, "train_seconds": seconds - wait,
                     "eval_accuracy": accuracy if step == len(step_seconds) else None})
        t += seconds
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_first_step_is_left_out_and_the_ratio_is_against_sync(tmp_path):
    sync = bench.run_summary(write_run(tmp_path / "s.jsonl", [60.0, 20.0, 20.0], 10.0, 0.35))
    fast = bench.run_summary(write_run(tmp_path / "a.jsonl", [60.0, 11.0, 11.0], 1.0, 0.36))
    assert sync["step_seconds"] == 20.0 and sync["breakdown"]["wait"] == 10.0
    assert sync["steps_per_minute"] == 3.0
    assert bench.minutes_to(sync["evals"], 0.3) == 100 / 60 and bench.minutes_to(sync["evals"], 0.5) is None
    args = argparse.Namespace(seeds=[0], staleness=[0, 1], steps=3, set=[])
    text = bench.report({0: [sync], 1: [fast]}, args)
    assert "**0.550** of a synchronous step, goal met" in text
    assert "floor of the ratio on this split: 0.50" in text
