"""benchmarks/trainer.py: the report of one update's seconds by micro-batch budget and prompt layout."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.trainer import report  # noqa: E402


def row(budget, shared, seconds, computed):
    return {"micro_batch_tokens": budget, "share_prompt_pass": shared, "seconds": seconds, "forward": seconds / 2,
            "backward": seconds / 2, "optimizer": 0.01, "computed": computed, "real": 1000}


def test_report_marks_the_preset_and_compares_with_the_slowest_setting():
    result = {"rows": [row(32768, False, 6.0, 1070), row(4096, True, 2.0, 490)], "groups": 32, "samples": 512,
              "response_tokens": 512 * 24, "prompt_tokens": 36, "default": [4096, True], "load": 1.0}
    text = report(result, "python -m benchmarks.trainer")
    lines = text.splitlines()
    slow = next(line for line in lines if line.startswith("| 32,768 |"))
    fast = next(line for line in lines if line.startswith("| **4,096** |"))
    assert "in every row" in slow and "| 1.07 |" in slow and "| 1.00x |" in slow
    assert "shared pass" in fast and "| 0.49 |" in fast and "| 3.00x |" in fast
    assert "24.0 response tokens on average after a 36-token prompt" in text
