"""`dapo ranks -- accelerate launch ... -m cli learner`: a multi-rank learner that exits with its rank 0's code.

torchrun (under `accelerate launch`) reports any end but a clean one of every rank as 1: a learner stopped at the
refill limit (3), fenced by another learner (75) or missing a dependency (69) would show as a crash. This wrapper
runs the command with $DAPO_EXIT_FILE set (services/startup.py: global rank 0 writes the code it chose there) and
exits with that code, or with the command's own when no rank 0 of this machine recorded one (it crashed or was
killed first, or it runs on another node; a death by signal as 128 + the signal, as a shell reports it).

Signals: SIGTERM and SIGINT are passed on to the command, which runs in a session of its own, so a terminal's
Ctrl-C reaches torchrun once (a second signal makes rank 0 stop without its checkpoint). The handlers are in
place before the command starts (a container's PID 1 drops a signal it has no handler for): a signal that comes
first is passed on as soon as the command exists. `dapo run --learner-procs K` does the same itself
(cli/launcher.py).
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


SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def shutdown_timeout_ignored() -> str | None:
    """Why torchrun will not give the ranks the stop time $TORCH_ELASTIC_SHUTDOWN_TIMEOUT asks for (None: it
    will, or none is asked for): torchrun reads it from torch 2.12 on (before: SIGKILL 30 s after SIGTERM, so the
    learner's step, publish and checkpoint after a stop never end)."""
    if not os.environ.get(SHUTDOWN_TIMEOUT_ENV):
        return None
    try:
        from torch.distributed.launcher.api import LaunchConfig
    except ImportError:
        return None  # no torch here: the command brings its own
    if "shutdown_timeout" in getattr(LaunchConfig, "__dataclass_fields__", {}):
        return None
    import torch

    return (f"dapo ranks: this torch ({torch.__version__}) has a torchrun that ignores {SHUTDOWN_TIMEOUT_ENV} "
            f"(torch >= 2.12 reads it): a stop SIGKILLs the ranks 30 s after SIGTERM, before their checkpoint")


def run_ranks(command: list[str]) -> int:
    """Run `command` and return the exit code its rank 0 recorded, else its own."""
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        print("dapo ranks: no command given, e.g. dapo ranks -- accelerate launch -m cli learner", file=sys.stderr)
        return 2
    child: list[subprocess.Popen] = []  # set once started
    early: list[int] = []  # signals that came before the command existed

    forwarded: list[int] = []  # signals passed on: a stop rank 0 records is then this wrapper's

    def forward(signum: int, _frame) -> None:
        if child:
            forwarded.append(signum)
            child[0].send_signal(signum)
        else:
            early.append(signum)

    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    if ignored := shutdown_timeout_ignored():  # (after the handlers: it imports torch, a second's window)
        print(ignored, file=sys.stderr)
    try:
        with tempfile.TemporaryDirectory(prefix="dapo-ranks-") as folder:
            exit_path = Path(folder) / "learner.exit"
            try:
                process = subprocess.Popen(command, env={**os.environ, EXIT_FILE_ENV: str(exit_path)},
                                           start_new_session=True)
            except OSError as err:
                print(f"dapo ranks: cannot start {command[0]!r}: {err}", file=sys.stderr)
                return 127
            child.append(process)
            for signum in early[:1]:  # one stop request: a second one would skip rank 0's checkpoint
                process.send_signal(signum)
            returncode = process.wait()
            own = 128 - returncode if returncode < 0 else returncode
            code = recorded_exit(exit_path, own)
            if code in (128 + signal.SIGTERM, 128 + signal.SIGINT) and not early and not forwarded and own != 0:
                # rank 0 was stopped by torchrun, not by us: another rank failed first (torchrun's own code)
                print(f"dapo ranks: rank 0 stopped on a signal this wrapper did not pass on (torchrun's, after "
                      f"another rank failed or was stopped): torchrun's exit {own}", file=sys.stderr)
                return own
            return code
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
