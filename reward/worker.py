"""The reward stream worker: rollouts in, scored groups out, acknowledged only after the write.

Each read takes a few groups and queues all their samples in the verifier pool at once, so the pool's
processes stay busy across group boundaries; each group is then forwarded (scored group written and
rollout acknowledged in one Redis script) in order. Unparseable rollouts never reach us: the stream moves
them to `dead`. A group whose verifier pool failed under it (`VerifierUnavailable`: an item that kills its child
gets an `error` verdict instead, so the group is not the cause) is handed back without counting a delivery, and the
worker pauses POOL_FAILURE_PAUSE_S while the pool restarts: a pool that takes a few tries to come back must not
dead-letter every group it held. Past UNCOUNTED_POOL_FAILURES such hand-backs of one group, they count (a group
that somehow always meets a failing pool must still end in `dead`, not loop). Any other failure hands the group
back with its delivery counted, so a group that fails whoever scores it reaches `dead` after
`streams.max_deliveries`. Between groups the worker renews its claim on those of the read still to score. On stop,
groups not yet forwarded are released at once.

Ground truth: generators never get it (the `prompts` stream carries tasks without it). The worker reads each
group's from the learner's `issued` hash and scores against that; a group whose task is not there (never issued,
or already settled: a late duplicate) goes to `dead` as `provenance: ...`, which makes no task lost.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time

from reward.sandbox import VerifierUnavailable
from reward.scoring import Scorer, group_items
from services.config import Settings
from services.errors import Unavailable
from services.messages import PromptTask, RolloutGroup, ScoredGroup, from_wire, to_wire
from services.streams import ISSUED, Delivery, Streams, consumer_name

log = logging.getLogger(__name__)
POOL_FAILURE_PAUSE_S = 0.5  # after the verifier pool failed under a read: its restart, not a busy loop of reclaims
WAIT_SLICE_S = 1.0  # while a group is verified, how often the worker looks for a stop
UNCOUNTED_POOL_FAILURES = 10  # hand-backs of one group for a pool failure that do not count as deliveries


class RewardWorker:
    def __init__(self, settings: Settings, scorer: Scorer, streams: Streams, consumer: str | None = None):
        self.settings = settings
        self.scorer = scorer
        self.rollouts = streams.stream("rollouts", RolloutGroup)
        self.scored = streams.stream("scored", ScoredGroup)
        self.redis, self.issued_key = streams.redis, streams.key(ISSUED)
        self.consumer = consumer or consumer_name("reward")
        # Two groups per verifier process keep every process busy while the previous group is forwarded.
        self.groups_per_read = max(2, 2 * settings.reward.workers)
        self.groups_done = 0
        # Heartbeat on the groups still to score, also while one is verified: a group of slow items (a timeout each,
        # ceil(n / workers) of them in a row) outlasting the visibility timeout would otherwise be reclaimed and
        # scored again elsewhere, a delivery counted each time.
        self.touch_every_s = settings.streams.visibility_timeout_s / 4
        self.last_poll = 0.0  # monotonic time of the last read or forward (for readiness)
        self._stop = threading.Event()
        self._recovered = False
        self._pool_failures: dict[str, int] = {}  # entry id -> pool failures under it (this process)

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Score until stop(); Redis outages are retried inside the stream calls, anything else is logged."""
        log.info("reward worker %s reading %s", self.consumer, self.rollouts.key)
        while not self._stop.is_set():
            try:
                self.run_once()
            except Unavailable:  # a dependency this process cannot do without (its key retired): ends it, exit 69
                raise
            except Exception:
                log.exception("reward worker iteration failed; retrying")
                self._stop.wait(1.0)

    def run_once(self, block_ms: int | None = None) -> int:
        """One read: score and forward what arrived. Returns the number of groups forwarded. Back-pressure: no read
        while `scored` is at its high-water mark (the learner is behind, or down)."""
        if self.scored.room() <= 0:
            self.scored.wait_for_room(self._stop)
            self.last_poll = time.monotonic()  # waiting on purpose is not a stall
            return 0
        if not self._recovered:
            # Entries this consumer name held before a restart (DAPO_WORKER_ID is stable across restarts).
            deliveries = self.rollouts.recover(self.consumer, count=self.groups_per_read)
            self._recovered = len(deliveries) < self.groups_per_read
        else:
            deliveries = self.rollouts.consume(self.consumer, count=self.groups_per_read, block_ms=block_ms)
        self.last_poll = time.monotonic()
        if not deliveries:
            return 0
        return self.process(deliveries)

    def with_ground_truth(self, deliveries: list[Delivery[RolloutGroup]]) -> list[RolloutGroup | str]:
        """Each delivery's group with its task's ground truth as the learner issued it, or why it gets none: its task
        id was not issued, its task differs from the one issued, or its samples do not answer it (`malformed`). The
        whole task is checked before the ground truth is attached, so a group a generator altered never carries it
        anywhere (the learner would refuse it, and a refused group goes to the dead letters)."""
        task_ids = [delivery.message.task.task_id for delivery in deliveries]
        issued = self.redis.hmget(self.issued_key, task_ids) if task_ids else []
        out: list[RolloutGroup | str] = []
        for delivery, raw in zip(deliveries, issued):
            task = delivery.message.task
            if to_wire(delivery.message) != delivery.payload:  # what the learner re-encodes to check its signature
                out.append("provenance: the rollout's bytes are not as `to_wire` writes them, so the learner "
                           "could not check its generator's signature once it is scored")
                continue
            if raw is None:
                out.append(f"provenance: unknown task id {task.task_id!r} (not issued by this run's learner, or "
                           "settled)")
                continue
            truth = from_wire(PromptTask, raw)
            if task != truth.for_generators():
                changed = [name for name in PromptTask.model_fields if name != "ground_truth"
                           and getattr(task, name) != getattr(truth, name)]
                out.append(f"provenance: task {task.task_id} does not match the task as issued (differs in "
                           f"{', '.join(changed) or 'ground_truth'})")
                continue
            # Not scored: the learner gives the task up for it (a generator's thousands of samples of
            # verifier-timeout text would hold the pool for the groups behind it).
            out.append(delivery.message.malformed() or delivery.message.model_copy(update={"task": truth}))
        return out

    def process(self, deliveries: list[Delivery[RolloutGroup]]) -> int:
        started = time.perf_counter()
        in_flight = []
        for delivery, group in zip(deliveries, self.with_ground_truth(deliveries)):
            if isinstance(group, str):
                self.rollouts.reject(delivery, group)
                continue
            items = group_items(group)
            in_flight.append((delivery, group, items, self.scorer.submit(items)))
        forwarded, pool_failed, touched = 0, False, time.monotonic()
        for index, (delivery, group, items, pending) in enumerate(in_flight):
            while True:  # wait for the group's verdicts, renewing the claims and watching for a stop meanwhile
                if time.monotonic() - touched >= self.touch_every_s:
                    self.rollouts.touch(self.consumer, [rest.id for rest, _, _, _ in in_flight[index:]])
                    touched = time.monotonic()
                if pending.done() or self._stop.is_set():
                    break
                concurrent.futures.wait([pending], timeout=min(self.touch_every_s, WAIT_SLICE_S))
                self.last_poll = time.monotonic()  # alive: a group of slow items must not look like a stall
            if self._stop.is_set():
                for rest, _, _, rest_pending in in_flight[index:]:
                    # A group whose verification had not begun is not counted as a delivery: a stop (a scale-down)
                    # is not its fault. One being verified keeps its count (Stream.release: work that started).
                    unused = not rest_pending.started()
                    rest_pending.cancel()
                    self.rollouts.release(rest, unused=unused)
                break
            try:
                scores = self.scorer.collect(items, pending, started)
            except VerifierUnavailable as err:  # no verdict is not a wrong answer, nor the group's fault
                failures = self._pool_failures[delivery.id] = self._pool_failures.get(delivery.id, 0) + 1
                uncounted = failures <= UNCOUNTED_POOL_FAILURES
                log.warning("scoring %s: %s; handed back%s", delivery.id, err,
                            ", not counted as a delivery" if uncounted else "")
                self.rollouts.release(delivery, unused=uncounted)
                pool_failed = True
                continue
            except Exception:
                log.exception("scoring %s failed; handed back for redelivery", delivery.id)
                self.rollouts.release(delivery)
                continue
            self._pool_failures.pop(delivery.id, None)
            result = ScoredGroup(rollout=group, scores=scores, reward_worker_id=self.consumer,
                                 rollout_signature=delivery.signature.decode(errors="replace"))
            if self.rollouts.forward(delivery, self.scored, result):
                forwarded += 1
            started = time.perf_counter()
            self.last_poll = time.monotonic()  # alive: a long batch of slow items must not look like a stall
        self.groups_done += forwarded
        if pool_failed:
            self._stop.wait(POOL_FAILURE_PAUSE_S)
        return forwarded
