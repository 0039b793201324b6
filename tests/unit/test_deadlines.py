"""learner/deadlines.py: a task's deadline follows the run's own round trips, with a floor."""

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
