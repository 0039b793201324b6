"""Learning that reproduces: the default `dapo run` over several seeds, median and worst held-out curves.

    python -m benchmarks.learning --seeds 16 17 18 19 20 --minutes 10 --reference --headline   # the README headline
    python -m benchmarks.learning --seeds 11 --minutes 5 --label base-weak \
        --set tiny.seed=1 --set tiny.warmup_target_accuracy=0.2                            # another base model
(the three other bases against TRL on each, over seeds: benchmarks/bases.py)

Each seed is one fresh `dapo run` (one at a time: they would share the cores), stopped after `--minutes` of
training (evaluations excluded) or `--steps`, whichever comes first. Reported, into benchmarks/README.md between
the `<label>` markers, and as benchmarks/results/<label>.{json,png}:
  * per seed: the held-out accuracy it started from (step 0), its gain at 2, 5 and 10 minutes of training, where
    it ended, its best, the mean step time, and its largest fall between two evaluations after step 10 (the
    stability figure: goal at most 5 points);
  * across seeds: the median and the worst gain at each mark, and accuracy against minutes and against steps;
  * `--reference`: the curves by step (worst, median, best) written beside the shipped model
    (services/tiny_model/reference.json), which every `dapo run` from that model is compared with in its summary;
  * `--headline`: the median and worst gains, the machine, the step time and the goals' verdict written into the
    top README.md between the `headline` markers.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.runs import ROOT, Curve, grid, machine, median_and_worst, read_curve, replace_section, run_seeded

STABILITY_GOAL = 0.05  # no seed loses more than 5 points between two evaluations after step 10
MARKS = (2.0, 5.0, 10.0)  # minutes of training at which every seed's gain is reported
# issue 36's goals on the shipped base: minute -> (median gain, worst seed's gain); None where no goal is set
GOALS = {5.0: (0.35, 0.30), 10.0: (0.40, None)}


def plot(curves: list[Curve], minutes: list[float], median: list[float], worst: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for c in curves:
        ax.plot(c.minutes, [100 * a for a in c.accuracy], color="grey", alpha=0.35, lw=1, marker=".")
    ax.step(minutes, [100 * v for v in median], where="post", lw=2, label="median over seeds")
    ax.step(minutes, [100 * v for v in worst], where="post", lw=2, ls="--", label="worst seed")
    ax.set_xlabel("minutes of training (after the step-0 evaluation)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title(f"tiny-cpu, {len(curves)} seeds")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def marks_within(curves: list[Curve]) -> list[float]:
    """The MARKS the runs lasted to (half a minute of slack: a run stops at the first step past its limit)."""
    return [m for m in MARKS if m <= max(c.minutes[-1] for c in curves) + 0.5]


def report(curves: list[Curve], command: str) -> str:
    minutes = grid(curves, points=7)
    median, worst = median_and_worst(curves, minutes)
    drops = [c.max_drop(after_step=10) for c in curves]
    common_steps = sorted(set.intersection(*(set(c.steps) for c in curves)))
    by_step = {k: [c.accuracy[c.steps.index(k)] for c in curves] for k in common_steps}
    marks = marks_within(curves)
    gains_at = {m: [c.gain(m) for c in curves] for m in marks}
    lines = [
        f"`{command}`, on {machine()}. Gains are in points of held-out accuracy over the run's own step 0, at "
        "minutes of training (evaluations excluded): what each run had measured by then.", "",
        "| seed | start (step 0) | " + " | ".join(f"gain at {m:g} min" for m in marks)
        + " | end | best | steps | minutes | mean step (s) | largest fall after step 10 |",
        "| --- | ---: |" + " ---: |" * len(marks) + " ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for i, (c, drop) in enumerate(zip(curves, drops)):
        lines.append(
            f"| {c.seed} | {100 * c.base:.1f} | " + " | ".join(f"{100 * gains_at[m][i]:+.1f}" for m in marks)
            + f" | {100 * c.accuracy[-1]:.1f} | {100 * max(c.accuracy):.1f} | {c.steps[-1]} | {c.minutes[-1]:.1f} | "
            f"{c.step_seconds:.1f} | {100 * drop:.1f} |"
        )
    lines += [
        f"| **median** | {100 * statistics.median(c.base for c in curves):.1f} | "
        + " | ".join(f"**{100 * statistics.median(gains_at[m]):+.1f}**" for m in marks)
        + f" | {100 * statistics.median(c.accuracy[-1] for c in curves):.1f} | | | | "
        f"{statistics.fmean(c.step_seconds for c in curves):.1f} | |",
        f"| **worst** | {100 * min(c.base for c in curves):.1f} | "
        + " | ".join(f"**{100 * min(gains_at[m]):+.1f}**" for m in marks)
        + f" | {100 * min(c.accuracy[-1] for c in curves):.1f} | | | | | {100 * max(drops):.1f} |",
        "| median, between evaluations¹ | | " + " | ".join(
            f"{100 * statistics.median(c.gain(m, between=True) for c in curves):+.1f}" for m in marks)
        + " | | | | | | |",
        "| worst, between evaluations¹ | | " + " | ".join(
            f"{100 * min(c.gain(m, between=True) for c in curves):+.1f}" for m in marks) + " | | | | | | |",
        "", "¹ The rows above count what each run had measured by the minute (its last evaluation at or before it, up "
        "to one evaluation interval back); these read the curve at the minute, linear between the evaluations on "
        "either side.",
        "", "Held-out accuracy (%) against minutes of training, across seeds:", "",
        "| minute | " + " | ".join(f"{m:.1f}" for m in minutes) + " |",
        "| --- |" + " ---: |" * len(minutes),
        "| median | " + " | ".join(f"{100 * v:.1f}" for v in median) + " |",
        "| worst | " + " | ".join(f"{100 * v:.1f}" for v in worst) + " |",
        "", "Held-out accuracy (%) against training steps, across seeds (independent of the machine's load):", "",
        "| step | " + " | ".join(str(step) for step in common_steps) + " |",
        "| --- |" + " ---: |" * len(common_steps),
        "| median | " + " | ".join(f"{100 * statistics.median(by_step[k]):.1f}" for k in common_steps) + " |",
        "| worst | " + " | ".join(f"{100 * min(by_step[k]):.1f}" for k in common_steps) + " |",
        "",
        f"Stability goal: no seed falls more than {100 * STABILITY_GOAL:.0f} points between two evaluations after "
        f"step 10. Measured: worst fall {100 * max(drops):.1f} points "
        f"({'met' if max(drops) <= STABILITY_GOAL else 'missed'}).",
    ]
    return "\n".join(lines)


def headline(curves: list[Curve], command: str) -> str:
    """The top README's claim: median and worst gains at each mark, read both ways, and the goals' verdict."""
    marks = marks_within(curves)
    by_eval = {m: [c.gain(m) for c in curves] for m in marks}
    between = {m: [c.gain(m, between=True) for c in curves] for m in marks}
    seconds = [c.step_seconds for c in curves]
    drops = [c.max_drop(after_step=10) for c in curves]
    lines = [
        f"`{command}`: {len(curves)} fresh `dapo run`s of the default, one at a time, on {machine()} "
        f"({min(seconds):.1f} to {max(seconds):.1f} s a step), each stopped after {max(marks):g} minutes of training "
        "(evaluations excluded). Gain over the run's own step 0, in points of held-out accuracy:", "",
        "| gain over step 0, points | " + " | ".join(f"{m:g} min" for m in marks) + " |",
        "| --- |" + " ---: |" * len(marks),
        f"| median of {len(curves)} seeds | " + " | ".join(f"**{100 * statistics.median(by_eval[m]):+.1f}**"
                                                           for m in marks) + " |",
        "| worst seed | " + " | ".join(f"**{100 * min(by_eval[m]):+.1f}**" for m in marks) + " |",
        "| median / worst, read between evaluations | " + " | ".join(
            f"{100 * statistics.median(between[m]):+.1f} / {100 * min(between[m]):+.1f}" for m in marks) + " |",
        "",
        f"Every seed went from {100 * min(c.base for c in curves):.0f} to {100 * max(c.base for c in curves):.0f} % "
        f"to {100 * min(c.accuracy[-1] for c in curves):.0f} to {100 * max(c.accuracy[-1] for c in curves):.0f} % "
        f"({min(c.steps[-1] for c in curves)} to {max(c.steps[-1] for c in curves)} steps); the largest fall "
        f"between two evaluations after step 10 was {100 * max(drops):.1f} points (goal {100 * STABILITY_GOAL:.0f}).",
    ]
    verdicts = []
    for minute, (median_goal, worst_goal) in GOALS.items():
        values = by_eval.get(minute)
        if values is None:
            continue
        for name, goal, got in (("median", median_goal, statistics.median(values)), ("worst", worst_goal, min(values))):
            if goal is None:
                continue
            verdicts.append(f"{name} {100 * goal:+.0f} at {minute:g} minutes: {100 * got:+.1f}, "
                            + ("met" if got >= goal - 1e-9 else f"missed by {100 * (goal - got):.1f}"))
    if verdicts:
        lines[-1] += " Goals (the last evaluation at or before the minute): " + "; ".join(verdicts) + "."
    return "\n".join(lines)


def reference(curves: list[Curve], command: str) -> dict:
    """The curves by step across seeds (machine-independent), for `dapo run` summaries to be held to."""
    common = sorted(set.intersection(*(set(c.steps) for c in curves)))
    by_step = [[c.accuracy[c.steps.index(k)] for c in curves] for k in common]
    return {"command": command, "seeds": [c.seed for c in curves], "steps": common,
            "worst": [min(v) for v in by_step], "median": [statistics.median(v) for v in by_step],
            "best": [max(v) for v in by_step], "machine": machine(),
            "minutes_per_step": statistics.fmean(c.minutes[-1] / max(1, c.steps[-1]) for c in curves)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=1000, help="learner.total_steps of each run")
    parser.add_argument("--minutes", type=float, default=10.0, help="learner.time_limit_minutes of each run")
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--set", action="append", default=[], help="extra override for every run (key=value)")
    parser.add_argument("--label", default="learning", help="names the run folders and the README section")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-learning")
    parser.add_argument("--timeout-minutes", type=float, default=60.0, help="per run")
    parser.add_argument("--report-only", action="store_true", help="rewrite the report from the runs' metrics")
    parser.add_argument("--reference", action="store_true",
                        help="write the curves by step beside the shipped model (runs from the shipped model only)")
    parser.add_argument("--headline", action="store_true", help="write the top README's headline from these runs")
    args = parser.parse_args()

    overrides = [f"learner.total_steps={args.steps}", f"learner.time_limit_minutes={args.minutes}", *args.set]
    folders = {seed: args.out / f"{args.label}-seed{seed}" for seed in args.seeds}
    if args.report_only:
        curves = [read_curve(args.label, seed, folder / "metrics.jsonl") for seed, folder in folders.items()]
    else:
        curves = [run_seeded(args.label, seed, folder, args.preset, overrides, args.timeout_minutes * 60)
                  for seed, folder in folders.items()]
    failed = [c.seed for c in curves if c.returncode != 0]
    if failed:
        print(f"runs for seeds {failed} did not exit 0 (see {args.out}): their curves are reported as they are")
    results = ROOT / "benchmarks" / "results"
    minutes = grid(curves)
    median, worst = median_and_worst(curves, minutes)
    plot(curves, minutes, median, worst, results / f"{args.label}.png")
    (results / f"{args.label}.json").write_text(json.dumps([c.to_json() for c in curves], indent=1))
    extra = "".join(f" --set {s}" for s in args.set)
    command = (f"python -m benchmarks.learning --seeds {' '.join(map(str, args.seeds))} --steps {args.steps} "
               f"--minutes {args.minutes:g} --preset {args.preset} --label {args.label}{extra}")
    written_by = command + "".join(f" --{flag}" for flag in ("reference", "headline") if getattr(args, flag))
    if args.reference:
        from services.models import SHIPPED_TINY_REFERENCE

        SHIPPED_TINY_REFERENCE.write_text(json.dumps(reference(curves, written_by), indent=1) + "\n")
    if args.headline:
        replace_section(ROOT / "README.md", "headline", headline(curves, written_by))
    body = report(curves, command) + f"\n\n![{args.label}](results/{args.label}.png)"
    print(body)
    replace_section(ROOT / "benchmarks" / "README.md", args.label, body)


if __name__ == "__main__":
    main()
