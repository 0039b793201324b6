"""Where a run's checkpoints live, and the refill limit's stop record beside them.

run_dir/checkpoints/step-N (learner/trainer.py writes them), checkpoints/latest (the name of the one to resume
from, replaced atomically), and checkpoints/stopped.json when `learner.on_refill_limit: stop` ended the run at the
refill limit (exit 3). The record names the checkpointed step it stopped at, so a later start that would resume
there finds the run over, as after total_steps: `dapo learner` exits 0 before it touches the run (a restart policy
on failure, Compose's, then leaves it down), and `dapo run` reports that exit as the stop it is. A start that goes
on (max_refills raised, on_refill_limit set to train, learner.resume=false, or the file deleted) clears it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from services.files import write_atomic

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
STOPPED = "stopped.json"
PREFIX = "step-"  # checkpoints/step-N


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step}"


def checkpoint_steps(checkpoint_dir: Path) -> list[int]:
    """The steps of the checkpoint folders present, in order."""
    return sorted(int(p.name.removeprefix(PREFIX)) for p in checkpoint_dir.iterdir()
                  if p.is_dir() and p.name.startswith(PREFIX) and p.name.removeprefix(PREFIX).isdigit())


def latest_step(checkpoint_dir: Path) -> int | None:
    """The step of the checkpoint `latest` names; None when there is none."""
    pointer = checkpoint_dir / LATEST
    return int(pointer.read_text().strip().removeprefix(PREFIX)) if pointer.is_file() else None


def record_stop(checkpoint_dir: Path, step: int, max_refills: int, reason: str) -> None:
    write_atomic(checkpoint_dir / STOPPED, json.dumps({"step": step, "max_refills": max_refills, "reason": reason}))


def recorded_stop(checkpoint_dir: Path) -> dict | None:
    """The stop record when it names the latest checkpoint's step (the run would resume where it stopped), else
    None. An unreadable record is ignored with a warning: it must not keep a run from starting."""
    path = checkpoint_dir / STOPPED
    if not path.is_file():
        return None
    try:
        stop = json.loads(path.read_text())
        stop = {"step": int(stop["step"]), "max_refills": int(stop["max_refills"]), "reason": str(stop["reason"])}
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("ignoring the unreadable stop record %s (%s)", path, err)
        return None
    return stop if stop["step"] == latest_step(checkpoint_dir) else None


def clear_stop(checkpoint_dir: Path) -> None:
    (checkpoint_dir / STOPPED).unlink(missing_ok=True)
