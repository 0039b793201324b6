"""The learner's single-writer lease: one learner per run, so two never push tasks, publish weight versions or
write checkpoints into the same run (a second `dapo learner`, or a pod left running on a partitioned node while
its replacement starts: `strategy: Recreate` does not cover that).

The lease is the Redis key `learner-lease` of the run (under `streams.run_prefix`), holding the holder's instance,
`identity@host:pid`, with a TTL of `learner.lease_ttl_s`. The identity is random, or `$DAPO_LEARNER_INSTANCE`: a
supervisor that restarts its own learner gives every restart the same one, so that a restart after a crash can
take its predecessor's lease back at once instead of one TTL later.

- **acquire** (rank 0, before it writes anything of the run): SET NX PX. Held by another instance: wait up to
  one TTL (a learner that just died holds it until then), then fail (`LeaseHeld`, exit 69) naming the holder.
- **renew** from a daemon thread every TTL/6, compare-and-set: PEXPIRE only while the value is ours. Each
  renewal is one attempt on a client of its own (no retries: they would outlast the lease).
- **lost**: a watchdog thread, which does no I/O (its last log line is waited for a second at most), ends the
  process (`os._exit(ExitCode.LEASE_LOST)`) once no renewal has got through for TTL/2, whatever a renewal under way
  is blocked on (Redis unreachable, this learner cut off from it while the disk is still there): before the TTL can
  run out and another learner take the run. A process frozen past the TTL cannot end itself: it reads its clock
  again before a checkpoint's commit, and asks Redis whose run it is the moment before (`confirm`). A renewal that
  finds the key gone after the watchdog's bound (the process was frozen past it) is lost too, never taken again; its
  supervisor restarts it, and it resumes once Redis is back. Gone within the bound is Redis's doing (its clock
  stepped ahead, which a TTL, kept as a date, follows; or it lost the key): the key is put back, and the learner
  goes on.
- **fence**: the key holds another instance's id (this learner lost the lease, and another one took the run):
  log critical and end the process at once (`os._exit(ExitCode.FENCED)`), writing nothing more.
- **release** on a clean exit (delete only if ours), so a restart does not wait one TTL.
- **own identity** (a restart under the same supervisor): taken over (compare-and-set) at once when the
  predecessor's process is gone (this host, no such pid); a predecessor that may be alive (a rank 0 outliving its
  torchrun, or another host) is waited for like any other holder.
- Clock: CLOCK_BOOTTIME, which counts a suspended host's sleep (CLOCK_MONOTONIC does not).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

import redis

from services.config import Settings
from services.errors import ExitCode, Unavailable
from services.redis_local import before_retry, connect, retry_redis
from services.startup import record_exit
from services.streams import run_prefix

log = logging.getLogger(__name__)

LEASE_KEY = "learner-lease"

# KEYS: lease. ARGV: instance id, TTL ms. Ours: extend it (1). Gone: put ours back (2; the caller is lost and
# exits, and no other learner takes the run before it is gone). Else: the holder's id.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if not holder then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 2
end
return holder
"""

# KEYS: lease. ARGV: the predecessor's value, ours, TTL ms. Replace it only if it still holds that predecessor.
_TAKE_OVER = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
  return 1
end
return 0
"""

# KEYS: lease. ARGV: instance id. Delete it only if it is ours.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseHeld(Unavailable):
    """Another live learner holds the run's lease."""


class LeaseGone(RuntimeError):
    """Raised on a thread that asks (`check`) once another found the lease lost or fenced and is ending the
    process: that thread writes nothing more meanwhile."""


INSTANCE_ENV = "DAPO_LEARNER_INSTANCE"


def now() -> float:
    """Seconds on a clock that also runs while the host is suspended (the TTL in Redis runs on meanwhile)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME) if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic()


def identity() -> str:
    """Who this learner is to the lease: the supervisor's identity, the same for its restarts, else unique."""
    return os.environ.get(INSTANCE_ENV) or uuid.uuid4().hex[:12]


def process_gone(place: str) -> bool:
    """Whether `host:pid` names a process of this host that no longer exists (elsewhere: not known, False)."""
    host, _, pid = place.rpartition(":")
    if host != socket.gethostname() or not (pid.isascii() and pid.isdigit()):  # a word read from Redis
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def log_bounded(message: str, wait_s: float = 1.0) -> None:
    """Log `message` (critical), waiting for it `wait_s` at most: the line before a lost or fenced learner ends
    must not keep it running (a log folder on a volume that hangs with the partition that cut Redis off)."""
    logged = threading.Thread(target=log.critical, args=(message,), name="learner-lease-log", daemon=True)
    try:
        logged.start()
    except RuntimeError:  # no thread to be had (a process limit): the exit matters, not the line
        return
    logged.join(wait_s)


def exit_fenced(holder: str) -> None:
    """The default reaction to a fence: end the process at once (no atexit, no finally: nothing more written)."""
    record_exit(ExitCode.FENCED)
    os._exit(ExitCode.FENCED)


def exit_lost(seconds: float) -> None:
    """The default reaction to a lease that could not be renewed in time: end the process at once, as above."""
    os._exit(ExitCode.LEASE_LOST)  # not recorded (no I/O on the watchdog's path): 74 and torchrun's 1 both restart


class LearnerLease:
    def __init__(self, settings: Settings, *, ttl_s: float | None = None,
                 on_fenced: Callable[[str], None] = exit_fenced, on_lost: Callable[[float], None] = exit_lost):
        self.ttl_s = float(settings.learner.lease_ttl_s if ttl_s is None else ttl_s)
        self.interval_s = self.ttl_s / 6
        # One attempt per command within one renewal interval: a renewal must fail in time, not retry past the TTL.
        self.redis = connect(settings, reply_timeout_s=self.interval_s, retrying=False)
        self.key = run_prefix(settings) + LEASE_KEY  # streams.run_prefix: the owner of the run's key names
        self.run = settings.redis.run
        self.identity = identity()
        self.instance = f"{self.identity}@{socket.gethostname()}:{os.getpid()}"
        self.on_fenced = on_fenced
        self.on_lost = on_lost
        # Taking the lease needs memory: what frees a full Redis first (the learner's trim; its renewal needs none).
        self.on_full: Callable[[], object] | None = None
        self._renewed_at = 0.0  # when the last renewal that got through was sent
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)
        self._take_over = self.redis.register_script(_TAKE_OVER)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.ended: str | None = None  # why the lease is lost or fenced, set before the process is ended

    @property
    def ttl_ms(self) -> int:
        return max(1, int(self.ttl_s * 1000))

    def holder(self) -> str | None:
        value = self.redis.get(self.key)
        return None if value is None else value.decode(errors="replace")

    def try_acquire(self) -> bool:
        return bool(self.redis.set(self.key, self.instance, nx=True, px=self.ttl_ms))

    def acquire(self) -> "LearnerLease":
        """Take the lease, waiting up to one TTL for a holder's to lapse, and keep it renewed; LeaseHeld if the
        holder kept it. Redis errors at start are retried as by every client (services.redis_local)."""
        def attempt() -> None:
            try:
                self._acquire()
            except redis.ResponseError as err:
                before_retry(err, self.redis, self.on_full)
                raise

        retry_redis(attempt)()
        log.info("learner lease on run %s taken by %s (TTL %.0f s)", self.run, self.instance, self.ttl_s)
        self._stop.clear()
        self._threads = [threading.Thread(target=loop, name=f"learner-lease-{loop.__name__}", daemon=True)
                         for loop in (self._renew_loop, self._watch_loop)]
        for thread in self._threads:
            thread.start()
        return self

    def _acquire(self) -> None:
        deadline, poll = None, min(0.5, self.ttl_s / 10)
        while True:
            sent = now()
            if self.try_acquire():
                break
            holder = self.holder()
            if holder is None:  # lapsed between the two calls
                continue
            if holder == self.instance:  # our SET went through, its reply was lost (the call was retried)
                break
            same, _, place = holder.partition("@")
            if same == self.identity and process_gone(place):  # a predecessor under this supervisor, gone
                sent = now()
                if self._take_over(keys=[self.key], args=[holder, self.instance, self.ttl_ms]) == 1:
                    log.info("took over the lease of %s, a predecessor of this learner that is gone", holder)
                    break
                continue
            if deadline is None:  # one TTL: ours, or the holder's (what its lease has left), if longer
                left_s = max(self.redis.pttl(self.key), 0) / 1000
                deadline = time.monotonic() + max(self.ttl_s, left_s) + poll
                log.warning("the run %s is held by learner %s: waiting up to %.0f s for its lease to lapse (a "
                            "learner that just died holds it that long)", self.run, holder, deadline - time.monotonic())
            if time.monotonic() >= deadline:
                raise LeaseHeld(
                    f"another learner ({holder}) holds the run {self.run} (Redis key {self.key}): stop it first, "
                    f"or wait {self.ttl_s:.0f} s if it just died"
                )
            time.sleep(poll)
        self._renewed_at = sent

    def renew(self) -> str:
        """One compare-and-set: "renewed"; "lapsed" (the key is gone: lost, the callback has been called); or
        "fenced" (another holds it; the fence callback has been called)."""
        sent = now()
        result = self._renew(keys=[self.key], args=[self.instance, self.ttl_ms])
        if result == 1:
            self._renewed_at = sent  # Redis extended it after `sent`: the lease runs at least TTL from there
            return "renewed"
        if result == 2 and sent - self._renewed_at <= self.ttl_s / 2:
            # Gone though renewed within the watchdog's bound: not this process's lapse but Redis's (its clock
            # stepped ahead past the TTL, which it keeps as a date, or it lost the key); nobody held it when the
            # script put ours back, and no learner can have taken the run and let it go in so short a time.
            log.warning("the learner lease was gone %.1f s after its last renewal (Redis's clock jumped ahead, or it "
                        "lost the key): put back", sent - self._renewed_at)
            self._renewed_at = sent
            return "renewed"
        if result == 2:  # the script put ours back: no other learner takes the run before this process is gone
            self._lost("the lease had lapsed (the process was frozen past its TTL)")
            return "lapsed"
        holder = result.decode(errors="replace") if isinstance(result, bytes) else str(result)
        self.ended = f"fenced by {holder}"
        log_bounded(f"FENCED: learner {self.instance} lost the run {self.run} to learner {holder}; exiting at once "
                    f"with code {ExitCode.FENCED}, writing nothing more")
        self.on_fenced(holder)
        return "fenced"

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                if self.renew() != "renewed":
                    return
            except Exception as err:  # Redis not reached in time: no fence, but the watchdog's clock runs on
                log.warning("learner lease renewal failed (%s)", err)

    def _watch_loop(self) -> None:
        """No I/O here: a renewal blocked on a socket must not keep the process writing past TTL/2."""
        while not self._stop.wait(self.interval_s / 2):
            self.check()  # lost: `_lost` sets _stop, which ends the loop

    def check(self) -> None:
        """The watchdog's test, also on the caller's thread before a write only the run's learner may make (a
        checkpoint becoming `latest`): a process frozen past TTL/2 that wakes up mid-checkpoint must not commit it
        before the watchdog's thread gets to run. LeaseGone once another thread found it lost or fenced (it is ending
        the process, after its last log line)."""
        if self.ended is not None:
            raise LeaseGone(f"learner lease {self.ended}: the process is ending")
        if now() - self._renewed_at > self.ttl_s / 2:
            self._lost(f"no renewal reached Redis for {now() - self._renewed_at:.0f} s")

    def confirm(self) -> None:
        """Just before a write only the run's learner may make (a checkpoint becoming `latest`, which removes the
        later steps and unfinished writes it finds): the watchdog's test, then one renewal from this thread, a round
        trip to Redis that fences a learner whose key another holds now (or ends one whose key lapsed), whatever its
        own clock says. Redis not reached in time: the watchdog's bound decides, as ever."""
        self.check()
        if self.ended is not None:
            return
        try:
            self.renew()
        except redis.RedisError as err:
            log.warning("learner lease not confirmed before a commit (%s): renewed %.1f s ago", err,
                        now() - self._renewed_at)

    def _lost(self, why: str) -> None:
        if self.ended is not None or self._stop.is_set():  # the other thread got here first, or released meanwhile
            return
        self.ended = f"lost: {why}"
        self._stop.set()
        silent_s = now() - self._renewed_at
        log_bounded(f"LEASE LOST: {why} (learner {self.instance}, TTL {self.ttl_s:.0f} s): another learner may take "
                    f"the run; exiting at once with code {ExitCode.LEASE_LOST}, writing nothing more (restarted, it "
                    "resumes once Redis is back)")
        self.on_lost(silent_s)

    def stop_renewing(self) -> None:
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=max(5.0, self.ttl_s))
        self._threads = []

    def release(self) -> bool:
        """Stop renewing and delete the lease if it is still ours (a clean exit: a restart need not wait)."""
        self.stop_renewing()
        try:
            released = bool(self._release(keys=[self.key], args=[self.instance]))
        except redis.RedisError as err:
            log.warning("could not release the learner lease (%s): it lapses in %.0f s", err, self.ttl_s)
            return False
        if released:
            log.info("learner lease on run %s released", self.run)
        return released
