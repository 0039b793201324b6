"""The ladder of the paper's Table 1 on the tiny model: each cumulative row, several seeds, a fixed time.

    python -m benchmarks.ablation [--seeds 0 1] [--minutes 4] [--preset tiny-cpu] [--set key=value ...]

The rows are `configs/ablations/*.yaml` (written for the 32B recipe). What a row changes is its DAPO switches
(SWITCHES below); those are read from the row and laid over the tiny preset, so the tiny ladder is the paper's
ladder and nothing else: same base model, data, batch shape and learning rate in every row. Each run trains
for `--minutes` of training, evaluations excluded (learner.time_limit_minutes: the same compute for every row,
as in the paper's figure of accuracy against steps at equal cost) and is evaluated at the end. Reported into
benchmarks/README.md between the `ablation` markers and as benchmarks/results/ablation.{json,png}: held-out
accuracy at the end, mean and spread over seeds, and the gain over the row's own step-0 accuracy.

Order. A fixed time makes every row sensitive to how fast the shared machine is while it runs, and the ladder
takes an hour: run row by row and a drift in machine speed becomes a trend down the ladder. So the runs go seed
by seed, the rows forward for one seed and backward for the next (`run_order`): a drift then moves both ends of
the ladder alike, and an even number of seeds cancels a linear one in each row's mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.runs import ROOT, Curve, replace_section, run_seeded, spread
from services.config import CONFIG_DIR, load_settings

# What the rows of Table 1 switch (README, "The DAPO techniques are switches").
SWITCHES = (
    "learner.loss.clip_high", "learner.loss.loss_agg", "learner.batch.dynamic_sampling", "learner.batch.filter_metric",
    "learner.loss.overlong_filter", "reward.soft_overlong",
)
PAPER_AIME = {"1-grpo": 30, "2-overlong-filter": 36, "3-clip-higher": 38, "4-soft-overlong": 41,
              "5-token-level-loss": 42, "6-dynamic-sampling": 50}


def rows() -> list[str]:
    return sorted(p.stem for p in (CONFIG_DIR / "ablations").glob("*.yaml"))


def row_switches(row: str) -> list[str]:
    """The row's DAPO switches as `--set` overrides (YAML values)."""
    settings = load_settings(f"ablations/{row}")
    out = []
    for path in SWITCHES:
        value = settings
        for part in path.split("."):
            value = getattr(value, part)
        out.append(f"{path}={str(value).lower() if isinstance(value, bool) else value}")
    return out


def run_order(row_names: list[str], seeds: list[int]) -> list[tuple[str, int]]:
    """(row, seed) pairs seed by seed, the rows forward for even-numbered seeds and backward for odd ones."""
    return [(row, seed) for k, seed in enumerate(seeds) for row in (row_names if k % 2 == 0 else row_names[::-1])]


def plot(results: dict[str, list[Curve]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    finals = [[100 * c.accuracy[-1] for c in results[n]] for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(range(len(names)), [statistics.fmean(f) for f in finals], color="tab:blue", alpha=0.6)
    for i, values in enumerate(finals):
        ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
    ax.set_xticks(range(len(names)), [n.split("-", 1)[1] for n in names], rotation=20)
    ax.set_ylabel("held-out accuracy at the time limit (%)")
    ax.set_title("Table 1 ladder on the tiny model (bars: mean, dots: seeds)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(results: dict[str, list[Curve]], command: str, minutes: float) -> str:
    lines = [
        f"`{command}`", "",
        f"| row (cumulative) | paper AIME 2024 | held-out at {minutes:g} min (%) | gain over step 0 (points) | "
        "steps done | mean step (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row, curves in results.items():
        lines.append(
            f"| {row} | {PAPER_AIME.get(row, '')} | {spread([c.accuracy[-1] for c in curves])} | "
            f"{spread([c.accuracy[-1] - c.base for c in curves])} | "
            f"{statistics.fmean(c.steps[-1] for c in curves):.0f} | "
            f"{statistics.fmean(c.step_seconds for c in curves):.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--minutes", type=float, default=4.0, help="training time of every run")
    parser.add_argument("--rows", nargs="+", default=None, help="a subset of configs/ablations (default: all)")
    parser.add_argument("--preset", default="tiny-cpu")
    parser.add_argument("--set", action="append", default=[], help="extra override for every run (key=value)")
    parser.add_argument("--label", default="ablation", help="names the README section and the result files")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-ablation")
    args = parser.parse_args()

    row_names = args.rows or rows()
    results: dict[str, list[Curve]] = {row: [] for row in row_names}
    for row, seed in run_order(row_names, args.seeds):
        overrides = [*row_switches(row), f"learner.time_limit_minutes={args.minutes}", "learner.total_steps=100000",
                     *args.set]
        results[row].append(
            run_seeded(row, seed, args.out / f"{row}-seed{seed}", args.preset, overrides, 60 * (args.minutes + 20))
        )
    out = ROOT / "benchmarks" / "results"
    plot(results, out / f"{args.label}.png")
    (out / f"{args.label}.json").write_text(json.dumps({r: [c.to_json() for c in cs] for r, cs in results.items()},
                                                       indent=1))
    extra = "".join(f" --set {s}" for s in args.set)
    rows_arg = f" --rows {' '.join(args.rows)}" if args.rows else ""
    out_arg = args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out
    label_arg = f" --label {args.label} --out {out_arg}" if args.label != "ablation" else ""
    command = (f"python -m benchmarks.ablation --seeds {' '.join(map(str, args.seeds))} --minutes {args.minutes:g}"
               f"{rows_arg} --preset {args.preset}{extra}{label_arg}")
    body = report(results, command, args.minutes) + f"\n\n![{args.label}](results/{args.label}.png)"
    print(body)
    replace_section(ROOT / "benchmarks" / "README.md", args.label, body)


if __name__ == "__main__":
    main()
