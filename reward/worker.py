"""The reward stream worker: rollouts in, scored groups out, acknowledged only after the write.

Each read takes a few groups and queues all their samples in the verifier pool at once, so the pool's
processes stay busy across group boundaries; each group is then forwarded (scored group written and
rollout acknowledged in one Redis script) in order. Unparseable rollouts never reach us: the stream moves
them to `dead`. A group whose scoring fails (the verifier pool failed, `VerifierUnavailable`) is handed back
unacknowledged, so it is redelivered and, after `streams.max_deliveries` attempts, dead-lettered. On stop, groups
not yet forwarded are released at once.
"""

from __future__ import annotations

import logging
import threading
import time

from services.config import Settings
from services.messages import RolloutGroup, ScoredGroup
from services.streams import Delivery, Streams, consumer_name

from reward.scoring import Scorer, group_items

log = logging.getLogger(__name__)


class RewardWorker:
    def __init__(self, settings: Settings, scorer: Scorer, streams: Streams, consumer: str | None = None):
        self.settings = settings
        self.scorer = scorer
        self.rollouts = streams.stream("rollouts", RolloutGroup)
        self.scored = streams.stream("scored", ScoredGroup)
        self.consumer = consumer or consumer_name("reward")
        # Two groups per verifier process keep every process busy while the previous group is forwarded.
        self.groups_per_read = max(2, 2 * settings.reward.workers)
        self.groups_done = 0
        self.last_poll = 0.0  # monotonic time of the last read or forward (for readiness)
        self._stop = threading.Event()
        self._recovered = False

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
            except Exception:
                log.exception("reward worker iteration failed; retrying")
                self._stop.wait(1.0)

    def run_once(self, block_ms: int | None = None) -> int:
        """One read: score and forward what arrived. Returns the number of groups forwarded."""
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

    def process(self, deliveries: list[Delivery[RolloutGroup]]) -> int:
        started = time.perf_counter()
        in_flight = []
        for delivery in deliveries:
            items = group_items(delivery.message)
            in_flight.append((delivery, items, self.scorer.submit(items)))
        forwarded = 0
        for index, (delivery, items, pending) in enumerate(in_flight):
            if self._stop.is_set():
                for rest, _, rest_pending in in_flight[index:]:
                    rest_pending.cancel()
                    self.rollouts.release(rest)
                break
            try:
                scores = self.scorer.collect(items, pending, started)
            except Exception:  # e.g. VerifierUnavailable: no verdict is not a wrong answer
                log.exception("scoring %s failed; handed back for redelivery", delivery.id)
                self.rollouts.release(delivery)
                continue
            result = ScoredGroup(rollout=delivery.message, scores=scores, reward_worker_id=self.consumer)
            if self.rollouts.forward(delivery, self.scored, result):
                forwarded += 1
            started = time.perf_counter()
            self.last_poll = time.monotonic()  # alive: a long batch of slow items must not look like a stall
        self.groups_done += forwarded
        return forwarded
