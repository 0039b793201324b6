"""Batch shape and update frequency of the tiny default, on the peer benchmark's clock.

    python -m benchmarks.shapes [--shapes 32x2x2 32x4x2 16x2x2 ...] [--seeds 0 1] [--minutes 2.5]

A shape is `PxMxE[:lr][+key=value...]`: P prompt groups per rollout step (`learner.batch.prompts_per_step`, n responses
each), cut into M mini-batches (`learner.batch.mini_batches`: M optimizer steps per pass), E passes
(`learner.batch.epochs`), optionally a learning rate (`learner.optimizer.lr`) and any other settings of that run only
(`32x4x2+learner.batch.oversample_margin=1.5`: the same shape with another push margin, side by side with `32x4x2`).
Every shape runs `dapo run` of the preset for `--minutes` of training, seeded and timed exactly as the `project`
system of benchmarks/peer_trl.py (so its minutes to a target compare with the peer's table), with evaluations
every `--eval-groups` trained groups (eval_every = eval_groups / P: the same training time between evaluations
whatever the shape; every step of P groups: the preset's batch warm-up is off unless a shape sets
`+learner.batch.warmup_steps=W`). Shapes are interleaved per seed, so a change in the machine's load hits
every shape alike.

Measured per shape: the step, the learner's wait for groups in it and its refill rounds, optimizer steps per
minute, completions per optimizer step, and the minutes of training to each held-out target of the peer benchmark
(median over seeds; a seed that never gets there counts as never). Reported into benchmarks/README.md between the
`shapes` markers and benchmarks/results/shapes.json (`--section` names another pair, as in benchmarks/peer_trl.py,
so a second sweep keeps the first one's report).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peer_trl import TARGETS, fmt, median_minutes, timed_project_run
from benchmarks.runs import ROOT, Curve, replace_section


@dataclass(frozen=True)
class Shape:
    prompts: int
    mini_batches: int
    epochs: int
    lr: float | None = None
    settings: tuple[str, ...] = ()  # further key=value overrides of this shape's runs

    @classmethod
    def parse(cls, text: str) -> Shape:
        head, *settings = text.split("+")
        dims, _, lr = head.partition(":")
        try:
            prompts, mini_batches, epochs = (int(x) for x in dims.split("x"))
            if any("=" not in item for item in settings):
                raise ValueError
            return cls(prompts, mini_batches, epochs, float(lr) if lr else None, tuple(settings))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"shape {text!r}: expected PxMxE[:lr][+key=value...], "
                "e.g. 16x2x2:3e-4+learner.batch.oversample_margin=1.5"
            ) from None

    @property
    def label(self) -> str:
        return (f"{self.prompts}x{self.mini_batches}x{self.epochs}" + (f":{self.lr:g}" if self.lr else "")
                + "".join(f"+{item}" for item in self.settings))

    @property
    def run_name(self) -> str:
        return re.sub(r"[^A-Za-z0-9._=-]+", "-", self.label.replace(":", "-lr"))

    def samples(self, preset_n: int) -> int:
        """Responses per prompt group: the shape's own `sampling.n`, else the preset's."""
        own = [item.split("=", 1)[1] for item in self.settings if item.startswith("sampling.n=")]
        return int(own[-1]) if own else preset_n

    def overrides(self, eval_groups: int) -> list[str]:
        # P groups from the first step (no batch warm-up, unless the shape sets one): evaluations at equal groups
        sets = [f"learner.batch.prompts_per_step={self.prompts}", f"learner.batch.mini_batches={self.mini_batches}",
                f"learner.batch.epochs={self.epochs}",
                f"learner.eval_every={max(1, round(eval_groups / self.prompts))}",
                "learner.batch.warmup_steps=0"]
        return sets + ([f"learner.optimizer.lr={self.lr}"] if self.lr else []) + list(self.settings)


def report(shapes: list[Shape], results: dict[str, list[Curve]], n: int, command: str) -> str:
    lines = [f"`{command}`", "",
             "Minutes of training (evaluations excluded) to each held-out accuracy, median over seeds; "
             "the same targets and clock as the peer benchmark:", "",
             "| shape P x M x E | completions per optimizer step | step (s) | wait (s) | refills / step | "
             "optimizer steps / min | start | end | " + " | ".join(f"{100 * t:.0f} %" for t in TARGETS) + " |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in TARGETS) + " |"]
    for shape in shapes:
        curves = results[shape.label]
        step = statistics.fmean(c.step_seconds for c in curves)
        lines.append(
            f"| {shape.label} | {shape.prompts * shape.samples(n) // shape.mini_batches} | {step:.2f} | "
            f"{statistics.fmean(c.wait_seconds for c in curves):.2f} | "
            f"{statistics.fmean(c.refills for c in curves):.2f} | "
            f"{60 * shape.mini_batches * shape.epochs / step:.0f} | "
            f"{100 * statistics.median(c.base for c in curves):.1f} | "
            f"{100 * statistics.median(c.accuracy[-1] for c in curves):.1f} | "
            + " | ".join(fmt(median_minutes(curves, t)) for t in TARGETS) + " |")
    lines += ["", "Per seed (minutes to each target):", "",
              "| shape | seed | step (s) | wait (s) | refills / step | start | end | evaluations | "
              + " | ".join(f"{100 * t:.0f} %" for t in TARGETS) + " |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in TARGETS) + " |"]
    for shape in shapes:
        for c in results[shape.label]:
            lines.append(f"| {shape.label} | {c.seed} | {c.step_seconds:.2f} | {c.wait_seconds:.2f} | "
                         f"{c.refills:.2f} | {100 * c.base:.1f} | {100 * c.accuracy[-1]:.1f} | "
                         f"{len(c.steps)} | " + " | ".join(fmt(c.minutes_to(t)) for t in TARGETS) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Shape.parse, nargs="+",
                        default=[Shape.parse(s) for s in ("32x2x2", "32x4x2", "16x2x2", "16x4x2", "8x2x2")])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--minutes", type=float, default=2.5, help="training minutes of every run")
    parser.add_argument("--eval-groups", type=int, default=96, help="trained groups between evaluations")
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="override for every shape")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-shapes")
    parser.add_argument("--reuse", action="store_true", help="read back the runs that already finished in --out")
    parser.add_argument("--section", default="shapes",
                        help="README markers and results/<section>.json to write (another sweep keeps the first's)")
    args = parser.parse_args()

    from services.config import load_settings

    n = load_settings(args.preset).sampling.n
    results: dict[str, list[Curve]] = {s.label: [] for s in args.shapes}
    for seed in args.seeds:  # interleaved
        for shape in args.shapes:
            run_dir = args.out / f"{shape.run_name}-seed{seed}"
            results[shape.label].append(timed_project_run(
                shape.label, seed, run_dir, args.preset, args.minutes,
                [*shape.overrides(args.eval_groups), *args.overrides], args.reuse))
    command = (f"python -m benchmarks.shapes --shapes {' '.join(s.label for s in args.shapes)} "
               f"--seeds {' '.join(map(str, args.seeds))} --minutes {args.minutes:g} --eval-groups {args.eval_groups}"
               f" --preset {args.preset}" + "".join(f" --set {o}" for o in args.overrides)
               + (f" --section {args.section}" if args.section != "shapes" else ""))
    (ROOT / "benchmarks" / "results" / f"{args.section.replace('-', '_')}.json").write_text(json.dumps(
        {"command": command, "runs": {label: [c.to_json() for c in cs] for label, cs in results.items()}}, indent=1))
    body = report(args.shapes, results, n, command)
    replace_section(ROOT / "benchmarks" / "README.md", args.section, body)
    print(body)


if __name__ == "__main__":
    main()
