"""The rollout worker: prompt tasks in, one RolloutGroup per task out, stamped with the policy version used.

The loop keeps up to `generator.tasks_per_batch` tasks inside the engine (continuous batching: a finished
group is written at once and its slot refilled), reads the prompts stream through the `generator` consumer
group, and writes each group with `forward` (write downstream + ack atomically, only while it still owns the
task), so a task is acknowledged after its group is written and never twice.

Weight versions. A newer announced version is pulled and verified in a background thread while the engine
keeps generating. Once it is ready the worker stops admitting tasks, lets the in-flight ones finish (the drain),
reloads the engine in place and resumes: every group is sampled by exactly one policy version. A refused or
failed sync leaves the old version serving. A task whose `min_version` is above the served version waits
(claimed) for that version up to `generator.min_version_wait_s`, then is handed back; a wait is not a delivery
(a slow pull must not dead-letter the tasks of its version). A task for a version this generator refused is
handed back at once for another generator, and that counts if the version itself is bad (a version no generator
can load ends its tasks in `dead`), not if the failure may pass (the learner unreachable, a full disk); nor does
a waiting task retry a refused version before its back-off (`POST /v1/weights/sync` does).

Ownership. A task in the engine longer than the stream's visibility timeout would be reclaimed by another
consumer; a heartbeat thread re-claims this worker's own entries (only those it still owns) every third of
the timeout. If the process dies, the heartbeat stops and another generator reclaims the work.

Hangs. The heartbeat runs beside the loop, so a hung engine would hold its tasks for ever; the heartbeat also
watches the loop, and a turn longer than `generator.stall_timeout_s` hands every task back and ends the process
(exit 70) for its supervisor (the launcher, Compose, Kubernetes) to start a fresh one. Each try of the first
weights check and load is such a turn, and the engine's start is held to the same bound (generator/service.py).

Shutdown (`stop()`, on SIGTERM): stop admitting, hand back waiting tasks, finish in-flight ones for up to
`generator.shutdown_grace_s`, then abort and hand back the rest.

Poison. Every task is checked before the engine sees it (`VllmEngine.check`: token ids inside the embedding
table, prompt plus max_tokens within the model length, sampling parameters in range); a bad one goes to `dead`
with the exact reason. If the engine still dies mid-batch, it is recreated from the last good weights and the
worker finds the task that killed it by bisection: it keeps the in-flight tasks (it still owns them: their
delivery counts do not grow), splits them in halves and runs each half alone, splitting again whichever half
kills the engine, down to one task. A task that kills a fresh engine on its own goes to `dead` with the
engine's error; the innocent are served as usual, never dead-lettered because of a neighbour.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from generator.engine import EngineFailure, InvalidTask, VllmEngine
from generator.sync import WeightSync
from services import metrics
from services.broadcast import MEMBER_TTL_S
from services.config import Settings
from services.errors import ExitCode
from services.messages import PromptTask, RolloutGroup, WeightsAnnouncement, WeightsBroadcast
from services.streams import Delivery, Streams
from services.weights import WeightsError

log = logging.getLogger(__name__)


TRANSIENT = {"unreachable", "http", "not_found"}  # a late joiner retries these before taking work
BAD_VERSION = {"checksum", "shape", "format", "untrusted_url"}  # refusals of the version itself: every generator's
ROUND_POLL_S = 0.02  # how often the loop asks the engine's workers whether a broadcast round is in
RETRY_FAILED_SYNC_S = 30.0  # a refused version is not retried automatically before this (POST /sync forces it)
HAND_BACK_S = 5.0  # past the stop's grace, Redis gets this long to take the hand-back, then is not waited for
IDLE_BLOCK_MS = 100  # longest wait for new tasks while idle: bounds how late an announcement or a stop is seen


def exit_stalled(seconds: float) -> None:
    """The process cannot stop a thread stuck inside the engine: end it (its supervisor starts a fresh one)."""
    sys.stderr.flush()
    os._exit(ExitCode.STALLED)


@dataclass
class InFlight:
    delivery: Delivery[PromptTask]
    admitted_at: float


@dataclass
class SyncOutcome:
    version: int
    previous: int
    changed: bool
    seconds: float = 0.0
    error: str | None = None
    reason: str | None = None


@dataclass
class _Ready:
    """A version ready to load: files (announcement, folder) or a broadcast round the engine staged."""

    announcement: WeightsAnnouncement | None
    folder: Path | None
    prepare_seconds: float
    staged: WeightsBroadcast | None = None

    @property
    def version(self) -> int:
        return self.staged.version if self.staged is not None else self.announcement.version


@dataclass
class ActivityClock:
    """The worker loop's wall time since the start, by activity: busy (an engine step), reload (a version loading
    or an engine restarting) and idle (the rest: nothing to generate). Stamped on every group it writes."""

    busy: float = 0.0
    reload: float = 0.0
    idle: float = 0.0
    _mark: float = field(default_factory=time.monotonic)

    def charge(self, activity: str) -> None:
        """The time since the previous charge went to `activity`."""
        now = time.monotonic()
        spent, self._mark = now - self._mark, now
        setattr(self, activity, getattr(self, activity) + spent)
        metrics.GEN_SECONDS.labels(activity).inc(spent)

    def stamp(self) -> dict[str, float]:
        return {"generator_busy_s": self.busy, "generator_reload_s": self.reload, "generator_idle_s": self.idle}


@dataclass
class _Rates:
    """Tokens/s and tasks/s over the last `window` seconds: what was written in it, over the window (groups that
    finish less often than once a window read as the rate they make, and an idle generator decays to 0)."""

    window: float = 10.0
    events: deque = field(default_factory=deque)

    def add(self, tokens: int, now: float) -> None:
        self.events.append((now, tokens))

    def rates(self, now: float) -> tuple[float, float]:
        while self.events and self.events[0][0] < now - self.window:
            self.events.popleft()
        return sum(t for _, t in self.events) / self.window, len(self.events) / self.window


def halves(items: list) -> list[list]:
    """Bisection step: `items` in two halves (a single item stays one batch of one)."""
    middle = (len(items) + 1) // 2
    return [part for part in (items[:middle], items[middle:]) if part]


def entry_time(entry_id: str) -> float:
    """The wall time a stream entry was written (its id is `<ms>-<seq>`)."""
    return int(entry_id.split("-", 1)[0]) / 1000.0


def heartbeat_interval(settings: Settings) -> float:
    """Seconds between heartbeats: a third of the longest a claim (streams.visibility_timeout_s) or a membership of
    broadcast rounds (MEMBER_TTL_S) may go unrenewed, so that one late beat loses neither."""
    return max(0.05, min(settings.streams.visibility_timeout_s, MEMBER_TTL_S) / 3)


class RolloutWorker:
    def __init__(self, settings: Settings, engine: VllmEngine, streams: Streams, sync: WeightSync, generator_id: str):
        self.settings = settings
        self.cfg = settings.generator
        self.engine = engine
        self.streams = streams
        self.prompts = streams.stream("prompts", PromptTask)
        self.rollouts = streams.stream("rollouts", RolloutGroup)
        self.sync = sync
        self.id = generator_id
        self.version = 0
        self.version_sha: str | None = None  # None = the model folder's own weights
        self.version_since = time.time()
        self.weights_folder: Path | None = None  # last good version, what a restarted engine loads
        self.folder_version: tuple[int, str | None] = (0, None)  # its version and sha256
        self.inflight: dict[str, InFlight] = {}
        self.deferred: dict[str, tuple[Delivery[PromptTask], float]] = {}  # waiting for min_version
        self.suspects: deque[list[Delivery[PromptTask]]] = deque()  # batches to run alone after an engine failure
        self.isolated = False  # the engine holds one of those batches and nothing else
        self.groups_written = 0
        self.restarts = 0
        self.ready = False
        self.status = "starting"
        self._lock = threading.RLock()  # stop() runs in a signal handler, on the very thread that may hold it
        self._stop = threading.Event()
        self._deadline = float("inf")
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-pull")
        self._pull: concurrent.futures.Future | None = None
        self._pull_target: WeightsAnnouncement | None = None
        self._ready_weights: _Ready | None = None
        self._receiving: WeightsBroadcast | None = None  # a broadcast round the engine's workers are taking
        self._round_tried: str | None = None  # the last round joined (a round is tried once)
        self._listed_busy = False  # as the membership of broadcast rounds says: loading a version from the files
        self._next_round_poll = 0.0
        self._failed: dict[tuple[int, str], tuple[float, str]] = {}  # (version, sha) -> (retry after, reason)
        # (version, sha) -> the prompt entries handed back, counted, since this generator last refused it
        self._counted_refusals: dict[tuple[int, str], set[str]] = {}
        self._waiters: list[tuple[int, concurrent.futures.Future]] = []
        self._sync_now = threading.Event()  # look the latest announcement up now (a task wants a newer version)
        self._retry_refused = threading.Event()  # an explicit request: also retry a refused version at once
        self._rates = _Rates()
        self.clock = ActivityClock()
        self._last_empty_read = 0.0
        self._heartbeat_thread: threading.Thread | None = None
        self._workers = 0  # the engine's model workers, once known (collective: what this generator registers)
        self._owned: tuple[str, ...] = ()
        self._finished = threading.Event()
        self._turn_started: float | None = None  # when the loop began its current turn (None: not looping)
        self.on_stall = exit_stalled  # what a hang ends in (tests watch it instead)

    # -- control (any thread) -----------------------------------------------------------------------------
    def stop(self, hard: bool = False) -> None:
        """Graceful: finish in-flight tasks for up to shutdown_grace_s. Hard (or a second call): hand back now."""
        with self._lock:
            now = time.monotonic()
            if hard or self._stop.is_set():
                self._deadline = now
            else:
                self._deadline = now + self.cfg.shutdown_grace_s
            self._stop.set()
            self.sync.cancel.set()  # a version that will not be loaded: the process must not wait for its download
            self.streams.redis.give_up_retrying_at(self._deadline + HAND_BACK_S)  # nor a Redis away past the grace

    def request_sync(self) -> concurrent.futures.Future:
        """Pull and load the latest announced version now; the future resolves to a SyncOutcome."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._waiters.append((-1, future))  # -1: the worker fills in the version wanted
        self._retry_refused.set()
        self._sync_now.set()
        return future

    def readiness(self) -> tuple[bool, str]:
        return (self.ready and not self._stop.is_set(), self.status)

    def describe(self) -> dict:
        newest = self.sync.watcher.newest
        return {
            "generator_id": self.id,
            "version": self.version,
            "sha256": self.version_sha,
            "since": self.version_since,
            "announced": newest.version if newest else None,
            "inflight_tasks": len(self.inflight),
            "waiting_tasks": len(self.deferred),
            "suspect_tasks": sum(len(batch) for batch in list(self.suspects)),  # (the loop thread changes it)
            "groups_written": self.groups_written,
            "engine_restarts": self.restarts,
            "status": self.status,
        }

    # -- the loop (one thread: the engine's) --------------------------------------------------------------
    def run(self) -> None:
        self.sync.watcher.start()
        self._heartbeat_thread = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._heartbeat_thread.start()
        try:
            self._join_late()
            if self.sync.collective:
                self._workers = self.engine.workers()
                self.sync.register(self._workers)
            self._recover_own()
            metrics.GEN_VERSION.set(self.version)
            self.ready = not self._stop.is_set()
            self.status = "serving"
            while True:
                now = self._turn_started = time.monotonic()
                if self._stop.is_set():
                    self._release_deferred("shutdown")
                    if not self.inflight or now >= self._deadline:
                        break
                self._advance_sync(now)
                if not self.inflight:
                    self.isolated = False
                    if self.suspects and not self._stop.is_set():
                        self._isolate_next(now)
                if self._admitting():
                    self._admit(now)
                self._expire_deferred(now)
                self._owned = self._owned_ids()  # before a step that may block (the first one compiles)
                self.clock.charge("reload" if self._pull is not None else "idle")  # reading, waiting, pulling
                if self.engine.has_unfinished():
                    self._step()
                    self.clock.charge("busy")
                elif self._stop.is_set() or self._ready_weights is not None or self._pull is not None:
                    time.sleep(0.01)  # nothing to read: waiting for a drain, a pull or the shutdown
                self._owned = self._owned_ids()
                tokens_per_s, tasks_per_s = self._rates.rates(now)
                metrics.GEN_TOKENS_PER_SECOND.set(tokens_per_s)
                metrics.GEN_TASKS_PER_SECOND.set(tasks_per_s)
        finally:
            self._turn_started = None
            self.ready = False
            self.status = "stopped"
            self._hand_back_all("shutdown")
            self._owned = ()
            self._finished.set()
            try:
                self.sync.leave()
            except Exception as err:  # Redis gone: the membership lapses by itself
                log.warning("could not leave the broadcast rounds: %s", err)
            self.sync.watcher.stop()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._resolve_waiters(failure=("worker stopped", "stopped"))
            log.info("generator %s stopped after %d groups", self.id, self.groups_written)

    def _join_late(self) -> None:
        """Serve the latest announced version before taking any work (the model folder's weights if none). Each try
        is a turn of the stall watchdog (`_stalled`): a check or reload that hangs ends the process, as in the loop."""
        while not self._stop.is_set():
            self._turn_started = time.monotonic()
            announcement = self.sync.latest()
            if announcement is None:
                return
            self.status = f"loading weights v{announcement.version}"
            try:
                folder, prepare_seconds = self.sync.prepare(announcement)
            except WeightsError as err:
                if err.reason == "cancelled":  # stopping
                    return
                if err.reason not in TRANSIENT:
                    self._refuse(announcement, err.reason, str(err), time.monotonic())
                    return
                metrics.GEN_RELOAD_FAILURES.labels(err.reason).inc()
                log.error("cannot load announced weights v%d yet: %s", announcement.version, err)
                self._stop.wait(5.0)
                continue
            except Exception as err:  # unexpected (disk full...): as in the loop, the weights we have keep serving
                self._refuse(announcement, "error", f"{type(err).__name__}: {err}", time.monotonic())
                return
            if self._stop.is_set():  # stopped during the check: no reload of minutes on the way out
                return
            self._apply(_Ready(announcement, folder, prepare_seconds))
            if self.version_sha != announcement.sha256:  # the engine refused it (already counted)
                log.error("announced weights v%d failed to load; serving v%d", announcement.version, self.version)
            return

    def _recover_own(self) -> None:
        """Tasks this consumer name held before a restart (same id) are ours: serve them first."""
        now = time.monotonic()
        for delivery in self.prompts.recover(self.id, count=4 * self.cfg.tasks_per_batch):
            if len(self.inflight) < self.cfg.tasks_per_batch and delivery.message.min_version <= self.version:
                self._submit(delivery, now)
            else:
                self._hand_back([delivery], "restart")

    def _admitting(self) -> bool:
        isolating = self.isolated or bool(self.suspects)
        return not self._stop.is_set() and self._ready_weights is None and not isolating

    def _owned_ids(self) -> tuple[str, ...]:
        return (*self.inflight, *self.deferred, *(d.id for batch in self.suspects for d in batch))

    def _admit(self, now: float) -> None:
        for entry_id, (delivery, _) in list(self.deferred.items()):  # their version may have arrived
            if delivery.message.min_version <= self.version:
                del self.deferred[entry_id]
                self._submit(delivery, now)
        room = self.cfg.tasks_per_batch - len(self.inflight) - len(self.deferred)
        if room <= 0:
            return
        busy = bool(self.inflight)
        if busy and now - self._last_empty_read < 0.02:
            return  # the stream was empty a moment ago: let the engine work
        # Redis times a blocking read out only on its event loop's tick (100 ms at the default hz 10), however short
        # the block asked for: with work in the engine, or a version on its way to load, the read must not block
        # (a 1 ms block held finished groups back up to 100 ms, and an in-process engine would stop meanwhile).
        # Idle, it blocks: new tasks end the wait at once, and a version or a shutdown is seen within IDLE_BLOCK_MS.
        block_ms = 0 if busy or self._pull is not None else min(self.settings.streams.block_ms, IDLE_BLOCK_MS)
        # Back-pressure: take no more tasks than `rollouts` has room for (the reward workers are behind, or down);
        # what is in flight is still written (at most tasks_per_batch beyond the mark per generator).
        room = min(room, self.rollouts.room())
        if room <= 0:
            if not busy:  # (busy: the engine's step is the wait)
                self.rollouts.wait_for_room(self._stop)
            return
        deliveries = self.prompts.consume(self.id, count=room, block_ms=block_ms)
        if not deliveries:
            self._last_empty_read = now
        for delivery in deliveries:
            if delivery.id in self.inflight or delivery.id in self.deferred:
                continue  # our own entry, re-read by the reclaim scan: it is already being served
            task = delivery.message
            metrics.GEN_QUEUE_WAIT.observe(max(0.0, time.time() - entry_time(delivery.id)))
            if task.min_version > self.version:
                if refused := self._refused_here(task.min_version, now):  # another generator may have it
                    self._hand_back_refused(delivery, refused)
                    continue
                self.deferred[delivery.id] = (delivery, now)
                self._sync_now.set()  # look for the version now rather than at the next poll
                continue
            self._submit(delivery, now)
        metrics.GEN_BATCH_FILL.set(len(self.inflight) / self.cfg.tasks_per_batch)

    def _submit(self, delivery: Delivery[PromptTask], now: float) -> bool:
        """Check the task and hand it to the engine; False if the engine died (it was restarted)."""
        task = delivery.message
        if task.min_version > self.version:  # the served version went back (an engine restart after a broadcast)
            self.deferred[delivery.id] = (delivery, now)
            self._sync_now.set()
            return True
        try:
            prompt_ids = self.engine.check(task)
            self.engine.submit(delivery.id, prompt_ids, task.sampling)
        except InvalidTask as err:  # no engine can serve it: never retried
            self.prompts.reject(delivery, f"invalid task: {err}"[:2000])
            return True
        except EngineFailure as err:
            self.inflight[delivery.id] = InFlight(delivery, now)
            self._recover_engine(err)
            return False
        self.inflight[delivery.id] = InFlight(delivery, now)
        return True

    def _isolate_next(self, now: float) -> None:
        """Run the next batch of suspects alone on the engine (bisection after an engine failure)."""
        batch = self.suspects.popleft()
        self.isolated = True
        for k, delivery in enumerate(batch):
            if not self._submit(delivery, now):  # the engine died taking them: the rest stay suspects
                if batch[k + 1:]:
                    self.suspects.appendleft(batch[k + 1:])
                return

    def _step(self) -> None:
        try:
            finished = self.engine.step()
        except EngineFailure as err:
            self._recover_engine(err)
            return
        now = time.monotonic()
        for done in finished:
            entry = self.inflight.pop(done.request_id, None)
            if entry is None:
                continue
            task = entry.delivery.message
            group = RolloutGroup(task=task, policy_version=self.version, generator_id=self.id, samples=done.samples,
                                 **self.clock.stamp())
            if self.prompts.forward(entry.delivery, self.rollouts, group):
                self.groups_written += 1
                tokens = sum(len(s.token_ids) for s in done.samples)
                metrics.GEN_TOKENS.inc(tokens)
                metrics.GEN_TASKS.labels(task.split).inc()
                self._rates.add(tokens, now)
        if finished:
            metrics.GEN_BATCH_FILL.set(len(self.inflight) / self.cfg.tasks_per_batch)

    def _recover_engine(self, err: Exception) -> None:
        """The engine died: recreate it from the last good weights, and keep its tasks to find the culprit.

        A task alone on the engine when it died is the culprit (dead-lettered with the engine's error); a batch
        of several is split in halves, each to run alone (`suspects`)."""
        batch = [entry.delivery for entry in self.inflight.values()]
        self.inflight.clear()
        if self.isolated and len(batch) == 1:
            (culprit,) = batch
            log.error("engine failure on task %s alone: %s", culprit.message.task_id, err)
            self.prompts.reject(culprit, f"engine failure on this task alone: {err}"[:2000])
        else:
            log.error("engine failure (%s) with %d tasks in flight: restarting, then running them in halves",
                      err, len(batch))
            self.suspects.extendleft(reversed(halves(batch)))
        self.isolated = False
        self.ready = False
        self.status = "restarting engine"
        self._restart_engine("failure")
        self.ready = True
        self.status = "serving"

    # -- weight versions ---------------------------------------------------------------------------------
    def _wanted(self, now: float) -> WeightsAnnouncement | None:
        newest = self.sync.watcher.newest
        if newest is None or newest.version <= self.version:
            return None
        if self._failed.get((newest.version, newest.sha256), (0.0, ""))[0] > now:
            return None
        return newest

    def _advance_sync(self, now: float) -> None:
        if self.sync.collective:
            try:
                self._advance_round(now)
            except EngineFailure as err:  # died while its workers took a round: as in a step
                self._recover_engine(err)
        if self._sync_now.is_set():
            self._sync_now.clear()
            explicit = self._retry_refused.is_set()
            self._retry_refused.clear()
            latest = self.sync.latest()
            with self._lock:
                waiters = [(w if w >= 0 else (latest.version if latest else -1), f) for w, f in self._waiters]
                self._waiters = waiters
            if latest is not None and explicit:  # not a task's wish: a refused version waits out its back-off
                self._failed.pop((latest.version, latest.sha256), None)
            self._resolve_waiters()  # those already satisfied (or with nothing announced)
        if self._pull is None and self._ready_weights is None and self._receiving is None:
            target = self._wanted(now)
            if target is not None:
                self._pull_target = target
                self._pull = self._pool.submit(self.sync.prepare, target)
                self.status = f"pulling weights v{target.version}"
        if self._pull is not None and self._pull.done():
            target, pull = self._pull_target, self._pull
            self._pull, self._pull_target = None, None
            try:
                folder, seconds = pull.result()
                self._ready_weights = _Ready(target, folder, seconds)
                self.status = f"draining for weights v{target.version}"
            except WeightsError as err:
                if err.reason != "cancelled":  # cancelled: we are stopping, not refusing the version
                    self._refuse(target, err.reason, str(err), now)
            except Exception as err:  # unexpected (disk full...): same treatment, the old weights keep serving
                self._refuse(target, "error", f"{type(err).__name__}: {err}", now)
        if self._ready_weights is not None and self.inflight and self.cfg.on_update == "abort":
            self.engine.abort(list(self.inflight))  # sampled again, all of each group by the new version
            self._hand_back(list(self.inflight), "update", unused=True)
        if self._ready_weights is not None and not self.inflight:
            self._apply(self._ready_weights)
        if self.sync.collective:
            self._list_busy()

    def _list_busy(self) -> None:
        """Say in the membership of broadcast rounds whether this generator is loading a version from the files:
        it skips rounds meanwhile (`_advance_round`), and a member that does not join is paused for MEMBER_PAUSE_S
        (and a newcomer closes the rounds to newcomers as long): a late joiner's next round would fail so."""
        # Stopping, it joins no more rounds (`_advance_round`): listed busy, the learner leaves it out of them.
        busy = self._pull is not None or self._ready_weights is not None or self._stop.is_set()
        if busy == self._listed_busy or not (self._workers and self.ready):
            return
        try:
            self.sync.register(self._workers, busy=busy)
            self._listed_busy = busy
        except Exception as err:  # Redis gone: the heartbeat says it again
            log.warning("broadcast membership not updated: %s", err)

    def _refuse(self, target: WeightsAnnouncement, reason: str, message: str, now: float) -> None:
        log.error("weights v%d refused (%s): %s; still serving v%d", target.version, reason, message, self.version)
        metrics.GEN_RELOAD_FAILURES.labels(reason).inc()
        self._failed[(target.version, target.sha256)] = (now + RETRY_FAILED_SYNC_S, reason)
        self._counted_refusals = {(target.version, target.sha256): set()}  # a new refusal: each task counts once
        self.status = "serving"
        self._resolve_waiters(failure=(message, reason))

    def _apply(self, ready: _Ready) -> None:
        """Reload the idle engine; on failure recreate it from the last good weights."""
        self._ready_weights = None
        self.clock.charge("idle")
        try:
            self._reload(ready)
        finally:
            self.clock.charge("reload")

    def _reload(self, ready: _Ready) -> None:
        previous = self.version
        try:
            reload_seconds = self.engine.load_staged() if ready.staged else self.engine.reload(ready.folder)
        except EngineFailure as err:
            if ready.staged is None:
                self._refuse(ready.announcement, "reload", str(err), time.monotonic())
            else:  # the files bring the same version next
                log.error("broadcast weights v%d failed to load: %s", ready.version, err)
                metrics.GEN_RELOAD_FAILURES.labels("reload").inc()
            self._restart_engine("reload")
            return
        self.version = ready.version
        self.version_sha = ready.announcement.sha256 if ready.announcement else None
        self.version_since = time.time()
        if ready.folder is not None:
            self.weights_folder, self.folder_version = ready.folder, (self.version, self.version_sha)
            self.sync.prune(keep={ready.folder})
        total = ready.prepare_seconds + reload_seconds
        metrics.GEN_VERSION.set(self.version)
        metrics.GEN_RELOAD_SECONDS.observe(total)
        metrics.GEN_LOAD_PAUSE_SECONDS.observe(reload_seconds)
        self.status = "serving"
        log.info(
            "now serving weights v%d (was v%d): %s %.2fs, load %.2fs",
            self.version, previous, "broadcast" if ready.staged else "pull+verify", ready.prepare_seconds,
            reload_seconds,
        )
        self._resolve_waiters(success=SyncOutcome(self.version, previous, True, total))

    def _restart_engine(self, why: str) -> None:
        """Recreate the engine with the last good version's files; a version that came by broadcast lived only in
        the engine, so this generator serves the files' version again (and the newer one comes as files do)."""
        self.engine.restart(str(self.weights_folder) if self.weights_folder else None)
        self._receiving = None
        if self._ready_weights is not None and self._ready_weights.staged:
            self._ready_weights = None  # staged in the old engine's workers: gone with them
        self.version, self.version_sha = self.folder_version
        metrics.GEN_VERSION.set(self.version)
        self.restarts += 1
        metrics.GEN_ENGINE_RESTARTS.labels(why).inc()

    def _advance_round(self, now: float) -> None:
        """collective: join a round that names this generator (the engine's workers take it in the background
        while it generates), then check what they staged; a refused or failed round leaves the version to the
        files."""
        if self._receiving is None:
            if self._stop.is_set():  # stopping: a round joined now would fail for every member
                return
            offered = self.sync.watcher.round
            files = self.sync.watcher.newest  # written after the round: the round is over
            if (offered is None or offered.version <= self.version or not offered.takes_part(self.id)
                    or offered.group == self._round_tried or self._pull is not None or self._ready_weights
                    or (files is not None and files.version >= offered.version)):
                return
            self._round_tried = offered.group
            self.engine.begin_receive(offered, self.sync.learner_host, self.id)
            self._receiving = offered
            self.status = f"receiving weights v{offered.version}"
            return
        if now < self._next_round_poll:
            return
        self._next_round_poll = now + ROUND_POLL_S
        statuses = self.engine.received()
        if statuses is None:
            return
        offered, self._receiving = self._receiving, None
        if refusal := self.sync.round_refusal(offered, statuses):
            log.error("broadcast weights v%d refused: %s; the files will bring it", offered.version, refusal)
            metrics.GEN_RELOAD_FAILURES.labels("broadcast").inc()
            self.engine.drop_staged()
            self.status = "serving"
            return
        seconds = max(status["seconds"] for status in statuses)
        self._ready_weights = _Ready(None, None, seconds, staged=offered)
        self.status = f"draining for weights v{offered.version}"

    def _resolve_waiters(self, success: SyncOutcome | None = None, failure: tuple[str, str] | None = None) -> None:
        with self._lock:
            keep = []
            for wanted, future in self._waiters:
                if future.done():
                    continue
                if failure is not None:
                    message, reason = failure
                    future.set_result(SyncOutcome(self.version, self.version, False, error=message, reason=reason))
                elif wanted >= 0 and self.version >= wanted:
                    future.set_result(success or SyncOutcome(self.version, self.version, False))
                elif wanted == -1 and success is None and self.sync.watcher.newest is None:
                    version = self.version
                    future.set_result(SyncOutcome(version, version, False, error="no weights announced", reason="none"))
                else:
                    keep.append((wanted, future))
            self._waiters = keep

    # -- tasks waiting for a version, hand-backs, heartbeat -------------------------------------------------
    def _refused_here(self, version: int, now: float) -> str | None:
        """Why this generator refused the newest announced version, if that version would serve `version` and is
        in its back-off (None: not refused)."""
        newest = self.sync.watcher.newest
        if newest is None or newest.version < version:
            return None
        until, reason = self._failed.get((newest.version, newest.sha256), (0.0, ""))
        return reason if until > now else None

    def _hand_back_refused(self, delivery: Delivery[PromptTask], reason: str) -> None:
        """For another generator. It counts as a delivery when the version itself is bad (no generator will load
        it: its tasks end in `dead`, not in an endless round); a failure of ours or of the way (the learner
        restarting, a full disk) may pass, and another generator may well load it: then it does not. Counted
        once per task and refusal: this generator reads the task back within a second (it is idle past the
        limit, and the others may be full), and its one verdict must not use up the task's deliveries before
        another generator had a chance; each retry it refuses again counts again."""
        newest = self.sync.watcher.newest
        counted = self._counted_refusals.setdefault((newest.version, newest.sha256), set())
        first = delivery.id not in counted
        counted.add(delivery.id)
        self._hand_back([delivery], "refused", unused=reason not in BAD_VERSION or not first, retake=False)

    def _expire_deferred(self, now: float) -> None:
        for entry_id, (delivery, since) in list(self.deferred.items()):
            if refused := self._refused_here(delivery.message.min_version, now):
                del self.deferred[entry_id]
                self._hand_back_refused(delivery, refused)
            elif now - since > self.cfg.min_version_wait_s:
                log.warning(
                    "task %s wants v%d, serving v%d after %.0fs: handing it back",
                    delivery.message.task_id, delivery.message.min_version, self.version, now - since,
                )
                del self.deferred[entry_id]
                self._hand_back([delivery], "min_version", unused=True, retake=False)

    def _release_deferred(self, why: str) -> None:
        if self.deferred:
            deliveries = [d for d, _ in self.deferred.values()]
            self.deferred.clear()
            self._hand_back(deliveries, why, unused=True, retake=False)

    def _hand_back_all(self, why: str) -> None:
        if self.inflight:
            self.engine.abort(list(self.inflight))
            self._hand_back(list(self.inflight), why)
        self._release_deferred(why)
        while self.suspects:
            self._hand_back(self.suspects.popleft(), why)

    def _hand_back(self, items: list, why: str, unused: bool = False, retake: bool = True) -> None:
        for item in items:
            delivery = self.inflight.pop(item, None).delivery if isinstance(item, str) else item
            try:
                self.prompts.release(delivery, unused=unused, retake=retake)
                metrics.GEN_RELEASED.labels(why).inc()
            except Exception as err:  # Redis gone: the visibility timeout hands it back anyway
                log.warning("could not release %s: %s", delivery.id, err)

    def _heartbeat_loop(self) -> None:
        interval = heartbeat_interval(self.settings)
        while not self._finished.wait(interval):
            if self._stalled():
                return
            if self._workers and self.ready:
                try:
                    self.sync.register(self._workers, busy=self._listed_busy)
                except Exception as err:
                    log.warning("broadcast membership not renewed: %s", err)
            ids = self._owned  # a snapshot the loop thread publishes (never iterate its dicts from here)
            if not ids:
                continue
            try:
                self.prompts.touch(self.id, list(ids))
            except Exception as err:
                log.warning("heartbeat failed: %s", err)

    def _stalled(self) -> bool:
        """A loop turn over stall_timeout_s: hand back every task this generator holds, then `on_stall`."""
        started = self._turn_started
        if started is None or time.monotonic() - started <= self.cfg.stall_timeout_s:
            return False
        seconds = time.monotonic() - started
        log.critical("generator %s: the rollout loop has been stuck for %.0fs (generator.stall_timeout_s %.0f), a "
                     "hung engine: handing back its tasks and exiting", self.id, seconds, self.cfg.stall_timeout_s)
        try:
            handed = self.prompts.release_all(self.id)
            metrics.GEN_RELEASED.labels("stalled").inc(handed)
        except Exception as err:  # Redis gone: the visibility timeout hands them back once the heartbeat is gone
            log.warning("could not hand back the tasks: %s", err)
        self.status = "stalled"
        self.on_stall(seconds)
        return True
