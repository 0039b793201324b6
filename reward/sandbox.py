"""A process pool that verifies untrusted model text with a time and a memory limit per item.

Each worker is a spawned child process with `RLIMIT_AS` set before it imports the verifier, talking to the
parent over a pipe. The parent's dispatcher thread keeps a few items queued in each child's pipe (so a child
never waits for a round trip between two items) and enforces the time limit, from outside, on the item the
child is working on (math-verify's own limit uses SIGALRM, which works only in a main thread). A child that
overruns its limit is killed and replaced, a child that dies is replaced; that item gets an incorrect verdict
with the reason (`timeout` or `error`) and the items queued behind it go to another child. One hostile
response can never stall or crash the service.

    with VerifierPool(workers=2, timeout_s=5, memory_mb=1024) as pool:
        verdicts = pool.verify_many([(response, ground_truth), ...])

Thread safe: the stream worker and HTTP requests can share one pool.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import os
import selectors
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from reward.verify import RULE_ERROR, RULE_TIMEOUT, Verdict

log = logging.getLogger(__name__)

# A child that has not finished importing math-verify by then is stuck (or the machine is); replace it.
STARTUP_TIMEOUT_S = 120.0
# After this many children in a row fail to start (e.g. memory_mb too small to import sympy) the pool is broken:
# items get an `error` verdict at once instead of waiting for a child that will never come.
MAX_STARTUP_FAILURES = 3
# Items sent ahead to a child beyond the one it works on, and their size bound: the bytes in flight stay far below
# a socket buffer, so the dispatcher's send never blocks behind a child that hangs (the limit could not fire).
PREFETCH = 4
PREFETCH_MAX_CHARS = 16_000


def _child_main(conn: Connection, memory_mb: int) -> None:
    """Worker process: set the memory limit, import the verifier, then verify items until told to stop."""
    import resource

    limit = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        from reward.verify import verify

        # Warm up: import math-verify, sympy and the LaTeX parser now, so that the first items are not slowed by
        # it and a memory limit too small for them shows at startup, not as failed items.
        verify("Answer: $2\\sqrt{2}$", "\\sqrt{8}")
    except BaseException as err:  # noqa: BLE001 - report anything, including MemoryError at import
        conn.send(("startup_failed", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        job_id, response, ground_truth = message
        try:
            verdict = verify(response, ground_truth)
            conn.send(("ok", job_id, verdict.correct, verdict.extracted, verdict.rule, verdict.detail))
        except MemoryError:
            # The heap may be in a poor state after an allocation failure: report, then let the parent replace us.
            conn.send(("fatal", job_id, f"MemoryError: over the {memory_mb} MiB limit"))
            return
        except BaseException as err:  # noqa: BLE001 - RecursionError, sympy internals, anything
            conn.send(("failed", job_id, f"{type(err).__name__}: {str(err)[:200]}"))


class _Batch:
    """The callers' side of some items: one future resolved once every item has its verdict.

    One future per batch rather than per item: waking the caller once per group, not once per item, is a
    large part of the pool's per-item overhead. Only the dispatcher thread resolves items.
    """

    def __init__(self, size: int, single: bool = False):
        self.future: Future = Future()
        self.results: list[Verdict | None] = [None] * size
        self.remaining = size
        self.single = single
        if size == 0:
            self.future.set_result([])

    def resolve(self, index: int, verdict: Verdict) -> None:
        self.results[index] = verdict
        self.remaining -= 1
        if self.remaining == 0:
            try:
                self.future.set_result(self.results[0] if self.single else self.results)
            except InvalidStateError:  # the caller cancelled it (a stopping worker): nobody is waiting
                pass

    def fail(self, error: Exception) -> None:
        try:
            self.future.set_exception(error)
        except InvalidStateError:
            pass


@dataclass
class _Job:
    job_id: int
    response: str
    ground_truth: str
    batch: _Batch
    index: int

    @property
    def size(self) -> int:
        return len(self.response) + len(self.ground_truth)


@dataclass
class _Worker:
    process: multiprocessing.process.BaseProcess
    conn: Connection
    started_at: float
    timeout_s: float
    ready: bool = False
    pid: int | None = None
    jobs: collections.deque = field(default_factory=collections.deque)  # sent, unanswered; jobs[0] is running
    head_since: float = 0.0  # when jobs[0] started, as far as the parent can tell
    inflight_chars: int = 0

    @property
    def deadline(self) -> float:
        return self.head_since + self.timeout_s


@dataclass
class PoolStats:
    verified: int = 0
    timeouts: int = 0
    errors: int = 0
    replaced: int = 0
    busy_seconds: float = 0.0


class VerifierPool:
    """Verify (response, ground_truth) pairs in child processes with per-item time and memory limits."""

    def __init__(
        self,
        workers: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        start_method: str = "spawn",
    ):
        if workers < 1:
            raise ValueError("workers must be at least 1")
        if timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        self.size = workers
        self.timeout_s = timeout_s
        self.memory_mb = memory_mb
        self.stats = PoolStats()
        self._ctx = multiprocessing.get_context(start_method)
        self._queue: collections.deque[_Job] = collections.deque()
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._workers: list[_Worker] = []
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        # One selector for the dispatcher's whole life (multiprocessing's wait() builds one per call).
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._closed = threading.Event()
        self._dispatcher: threading.Thread | None = None
        self._startup_failures = 0
        self.broken: str | None = None  # why no child can start, once MAX_STARTUP_FAILURES is reached

    # ---- lifecycle ---------------------------------------------------------------------------------------

    def start(self, wait_ready: bool = True) -> "VerifierPool":
        if self._dispatcher is not None:
            return self
        self._workers = [self._spawn() for _ in range(self.size)]
        self._dispatcher = threading.Thread(target=self._run, name="verifier-pool", daemon=True)
        self._dispatcher.start()
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> bool:
        """Block until every child has imported the verifier (so the first items are not slowed by startup)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_workers() == self.size:
                return True
            if self.broken:
                return False
            time.sleep(0.02)
        return False

    def ready_workers(self) -> int:
        return sum(1 for w in list(self._workers) if w.ready)

    def worker_pids(self) -> list[int]:
        """PIDs of the live children (ready or busy), for inspection and fault-injection tests."""
        return [w.pid for w in list(self._workers) if w.pid is not None]

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake()
        if self._dispatcher is not None:
            self._dispatcher.join(timeout=10)
        for worker in self._workers:
            self._stop(worker, graceful=not worker.jobs)  # a busy child would not read the stop message
        with self._lock:
            pending = [job for w in self._workers for job in w.jobs] + list(self._queue)
            self._queue.clear()
        for job in pending:
            job.batch.fail(RuntimeError("verifier pool closed"))
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "VerifierPool":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- API ---------------------------------------------------------------------------------------------

    def submit(self, response: str, ground_truth: str) -> Future:
        """Queue one verification; the future resolves to a Verdict (never raises for bad input)."""
        return self._enqueue([(response, ground_truth)], single=True)

    def submit_many(self, pairs: list[tuple[str, str]]) -> Future:
        """Queue (response, ground_truth) pairs; the future resolves to their Verdicts, in order.

        Cancelling the future drops the items that no child has started yet.
        """
        return self._enqueue(pairs, single=False)

    def verify_many(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        """Verdicts for (response, ground_truth) pairs, in order."""
        return self.submit_many(pairs).result()

    def verify(self, response: str, ground_truth: str) -> Verdict:
        return self.submit(response, ground_truth).result()

    def _enqueue(self, pairs: list[tuple[str, str]], single: bool) -> Future:
        if self._closed.is_set():
            raise RuntimeError("verifier pool closed")
        if self._dispatcher is None:
            self.start(wait_ready=False)
        batch = _Batch(len(pairs), single=single)
        jobs = [_Job(next(self._ids), str(r), str(t), batch, i) for i, (r, t) in enumerate(pairs)]
        with self._lock:
            was_empty = not self._queue
            self._queue.extend(jobs)
        if jobs and was_empty:  # otherwise the dispatcher is already due to look at the queue
            self._wake()
        return batch.future

    # ---- dispatcher --------------------------------------------------------------------------------------

    def _wake(self) -> None:
        try:
            self._wake_w.send_bytes(b"")
        except OSError:  # closed during shutdown
            pass

    def _spawn(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_child_main, args=(child_conn, self.memory_mb), name="verifier", daemon=True
        )
        process.start()
        child_conn.close()
        worker = _Worker(process=process, conn=parent_conn, started_at=time.monotonic(), timeout_s=self.timeout_s)
        self._selector.register(parent_conn, selectors.EVENT_READ, worker)
        return worker

    def _stop(self, worker: _Worker, graceful: bool = False) -> None:
        try:
            self._selector.unregister(worker.conn)
        except (KeyError, ValueError):
            pass
        if graceful and worker.process.is_alive():
            try:
                worker.conn.send(None)
            except OSError:
                pass
            worker.process.join(timeout=1)
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=5)
        worker.conn.close()

    def _replace(self, worker: _Worker, reason: str) -> None:
        log.warning("replacing verifier process %s: %s", worker.pid, reason)
        self._stop(worker)
        self.stats.replaced += 1
        index = self._workers.index(worker)
        self._workers[index] = self._spawn()

    def _finish_head(self, worker: _Worker, verdict: Verdict) -> None:
        """Resolve the item the child was working on; the next one queued in its pipe starts now."""
        if not worker.jobs:
            return
        job = worker.jobs.popleft()
        worker.inflight_chars -= job.size
        now = time.monotonic()
        self.stats.verified += 1
        self.stats.busy_seconds += now - worker.head_since
        worker.head_since = now
        if verdict.rule == RULE_TIMEOUT:
            self.stats.timeouts += 1
        elif verdict.rule == RULE_ERROR:
            self.stats.errors += 1
        job.batch.resolve(job.index, verdict)

    def _fail_child(self, worker: _Worker, verdict: Verdict, reason: str) -> None:
        """Replace a child that hung or died: its current item gets `verdict`, the items behind it go back first."""
        self._replace(worker, reason)  # first, so that the caller sees the pool already mended
        self._finish_head(worker, verdict)
        with self._lock:
            self._queue.extendleft(reversed(worker.jobs))
        worker.jobs.clear()

    def _assign(self) -> None:
        """Fill the children's pipes, one item at a time to the least loaded child."""
        while True:
            candidates = [w for w in self._workers if w.ready and len(w.jobs) < PREFETCH]
            if not candidates:
                return
            worker = min(candidates, key=lambda w: len(w.jobs))
            with self._lock:
                while self._queue and self._queue[0].batch.future.cancelled():
                    self._queue.popleft()
                if not self._queue:
                    return
                job = self._queue[0]
                if worker.jobs and worker.inflight_chars + job.size > PREFETCH_MAX_CHARS:
                    return  # a big item waits for an idle child
                self._queue.popleft()
            try:
                worker.conn.send((job.job_id, job.response, job.ground_truth))
            except (OSError, ValueError) as err:  # the child died between two checks; the item goes first again
                with self._lock:
                    self._queue.appendleft(job)
                self._fail_child(worker, Verdict(False, None, RULE_ERROR, f"send failed: {err}"), "send failed")
                continue
            if not worker.jobs:
                worker.head_since = time.monotonic()
            worker.jobs.append(job)
            worker.inflight_chars += job.size

    def _on_message(self, worker: _Worker) -> None:
        try:
            message = worker.conn.recv()
        except (EOFError, OSError):
            code = worker.process.exitcode
            worker.process.join(timeout=1)
            code = worker.process.exitcode if code is None else code
            if not worker.ready:
                self._startup_failed(worker, f"exit code {code}")
                return
            self._fail_child(worker, Verdict(False, None, RULE_ERROR, f"verifier process died (exit code {code})"),
                             f"died with exit code {code}")
            return
        kind = message[0]
        if kind == "ready":
            worker.ready, worker.pid = True, message[1]
            self._startup_failures, self.broken = 0, None
        elif kind == "startup_failed":
            self._startup_failed(worker, message[1])
        elif kind == "ok":
            _, job_id, correct, extracted, rule, detail = message
            assert worker.jobs and worker.jobs[0].job_id == job_id, "a child answers its items in order"
            self._finish_head(worker, Verdict(correct, extracted, rule, detail))
        elif kind == "failed":
            self._finish_head(worker, Verdict(False, None, RULE_ERROR, message[2]))
        elif kind == "fatal":
            self._fail_child(worker, Verdict(False, None, RULE_ERROR, message[2]), message[2])

    def _startup_failed(self, worker: _Worker, reason: str) -> None:
        self._startup_failures += 1
        if self._startup_failures >= MAX_STARTUP_FAILURES and not self.broken:
            self.broken = f"verifier processes cannot start ({reason})"
            log.error("%s; failing items until restarted", self.broken)
        self._replace(worker, f"startup failed: {reason}")

    def _fail_queued(self) -> None:
        with self._lock:
            jobs = list(self._queue)
            self._queue.clear()
        for job in jobs:
            job.batch.resolve(job.index, Verdict(False, None, RULE_ERROR, self.broken or "verifier unavailable"))

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._step()
            except Exception:  # the dispatcher must survive anything, or every caller would wait forever
                log.exception("verifier pool dispatcher error")
                time.sleep(0.1)

    def _step(self) -> None:
        if self.broken:
            self._fail_queued()
            time.sleep(1.0)  # keep trying to start children, slowly
        self._assign()
        now = time.monotonic()
        deadlines = [w.deadline for w in self._workers if w.jobs]
        deadlines += [w.started_at + STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        for key, _ in self._selector.select(timeout):
            worker = key.data
            if worker is None:
                while self._wake_r.poll():
                    self._wake_r.recv_bytes()
            elif worker in self._workers:  # not replaced earlier in this round
                self._on_message(worker)
        now = time.monotonic()
        for worker in list(self._workers):
            if worker.jobs and now >= worker.deadline:
                timeout = Verdict(False, None, RULE_TIMEOUT, f"verification exceeded {self.timeout_s:g} s")
                self._fail_child(worker, timeout, "time limit")
            elif not worker.ready and now >= worker.started_at + STARTUP_TIMEOUT_S:
                self._startup_failed(worker, "startup time limit")
