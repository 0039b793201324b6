"""benchmarks/recompute.py: the report of FLOPs, activation memory and seconds by checkpointing setting."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.recompute import report  # noqa: E402


def row(setting, gflop, peak_mb, seconds):
    return {"setting": setting, "tokens": 2560, "layers": 2, "vocab": 4096, "flops": gflop * 1e9, "peak_mb": peak_mb,
            "gradients_mb": 400.0, "seconds": seconds, "threads": 2}


def test_report_gives_each_setting_against_off_with_the_gradients_taken_out():
    text = report([row("off", 1500, 1400, 10.0), row("full", 1800, 600, 12.5), row("selective", 1500, 1000, 10.5)],
                  "python -m benchmarks.recompute")
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    assert lines["| off"].endswith("| 1,500 | 1.00 | 1,400 | 1,000 | 1.00 | 10.00 | 1.00 |")
    assert lines["| full"].endswith("| 1,800 | 1.20 | 600 | 200 | 0.20 | 12.50 | 1.25 |")
    assert lines["| selective"].endswith("| 1,500 | 1.00 | 1,000 | 600 | 0.60 | 10.50 | 1.05 |")
    assert "2 layers, vocabulary 4,096, 2,560 tokens" in text and "(2 threads)" in text
