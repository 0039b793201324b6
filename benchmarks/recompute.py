"""What the decoder layers keep for backward: `learner.compute.gradient_checkpointing` off, full and selective (and
selective with `learner.compute.compile`), side by side on the same rows.

Each setting in a fresh process: the trainer (`Trainer.loss_gradients`, one forward and backward of every row, the
packed layout a GPU runs) on a Qwen2.5-1.5B-shaped model cut to a few layers and a small vocabulary (so that the
layers, not the head, dominate), fp32 on the CPU. Reported per setting:
- FLOPs of the forward and backward (torch.utils.flop_counter: the matrix products and attention actually run, the
  recompute included; machine-independent);
- the peak resident memory above the model's (VmHWM, reset before the measured call), and that peak less the
  gradients (fp32, every setting allocates them alike): the activations kept for backward and the temporaries;
- seconds (median of `--rounds` calls after a warm-up: on a CPU a step is its arithmetic, a GPU's ratio differs).

    python -m benchmarks.recompute --write
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.runs import in_fresh_process, print_report

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "recompute.json"
SETTINGS = {"off": ("off", False), "full": ("full", False), "selective": ("selective", False),
            "selective+compile": ("selective", True)}


def _status_mb(field: str) -> float:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as handle:  # 5: reset the peak resident size (VmHWM) to the current
        handle.write("5")


def one(name: str, layers: int, vocab: int, groups: int, n: int, response_tokens: int, rounds: int) -> dict:
    """One setting, meant to run in a fresh process."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks import gpu_trainer
    from learner.trainer import Trainer
    from services.config import load_settings

    checkpointing, compile_layers = SETTINGS[name]
    with tempfile.TemporaryDirectory() as tmp:
        model_path = gpu_trainer.build_model("1.5b", Path(tmp) / "model", num_hidden_layers=layers, vocab_size=vocab)
        rows = gpu_trainer.synthetic_groups(groups, n, vocab, (64, 64), (response_tokens, response_tokens))
        settings = load_settings("tiny-cpu", run_dir=str(Path(tmp) / "run"), model={"name_or_path": str(model_path)},
                                 sampling={"n": n}, learner={
                                     "compute": {"packing": "on",
                                                 "micro_batch_tokens": groups * n * (64 + response_tokens),
                                                 "gradient_checkpointing": checkpointing, "compile": compile_layers},
                                     "batch": {"mini_batches": 1, "epochs": 1}})
        trainer = Trainer(settings, model_path)
        trainer.loss_gradients(rows)  # warm-up (and compiling)
        _reset_peak()
        before = _status_mb("VmRSS")
        seconds = []
        for _ in range(rounds):
            started = time.perf_counter()
            trainer.loss_gradients(rows)
            seconds.append(time.perf_counter() - started)
        peak = _status_mb("VmHWM") - before
        with FlopCounterMode(display=False) as flops:
            trainer.loss_gradients(rows)
    gradients = sum(p.numel() * p.element_size() for p in trainer.model.parameters() if p.requires_grad) / 2**20
    return {"setting": name, "tokens": groups * n * (64 + response_tokens), "layers": layers, "vocab": vocab,
            "flops": flops.get_total_flops(), "peak_mb": peak, "gradients_mb": gradients,
            "threads": torch.get_num_threads(),
            "seconds": statistics.median(seconds),
            "all_seconds": seconds}


def measure(args) -> list[dict]:
    rows = []
    # Every large block from mmap, given back when freed (glibc otherwise raises its mmap threshold after the
    # warm-up's frees and keeps freed blocks in the heap: the resident size would no longer follow the live tensors).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    for name in args.settings:
        rows.append(in_fresh_process(one, name, args.layers, args.vocab, args.groups, args.n, args.response_tokens,
                                     args.rounds))
        print(rows[-1], flush=True)
    return rows


def report(rows: list[dict], command: str) -> str:
    base = next(r for r in rows if r["setting"] == "off")
    lines = [
        f"`{command}`", "",
        f"Qwen2.5-1.5B's layer shape, {base['layers']} layers, vocabulary {base['vocab']:,}, {base['tokens']:,} "
        f"tokens in one packed micro-batch, fp32 on the CPU ({base['threads']} threads), one forward and backward; "
        "each setting in a fresh process.", "",
        "| setting | GFLOP | vs off | peak MB above the model | less the gradients | vs off | s | vs off |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def activations(row):
        return row["peak_mb"] - row["gradients_mb"]

    for row in rows:
        lines.append(f"| {row['setting']} | {row['flops'] / 1e9:,.0f} | {row['flops'] / base['flops']:.2f} | "
                     f"{row['peak_mb']:,.0f} | {activations(row):,.0f} | {activations(row) / activations(base):.2f} | "
                     f"{row['seconds']:.2f} | {row['seconds'] / base['seconds']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--groups", type=int, default=1)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--response-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/recompute.json")
    args = parser.parse_args()
    if "off" not in args.settings:
        parser.error("--settings needs off (the ratios are to it)")
    rows = measure(args)
    print_report(rows, report(rows, "python -m benchmarks.recompute " + " ".join(sys.argv[1:])),
                 RESULTS if args.write else None)


if __name__ == "__main__":
    main()
