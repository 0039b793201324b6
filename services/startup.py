"""How a service starts: it checks its dependencies before loading anything heavy, and a signal stops it at once
while it starts.

The `dapo` command line installs `raise_on_signals` before it runs a service and turns these exceptions into
one line and an exit code; a service replaces the handlers with its graceful stop once it is up.
"""

from __future__ import annotations

import signal

EXIT_UNAVAILABLE = 69  # sysexits EX_UNAVAILABLE: a dependency is missing; fix it and start again


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
