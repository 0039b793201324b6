"""Does asynchrony pay? Synchronous steps (max_staleness 0) against asynchronous ones (1, 2), same CPU plan.

    python -m benchmarks.async [--seeds 0 1] [--staleness 0 1 2] [--steps 12] [--set key=value ...]

Each (seed, staleness) is one fresh `dapo run` of the default preset, interleaved (seed 0: k = 0, 1, 2; seed 1:
...) so that a change in the machine's load hits every setting alike. Every service runs on its own CPUs
(cli/cores.py: on 2 CPUs, the learner on one and the generator on the other), so a synchronous step leaves one
side idle while the other works, and an asynchronous one can overlap them. Measured from each run's
metrics.jsonl: the mean step time after the first step (the first one includes the engine's warm-up), steps
per minute, the step breakdown (learner/records.py PHASES) and the minutes to reach held-out accuracy targets.
Reported into benchmarks/README.md between the `async` markers and as benchmarks/results/async.json.

Goal (issue 15): with generation and training on their own CPUs, an asynchronous step costs at most 0.6 of a
synchronous one.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.runs import ROOT, first_minute_at, replace_section, run_seeded, training_minutes

GOAL = 0.6
BREAKDOWN = ("wait", "wait_generation", "wait_verification", "train", "publish", "learner_idle", "generator_busy",
             "generator_idle")


def step_rows(metrics_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    return [r for r in rows if r.get("step", 0) > 0 and r.get("step_seconds") is not None]


def run_summary(metrics_path: Path) -> dict:
    """Mean step seconds after the first step, steps per minute, the mean breakdown and the eval curve."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    steps = step_rows(metrics_path)[1:]  # the first step carries the engines' warm-up
    if not steps:
        raise RuntimeError(f"{metrics_path}: fewer than 2 steps")
    span = steps[-1]["time"] - steps[0]["started"]
    start = next((r["time"] for r in rows if r["step"] == 0), rows[0]["time"])
    measured = [r for r in rows if r.get("eval_accuracy") is not None]
    evals = list(zip((r["step"] for r in measured), training_minutes(rows, start, measured),
                     (r["eval_accuracy"] for r in measured)))
    return {
        "step_seconds": statistics.fmean(r["step_seconds"] for r in steps),
        "steps_per_minute": 60.0 * len(steps) / span if span > 0 else None,
        "breakdown": {phase: statistics.fmean(r.get(f"{phase}_seconds") or 0.0 for r in steps) for phase in BREAKDOWN},
        "staleness": statistics.fmean(r["staleness"] or 0.0 for r in steps),
        "evals": evals,
    }


def minutes_to(evals: list[tuple[int, float, float]], target: float) -> float | None:
    return first_minute_at([m for _, m, _ in evals], [a for _, _, a in evals], target)


def report(results: dict[int, list[dict]], args: argparse.Namespace) -> str:
    sync = statistics.fmean(r["step_seconds"] for r in results[0])
    base = statistics.median(r["evals"][0][2] for runs in results.values() for r in runs if r["evals"])
    targets = [base + gain for gain in (0.05, 0.10)]
    lines = [
        f"`python -m benchmarks.async --seeds {' '.join(map(str, args.seeds))} --staleness "
        f"{' '.join(map(str, args.staleness))} --steps {args.steps}"
        + "".join(f" --set {s}" for s in args.set) + "`",
        "",
        f"Default preset, {args.steps} steps per run, seeds interleaved; each service on its own CPUs "
        "(`cli/cores.py`). Step seconds are means after the first step; the breakdown is per step, in seconds. "
        f"Targets: step-0 accuracy (median {100 * base:.1f} %) + 5 and + 10 points; with evaluations every "
        f"{max(1, args.steps // 3)} steps the minutes to a target are coarse."
        + (" One seed: the subject is the step time, which chance moves little; the accuracy columns are one run "
           "each." if len(args.seeds) == 1 else ""),
        "",
        "| max_staleness | step s (mean over seeds) | vs sync | steps/min | wait (gen / verify) | train | publish | "
        "learner idle | generators busy / idle | min to +5 | min to +10 |",
        "| ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- | --- |",
    ]
    for k, runs in sorted(results.items()):
        step = statistics.fmean(r["step_seconds"] for r in runs)
        b = {p: statistics.fmean(r["breakdown"][p] for r in runs) for p in BREAKDOWN}
        to = [[minutes_to(r["evals"], t) for r in runs] for t in targets]
        fmt = lambda values: " / ".join("-" if v is None else f"{v:.1f}" for v in values)  # noqa: E731
        lines.append(
            f"| {k} | {step:.1f} | {step / sync:.2f} | "
            f"{statistics.fmean(r['steps_per_minute'] for r in runs):.2f} | "
            f"{b['wait']:.1f} ({b['wait_generation']:.1f} / {b['wait_verification']:.1f}) | {b['train']:.1f} | "
            f"{b['publish']:.2f} | {b['learner_idle']:.1f} | {b['generator_busy']:.1f} / {b['generator_idle']:.1f} | "
            f"{fmt(to[0])} | {fmt(to[1])} |")
    train = statistics.fmean(r["breakdown"]["train"] for r in results[0])
    lines += ["", f"Goal: an asynchronous step at most {GOAL} of a synchronous one."]
    for k in sorted(k for k in results if k > 0):
        ratio = statistics.fmean(r["step_seconds"] for r in results[k]) / sync
        verdict = "met" if ratio <= GOAL else f"missed by {ratio - GOAL:.3f}"
        lines.append(f"- max_staleness {k}: **{ratio:.3f}** of a synchronous step, goal {verdict}.")
    lines += ["", f"Why, from the breakdown: a synchronous step is the wait for its groups plus the update, one after "
                  f"the other; with asynchrony the next step's groups are generated while this one trains, so the "
                  f"wait nearly vanishes and the step approaches the update alone. The update ({train:.1f} s) over "
                  f"the synchronous step ({sync:.1f} s) is the floor of the ratio on this split: "
                  f"{train / sync:.2f}. What remains above it is the wait that generation did not hide."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-async")
    parser.add_argument("--report-only", action="store_true", help="no runs: the report from results/async.json")
    args = parser.parse_args()
    if 0 not in args.staleness:
        parser.error("--staleness must include 0: the synchronous baseline")
    out = ROOT / "benchmarks" / "results" / "async.json"
    if args.report_only:
        saved = json.loads(out.read_text())
        args = argparse.Namespace(**{**vars(args), **saved["args"]})
        results = {int(k): runs for k, runs in saved["results"].items()}
        body = report(results, args)
        replace_section(ROOT / "benchmarks" / "README.md", "async", body)
        print(body)
        return
    results: dict[int, list[dict]] = {k: [] for k in args.staleness}
    eval_every = max(1, args.steps // 3)
    for seed in args.seeds:
        for k in args.staleness:
            label = f"staleness-{k}"
            run_dir = args.out / f"{label}-seed{seed}"
            # every step of one size (no batch warm-up): the mean step compares like with like
            overrides = [f"learner.batch.max_staleness={k}", f"learner.total_steps={args.steps}",
                         f"learner.eval_every={eval_every}", "learner.batch.warmup_steps=0", *args.set]
            run_seeded(label, seed, run_dir, args.preset, overrides, timeout_s=60 * 60)
            results[k].append({"seed": seed, **run_summary(run_dir / "metrics.jsonl")})
    body = report(results, args)
    out.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "out"}, "results": results},
                              indent=2, default=str))
    replace_section(ROOT / "benchmarks" / "README.md", "async", body)
    print(body)


if __name__ == "__main__":
    main()
