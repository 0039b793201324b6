"""Experiment tracking: the learner's per-step numbers and eval samples in Weights & Biases, TensorBoard or
MLflow, through accelerate's trackers.

metrics.jsonl and Prometheus stay the record of a run; users of verl, prime-rl and TRL look for their runs in
a tracker, so `learner.report_to` names the trackers that get the same numbers. The Trainer builds its
Accelerator with `accelerator_kwargs(settings)` (accelerate wants the trackers at construction), and the
learner service logs through `Tracking`. accelerate logs on the main process only, so other ranks' calls are
no-ops. Offline use: `WANDB_MODE=offline` (files under {run_dir}/tracking/wandb), TensorBoard event files under
{run_dir}/tracking/<run>, MLflow wherever `MLFLOW_TRACKING_URI` points (its default, ./mlruns, otherwise).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from services.config import ConfigError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from services.config import Settings
    from services.messages import ScoredGroup

log = logging.getLogger(__name__)

# tracker name (accelerate's) -> the module it imports
TRACKER_MODULES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}
EXTRA = "track"
TRACKING_DIR = "tracking"
SAMPLES_KEY = "eval/samples"
SAMPLE_COLUMNS = ["prompt", "response", "reward", "correct"]
SAMPLES_PER_GROUP = 2  # responses shown per prompt: a few rows per evaluation, not the whole eval set
# metrics.jsonl fields that are not per-step numbers to plot
NOT_LOGGED = {"step", "time", "started"}
TRACKER_PAUSE_S = 300.0  # after a tracker's failure, none of its calls for this long (one warning each time)


class TrackerNotInstalled(ConfigError):
    """A tracker named in learner.report_to whose package is missing (a configuration error: the CLI prints
    its one line and exits 2)."""


def check_installed(names: Sequence[str]) -> None:
    """One clear line naming the pip extra, instead of accelerate's error deep inside Accelerator()."""
    missing = [name for name in names if importlib.util.find_spec(TRACKER_MODULES[name]) is None]
    if missing:
        raise TrackerNotInstalled(
            f"learner.report_to: {', '.join(missing)} not installed; pip install 'dapo-services[{EXTRA}]'"
        )


def tracking_dir(settings: "Settings") -> Path:
    return Path(settings.run_dir) / TRACKING_DIR


def accelerator_kwargs(settings: "Settings") -> dict:
    """What the Trainer passes to Accelerator(): the trackers and where they write (empty when none)."""
    names = list(settings.learner.report_to)
    if not names:
        return {}
    check_installed(names)
    return {"log_with": names, "project_dir": str(tracking_dir(settings))}


def flat_config(settings: "Settings") -> dict:
    """The resolved settings as flat `section.field` hyperparameters (secrets redacted, services.config)."""
    flat: dict = {}

    def walk(prefix: str, node) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(f"{prefix}{key}.", value)
            else:
                flat[f"{prefix}{key}"] = value if isinstance(value, (bool, int, float, str)) else str(value)

    walk("", settings.model_dump(mode="json"))
    return flat


def step_values(record: dict) -> dict[str, float]:
    """The numbers of one metrics.jsonl record (flags as 0/1; missing values left out)."""
    return {
        key: float(value) for key, value in record.items()
        if key not in NOT_LOGGED and isinstance(value, (bool, int, float))
    }


def sample_rows(groups: Sequence["ScoredGroup"]) -> list[list]:
    """prompt, response, reward, correct for the first responses of each group."""
    return [
        [group.rollout.task.prompt, sample.text, score.reward, score.correct]
        for group in groups
        for sample, score in list(zip(group.rollout.samples, group.scores))[:SAMPLES_PER_GROUP]
    ]


def markdown_table(rows: list[list]) -> str:
    """TensorBoard has no table: its text plugin renders markdown."""
    def cell(value) -> str:
        return str(value).replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(SAMPLE_COLUMNS) + " |", "|" + " --- |" * len(SAMPLE_COLUMNS)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


class Tracking:
    """The trackers of one run, started on the Trainer's Accelerator (a no-op when report_to is empty)."""

    def __init__(self, accelerator: "Accelerator", settings: "Settings", resume_step: int | None = None):
        """`resume_step`: the checkpoint this process resumes from. The steps a crashed process logged after it are
        trained again. TensorBoard drops them, as metrics.jsonl is cut back. W&B and MLflow cannot drop logged
        steps (W&B's rewind is a private preview; MLflow's history is append-only and its params immutable), so a
        resumed process starts a new tracker run named for the step it resumes at, in the run's W&B group and
        with MLflow tags: the earlier run keeps the steps that were trained again, and says so by its successor."""
        self.accelerator = accelerator
        self.names = list(settings.learner.report_to)
        self.failures, self.paused_until = 0, 0.0
        if self.names:
            directory = tracking_dir(settings)
            directory.mkdir(parents=True, exist_ok=True)
            run = settings.redis.run
            name = run if resume_step is None else f"{run}-resumed-at-{resume_step}"
            tags = {"dapo.run": run} | ({} if resume_step is None else {"dapo.resumed_at_step": str(resume_step)})
            init_kwargs = {"wandb": {"dir": str(directory), "group": run, "name": name}, "mlflow": {"run_name": name}}
            # Steps past where this process starts go: a resume's (trained again), or a crashed start's before its
            # first checkpoint (a fresh start from step 1 again).
            init_kwargs["tensorboard"] = {"purge_step": 0 if resume_step is None else resume_step + 1}
            try:  # a tracker that cannot start (W&B without its key, a server down) ends no training either
                accelerator.init_trackers(run, config=flat_config(settings), init_kwargs=init_kwargs)
                if "mlflow" in self.names and accelerator.is_main_process:
                    import mlflow

                    mlflow.set_tags(tags)  # on the run (accelerate's `tags` would also tag an experiment it creates)
            except Exception as err:  # noqa: BLE001 (any tracker's own error type)
                log.error("the trackers %s could not start, and this process reports to none (metrics.jsonl has "
                          "every step): %s: %s", ", ".join(self.names), type(err).__name__, err)
                self.names = []
                with contextlib.suppress(Exception):  # those that did start are ended (an MLflow run left RUNNING)
                    accelerator.end_training()

    def _failed(self, what: str, err: Exception) -> None:
        """A tracker's error is logged, never raised: metrics.jsonl is the run's record, and a tracking server down
        (MLflow's client gives up after minutes of retries) must not end the training it only mirrors, nor hold up
        every step for those minutes: the trackers are left alone for TRACKER_PAUSE_S after a failure."""
        self.failures += 1
        self.paused_until = time.monotonic() + TRACKER_PAUSE_S
        log.warning("tracker %s failed (%d failures so far; metrics.jsonl has every step; the trackers get nothing "
                    "for %.0f s): %s: %s", what, self.failures, TRACKER_PAUSE_S, type(err).__name__, err)

    def _call(self, what: str, call: Callable[[], object]) -> None:
        """`call` to the trackers unless they are paused after a failure (`_failed`)."""
        if not self.names or time.monotonic() < self.paused_until:
            return
        try:
            call()
        except Exception as err:  # noqa: BLE001 (any tracker's own error type)
            self._failed(what, err)

    def log_step(self, record: dict) -> None:
        """One metrics.jsonl record, at its step."""
        self._call(f"step {record['step']}",
                   lambda: self.accelerator.log(step_values(record), step=record["step"]))

    def log_samples(self, groups: Sequence["ScoredGroup"], step: int) -> None:
        """A few prompts, responses and rewards of an evaluation: a table (W&B, MLflow), text (TensorBoard)."""
        self._call(f"samples of step {step}", lambda: self._log_samples(groups, step))

    def _log_samples(self, groups: Sequence["ScoredGroup"], step: int) -> None:
        rows = sample_rows(groups)
        if not rows or not self.accelerator.is_main_process:
            return
        if "wandb" in self.names:
            self.accelerator.get_tracker("wandb").log_table(SAMPLES_KEY, columns=SAMPLE_COLUMNS, data=rows, step=step)
        if "tensorboard" in self.names:
            self.accelerator.get_tracker("tensorboard").log({SAMPLES_KEY: markdown_table(rows)}, step=step)
        if "mlflow" in self.names:
            import mlflow

            # log_table's JSON layout, without the pandas that log_table needs (mlflow-skinny has none)
            mlflow.log_dict({"columns": SAMPLE_COLUMNS, "data": rows}, f"{SAMPLES_KEY}/step-{step}.json")

    def finish(self) -> None:
        self._call("finish", self.accelerator.end_training)  # (paused, a tracker down: its run stays open)
