"""learner/deadlines.py: a task's deadline follows the run's own round trips, with a floor."""

import pytest

from learner.deadlines import Deadlines


def test_the_floor_holds_before_any_round_trip_and_under_fast_ones():
    deadlines = Deadlines(factor=4.0, floor_s=60.0)
    deadlines.pushed("a", now=0.0)
    assert deadlines.limit_s() == 60.0 and deadlines.overdue(now=59.0) == []
    assert deadlines.overdue(now=61.0) == ["a"] and deadlines.overdue(now=1000.0) == []  # counted once
    for i in range(10):
        deadlines.pushed(f"fast{i}", now=100.0)
        deadlines.returned(f"fast{i}", now=101.0)
    assert deadlines.limit_s() == 60.0  # 4 x 1 s is under the floor


def test_the_deadline_is_a_multiple_of_the_95th_percentile_of_recent_round_trips():
    deadlines = Deadlines(factor=4.0, floor_s=1.0, window=100)
    for i in range(100):
        deadlines.pushed(f"t{i}", now=0.0)
        deadlines.returned(f"t{i}", now=10.0 if i < 95 else 50.0)  # 5 % slow ones
    assert deadlines.limit_s() == 4.0 * 50.0
    for i in range(100):  # the window moves on: only the recent ones count
        deadlines.pushed(f"u{i}", now=0.0)
        deadlines.returned(f"u{i}", now=2.0)
    assert deadlines.limit_s() == 8.0
    deadlines.pushed("slow", now=0.0)
    deadlines.pushed("settled", now=0.0)
    deadlines.forget(["settled"])
    deadlines.returned("never-pushed", now=5.0)  # a duplicate or an unknown task: nothing measured
    assert deadlines.limit_s() == 8.0
    assert deadlines.overdue(now=7.0) == [] and deadlines.overdue(now=9.0) == ["slow"]


def test_a_worker_answering_just_before_each_deadline_cannot_raise_it_past_the_ceiling():
    """The round trips are the workers' to make: one holding every task it reads and answering just in time
    multiplied the deadline about 3.6 times a round (600 s, 2,360 s, 9,400 s...), stalling the run ever longer."""
    deadlines = Deadlines(factor=4.0, floor_s=600.0, window=16, ceiling_s=3600.0)
    for round_ in range(6):
        limit = deadlines.limit_s()
        for i in range(16):
            deadlines.pushed(f"r{round_}-{i}", now=0.0)
            deadlines.returned(f"r{round_}-{i}", now=0.99 * limit)
    assert deadlines.limit_s() == 3600.0
    assert Deadlines(factor=4.0, floor_s=600.0, ceiling_s=60.0).limit_s() == 600.0  # the floor wins a lower ceiling


def test_a_task_no_one_has_read_waits_and_its_clock_starts_when_it_was_last_seen_unread():
    """Generators that start late, or a backlog: tasks still queued in `prompts` counted lost at the floor, while
    their entries stayed first in line, so the refills waited behind entries whose groups would be refused."""
    deadlines = Deadlines(factor=4.0, floor_s=60.0, ceiling_s=1000.0)
    deadlines.pushed("read", now=0.0)
    deadlines.pushed("unread", now=0.0)
    asked = []
    assert deadlines.overdue(now=61.0, queued=lambda late: asked.append(sorted(late)) or {"unread"}) == ["read"]
    assert asked == [["read", "unread"]]  # asked about the late ones only, once
    limit = deadlines.limit_s()
    assert deadlines.overdue(now=61.0 + limit - 1, queued=lambda late: set()) == []  # read since: a whole deadline
    assert deadlines.overdue(now=61.0 + limit + 1, queued=lambda late: set()) == ["unread"]
    deadlines.pushed("back", now=0.0)
    deadlines.overdue(now=5000.0, queued=lambda late: set(late))
    deadlines.returned("back", now=5010.0)  # its round trip runs from the push, queue included
    assert list(deadlines.round_trips) == [5010.0]


def test_losses_before_any_group_came_back_double_the_deadline_until_one_does():
    """A first wave of groups longer than the floor (20k-token responses on a cold engine) was lost whole; their
    groups, refused as unknown when they came, measured nothing, so every later wave was lost too: no update for
    hours while every GPU generated groups that were thrown away."""
    deadlines = Deadlines(factor=4.0, floor_s=600.0, ceiling_s=3000.0)
    now, limits = 0.0, []
    for wave in range(4):
        deadlines.pushed(f"w{wave}", now=now)
        limits.append(deadlines.limit_s())
        now += limits[-1] + 1
        assert deadlines.overdue(now=now) == [f"w{wave}"]
    assert limits == [600.0, 1200.0, 2400.0, 3000.0]  # up to the ceiling
    deadlines.pushed("slow", now=now)
    deadlines.returned("slow", now=now + 700.0)  # measured: the round trips decide from here
    assert deadlines.limit_s() == 4 * 700.0
    deadlines.pushed("lost", now=now)
    deadlines.overdue(now=now + 3000.0)
    assert deadlines.limit_s() == 4 * 700.0  # a loss among groups that come back is a loss, not a slow start


def updates_in(hours: float, group_s: int, generators_up_s: int, slots: int = 256, tick_s: int = 10,
               given_up: set | None = None) -> int:
    """The 32B recipe's batch (512 prompts a step, the refills, its deadlines) against a FIFO pool of `slots` task
    places whose groups take `group_s` each (all informative), up `generators_up_s` after the first push: the real
    Deadlines and BatchAssembler, as the learner's loop drives them; a task given up stays in `prompts` (the pool
    still generates it, and its group is refused as unknown: no round trip). The updates made."""
    from collections import deque
    from types import SimpleNamespace as Group

    from learner.batch import BatchAssembler
    from services.config import load_settings

    settings = load_settings("dapo-qwen2.5-32b")
    batch = settings.learner.batch
    assembler = BatchAssembler.from_settings(settings.learner)
    deadlines = Deadlines(batch.task_deadline_factor, batch.task_deadline_min_s, ceiling_s=batch.task_deadline_max_s)
    queue, running, given_up = deque(), {}, set() if given_up is None else given_up
    version = issued = 0
    for now in range(0, int(hours * 3600), tick_s):
        status = assembler.status(version)
        if status in ("train", "limit"):
            taken = assembler.take_batch(version) if status == "train" else assembler.take_at_limit(version, "train")
            version += bool(taken.groups)
        else:
            ids = [f"t{issued + i}" for i in range(assembler.plan(version).count)]
            issued += len(ids)
            assembler.issued(ids, version)
            for task_id in ids:
                queue.append(task_id)
                deadlines.pushed(task_id, now)
        while now >= generators_up_s and queue and len(running) < slots:
            running[queue.popleft()] = now + group_s
        for task_id in [task_id for task_id, done in running.items() if done <= now]:
            del running[task_id]
            if task_id not in given_up:
                deadlines.returned(task_id, now)
                task = Group(task_id=task_id, created_at=0.0)
                assembler.admit(Group(rollout=Group(task=task, policy_version=version),
                                      scores=[Group(correct=c, reward=1.0 if c else -1.0) for c in (True, False) * 8]),
                                version)
        lost = deadlines.overdue(now, queued=lambda late: set(late).intersection(queue))
        given_up.update(lost)
        assembler.lost(lost)
    return version


@pytest.mark.parametrize("group_s, generators_up_s", [(700, 0), (1200, 0), (300, 500), (300, 700)])
def test_a_run_whose_first_groups_outlast_the_floor_or_whose_generators_start_late_still_trains(group_s,
                                                                                               generators_up_s):
    """At the 32B recipe's shapes each of these made no update in 6 hours (every task given up, every refill behind
    the given-up entries, no round trip ever measured) while every GPU generated groups that were thrown away."""
    assert updates_in(hours=6, group_s=group_s, generators_up_s=generators_up_s) >= 3


def test_the_32b_recipe_gives_up_no_task_whose_group_takes_what_the_plan_says():
    """A generator's batch of 64 groups of 16 x ~10k tokens takes about 2,150 s (`dapo plan`): under the 600 s floor
    the first wave after every start was given up and generated again (512 groups, 1.2 hours of 32 GPUs)."""
    given_up = set()
    assert updates_in(hours=6, group_s=2150, generators_up_s=0, given_up=given_up) >= 2
    assert not given_up


def test_a_queued_task_read_just_before_a_deadline_gets_a_whole_one_from_then():
    """Its clock restarted only at the check that found it late and unread: a generator that took it just before
    the next such check saw it given up moments later (in the 32B simulation, a whole first wave 30 s after it was
    taken). A task found queued is asked about at every check, so its clock starts at most one check before it was
    read."""
    deadlines = Deadlines(factor=4.0, floor_s=60.0)
    deadlines.pushed("t", now=0.0)
    unread = {"t"}
    for now in range(61, 119):  # the learner checks every second; queued all along
        assert deadlines.overdue(now=float(now), queued=lambda asked: unread & set(asked)) == []
    unread.clear()  # read at 118.5
    for now in range(119, 179):
        assert deadlines.overdue(now=float(now), queued=lambda asked: unread & set(asked)) == []
    assert deadlines.overdue(now=179.0, queued=lambda asked: unread & set(asked)) == ["t"]  # 60 s after 118
