"""End-of-run report: PNG plots and a summary table from the learner's metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

# plot file -> (title, [(metrics.jsonl key, label)])
PLOTS = {
    "reward.png": ("Reward", [("reward_all", "all groups"), ("reward_trained", "trained groups")]),
    "eval_accuracy.png": ("Held-out accuracy", [("eval_accuracy", "held-out")]),
    "response_length.png": ("Response length (tokens)", [("response_length", "mean")]),
    "entropy.png": ("Policy entropy", [("entropy", "mean token entropy")]),
    "clip_fractions.png": ("Clip fractions",
                           [("clip_frac_low", "low (1-eps_low)"), ("clip_frac_high", "high (1+eps_high)")]),
}


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if r.get(key) is not None and "step" in r]
    return [p[0] for p in points], [p[1] for p in points]


def write_plots(rows: list[dict], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for filename, (title, keys) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in keys:
            xs, ys = series(rows, key)
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, label=label)
        ax.set_title(title)
        ax.set_xlabel("training step")
        ax.grid(alpha=0.3)
        if len(keys) > 1:
            ax.legend()
        fig.tight_layout()
        path = out_dir / filename
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


def summary(rows: list[dict]) -> dict:
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    # the steps' rows (an evaluation redone after a stop during the final one has a line of its own after them)
    trained = [r for r in rows if r.get("step", 0) > 0 and "groups_trained" in r]
    mean = lambda key: (sum(r[key] for r in trained if r.get(key) is not None) /  # noqa: E731
                        max(1, sum(1 for r in trained if r.get(key) is not None)))
    return {
        "steps": max((r.get("step", 0) for r in rows), default=0),
        "eval_accuracy_first": evals[0]["eval_accuracy"] if evals else None,
        "eval_accuracy_last": evals[-1]["eval_accuracy"] if evals else None,
        "eval_accuracy_best": max((r["eval_accuracy"] for r in evals), default=None),
        "reward_all_last": trained[-1].get("reward_all") if trained else None,
        "mean_refills": mean("refills") if trained else None,
        "mean_informative_ratio": mean("informative_ratio") if trained else None,
        "mean_step_seconds": mean("step_seconds") if trained else None,
        "wall_seconds": (rows[-1].get("time", 0) - rows[0].get("time", 0)) if len(rows) > 1 else 0.0,
        "learner_world_size": trained[-1].get("world_size") if trained else None,  # ranks of the last step
    }


# Below the reference's worst seed by more than this at a step, a run is reported as learning less than the README
# (the held-out evaluation itself varies by about 1.1 points at 500 problems x 4 samples).
REFERENCE_TOLERANCE = 0.03


def against_reference(rows: list[dict], reference: dict) -> dict:
    """The run's held-out accuracy against the reference curves for the same base model, step by step (steps,
    not minutes: a slower machine takes longer per step but should learn as much per step).

    `reference`: {"command", "seeds", "steps", "median", "worst", "best"} (benchmarks/learning.py --reference).
    Returns the last step both measured, the run's accuracy there, the band, and a plain verdict.
    """
    band = {step: (worst, median, best) for step, worst, median, best
            in zip(reference["steps"], reference["worst"], reference["median"], reference["best"])}
    shared = [r for r in rows if r.get("eval_accuracy") is not None and r.get("step") in band and r["step"] > 0]
    if not shared:
        return {"verdict": "no evaluation at a step the reference measured", "command": reference["command"]}
    last = shared[-1]
    worst, median, best = band[last["step"]]
    accuracy = last["eval_accuracy"]
    if accuracy < worst - REFERENCE_TOLERANCE:
        verdict = (f"below: {accuracy:.1%} at step {last['step']} against {worst:.1%} for the reference's worst seed "
                   f"(median {median:.1%}, {len(reference['seeds'])} seeds) from the same base model; "
                   "docs/tiny-model.md lists what makes a run learn less")
    elif accuracy > best + REFERENCE_TOLERANCE:
        verdict = f"above: {accuracy:.1%} at step {last['step']}, past the reference's best seed {best:.1%}"
    else:
        verdict = (f"within: {accuracy:.1%} at step {last['step']}, reference {worst:.1%} to {best:.1%} "
                   f"(median {median:.1%})")
    return {"step": last["step"], "accuracy": accuracy, "worst": worst, "median": median, "best": best,
            "verdict": verdict, "command": reference["command"]}


def write_report(rows: list[dict], run_dir: Path, extra: dict | None = None) -> Table:
    """Plots, and summary.json: `summary(rows)` plus `extra` (the launcher's: CPU plan and use per service; the
    comparison with the reference curves when the run starts from the shipped model)."""
    import json

    write_plots(rows, run_dir / "plots")
    result = {**summary(rows), **(extra or {})}
    (run_dir / "summary.json").write_text(json.dumps(result, indent=2))
    table = Table(title=f"summary: {run_dir}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if isinstance(value, dict) and "verdict" in value:
            value = value["verdict"]
        elif isinstance(value, dict):
            value = ", ".join(f"{k} {v:.0f}" if isinstance(v, float) else f"{k} {v}" for k, v in value.items())
        table.add_row(key, "-" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value)))
    return table


def main(settings) -> int:
    """`dapo report`: a run folder's plots and summary.json from its metrics.jsonl, as `dapo run` writes them at its
    end, for a run it did not launch (Compose, Kubernetes, `dapo learner`) or one still going. What the launcher
    alone knows (CPU plan and use, the reference comparison) is kept from a summary.json it wrote."""
    import json

    from rich.console import Console

    from learner.records import METRICS_FILE, read_rows
    from services.data import DataError

    run_dir = Path(settings.run_dir)
    rows = read_rows(run_dir / METRICS_FILE)
    if not rows:
        raise DataError(f"{run_dir / METRICS_FILE}: no step recorded (is run_dir the run's folder? --set run_dir=...)")
    try:
        before = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        before = {}
    launcher_only = {key: value for key, value in before.items() if key in ("cpus", "cpu_seconds", "reference")} \
        if isinstance(before, dict) else {}
    Console().print(write_report(rows, run_dir, launcher_only))
    return 0
