"""How a service starts: it checks its dependencies before loading anything heavy, and a signal stops it at once
while it starts.

The `dapo` command line installs `raise_on_signals` before it runs a service and turns these exceptions into
one line and an exit code; a service replaces the handlers with its graceful stop once it is up.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: a dependency is missing; fix it and start again
EXIT_DATA_ERROR = 65  # sysexits EX_DATAERR: a data file cannot be used; a restart would fail the same way
# Where a service writes the code it chose to exit with, for a supervisor that cannot see it: under `accelerate
# launch` torchrun reports any rank's failure as 1 (and a SIGTERMed run's as 1 too), so a learner fenced or
# stopped at the refill limit would look like a crash and be restarted (cli/launcher.py reads the file).
EXIT_FILE_ENV = "DAPO_EXIT_FILE"


def record_exit(code: int) -> None:
    """Write the exit code rank 0 (or a single process) chose to $DAPO_EXIT_FILE, when set: the other ranks follow
    rank 0, and their codes (stopped by torchrun after rank 0 went) are consequences. Written whole or not at all;
    best effort: exiting matters more."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return
    from services.weights_layout import write_atomic  # lazily: it imports torch, which a config error never needs

    try:
        write_atomic(Path(path), f"{code}\n")
    except OSError:
        pass


def recorded_exit(path: Path, returncode: int) -> int:
    """The code a service recorded at `path` (record_exit), else the process's own `returncode`: it crashed, or was
    killed, before it could record one."""
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return returncode


class Unavailable(RuntimeError):
    """A dependency is not there; the message says what was tried and what to do."""


class Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived before the service could stop gracefully (a KeyboardInterrupt: never swallowed)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def raise_on_signals() -> None:
    """SIGINT and SIGTERM raise Stopped: loading, waiting or retrying ends at once (SIGINT too when inherited
    as ignored, as a shell does for a background job)."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, raise_stopped)
