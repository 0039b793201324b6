"""When the learner gives up on a task it issued: a deadline from the run's own round trips.

A task whose group never comes back (its stream entry deleted or trimmed, a consumer group destroyed, a worker that
holds it and stalls without dying) would otherwise keep the synchronous loop, an evaluation or a drain waiting
forever. Each pushed task gets a deadline: `factor` times the 95th percentile of the round trips (pushed -> its
scored group read) of the last `window` tasks, and never less than `floor_s` (before any group came back it is
`floor_s` at first: a cold engine's first batch may take long), and never more than `ceiling_s` (the round trips are
the workers' to make: one that answers every task it holds just before its deadline would raise it without end).
Past it the task counts as lost; the step refills.

Two waits are not losses. A task no generator has read yet is queued, not lost (generators that start late, or a
backlog): its clock starts again each time it is seen unread (the caller looks every second). And tasks lost before
any group came back say that the deadline is shorter than a group takes (20k-token responses on a cold engine): each
such loss doubles the deadline until a round trip is measured (up to `ceiling_s`). Either, counted as lost, stalled
a run for good: the lost tasks' groups, refused as unknown when they came, measured nothing, and the refills waited
behind the expired tasks' entries.
"""

from __future__ import annotations

from collections import deque
from typing import Callable


class Deadlines:
    def __init__(self, factor: float, floor_s: float, window: int = 256, ceiling_s: float = float("inf")):
        self.factor, self.floor_s, self.ceiling_s = factor, floor_s, max(floor_s, ceiling_s)
        self.cold_s = floor_s  # the deadline until a round trip is measured
        self.pushed_at: dict[str, float] = {}
        self.seen_queued: dict[str, float] = {}  # task id -> when it was last seen unread: its clock starts there
        self.still_queued: set[str] = set()  # those found unread at the last call: asked about again at the next
        self.round_trips: deque[float] = deque(maxlen=window)

    def pushed(self, task_id: str, now: float) -> None:
        self.pushed_at[task_id] = now

    def returned(self, task_id: str, now: float) -> None:
        """Its group was read: one more round trip measured (a duplicate or an unknown task measures nothing)."""
        started = self.pushed_at.pop(task_id, None)
        self.seen_queued.pop(task_id, None)
        self.still_queued.discard(task_id)
        if started is not None:
            self.round_trips.append(now - started)

    def forget(self, task_ids) -> None:
        for task_id in task_ids:
            self.pushed_at.pop(task_id, None)
            self.seen_queued.pop(task_id, None)
            self.still_queued.discard(task_id)

    def limit_s(self) -> float:
        """The current deadline, seconds after the push."""
        if not self.round_trips:
            return self.cold_s
        ordered = sorted(self.round_trips)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(max(self.floor_s, self.factor * p95), self.ceiling_s)

    def overdue(self, now: float, queued: Callable[[list[str]], set[str]] | None = None) -> list[str]:
        """The tasks past their deadline, forgotten here (the caller counts them lost). `queued(task_ids)`: those of
        them no one has read yet, which wait on; asked again at the next call about each task found queued, so that
        its clock starts when it was last seen unread, at most one call before it was read."""
        limit = self.limit_s()
        late = [task_id for task_id, at in self.pushed_at.items() if now - self.seen_queued.get(task_id, at) > limit]
        if queued is not None and (asked := [*late, *self.still_queued.difference(late)]):
            self.still_queued = queued(asked)
            self.seen_queued.update(dict.fromkeys(self.still_queued, now))
            late = [task_id for task_id in late if task_id not in self.still_queued]
        if late and not self.round_trips:
            self.cold_s = min(2 * self.cold_s, self.ceiling_s)
        self.forget(late)
        return late
