"""`dapo plan` against one GPU: the peak the plan predicts for the preset's heaviest micro-batch, and the peak the
trainer's same update reaches on the card, on the same rows (the issue's goal: within 15 %).

The plan (`learner.plan.make_plan`, one learner rank, in a process of its own that sees no GPU, as `dapo plan` runs)
runs the trainer's update under fake tensors on the host and counts the tensors alive at rank 0's peak; here the
same `Trainer` then runs that update, on the same rows
(`learner.plan.heaviest_rows`: the longest row the preset allows, packed with others up to `micro_batch_tokens`),
on the GPU: one update, then one more whose `torch.cuda.max_memory_allocated` is the measured peak (the steady
state, as the plan tracks its second update). Both uncompiled, as the plan traces (inductor fuses temporaries
away: the plan is an upper bound for compiled layers); `--compiled` also measures the compiled update beside them.
The model is a random init of the preset's model config (no download). The plan's runtime line (CUDA context,
NCCL, allocator slack) is not tensors: it is compared with what the card reserved beyond the peak, apart.

    python -m benchmarks.plan_check --preset dapo-qwen2.5-math-1.5b --write   # on a GPU
    python -m benchmarks.plan_check --preset tiny-cpu                          # the same code on a CPU, no peak
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
GOAL = 0.15  # the plan within 15 % of the measured peak


def measured_peak(settings, model_path: Path, vocab: int, compiled: bool) -> dict:
    """The trainer's update on the plan's rows, on this machine's device: peak GiB allocated and reserved over the
    second update (None without CUDA)."""
    import torch

    from learner import plan
    from learner.trainer import Trainer

    settings = settings.model_copy(deep=True)
    settings.learner.compute.compile = compiled
    trainer = Trainer(settings, model_path)
    groups, _ = plan.heaviest_rows(settings, settings.learner.compute.micro_batch_tokens, vocab)
    batch = trainer.prepare(groups)
    cuda = torch.cuda.is_available()
    trainer.update_without_reads(batch)  # AdamW's moments made; compiled graphs built
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    trainer.update_without_reads(batch)
    if not cuda:
        return {"compiled": compiled, "allocated_gib": None, "reserved_gib": None}
    torch.cuda.synchronize()
    peak = {"compiled": compiled, "allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    del trainer, batch
    torch.cuda.empty_cache()
    return peak


PLAN_IN_CHILD = """if True:
    import json, sys
    from learner import plan
    from services.config import load_settings
    preset, gpu, overrides = json.loads(sys.argv[1])
    made = plan.make_plan(load_settings(preset, **overrides), 1, gpu=gpu, learner_ranks=1)
    print(json.dumps({"bytes": made.bytes_by_category, "micro_batch_tokens": made.micro_batch_tokens,
                      "longest_row": made.longest_row}))
"""


def planned(preset: str, gpu: str, overrides: dict) -> dict:
    """`dapo plan`'s figures for one rank, made as `dapo plan` makes them: in a process of its own that sees no GPU
    (its fake tensors live on the host; the process measured here keeps no tensor of it)."""
    done = subprocess.run([sys.executable, "-c", PLAN_IN_CHILD, json.dumps([preset, gpu, overrides])],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    if done.returncode:
        raise RuntimeError(f"the plan failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def check(preset: str, gpu: str, compiled: bool) -> dict:
    import torch

    from benchmarks.gpu_trainer import build_model
    from learner import plan
    from services.config import load_settings

    with tempfile.TemporaryDirectory() as tmp:
        config = plan.model_config(load_settings(preset))
        shape = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
                 "num_hidden_layers": config.num_hidden_layers, "num_attention_heads": config.num_attention_heads,
                 "num_key_value_heads": config.num_key_value_heads, "vocab_size": config.vocab_size,
                 "tie_word_embeddings": config.tie_word_embeddings}
        model_path = build_model("tiny", Path(tmp) / "model", **shape)
        overrides = {"run_dir": str(Path(tmp) / "run"), "model": {"name_or_path": str(model_path)},
                     "learner": {"checkpoints": {"every": 0}, "compute": {"packing": "on"}}}
        made = planned(preset, gpu, overrides)
        settings = load_settings(preset, **overrides)
        rows = [measured_peak(settings, model_path, config.vocab_size, False)]
        if compiled:
            rows.append(measured_peak(settings, model_path, config.vocab_size, True))
    planned_gib = sum(made["bytes"].values()) / 2**30
    for row in rows:
        row["plan_over_measured"] = planned_gib / row["allocated_gib"] if row["allocated_gib"] else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"preset": preset, "device": device, "torch": torch.__version__, "gpu": gpu,
            "micro_batch_tokens": made["micro_batch_tokens"], "longest_row": made["longest_row"],
            "plan_gib": planned_gib, "plan_by_category_gib": {k: v / 2**30 for k, v in made["bytes"].items()},
            "plan_runtime_gib": plan.RUNTIME_GIB, "measured": rows}


def report(result: dict, command: str) -> str:
    lines = [f"`{command}`", "",
             f"{result['device']} (torch {result['torch']}), preset `{result['preset']}`: one update on the heaviest "
             f"micro-batch ({result['micro_batch_tokens']:,} tokens, longest row {result['longest_row']:,}); the "
             f"plan's tensors at the peak: {result['plan_gib']:.2f} GiB (runtime {result['plan_runtime_gib']} GiB "
             "apart).", "",
             "| update | measured peak allocated GiB | reserved GiB | plan / measured | within 15 % |",
             "| --- | ---: | ---: | ---: | --- |"]
    for row in result["measured"]:
        ratio = row["plan_over_measured"]
        lines.append(f"| {'compiled' if row['compiled'] else 'uncompiled'} | "
                     + (f"{row['allocated_gib']:.2f} | {row['reserved_gib']:.2f} | {ratio:.3f} | "
                        f"{'yes' if abs(ratio - 1) <= GOAL else 'no'} |" if ratio else "n/a (no GPU) | | | |"))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="dapo-qwen2.5-math-1.5b")
    parser.add_argument("--gpu", default="h200", help="the card the plan is made for (learner/plan.py GPUS)")
    parser.add_argument("--compiled", action="store_true", help="also measure the compiled update")
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/plan_check-<preset>.json")
    args = parser.parse_args()
    command = "python -m benchmarks.plan_check " + " ".join(sys.argv[1:])
    result = check(args.preset, args.gpu, args.compiled)
    text = report(result, command)
    if args.write:
        (RESULTS / f"plan_check-{args.preset}.json").write_text(json.dumps({**result, "report": text}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
