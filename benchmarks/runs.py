"""Shared by the benchmarks: run `dapo run` with a seed, read its curve, summarise over seeds (the learning
benchmarks); measure in a fresh process and write a report (the memory benchmarks).

A seed moves everything chance enters through in a run: the order of the training data (`data.seed`), vLLM's
sampling (`generator.seed`, the engine seed) and the learner's RNG (`learner.seed`: torch, the mini-batch
shuffle). The base model (`tiny.seed`) stays fixed, so seeds differ in the RL run, not in where it starts; the
held-out accuracy each seed starts from is reported anyway (step 0 is measured, not assumed).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DAPO = str(Path(sys.executable).with_name("dapo"))


@dataclass
class Curve:
    """One run's held-out accuracy against training steps and minutes (from its metrics.jsonl)."""

    label: str
    seed: int
    steps: list[int]
    minutes: list[float]  # of training: since the step-0 record (after the baseline evaluation), evaluations excluded
    accuracy: list[float]
    step_seconds: float  # mean over training steps
    returncode: int
    wait_seconds: float = 0.0  # the learner's mean wait for groups a step (project runs; TRL has none)
    refills: float = 0.0  # mean refill rounds a step (project runs)

    @property
    def base(self) -> float:
        return self.accuracy[0]

    def at_minute(self, minute: float) -> float:
        """The last accuracy measured at or before `minute` (a step function: what the run had by then)."""
        value = self.accuracy[0]
        for m, a in zip(self.minutes, self.accuracy):
            if m <= minute + 1e-9:
                value = a
        return value

    def interpolated(self, minute: float) -> float:
        """The accuracy at `minute`, linear between the evaluations on either side (the last one past the end)."""
        points = list(zip(self.minutes, self.accuracy))
        for (m0, a0), (m1, a1) in zip(points, points[1:]):
            if m0 <= minute <= m1:
                return a0 + (a1 - a0) * (minute - m0) / (m1 - m0) if m1 > m0 else a1
        return points[-1][1] if minute > points[-1][0] else points[0][1]

    def gain(self, minute: float, between: bool = False) -> float:
        """Accuracy over step 0 at `minute`: what the run had measured by then, or read between evaluations."""
        return (self.interpolated(minute) if between else self.at_minute(minute)) - self.base

    def minutes_to(self, target: float) -> float | None:
        """Minutes of the first evaluation at or above `target` (None: never reached)."""
        return first_minute_at(self.minutes, self.accuracy, target)

    def max_drop(self, after_step: int = 10) -> float:
        """The largest fall between two consecutive evaluations taken after `after_step` (0 if none fell)."""
        points = [(s, a) for s, a in zip(self.steps, self.accuracy) if s >= after_step]
        return max([0.0, *(earlier - later for (_, earlier), (_, later) in zip(points, points[1:]))])

    def to_json(self) -> dict:
        return {"label": self.label, "seed": self.seed, "steps": self.steps, "minutes": self.minutes,
                "accuracy": self.accuracy, "step_seconds": self.step_seconds, "returncode": self.returncode,
                "wait_seconds": self.wait_seconds, "refills": self.refills}


def first_minute_at(minutes: list[float], accuracy: list[float], target: float) -> float | None:
    return next((m for m, a in zip(minutes, accuracy) if a >= target - 1e-9), None)


def machine() -> str:
    """The CPU model and the cores this process may use: what a minutes figure was measured on."""
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
             if line.startswith("model name")] if cpuinfo.exists() else []
    return f"{names[0] if names else 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores"


def seed_overrides(seed: int) -> list[str]:
    return [f"data.seed={seed}", f"generator.seed={seed}", f"learner.seed={seed}"]


def run_seeded(label: str, seed: int, run_dir: Path, preset: str, overrides: list[str], timeout_s: float) -> Curve:
    """One fresh `dapo run` (no resume, its own Redis prefix), waited for; its curve."""
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    sets = [f"run_dir={run_dir}", f"redis.run={run_dir.name}", "learner.checkpoints.resume=false",
            *seed_overrides(seed),
            *overrides]
    command = [DAPO, "run", "--no-display", "--config", preset]
    for item in sets:
        command += ["--set", item]
    env = {**os.environ, "DAPO_LOG_LEVEL": os.environ.get("DAPO_LOG_LEVEL", "WARNING")}
    started = time.monotonic()
    print(f"[{label} seed {seed}] {' '.join(command)}", flush=True)
    with open(run_dir.parent / f"{run_dir.name}.out", "w") as out:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
    curve = read_curve(label, seed, run_dir / "metrics.jsonl", proc.returncode)
    print(f"[{label} seed {seed}] exit {proc.returncode} in {time.monotonic() - started:.0f}s: "
          f"{len(curve.steps)} evaluations, {curve.base:.3f} -> {curve.accuracy[-1]:.3f}", flush=True)
    return curve


def read_curve(label: str, seed: int, metrics_path: Path, returncode: int = 0) -> Curve:
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    start = next(r["time"] for r in rows if r["step"] == 0)
    evals = [r for r in rows if r.get("eval_accuracy") is not None]
    trained = [r for r in rows if r.get("step_seconds") is not None]
    return Curve(
        label=label, seed=seed,
        steps=[r["step"] for r in evals],
        minutes=training_minutes(rows, start, evals),
        accuracy=[r["eval_accuracy"] for r in evals],
        step_seconds=mean_of(trained, "step_seconds"),
        returncode=returncode,
        wait_seconds=mean_of(trained, "wait_seconds"),
        refills=mean_of(trained, "refills"),
    )


def mean_of(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else 0.0


def training_minutes(rows: list[dict], start: float, at: list[dict]) -> list[float]:
    """Minutes from `start` to each row of `at`, less the evaluations run after step 0 before it, which train
    nothing (the same clock as learner.time_limit_minutes). A step's `time` is taken before its own evaluation."""
    minutes, evaluating = [], 0.0
    marks = {id(r) for r in at}
    for row in rows:
        if id(row) in marks:
            minutes.append((row["time"] - start - evaluating) / 60.0)
        if row["step"] > 0:
            evaluating += row.get("eval_seconds") or 0.0
    return minutes


def grid(curves: list[Curve], points: int = 60) -> list[float]:
    """Minutes from 0 to the shortest run's last evaluation (every seed has a value at every point)."""
    end = min(c.minutes[-1] for c in curves)
    return [end * k / (points - 1) for k in range(points)]


def median_and_worst(curves: list[Curve], minutes: list[float]) -> tuple[list[float], list[float]]:
    """Across seeds at each minute: the median accuracy and the worst (lowest)."""
    values = [[c.at_minute(m) for c in curves] for m in minutes]
    return [statistics.median(v) for v in values], [min(v) for v in values]


def spread(values: list[float]) -> str:
    """mean ± sample std in points (a single value has no spread)."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return f"{100 * mean:.1f}"
    return f"{100 * mean:.1f} ± {100 * statistics.stdev(values):.1f}"


def replace_section(readme: Path, name: str, body: str) -> None:
    """Put `body` between `<!-- name:begin -->` and `<!-- name:end -->` in `readme` (appended if absent)."""
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    text = readme.read_text() if readme.exists() else ""
    block = f"{begin}\n{body.rstrip()}\n{end}"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def in_fresh_process(function, *args):
    """`function(*args)` in a new interpreter (spawn), so that its peak resident memory is its own."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        return child.submit(function, *args).result()


def print_report(rows: list[dict], text: str, results: Path | None) -> None:
    """Print a benchmark's report and, where asked, write it with its rows to `results` (JSON)."""
    print(text)
    if results:
        results.write_text(json.dumps({"rows": rows, "report": text}, indent=2) + "\n")
