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
import re
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
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4  # <linux/prctl.h>

# Names that say a credential whatever program set them (HF_TOKEN, WANDB_API_KEY, AWS_SECRET_ACCESS_KEY, PGPASSWORD,
# SSH_AUTH_SOCK), as words between underscores (TOKENIZERS_PARALLELISM is not one) or anywhere for the unambiguous.
CREDENTIAL_WORDS = frozenset({"TOKEN", "KEY", "APIKEY", "AUTH", "COOKIE", "PRIVATE", "PASS", "PASSPHRASE", "JWT",
                              "DSN"})
CREDENTIAL_PARTS = ("PASSWORD", "PASSWD", "SECRET", "CREDENTIAL")
# A value holding a credential: a URL with userinfo (redis://user:pass@host, a Sentry DSN's key@host, a proxy with
# credentials), or an HTTP authorization (OTEL_EXPORTER_OTLP_HEADERS=Authorization=Bearer ...).
CREDENTIAL_VALUE = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s@]+@|\b(bearer|basic)\s+\S", re.IGNORECASE)


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
    libc = _libc()  # loaded before the fork

    def arm() -> None:
        _arm_parent_death(libc, signum, parent)

    return arm


def die_with_launcher(signum: int = signal.SIGTERM) -> bool:
    """In a process torchrun started (a learner rank: $TORCHELASTIC_RUN_ID set): get `signum` when torchrun dies,
    even by SIGKILL. torchrun starts each rank in a session of its own, so a torchrun killed outright left its ranks
    running (holding the run, its port and the GPUs) where no one looks for them. Armed after the interpreter has
    started: a torchrun that died before then is not seen. Returns whether it is armed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or (libc := _libc()) is None:
        return False
    return _arm_parent_death(libc, signum, os.getppid())


def _libc() -> ctypes.CDLL | None:
    return ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _arm_parent_death(libc: ctypes.CDLL | None, signum: int, parent: int) -> bool:
    if libc is None or libc.prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)  # the parent died before the prctl: no one else will send it
    return True


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
    """Drop the variables that carry a secret from this process's environment once its settings hold what it needs:
    the project's own (the token, Redis passwords and URLs, a private key) and any other that looks like a credential
    (`looks_secret`: HF_TOKEN, a cloud key, a URL with a password). The processes it starts from then on inherit none
    (the reward role's verifier children run the code that parses what generators wrote). Returns the names dropped."""
    from services.config import secret_variables

    secret = secret_variables()
    dropped = [name for name, value in os.environ.items() if name.upper() in secret or looks_secret(name, value)]
    for name in dropped:
        del os.environ[name]
    return dropped


def looks_secret(name: str, value: str) -> bool:
    """Whether an environment variable looks like a credential, by its name or by its value. The project's own
    `DAPO_` variables are judged by the config's types alone (`secret_variables`): a field such as
    `DAPO_LEARNER__COMPUTE__SHARE_PROMPT_PASS` is a setting, not a pass."""
    upper = name.upper()
    if upper.startswith("DAPO_"):
        return False
    return (bool(CREDENTIAL_WORDS.intersection(upper.split("_"))) or any(part in upper for part in CREDENTIAL_PARTS)
            or CREDENTIAL_VALUE.search(value) is not None)


def hide_from_same_user() -> bool:
    """Make this process non-dumpable (Linux's PR_SET_DUMPABLE 0): its /proc/PID/environ, mem, maps and fd become
    root's, and no process of the same user may ptrace it. A sibling role of `dapo run`, or code a hostile response
    got to run in a verifier, then cannot read the secrets this process was started with or holds in memory. Reset
    by execve, so every service sets it for itself; forked children keep it. Costs: no core dumps, and py-spy, gdb
    or a library that passes file descriptors with pidfd_getfd need root's CAP_SYS_PTRACE; `DAPO_DUMPABLE=1` keeps a
    service dumpable. Returns whether it is set (False off Linux, or when kept)."""
    if not sys.platform.startswith("linux") or os.environ.get("DAPO_DUMPABLE") == "1":
        return False
    return _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0
