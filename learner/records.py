"""The learner's records: what each step did, written where a user and the tools read it.

Files under run_dir: config.yaml (the resolved settings, secrets redacted), metrics.jsonl (one object per step;
step 0 is the baseline evaluation), ledger.jsonl (the task ids trained and dropped per step: what the exactly-once
checks count). The same step record goes to the experiment trackers and to the Prometheus gauges. After a resume
both JSONL files are cut back to the checkpoint's step, so that they describe the surviving lineage.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from learner.batch import Batch, task_id_of
from learner.tracking import Tracking
from services import metrics
from services.config import Settings, dump_settings
from services.files import write_atomic
from services.messages import ScoredGroup

# Where a step's time goes (each `{phase}_seconds` in metrics.jsonl and a label of dapo_learner_step_phase_seconds):
# the learner's wait for groups (split: generation, verification), its update (forward, backward, optimizer),
# publishing, the evaluation (after the drain of the train prompts in flight), and each side's idle time; the
# generators' engine, reload and idle seconds are summed over generators.
PHASES = (
    "wait", "wait_generation", "wait_verification", "train", "forward", "backward", "optimizer", "publish",
    "eval_drain", "eval", "learner_idle", "generator_busy", "generator_reload", "generator_idle",
)
METRICS_FILE = "metrics.jsonl"
LEDGER_FILE = "ledger.jsonl"


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Cut a per-step JSONL file after the last line whose step <= last_step (and any partial line written by a
    crash). In place, so a reader holding the file open keeps its handle. Returns the lines kept."""
    if not path.exists():
        return 0
    keep_bytes, kept = 0, 0
    with path.open("rb") as handle:
        for line in handle:
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                break
            if not line.endswith(b"\n") or step > last_step:
                break
            keep_bytes += len(line)
            kept += 1
    os.truncate(path, keep_bytes)
    return kept


def read_rows(path: Path) -> list[dict]:
    """The records of a JSONL file (metrics.jsonl, ledger.jsonl); none if it is missing."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line being written right now
    return rows


class Progress:
    """What `dapo run`'s status table shows of metrics.jsonl, followed as it grows: the newest row, the first and
    the newest held-out evaluation. Each `read` parses only the lines appended since the one before (a run of
    10,000 steps writes some 20 MB there, and the table is redrawn every second); a file cut or replaced (a
    resume, `Records.cut_after`) is read again from its start."""

    def __init__(self, path: Path):
        self.path = path
        self._start()

    def _start(self, inode: int | None = None) -> None:
        self._inode, self._offset = inode, 0
        self.last: dict = {}
        self.first_eval: dict | None = None
        self.last_eval: dict | None = None

    def read(self) -> "Progress":
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                if stat.st_ino != self._inode or stat.st_size < self._offset:
                    self._start(stat.st_ino)
                f.seek(self._offset)
                appended = f.read()
        except FileNotFoundError:
            return self
        whole = appended[:appended.rfind(b"\n") + 1]  # a line being written is read once it is whole
        self._offset += len(whole)
        for line in whole.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line a crash cut short
            self.last = row
            if row.get("eval_accuracy") is not None:
                self.first_eval, self.last_eval = self.first_eval or row, row
        return self


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class GeneratorClocks:
    """Where the generators' time went between two steps: the differences of the activity clocks stamped on the
    groups the learner read (generator/worker.py ActivityClock), summed over generators. A generator's first group
    sets its baseline; so does the first group of a restarted generator (its clock started again: a different
    start time, generated_at minus the clock's total)."""

    ACTIVITIES = ("busy", "reload", "idle")
    SAME_START_S = 30.0  # a clock stamped before an engine step lags by that step: starts within this are one run

    def __init__(self):
        self.latest: dict[str, tuple[float, tuple[float, ...]]] = {}  # generator -> (start time, clock)
        self.taken: dict[str, tuple[float, ...]] = {}

    def observe(self, group: ScoredGroup) -> None:
        rollout = group.rollout
        clock = (rollout.generator_busy_s, rollout.generator_reload_s, rollout.generator_idle_s)
        started = rollout.generated_at - sum(clock)
        known = self.latest.get(rollout.generator_id)
        if known is None or abs(started - known[0]) > self.SAME_START_S:
            self.latest[rollout.generator_id] = (started, clock)
            self.taken[rollout.generator_id] = clock
        elif sum(clock) > sum(known[1]):  # groups can arrive out of order
            self.latest[rollout.generator_id] = (known[0], clock)

    def take(self) -> dict[str, float]:
        """Seconds per activity since the previous call, summed over generators: generator_{busy,reload,idle}."""
        totals = dict.fromkeys(self.ACTIVITIES, 0.0)
        for generator, (_, clock) in self.latest.items():
            for activity, now, then in zip(self.ACTIVITIES, clock, self.taken[generator]):
                totals[activity] += max(0.0, now - then)
            self.taken[generator] = clock
        return {f"generator_{activity}_seconds": value for activity, value in totals.items()}


def wait_split(wait_seconds: float, groups: list[ScoredGroup]) -> dict[str, float]:
    """The learner's wait for groups, split between generation and verification in proportion to the batch's mean
    latencies: task issued -> rollout written (queue + engine), rollout written -> scored (queue + verifier)."""
    generation = [max(0.0, g.rollout.generated_at - g.rollout.task.created_at) for g in groups]
    verification = [max(0.0, g.scored_at - g.rollout.generated_at) for g in groups]
    total = sum(generation) + sum(verification)
    share = sum(generation) / total if total > 0 else 1.0
    return {"wait_generation_seconds": wait_seconds * share, "wait_verification_seconds": wait_seconds * (1 - share)}


def with_delivery(figures: dict, delivery: dict) -> dict:
    """A step's `figures` with those of a version `delivery` that ended after the ones they hold: the newest's
    under their names (`delivered_version`, `delivery_seconds`, its broadcast round's), and every delivery that
    ended in the step, oldest first, under `deliveries` (a step can see two end: the one before in the background,
    then its own)."""
    if not delivery:
        return figures
    earlier = figures.get("deliveries", [])
    replaced = set(earlier[-1]) if earlier else set()  # the older one's names: none of its figures stays on top
    return {**{k: v for k, v in figures.items() if k not in replaced}, **delivery, "deliveries": [*earlier, delivery]}


def step_record(step: int, version: int, batch: Batch, lags: list[int], result: dict, timing: dict) -> dict[str, Any]:
    """One line of metrics.jsonl: the batch's statistics, the update's metrics (`result` of Trainer.train_step)
    and where the step's time went (`timing`)."""
    stats = batch.stats
    trained_rewards = [s.reward for g in batch.groups for s in g.scores]
    tokens = result.get("tokens")
    step_seconds = timing["step_seconds"]
    return {
        "step": step,
        "version": version,
        "reward_all": stats.reward_all,
        "reward_trained": _mean(trained_rewards),
        "accuracy_train": stats.accuracy_all,
        "eval_accuracy": None,
        "informative_ratio": stats.informative_share,
        "informative_ratio_estimate": batch.informative_ratio,
        "refills": batch.refills,
        "stale_dropped": stats.stale_dropped,
        "uninformative_dropped": stats.uninformative,
        "duplicates": stats.duplicates,
        "lost": stats.lost,
        "groups_scored": stats.scored,
        "staleness": _mean([float(x) for x in lags]),
        "entropy": result.get("entropy"),
        "response_length": result.get("response_length_mean"),
        "clip_frac_low": result.get("clip_frac_low"),
        "clip_frac_high": result.get("clip_frac_high"),
        "approx_kl": result.get("approx_kl"),
        "log_ratio_max": result.get("log_ratio_max"),
        "grad_norm": result.get("grad_norm"),
        "loss": result.get("loss"),
        "lr": result.get("lr"),
        **timing,
        "train_seconds": result.get("step_seconds"),
        **{f"{phase}_seconds": result.get(f"{phase}_seconds") for phase in ("forward", "backward", "optimizer")},
        "tokens_per_second": (tokens / step_seconds) if tokens and step_seconds > 0 else None,
        "train_tokens_per_second": result.get("tokens_per_second"),
        "model_tflops": result.get("model_tflops"),  # per learner device (learner/throughput.py)
        "mfu": result.get("mfu"),  # None where the device's peak is unknown (a CPU)
        "batch_target": batch.target,  # B_t: below prompts_per_step during the batch warm-up
        "groups_trained": len(batch.groups),
        "refill_limit_hit": batch.refill_limit_hit,
    }


class Records:
    """metrics.jsonl, ledger.jsonl, the trackers and the Prometheus gauges of one run (rank 0 only)."""

    def __init__(self, settings: Settings, tracking: Tracking | None = None):
        self.run_dir = Path(settings.run_dir)
        self.tracking = tracking

    @staticmethod
    def write_config(settings: Settings) -> None:
        """The resolved settings, their secrets redacted (services read them from the environment)."""
        write_atomic(Path(settings.run_dir) / "config.yaml", dump_settings(settings))

    def cut_after(self, step: int) -> None:
        """Keep the lines of steps <= `step` (-1: none): a fresh start, or a resume from that step's checkpoint."""
        for name in (METRICS_FILE, LEDGER_FILE):
            truncate_jsonl(self.run_dir / name, step)

    def sync(self) -> None:
        """metrics.jsonl and ledger.jsonl on disk (fsync), before a checkpoint that covers their lines is committed."""
        for name in (METRICS_FILE, LEDGER_FILE):
            path = self.run_dir / name
            if path.is_file():
                with open(path, "rb+") as handle:
                    os.fsync(handle.fileno())

    def append(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def resumed(self, step: int) -> None:
        """The gauges a scrape reads before this process's first step: the step it goes on from and how long the
        last one took (DapoLearnerStalled measures a stall against it), progress now."""
        metrics.LEARNER_STEP.set(step)
        metrics.learner_progressed()
        last = next((row for row in reversed(read_rows(self.run_dir / METRICS_FILE))
                     if row.get("step") == step and "groups_trained" in row), {})
        if last.get("step_seconds") is not None:
            metrics.LEARNER_STEP_SECONDS.set(last["step_seconds"])
        for phase in PHASES:  # a fresh run has no training phase to go by yet: 0 (the alert's 30-minute floor)
            metrics.LEARNER_STEP_PHASE_SECONDS.labels(phase).set(last.get(f"{phase}_seconds") or 0.0)

    def has_evaluation(self, step: int) -> bool:
        """Whether metrics.jsonl holds an evaluation of `step` (read back on a resume)."""
        return any(row.get("step") == step and row.get("eval_accuracy") is not None
                   for row in read_rows(self.run_dir / METRICS_FILE))

    def evaluation(self, record: dict) -> None:
        """An evaluation on a line of its own (the baseline, or one redone after a stop cut it short)."""
        self.append(METRICS_FILE, record)
        if self.tracking is not None:
            self.tracking.log_step(record)
        # every eval task lost: no accuracy, not 0 %
        metrics.LEARNER_ACCURACY.labels("eval").set(_or_nan(record.get("eval_accuracy")))

    def step(self, record: dict, batch: Batch, drops: dict[str, list[str]]) -> None:
        self.append(METRICS_FILE, record)
        if self.tracking is not None:
            self.tracking.log_step(record)
        self.append(LEDGER_FILE, {
            "step": record["step"],
            "version": record["version"],
            "trained": batch.task_ids,
            "stale_at_take": [task_id_of(g) for g in batch.stale_at_take],
            **{f"dropped_{k}": v for k, v in drops.items()},
        })
        self.export(record, batch)

    @staticmethod
    def export(record: dict, batch: Batch) -> None:
        def set_if(gauge, value) -> None:
            if value is not None:
                gauge.set(value)

        metrics.LEARNER_STEP.set(record["step"])
        metrics.learner_progressed()
        set_if(metrics.LEARNER_REWARD.labels("all"), record["reward_all"])
        set_if(metrics.LEARNER_REWARD.labels("trained"), record["reward_trained"])
        set_if(metrics.LEARNER_ACCURACY.labels("train"), record["accuracy_train"])
        set_if(metrics.LEARNER_ACCURACY.labels("eval"), record.get("eval_accuracy"))
        set_if(metrics.LEARNER_INFORMATIVE, record["informative_ratio"])
        set_if(metrics.LEARNER_STALENESS, record["staleness"])
        set_if(metrics.LEARNER_ENTROPY, record["entropy"])
        set_if(metrics.LEARNER_RESPONSE_LENGTH, record["response_length"])
        set_if(metrics.LEARNER_CLIP_FRACTION.labels("low"), record["clip_frac_low"])
        set_if(metrics.LEARNER_CLIP_FRACTION.labels("high"), record["clip_frac_high"])
        set_if(metrics.LEARNER_KL, record["approx_kl"])
        set_if(metrics.LEARNER_LOG_RATIO_MAX, record.get("log_ratio_max"))
        set_if(metrics.LEARNER_LR, record["lr"])
        set_if(metrics.LEARNER_GRAD_NORM, record["grad_norm"])
        set_if(metrics.LEARNER_STEP_SECONDS, record["step_seconds"])
        for phase in PHASES:  # a phase the step did not have (an evaluation) took no time in it
            metrics.LEARNER_STEP_PHASE_SECONDS.labels(phase).set(record.get(f"{phase}_seconds") or 0.0)
        set_if(metrics.LEARNER_TOKENS_PER_SECOND, record["tokens_per_second"])
        set_if(metrics.LEARNER_MODEL_TFLOPS, record.get("model_tflops"))
        set_if(metrics.LEARNER_MFU, record.get("mfu"))
        if batch.refill_limit_hit:
            metrics.LEARNER_REFILL_LIMIT.inc()
        if batch.stale_at_take:
            metrics.LEARNER_STALE.inc(len(batch.stale_at_take))


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
