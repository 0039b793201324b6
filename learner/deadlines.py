"""When the learner gives up on a task it issued: a deadline from the run's own round trips.

A task whose group never comes back (its stream entry deleted or trimmed, a consumer group destroyed, a worker that
holds it and stalls without dying) would otherwise keep the synchronous loop, an evaluation or a drain waiting
forever. Each pushed task gets a deadline: `factor` times the 95th percentile of the round trips (pushed -> its
scored group read) of the last `window` tasks, and never less than `floor_s` (before any group came back it is
`floor_s` alone: a cold engine's first batch may take long), and never more than `ceiling_s` (the round trips are
the workers' to make: one that answers every task it holds just before its deadline would raise it without end).
Past it the task counts as lost; the step refills.
"""

from __future__ import annotations

from collections import deque


class Deadlines:
    def __init__(self, factor: float, floor_s: float, window: int = 256, ceiling_s: float = float("inf")):
        self.factor, self.floor_s, self.ceiling_s = factor, floor_s, max(floor_s, ceiling_s)
        self.pushed_at: dict[str, float] = {}
        self.round_trips: deque[float] = deque(maxlen=window)

    def pushed(self, task_id: str, now: float) -> None:
        self.pushed_at[task_id] = now

    def returned(self, task_id: str, now: float) -> None:
        """Its group was read: one more round trip measured (a duplicate or an unknown task measures nothing)."""
        started = self.pushed_at.pop(task_id, None)
        if started is not None:
            self.round_trips.append(now - started)

    def forget(self, task_ids) -> None:
        for task_id in task_ids:
            self.pushed_at.pop(task_id, None)

    def limit_s(self) -> float:
        """The current deadline, seconds after the push."""
        if not self.round_trips:
            return self.floor_s
        ordered = sorted(self.round_trips)
        p95 = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        return min(max(self.floor_s, self.factor * p95), self.ceiling_s)

    def overdue(self, now: float) -> list[str]:
        """The tasks past their deadline, forgotten here (the caller counts them lost)."""
        limit = self.limit_s()
        late = [task_id for task_id, at in self.pushed_at.items() if now - at > limit]
        self.forget(late)
        return late
