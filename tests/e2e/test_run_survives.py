"""`dapo run` survives its own processes dying: the learner and then redis-server are SIGKILLed mid-run, the
launcher restarts them (the learner resumes from its checkpoint, Redis from its AOF), and the run finishes by
itself with every step once in the ledger and no task trained twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.faults import children_of
from learner.records import read_rows

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 5


def small_run(steps: int) -> list[str]:
    """`--set` overrides of a short run that checkpoints every step (the kill tests)."""
    return [f"learner.total_steps={steps}", "learner.batch.prompts_per_step=4", "learner.eval_every=0",
            "learner.checkpoints.every=1", "sampling.n=4", "sampling.max_tokens=48", "streams.visibility_timeout_s=20"]


def child_running(launcher: int, needle: str) -> int:
    return next((pid for pid, cmd in children_of(launcher).items() if needle in cmd), 0)


def ledger(run_dir: Path) -> list[dict]:
    return read_rows(run_dir / "ledger.jsonl")  # the records' JSONL reader: skips a line being written


def checkpointed(run_dir: Path) -> bool:
    return (run_dir / "checkpoints" / "latest").is_file()


def wait_for(what: str, check, proc: subprocess.Popen, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        assert proc.poll() is None, f"dapo run exited ({proc.returncode}) while waiting for {what}"
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}")


def test_run_survives_sigkill_of_learner_and_redis(short_tmp):
    run_dir = Path(short_tmp) / "run"
    command = [sys.executable, "-m", "cli", "run", "--no-display", "-s", f"run_dir={run_dir}"]
    for override in small_run(STEPS):
        command += ["-s", override]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # after the first checkpoint (a step is in the ledger a moment before its checkpoint is written: a kill
        # in between restarts from scratch, correctly, but then nothing is resumed)
        learner = wait_for("the first checkpoint",
                           lambda: checkpointed(run_dir) and child_running(proc.pid, "cli learner"), proc, 600)
        os.kill(learner, signal.SIGKILL)
        wait_for("a new learner", lambda: child_running(proc.pid, "cli learner") not in (0, learner), proc, 60)
        done = len(ledger(run_dir))
        wait_for("a step after the restart", lambda: len(ledger(run_dir)) > max(done, 1), proc, 600)
        redis_pid = child_running(proc.pid, "redis-server")
        assert redis_pid
        os.kill(redis_pid, signal.SIGKILL)
        wait_for("a new redis-server", lambda: child_running(proc.pid, "redis-server") not in (0, redis_pid), proc, 60)
        output = proc.communicate(timeout=900)[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    logs = "\n".join((run_dir / "logs" / name).read_text(errors="replace")[-2000:] for name in ("learner.log",))
    assert proc.returncode == 0, output[-3000:] + logs

    rows = ledger(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    trained = [task for row in rows for task in row["trained"]]
    assert trained and len(trained) == len(set(trained))
    log_text = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert "resuming from" in log_text  # the restarted learner resumed from its checkpoint
    assert "@" not in json.loads((run_dir / "services.json").read_text())["redis"]  # no password in the file
