"""`dapo run --learner-procs 2`: the learner as 2 ranks under accelerate launch (gloo on CPU). One rank is
SIGKILLed mid-run: the learner exits non-zero instead of hanging, the launcher starts it again, it resumes from its
checkpoint on 2 ranks, and the run finishes with every step once in the ledger and `learner_world_size: 2`.
Weights go through a shared folder, so each rank writes its own share of every version (learner/publish.py) and the
generators load versions written by two ranks."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from test_run_survives import checkpointed, ledger, small_run, wait_for

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

STEPS = 4


def learner_rank(run_dir: Path, rank: int) -> int:
    """The pid of learner rank `rank` of this run (a torchrun worker: RANK in its environment), or 0."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            if "cli learner" not in cmdline or str(run_dir) not in cmdline or "accelerate" in cmdline:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(entry.name)
    return 0


def test_two_learner_ranks_survive_the_loss_of_one(short_tmp):
    run_dir = Path(short_tmp) / "run"
    shared = Path(short_tmp) / "shared"
    command = [sys.executable, "-m", "cli", "run", "--no-display", "--learner-procs", "2", "-s", f"run_dir={run_dir}"]
    for override in [*small_run(STEPS), "weights.transport=shared-fs", f"weights.shared_dir={shared}"]:
        command += ["-s", override]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        follower = wait_for("the first checkpoint", lambda: checkpointed(run_dir) and learner_rank(run_dir, 1),
                            proc, 900)
        leader = learner_rank(run_dir, 0)
        assert leader and leader != follower
        os.kill(follower, signal.SIGKILL)
        wait_for("both ranks of a new learner", lambda: learner_rank(run_dir, 1) not in (0, follower)
                 and learner_rank(run_dir, 0) not in (0, leader), proc, 300)
        output = proc.communicate(timeout=900)[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    log_text = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    assert proc.returncode == 0, output[-3000:] + log_text[-3000:]
    assert re.search(r"learner exited with [1-9]\d*; restart 1", output), output[-3000:]  # non-zero, no hang
    assert "resuming from" in log_text  # the restarted ranks resumed from the checkpoint

    rows = ledger(run_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    trained = [task for row in rows for task in row["trained"]]
    assert trained and len(trained) == len(set(trained))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["learner_world_size"] == 2 and summary["steps"] == STEPS
    newest = max(shared.glob("v*"), key=lambda folder: int(folder.name[1:]))
    shards = {path.name.split("-")[1] for path in newest.glob("*.safetensors")}
    assert shards == {"rank000", "rank001"}, sorted(newest.iterdir())  # each rank wrote its share
    generator_log = (run_dir / "logs" / "generator-0.log").read_text(errors="replace")
    loaded = [int(v) for v in re.findall(r"now serving weights v(\d+)", generator_log)]
    assert loaded and max(loaded) >= 1, generator_log[-3000:]  # versions two ranks wrote, loaded into vLLM
