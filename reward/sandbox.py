"""A process pool that verifies untrusted model text with a time and a memory limit per item.

The processes are `pebble.ProcessPool`'s: it starts the timeout of an item when a child picks it up (math-verify's
own limit uses SIGALRM, which works only in a main thread), kills and replaces a child that overruns it, and
replaces a child that dies. What is ours is the policy: `RLIMIT_AS` and the verifier's warm-up in every child
(before its first item), and the verdicts: an item that overruns gets `timeout`, one whose child died gets
`error`, and when no child can start at all (e.g. `memory_mb` too small to import sympy) the pool says so in
`broken` and answers `error` at once instead of waiting. One hostile response can never stall or crash the
service. When the pool itself fails while an item waits (pebble aborts every queued item once an idle child dies),
the item was not judged at all: its future raises `VerifierUnavailable` rather than passing for a wrong answer.

    with VerifierPool(workers=2, timeout_s=5, memory_mb=1024) as pool:
        verdicts = pool.verify_many([(response, ground_truth), ...])

`rule` chooses the answer rule every child applies (`ANSWER_RULES`: `robust`, the default, or `dapo`, the paper's
reference); `VerifierPool.from_config(settings.reward)` takes it, and the limits, from `reward.answer_rule`.

Thread safe: the stream worker and HTTP requests can share one pool.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import CancelledError, Future, InvalidStateError, TimeoutError
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import pebble.pool.base_pool
import pebble.pool.process
from pebble import ProcessExpired, ProcessPool

from reward.reference import verify_dapo
from reward.verify import RULE_ERROR, RULE_TIMEOUT, Verdict, verify
from services.config import RewardConfig
from services.startup import signals_deferred

log = logging.getLogger(__name__)



class RunningClock:
    """Monotonic seconds less the time this process was stopped: pebble times each item by it. pebble used the wall
    clock, whose steps (NTP at boot, a VM resumed) timed out every running item (honest answers scored -1) or
    switched the limit off for as long; and CLOCK_MONOTONIC counts the time a process group was stopped (SIGSTOP,
    Ctrl-Z, `docker pause`, a cgroup frozen), after which every item that was running timed out at once, its child
    frozen with it and its work not done. A stop shows as a gap between two readings: a thread reads the clock
    every TICK_S (`tick`), so a gap beyond STOP_GAP_S is taken for one (a thread merely starved that long gives the
    items that much more time, never less)."""

    TICK_S = 0.1
    STOP_GAP_S = 0.5

    def __init__(self):
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._stopped = 0.0
        self._ticking = False

    def __call__(self) -> float:
        with self._lock:
            now = time.monotonic()
            if now - self._last > self.STOP_GAP_S:
                self._stopped += now - self._last - self.TICK_S
            self._last = now
            return now - self._stopped

    def tick(self) -> None:
        """Read the clock every TICK_S from a thread of its own, for the life of the process (started once)."""
        with self._lock:
            if self._ticking:
                return
            self._ticking = True
            self._last = time.monotonic()

        def ticking() -> None:
            while True:
                self()
                time.sleep(self.TICK_S)

        threading.Thread(target=ticking, name="verifier-clock", daemon=True).start()


RUNNING_CLOCK = RunningClock()
for _module in (pebble.pool.process, pebble.pool.base_pool):
    _module.time = SimpleNamespace(**{**vars(time), "time": RUNNING_CLOCK})

# A child that has not finished importing math-verify by then is stuck (or the machine is).
STARTUP_TIMEOUT_S = 120.0
POOL_JOIN_S = 10.0  # how long close() waits for pebble's threads to end
WATCH_S = 1.0  # how often the pool is checked for pebble having given up on it while items wait

# `reward.answer_rule` -> the verifier a child runs (the names of services.config.RewardConfig.answer_rule).
ANSWER_RULES: dict[str, Callable[[str, str], Verdict]] = {"robust": verify, "dapo": verify_dapo}


CHILD_MAX_FILE_BYTES = 1 << 20  # RLIMIT_FSIZE: a verifier writes no file; a write past this kills it (SIGXFSZ)
CHILD_MAX_OPEN_FILES = 64  # RLIMIT_NOFILE: its pipes to the pool, and little else once the imports are done


CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000  # <sched.h>
UNPRIVILEGED_ID = 65534  # `nobody`: what a verifier started as root runs as (it owns no file and no secret)
CHILD_MAX_PROCESSES = 256  # RLIMIT_NPROC once it runs as `nobody`: the verifiers' processes and threads, all told


def isolate_network() -> str:
    """Move the calling process into a network namespace of its own, whose only interface is a loopback that is
    down: code a hostile response got to run in a verifier reaches no Redis, no service and no host. As root
    `unshare(CLONE_NEWNET)`; otherwise inside a new user namespace as well (`CLONE_NEWUSER`, where the kernel allows
    unprivileged ones; file access is unchanged). Returns what was done, or why not (a container without
    CAP_SYS_ADMIN under Docker's default seccomp profile refuses both: the other limits still hold)."""
    import ctypes
    import errno

    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    try:
        unshare = ctypes.CDLL(None, use_errno=True).unshare
    except (OSError, AttributeError) as err:  # not Linux
        return f"no network namespace: {err}"
    if unshare(flags) != 0:
        code = ctypes.get_errno()
        return f"no network namespace: unshare refused ({errno.errorcode.get(code, code)})"
    return "network namespace of its own" + ("" if os.geteuid() == 0 else " (in a user namespace)")


def drop_privileges() -> str:
    """Started as root, become `nobody` (no supplementary group, and a process limit that now counts the verifiers
    alone): code a hostile response got to run can read no file the services own (the role keys, the run's
    configuration, mode 0600) and fork no more than `CHILD_MAX_PROCESSES`. Not root: nothing to drop (a user's
    RLIMIT_NPROC would count every process of the services that share that user, so none is set)."""
    import resource

    if os.geteuid() != 0:
        return f"uid {os.geteuid()}, its service's"
    os.setgroups([])
    os.setgid(UNPRIVILEGED_ID)
    os.setuid(UNPRIVILEGED_ID)  # real, effective and saved: no way back
    resource.setrlimit(resource.RLIMIT_NPROC, (CHILD_MAX_PROCESSES, CHILD_MAX_PROCESSES))
    return f"uid {UNPRIVILEGED_ID} (nobody)"


def _start_child(memory_mb: int, ready) -> None:
    """Pebble initializer: a network namespace of its own (`isolate_network`, before any thread is started), the
    memory and file size limits, then the verifier's imports (a limit too small for them fails here, at startup, not
    as failed items; pebble logs the reason and the child exits), then, as root, the switch to `nobody`
    (`drop_privileges`, after the imports: they read the interpreter's files as the service does), the open files
    limit, and tell the parent its pid, its network isolation and its user."""
    import resource

    network = isolate_network()
    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    resource.setrlimit(resource.RLIMIT_FSIZE, (CHILD_MAX_FILE_BYTES, CHILD_MAX_FILE_BYTES))
    verify("Answer: $2\\sqrt{2}$", "\\sqrt{8}")
    user = drop_privileges()
    resource.setrlimit(resource.RLIMIT_NOFILE, (CHILD_MAX_OPEN_FILES, CHILD_MAX_OPEN_FILES))  # after the imports
    ready.put((os.getpid(), network, user))


def _verify_in_child(response: str, ground_truth: str, rule: str = "robust") -> Verdict:
    try:
        return ANSWER_RULES[rule](response, ground_truth)
    except BaseException as err:  # noqa: BLE001 - RecursionError, MemoryError, sympy internals, anything
        return Verdict(False, None, RULE_ERROR, f"{type(err).__name__}: {str(err)[:200]}")


class VerifierUnavailable(RuntimeError):
    """The verifier processes failed while the item waited; the item itself has no verdict (retry it later)."""


class Verification(Future):
    """Verdicts to come (one item's, or a batch's); `started()`: whether a child has taken any of its items."""

    def __init__(self, tasks: list[Future] | None = None):
        super().__init__()
        self.tasks = tasks or []  # pebble's futures of its items (a verdict given at once has none)

    def started(self) -> bool:
        return any(task.running() or (task.done() and not task.cancelled()) for task in self.tasks)


@dataclass
class PoolStats:
    verified: int = 0
    timeouts: int = 0
    errors: int = 0
    replaced: int = 0


class VerifierPool:
    """Verify (response, ground_truth) pairs in child processes with per-item time and memory limits."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        start_method: str = "spawn",
        rule: str = "robust",
    ):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if rule not in ANSWER_RULES:
            raise ValueError(f"unknown answer rule {rule!r} (one of {', '.join(ANSWER_RULES)})")
        self.rule = rule
        self.size = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.stats = PoolStats()
        self.broken: str | None = None  # why no child can start
        self._context = multiprocessing.get_context(start_method)
        self._pool: ProcessPool | None = None
        self._launched: threading.Event | None = None  # set once the current pool's children are spawned
        self._ready = self._context.SimpleQueue()  # pids of children that finished _start_child
        self._ready_pids: set[int] = set()
        # Read at once, whoever asks (`ready_workers`): a pipe nobody reads fills after some 600 replaced children,
        # and the next one then blocks in its start for good, before it takes an item (no time limit runs yet).
        threading.Thread(target=self._read_ready, name="verifier-ready", daemon=True).start()
        self.network = ""  # the children's network isolation, as the last one to start reported it
        self.user = ""  # and the user they run as
        self._pending: dict[Future, ProcessPool] = {}  # each unsettled verification, with the pool it waits in
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._watch, name="verifier-watch", daemon=True).start()
        RUNNING_CLOCK.tick()

    @classmethod
    def from_config(cls, cfg: RewardConfig, **kwargs) -> "VerifierPool":
        """The pool the reward settings describe: `workers`, `timeout_s`, `memory_mb` and `answer_rule`."""
        return cls(workers=cfg.workers, timeout_s=cfg.timeout_s, memory_mb=cfg.memory_mb, rule=cfg.answer_rule,
                   **kwargs)

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, wait_ready: bool = True) -> "VerifierPool":
        # A signal's exception never lands inside the launch thread's start (it could leave one of threading's locks
        # held, and the launch, holding ours, would wait on it forever); it may cut the wait short, and close()
        # stops what was launched.
        with signals_deferred(), self._lock:
            if self._launched is None:
                self._launched = self._launch(replacing=None)
            launched = self._launched
        launched.wait()
        if wait_ready:
            self.wait_ready()
        return self

    def _launch(self, replacing: ProcessPool | None) -> threading.Event:
        """Start a pool in place of `replacing` (None: the first), in a thread of its own that holds the lock until
        the children are spawned. Pebble spawns them on first use, in the calling thread; in the main thread a
        signal (`services.startup` raises there) could cut a spawn short of pebble recording the child: nobody would
        stop that child, and it would die on the semaphores the exiting parent removed, printing their traceback."""
        launched = threading.Event()

        def launch() -> None:
            try:
                with self._lock:
                    if not self._closed and self._pool is replacing:
                        self._pool = ProcessPool(max_workers=self.size, initializer=_start_child,
                                                 initargs=(self.memory_mb, self._ready), context=self._context)
                        self._pool.active  # noqa: B018 - pebble's first state check spawns the children
            finally:
                launched.set()

        threading.Thread(target=launch, name="verifier-launch", daemon=True).start()
        return launched

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> bool:
        """Block until every child has imported the verifier (so the first items are not slowed by startup); a pool
        whose children cannot start is marked `broken`."""
        _, probe = self._schedule("Answer: 1", "1")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if probe.done() and isinstance(probe.exception(), BrokenProcessPool):
                self.broken = "verifier processes cannot start (their log says why, e.g. a MemoryError)"
                log.error("%s; failing items", self.broken)
                return False
            if probe.done() and self.ready_workers() == self.size:
                return True
            time.sleep(0.02)
        return False

    def _read_ready(self) -> None:
        """Record each child that finished its start (until close() sends None)."""
        while (started := self._ready.get()) is not None:
            pid, network, user = started
            with self._lock:
                self._ready_pids.add(pid)
                if (network, user) != (self.network, self.user):
                    (log.info if network.startswith("network namespace") else log.warning)(
                        "verifier processes: %s, %s", network, user)
                    self.network, self.user = network, user

    def _watch(self) -> None:
        """Replace a pool pebble gave up on while items wait in it (`_replace_pool` fails them): a new item would
        find it so, but the stream worker submits none while it waits for a read's verdicts."""
        while not self._closed:
            time.sleep(WATCH_S)
            with self._lock:  # (a launch holds it until the new pool is started)
                pool = self._pool
                given_up = pool is not None and bool(self._pending) and not self._closed and not pool.active
            if given_up:
                log.warning("the verifier pool failed with items waiting: they are handed back, a new pool starts")
                self._replace_pool(pool)

    def ready_workers(self) -> int:
        """Live children that have imported the verifier."""
        with self._lock:
            self._ready_pids &= set(self.worker_pids())
            return 0 if self.broken else len(self._ready_pids)

    def worker_pids(self, pool: ProcessPool | None = None) -> list[int]:
        """PIDs of the live children (of `pool`, default the current one), for inspection and fault-injection
        tests (pebble has no public accessor)."""
        pool = pool or self._pool
        if pool is None:
            return []
        workers = pool._pool_manager.worker_manager.workers
        return [pid for pid, process in list(workers.items()) if process.is_alive()]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True  # a launch not begun yet will not begin; one under way has ended (it holds the lock)
            pending, self._pending = self._pending, {}
            pool = self._pool
        self._ready.put(None)
        for future in pending:
            _settle(future, error=RuntimeError("verifier pool closed"))
        if pool is not None:
            pool.stop()
            # pebble unlinks its channel's semaphores before it terminates its workers: a worker spawned a moment
            # ago, still unpickling them, would die of the missing semaphore with a traceback on our stderr. So the
            # workers go first, once pebble's manager thread (which replaces dead workers) has ended.
            manager = pool._pool_manager_loop
            if manager is not None:
                manager.join(timeout=10)
            for pid in self.worker_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            # pebble's join waits for its threads without a bound (its timeout is for the tasks): one reading a
            # message a killed worker had half written waits for the rest for ever. Its threads are daemons.
            joining = threading.Thread(target=pool.join, name="verifier-pool-join", daemon=True)
            joining.start()
            joining.join(timeout=POOL_JOIN_S)
            if joining.is_alive():
                log.warning("the verifier pool's threads did not end within %.0f s (a worker killed mid-message): "
                            "left behind, they end with the process", POOL_JOIN_S)
                multiprocessing.active_children()  # reaps the killed workers its join did not get to

    def __enter__(self) -> "VerifierPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- API ---------------------------------------------------------------------------------------------

    def submit(self, response: str, ground_truth: str) -> Verification:
        """Queue one verification; the future resolves to a Verdict (never raises for bad input)."""
        if self.broken:
            verdict = Verification()
            verdict.set_result(Verdict(False, None, RULE_ERROR, self.broken))
            return verdict
        return self._track(*self._schedule(response, ground_truth))

    def submit_many(self, pairs: list[tuple[str, str]]) -> Verification:
        """Queue (response, ground_truth) pairs; the future resolves to their Verdicts, in order.

        Cancelling the future drops its items that no child has started yet (and stops those running).
        """
        if not pairs:
            batch = Verification()
            batch.set_result([])
            return batch
        items = [self.submit(response, truth) for response, truth in pairs]
        batch = Verification([task for item in items for task in item.tasks])
        remaining = [len(items)]

        def on_item(_done: Future) -> None:
            with self._lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last:
                try:
                    _settle(batch, result=[item.result() for item in items])
                except (RuntimeError, CancelledError) as err:  # the pool closed, or the batch was cancelled
                    _settle(batch, error=err)

        for item in items:
            item.add_done_callback(on_item)
        batch.add_done_callback(lambda b: b.cancelled() and [item.cancel() for item in items])
        return batch

    def verify_many(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        """Verdicts for (response, ground_truth) pairs, in order."""
        return self.submit_many(pairs).result()

    def verify(self, response: str, ground_truth: str) -> Verdict:
        return self.submit(response, ground_truth).result()

    # ---- policy: pebble outcomes to verdicts -------------------------------------------------------------

    def _schedule(self, response: str, ground_truth: str) -> tuple[ProcessPool, Future]:
        if self._closed:
            raise RuntimeError("verifier pool closed")
        self.start(wait_ready=False)
        pool = self._pool
        if pool is not None and not pool.active:  # pebble gave up on it: a child died while no item ran
            self._replace_pool(pool)
            self.start(wait_ready=False)
            pool = self._pool
        if pool is None:  # closed while it waited for the launch
            raise RuntimeError("verifier pool closed")
        return pool, pool.schedule(_verify_in_child, args=(response, ground_truth, self.rule), timeout=self.timeout_s)

    def _track(self, pool: ProcessPool, task: Future) -> Verification:
        """A future of the task's Verdict, which close() can fail (pebble's own are cancelled by stop())."""
        verdict = Verification([task])
        with self._lock:
            replaced = self._pool is not pool  # given up on between its schedule and now: `_replace_pool` missed it
            if not replaced:
                self._pending[verdict] = pool
        if replaced:
            task.cancel()
            _settle(verdict, error=VerifierUnavailable("verifier processes died; pool restarted"))
            return verdict
        verdict.add_done_callback(lambda v: v.cancelled() and task.cancel())

        def on_done(done: Future) -> None:
            with self._lock:
                self._pending.pop(verdict, None)
            try:
                _settle(verdict, result=self._verdict(pool, done))
            except VerifierUnavailable as err:
                _settle(verdict, error=err)
            except Exception as err:  # noqa: BLE001 (pebble's own failure of any kind: no verdict, and no wait)
                _settle(verdict, error=VerifierUnavailable(f"the verifier pool failed: {type(err).__name__}: {err}"))

        task.add_done_callback(on_done)
        return verdict

    def _verdict(self, pool: ProcessPool, task: Future) -> Verdict:
        """The item's verdict; `VerifierUnavailable` when the pool, not the item, failed (a wrong answer would
        be a false label)."""
        try:
            verdict = task.result()
        except CancelledError as err:  # by pebble: the pool stopped (replaced or closed) before the item ran
            raise VerifierUnavailable("verification cancelled: the verifier pool stopped") from err
        except TimeoutError:
            self.stats.timeouts += 1
            self.stats.replaced += 1
            return Verdict(False, None, RULE_TIMEOUT, f"verification exceeded {self.timeout_s:g} s")
        except ProcessExpired as err:
            self.stats.errors += 1
            self.stats.replaced += 1
            return Verdict(False, None, RULE_ERROR, f"verifier process died (exit code {err.exitcode})")
        except BrokenProcessPool as err:
            self._replace_pool(pool)
            raise VerifierUnavailable("verifier processes died; pool restarted") from err
        self.stats.verified += 1
        if verdict.rule == RULE_ERROR:
            self.stats.errors += 1
        return verdict

    def _replace_pool(self, broken: ProcessPool) -> None:
        """Pebble gives up on a pool in which a child died while no item ran; start a new one (once). Every item
        still waiting in the broken one is unavailable: pebble fails only those it had written to a child's pipe
        (about one item of tens of KB), and the rest, queued in this process, would wait for ever (the stream
        worker with them, renewing its claims)."""
        with self._lock:
            if self._pool is not broken or self._closed:
                return
            self._launched = self._launch(replacing=broken)
            stranded = [verdict for verdict, pool in self._pending.items() if pool is broken]
            for verdict in stranded:
                del self._pending[verdict]
        for verdict in stranded:
            _settle(verdict, error=VerifierUnavailable("verifier processes died; pool restarted"))
        broken.stop()
        # pebble stops a pool's children only in join(), which its own callback threads (this may be one) cannot
        # call: the surviving children would wait on the dead pool's pipe for the life of the service.
        for pid in self.worker_pids(broken):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        threading.Thread(target=broken.join, kwargs={"timeout": 10}, name="verifier-reap", daemon=True).start()


def _settle(future: Future, *, result=None, error: BaseException | None = None) -> None:
    """Resolve a future unless it already is (a cancelled batch, a closed pool)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
