"""How a service starts: it checks its dependencies before loading anything heavy, and a signal stops it at once
while it starts.

The `dapo` command line installs `raise_on_signals` before it runs a service and turns these exceptions into
one line and an exit code; a service replaces the handlers with its graceful stop once it is up.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import sys
import threading
from pathlib import Path
from typing import IO, Callable

from services.files import write_atomic

# Where a service writes the code it chose to exit with, for a supervisor that cannot see it: under `accelerate
# launch` torchrun reports any rank's failure as 1 (and a SIGTERMed run's as 1 too), so a learner fenced or
# stopped at the refill limit would look like a crash and be restarted (cli/launcher.py reads the file).
EXIT_FILE_ENV = "DAPO_EXIT_FILE"
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def record_exit(code: int) -> None:
    """Write the exit code rank 0 (or a single process) chose to $DAPO_EXIT_FILE, when set: the other ranks follow
    rank 0, and their codes (stopped by torchrun after rank 0 went) are consequences. Written whole or not at all;
    best effort: exiting matters more."""
    path = os.environ.get(EXIT_FILE_ENV)
    if not path or os.environ.get("RANK", "0") != "0":
        return

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


@contextlib.contextmanager
def signals_deferred():
    """Hold the Python signal handlers back while the block runs, then run them for what arrived. `raise_on_signals`
    raises wherever the main thread is: inside threading's own bookkeeping (a `Thread.start`, an `Event.wait` under
    a lock) the exception can leave a lock held that a later thread start then waits on forever. A block that
    starts threads runs under this, and the exception lands after it. (Blocking the signals instead would not do:
    another thread receives them, and Python still runs the handler in the main thread at once.)"""
    if threading.current_thread() is not threading.main_thread():  # handlers only ever run in the main thread
        yield
        return
    arrived: list[int] = []
    held = {}
    for signum in signal.valid_signals():
        if callable(signal.getsignal(signum)):
            held[signum] = signal.signal(signum, lambda received, _frame: arrived.append(received))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        for signum in arrived:
            signal.raise_signal(signum)  # handled now, as it would have been


def die_with_parent(signum: int = signal.SIGTERM) -> Callable[[], None]:
    """A `preexec_fn` for subprocess.Popen: the child gets `signum` when this process dies, even by SIGKILL
    (Linux's PR_SET_PDEATHSIG; elsewhere it does nothing). Start the child from a thread that lives as long as the
    process: the signal comes when the thread that started the child ends."""
    parent = os.getpid()
    libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None  # loaded before the fork

    def arm() -> None:
        if libc is not None and libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0 and os.getppid() != parent:
            os.kill(os.getpid(), signum)  # the parent died before the prctl: no one else will send it

    return arm


class LockHeld(RuntimeError):
    """Another process holds the lock; `holder` is what it wrote into the lock file."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def take_lock(path: Path) -> IO[str]:
    """An exclusive flock on `path`, the file emptied for the new holder to write its name; held while the returned
    file (or a child's inherited copy) stays open, dropped by the kernel when its holders die. LockHeld if taken."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "a process that has not written its name yet"
        handle.close()
        raise LockHeld(holder) from None
    handle.truncate(0)
    return handle


def scrub_secret_environment() -> list[str]:
    """Drop the variables that carry a secret (the token, Redis passwords and URLs, a private key) from this process's
    environment once its settings hold them: the processes it starts from then on inherit none (the reward role's
    verifier children run the code that parses what generators wrote). Returns the names dropped."""
    from services.config import secret_variables

    secret = secret_variables()
    dropped = [name for name in os.environ if name.upper() in secret]
    for name in dropped:
        del os.environ[name]
    return dropped
