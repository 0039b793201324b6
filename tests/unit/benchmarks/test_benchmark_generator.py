"""benchmarks/generator.py's pure pieces: batch fill from samples, HF token counts, the report."""

from __future__ import annotations

import torch

from benchmarks.generator import PATHS, batch_fill, generated_lengths, report


def test_batch_fill_counts_the_drained_tail_only_in_the_whole_run_figure():
    # 10 tasks, 4 per batch: full while tasks wait, then the tail drains (2, then 1 left in flight)
    samples = [(0, 0), (4, 0), (4, 4), (4, 6), (2, 8), (1, 9)]
    waiting, whole = batch_fill(samples, total=10, tasks_per_batch=4)
    assert waiting == (0 + 1 + 1) / 3  # the first sample (nothing admitted yet) counts against the worker
    assert whole == (0 + 4 + 4 + 4 + 2 + 1) / 4 / 6
    assert batch_fill([], total=10, tasks_per_batch=4) == (0.0, 0.0)


def test_generated_lengths_stop_at_and_include_the_first_stop_id():
    rows = torch.tensor([[5, 6, 2, 0, 0], [5, 6, 7, 8, 9], [3, 0, 0, 0, 0], [1, 4, 1, 2, 0]])
    assert generated_lengths(rows, [2, 3]).tolist() == [3, 5, 1, 4]


def _result(service: float) -> dict:
    rounds = [
        {"first": PATHS[k], "raw": 5000.0, "service": service, "hf": 10000.0, "hf_plain": 12500.0, "fill": 0.98,
         "fill_all": 0.8, "tokens": {path: 1000 + k for path in PATHS}}
        for k in range(3)
    ]
    sweep = {256: {"raw": 3000.0, "service": {8: {"rate": 2000.0, "fill": 0.99}, 64: {"rate": 2900.0, "fill": 0.97}}},
             4096: {"raw": 5000.0, "service": {8: {"rate": 2100.0, "fill": 0.99}, 64: {"rate": 4900.0, "fill": 0.96}}}}
    setup = {"model": "Qwen2, 1 parameters", "vllm": "0", "torch": "0", "transformers": "0", "threads": 2, "cores": 2,
             "load": 1.0, "prompts": 256, "n": 16, "max_tokens": 64, "tasks_per_batch": 64, "max_num_seqs": 1024,
             "max_num_batched_tokens": 8192, "block_size": 128}
    return {"command": "python benchmarks/generator.py", "setup": setup, "rounds": rounds, "sweep": sweep,
            "tasks_per_batch": [8, 64]}


def test_report_states_each_goal_and_how_far_the_result_is():
    text = report(_result(service=4000.0))
    assert "| **median** | | **5,000** | **4,000** | **10,000** | **12,500** | **0.800** | **0.50** | **0.98** |" in text  # noqa: E501
    assert "Measured **0.800x** (median of the per-round ratios): short by 0.15 (84% of the goal)." in text
    assert "Raw vLLM **0.50x**, the service **0.40x**: short by 0.60 (40% of the goal)." in text
    assert "| 4096 | 5,000 | 2,100 (0.99) | 4,900 (0.96) |" in text
    assert "Fastest service cell: `max_num_seqs` 4096, `tasks_per_batch` 64 (4,900 tok/s)." in text
    assert "Measured **1.000x** (median of the per-round ratios): goal met." in report(_result(service=5000.0))
