"""The kernel's error types and every exit code of `dapo`, in one place that imports nothing of the project.

A service exits with one of `ExitCode`; `dapo run`'s launcher reads it to decide whether to restart (Compose's
`on-failure` restarts any code but 0, Kubernetes any code: there it tells the operator). sysexits(3) codes where
one fits. Beside these: 1 (a crash, torchrun's own failure, `dapo plan`'s misfit), 64 (the image's entry point: a
secret file missing), 127 (`dapo ranks` cannot start its command).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    OK = 0
    USAGE = 2  # a bad argument or configuration (argparse's own code): fix the command
    REFILL_LIMIT = 3  # the learner stopped at learner.batch.max_refills (on_refill_limit: stop); the stop is recorded
    DATA_ERROR = 65  # EX_DATAERR: a data file cannot be used; a restart would fail the same way
    UNAVAILABLE = 69  # EX_UNAVAILABLE: a dependency (Redis, a key, the model) is missing; fix it and start again
    STALLED = 70  # EX_SOFTWARE: the generator's rollout loop hung (generator.stall_timeout_s); restart it
    LEASE_LOST = 74  # EX_IOERR: no lease renewal reached Redis for TTL/2; restarted, the learner resumes
    FENCED = 75  # EX_TEMPFAIL: another learner took the run; this one stopped without writing more
    SIGNALLED = 128  # + the signal's number (143 SIGTERM, 130 SIGINT): stopped, with a checkpoint, before the run's
    # end; restarted unless the supervisor sent the signal itself


class Unavailable(RuntimeError):
    """A dependency is not there; the message says what was tried and what to do (exit ExitCode.UNAVAILABLE)."""
