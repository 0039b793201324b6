"""`dapo ranks -- accelerate launch ... -m cli learner`: a multi-rank learner that exits with its rank 0's code.

torchrun (under `accelerate launch`) reports any end but a clean one of every rank as 1: a learner stopped at the
refill limit (3), fenced by another learner (75) or missing a dependency (69) would look like a crash to a
container's restart policy. This wrapper runs the command with $DAPO_EXIT_FILE set (services/startup.py: rank 0
writes the code it chose there) and exits with that code, or with the command's own when rank 0 recorded none
(it crashed or was killed first; a death by signal as 128 + the signal, as a shell reports it). SIGTERM and SIGINT
are passed on to the command, so `docker stop` and a pod's termination still stop the ranks gracefully.
`dapo run --learner-procs K` does the same itself (cli/launcher.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from services.startup import EXIT_FILE_ENV, recorded_exit

FORWARDED = (signal.SIGTERM, signal.SIGINT)


def run_ranks(command: list[str]) -> int:
    """Run `command` and return the exit code its rank 0 recorded, else its own."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("dapo ranks: no command given, e.g. dapo ranks -- accelerate launch -m cli learner", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="dapo-ranks-") as folder:
        exit_path = Path(folder) / "learner.exit"
        try:
            process = subprocess.Popen(command, env={**os.environ, EXIT_FILE_ENV: str(exit_path)})
        except OSError as err:
            print(f"dapo ranks: cannot start {command[0]!r}: {err}", file=sys.stderr)
            return 127
        previous = {signum: signal.signal(signum, lambda signum, _frame: process.send_signal(signum))
                    for signum in FORWARDED}
        try:
            returncode = process.wait()
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return recorded_exit(exit_path, 128 - returncode if returncode < 0 else returncode)
