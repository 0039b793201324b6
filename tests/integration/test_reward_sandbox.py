"""The verifier pool: real child processes, a real time limit, a real memory limit, real crashes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from benchmarks.faults import children_of
from reward.sandbox import VerifierPool, VerifierUnavailable
from reward.verify import RULE_TIMEOUT
from services.config import RewardConfig

# Comparing this with 1 makes sympy expand a polynomial of about 500,000 terms: it does not come back for minutes.
HANG = "Answer: $(x+y+z)^{999}$"
TIMEOUT_S = 1.5


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=TIMEOUT_S, memory_mb=1024) as p:
        yield p


def test_verdicts_come_back_in_order(pool):
    pairs = [("Answer: 5", "5"), ("\\boxed{3}", "4"), ("Answer: $\\frac{1}{3}$", "0.3333333"), ("nothing", "1")] * 5
    verdicts = pool.verify_many(pairs)
    assert [v.correct for v in verdicts] == [True, False, True, False] * 5
    assert [v.rule for v in verdicts[:4]] == ["answer_line", "boxed", "math_verify", "none"]


def test_the_configured_answer_rule_runs_in_the_children(pool):
    """`reward.answer_rule: dapo` reaches the children: the same pairs, read by the paper's rule, differ."""
    pairs = [("So the total is $\\boxed{34}$.", "34"), ("Answer: 025", "25"),
             ("We are done.\nWe may check our answer: 34", "34"),
             ("Answer: $\\frac{1}{2}$", "\\frac12"), ("Answer: 34\n" + "Let me check once more. " * 15, "34")]
    cfg = RewardConfig(answer_rule="dapo", workers=1, timeout_s=TIMEOUT_S, memory_mb=1024)
    with VerifierPool.from_config(cfg) as dapo:
        assert dapo.rule == "dapo" and dapo.size == 1 and dapo.timeout_s == TIMEOUT_S
        verdicts = dapo.verify_many(pairs)
    assert [(v.correct, v.rule) for v in verdicts] == [
        (False, "none"), (False, "dapo_minerva"), (True, "dapo_minerva"), (True, "dapo_minerva"), (False, "none")
    ]
    assert verdicts[3].extracted == "\\frac{1}{2}"
    assert [v.correct for v in pool.verify_many(pairs)] == [True, True, False, True, True]  # the robust default


def test_a_hang_times_out_and_the_child_is_replaced(pool):
    pids_before = set(pool.worker_pids())
    replaced_before = pool.stats.replaced
    started = time.monotonic()
    verdict = pool.verify(HANG, "1")
    elapsed = time.monotonic() - started
    assert verdict.rule == "timeout" and not verdict.correct and verdict.extracted is None
    assert "exceeded" in verdict.detail
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.0
    assert pool.stats.replaced == replaced_before + 1
    # The pool keeps going: the next item is verified by the remaining or the new child.
    assert pool.verify("Answer: 7", "7").correct
    assert pool.wait_ready(30)
    assert set(pool.worker_pids()) != pids_before


def test_a_killed_child_gives_an_error_verdict_and_is_replaced():
    with VerifierPool(workers=1, timeout_s=30, memory_mb=1024) as alone:
        (busy_pid,) = alone.worker_pids()
        future = alone.submit(HANG, "1")
        time.sleep(1.0)  # the only child is working on it
        os.kill(busy_pid, signal.SIGKILL)  # what the kernel's OOM killer would do
        verdict = future.result(timeout=10)
        assert verdict.rule == "error" and not verdict.correct
        assert "died" in verdict.detail and "-9" in verdict.detail
        assert alone.verify("Answer: 8", "8").correct
        assert alone.wait_ready(30) and busy_pid not in alone.worker_pids()


def test_an_idle_child_killed_breaks_no_later_item():
    """Pebble gives up on a pool in which a child dies while no item runs (it raises BrokenProcessPool for every
    queued item and refuses new ones). An item queued then has no verdict, which must not read as a wrong answer;
    an item submitted later is verified by a new pool."""
    with VerifierPool(workers=1, timeout_s=30, memory_mb=1024) as alone:
        (idle_pid,) = alone.worker_pids()
        os.kill(idle_pid, signal.SIGKILL)
        waiting = alone.submit("Answer: 8", "8")  # queued before pebble noticed the death, as a rule
        try:
            verdict = waiting.result(timeout=30)
            assert verdict.correct, verdict  # scheduled on the new pool after all
        except VerifierUnavailable as err:
            assert "died" in str(err)
        time.sleep(1.0)  # whatever pebble made of the death, it has made it by now
        assert alone.verify("Answer: 9", "9").correct
        (idle_pid,) = alone.worker_pids()
        os.kill(idle_pid, signal.SIGKILL)
        time.sleep(1.0)  # pebble has given up on the pool before the next item comes
        assert alone.verify("Answer: 10", "10").correct
        assert alone.wait_ready(30) and idle_pid not in alone.worker_pids()


def test_items_queued_past_the_pipe_when_the_pool_fails_are_handed_back_not_left_waiting():
    """Pebble fails, when it gives up on a pool, only the items it wrote to a child's pipe (64 KiB: one response of
    a long chain of thought); the rest, queued in this process, waited for ever, and the stream worker with them,
    renewing its claims (its /readyz green). Every one of them must end: a verdict, or unavailable."""
    long = "Let me think step by step. " * 3000 + "Answer: 4"  # 80 KB
    with VerifierPool(workers=1, timeout_s=30, memory_mb=1024) as alone:
        (idle_pid,) = alone.worker_pids()
        os.kill(idle_pid, signal.SIGKILL)
        group = alone.submit_many([(long, "4")] * 4)
        try:
            assert all(verdict.correct for verdict in group.result(timeout=30))  # on the new pool after all
        except VerifierUnavailable:
            pass
        assert alone.verify("Answer: 5", "5").correct


def test_a_step_of_the_wall_clock_times_out_no_item(monkeypatch):
    """NTP stepping the clock at boot, or a VM resumed: pebble timed items by the wall clock, and an honest answer
    running across a step of more than timeout_s was scored `timeout` (-1)."""
    slow = "Answer: $99997^{99999} \\cdot 99996^{99999}$"  # a second or so of honest work
    with VerifierPool(workers=1, timeout_s=10, memory_mb=1024) as alone:
        real, offset = time.time, [0.0]
        monkeypatch.setattr(time, "time", lambda: real() + offset[0])
        running = alone.submit(slow, "1")
        while not running.started():
            time.sleep(0.005)
        offset[0] = 15.0  # the wall clock steps 15 s forward while the item runs
        assert not running.done()
        assert running.result(timeout=60).rule != RULE_TIMEOUT


FROZEN_MIDWAY = """
import sys, time
from reward.sandbox import VerifierPool
product = "99991^{99999} \\\\cdot 99989^{99999}", "99989^{99999} \\\\cdot 99991^{99999}"  # a second of honest work
with VerifierPool(workers=1, timeout_s=5, memory_mb=1024) as pool:
    running = pool.submit(f"Answer: ${product[0]}$", product[1])
    while not running.started():
        time.sleep(0.005)
    print("started", flush=True)
    sys.stdin.readline()
    verdict = running.result(timeout=60)
    print(verdict.rule, verdict.correct, flush=True)
"""


def test_a_reward_worker_stopped_while_an_item_runs_does_not_time_it_out():
    """Ctrl-Z, `docker pause`, a cgroup frozen: the monotonic clock counts the time the process group was stopped,
    and every item that was running timed out at once on its return, its child stopped with it (an honest answer
    scored -1, with nothing to tell it from a wrong one)."""
    worker = subprocess.Popen([sys.executable, "-c", FROZEN_MIDWAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True, cwd=Path(__file__).parents[2])
    try:
        assert worker.stdout.readline().strip() == "started"
        os.killpg(worker.pid, signal.SIGSTOP)
        time.sleep(6.0)  # past the item's 5 s
        os.killpg(worker.pid, signal.SIGCONT)
        worker.stdin.write("\n")
        worker.stdin.flush()
        assert worker.stdout.readline().split() == ["math_verify", "True"]
    finally:
        os.killpg(worker.pid, signal.SIGCONT)
        worker.kill()
        worker.wait(timeout=30)


def test_the_children_s_start_messages_are_read_whether_or_not_anyone_asks_how_many_are_ready(pool):
    """Every child a timeout or a death replaces says it started, through a pipe: read only when someone asked
    (/readyz), it filled after some 600 replacements, and the next child blocked in its start for good, holding
    every later item (no time limit runs before a child takes one). A thousand messages go through now, unasked."""
    started = (os.getpid(), "network namespace of its own", "uid 65534 (nobody)")  # a child's, in size
    sent = threading.Thread(target=lambda: [pool._ready.put(started) for _ in range(1000)], daemon=True)
    sent.start()
    sent.join(timeout=20)
    assert not sent.is_alive()
    assert pool.verify(HANG, "1").rule == "timeout"
    assert pool.verify("Answer: 8", "8").correct


def test_the_survivors_of_a_pool_given_up_on_are_stopped():
    """Pebble gives up on a pool when an idle child dies, and stops the others only in a join() that its own
    threads cannot call: they waited on the dead pool's pipe for the life of the service (80 MB each)."""
    with VerifierPool(workers=2, timeout_s=30, memory_mb=1024) as both:
        first, survivor = both.worker_pids()
        os.kill(first, signal.SIGKILL)
        time.sleep(1.0)  # pebble has given up on the pool
        assert both.verify("Answer: 9", "9").correct
        deadline = time.monotonic() + 10
        while survivor in children_of(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert survivor not in children_of(os.getpid())


def test_hostile_items_do_not_delay_the_others_beyond_the_limit(pool):
    assert pool.wait_ready(30)
    started = time.monotonic()
    pairs = [(HANG, "1"), ("Answer: 1", "1"), ("Answer: 2", "2"), ("Answer: 3", "3")]
    verdicts = pool.verify_many(pairs)
    assert [v.rule for v in verdicts] == ["timeout", "answer_line", "answer_line", "answer_line"]
    assert all(v.correct for v in verdicts[1:])
    assert time.monotonic() - started < TIMEOUT_S + 1.5


def test_the_memory_limit_is_set_in_every_child(pool):
    assert pool.wait_ready(30)
    for pid in pool.worker_pids():
        with open(f"/proc/{pid}/limits") as f:
            line = next(row for row in f if row.startswith("Max address space"))
        soft, hard = line.split()[3:5]
        assert int(soft) == int(hard) == 1024 * 1024 * 1024


def test_every_child_may_write_no_large_file_and_open_few(pool):
    from reward.sandbox import CHILD_MAX_FILE_BYTES, CHILD_MAX_OPEN_FILES

    assert pool.wait_ready(30)
    for pid in pool.worker_pids():
        with open(f"/proc/{pid}/limits") as f:
            rows = {row[:26].strip(): row[26:].split()[:2] for row in f}
        assert [int(v) for v in rows["Max file size"]] == [CHILD_MAX_FILE_BYTES] * 2
        assert [int(v) for v in rows["Max open files"]] == [CHILD_MAX_OPEN_FILES] * 2


def test_every_child_has_a_network_namespace_of_its_own_with_no_interface_up(pool):
    """Code a hostile response got to run in a verifier reaches nothing: the child's network namespace is not the
    service's, and holds only its own loopback (no Redis, no service, no host). Where the OS refuses the
    namespace (a container without CAP_SYS_ADMIN), the pool says so and this test says why it cannot check."""
    assert pool.wait_ready(30)
    if not pool.network.startswith("network namespace"):
        pytest.skip(f"this machine refuses the verifier a network namespace: {pool.network}")
    for pid in pool.worker_pids():
        assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
        with open(f"/proc/{pid}/net/dev") as f:
            interfaces = [row.split(":")[0].strip() for row in f.readlines()[2:]]
        assert interfaces == ["lo"]


def test_a_child_started_as_root_runs_as_nobody_with_a_process_limit(pool, tmp_path):
    """Code a hostile response got to run reads no file the services own and forks no bomb: a verifier started as
    root runs as uid/gid 65534 with no supplementary group and RLIMIT_NPROC; and still verifies."""
    from reward.sandbox import CHILD_MAX_PROCESSES, UNPRIVILEGED_ID

    if os.geteuid() != 0:
        pytest.skip("the service does not run as root here: its verifiers keep its user")
    assert pool.wait_ready(30) and pool.user == f"uid {UNPRIVILEGED_ID} (nobody)"
    for pid in pool.worker_pids():
        with open(f"/proc/{pid}/status") as f:
            status = dict(row.split(":", 1) for row in f)
        nobody = [str(UNPRIVILEGED_ID)] * 4  # real, effective, saved, file system
        assert status["Uid"].split() == nobody and status["Gid"].split() == nobody
        assert status["Groups"].strip() == ""
        with open(f"/proc/{pid}/limits") as f:
            rows = {row[:26].strip(): row[26:].split()[:2] for row in f}
        assert [int(v) for v in rows["Max processes"]] == [CHILD_MAX_PROCESSES] * 2
    assert pool.verify("Answer: 4", "4").correct  # the verifier still reads what it needs


def test_a_memory_limit_too_small_to_verify_fails_items_fast_instead_of_hanging():
    # 40 MiB cannot hold sympy: children fail at startup, the pool says so, and items get `error` verdicts.
    with VerifierPool(workers=1, timeout_s=TIMEOUT_S, memory_mb=40) as small:
        # The reason is the child's MemoryError, or its exit code when it could not even report that.
        assert small.broken and "cannot start" in small.broken
        started = time.monotonic()
        verdict = small.verify("Answer: 5", "5")
        assert verdict.rule == "error" and not verdict.correct and "cannot start" in verdict.detail
        assert time.monotonic() - started < 5


def test_concurrent_callers_share_the_pool(pool):
    results: dict[int, list] = {}

    def caller(k: int) -> None:
        results[k] = pool.verify_many([(f"Answer: {k * 10 + i}", str(k * 10 + i)) for i in range(10)])

    threads = [threading.Thread(target=caller, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results) == [0, 1, 2, 3]
    assert all(v.correct and v.rule == "answer_line" for verdicts in results.values() for v in verdicts)


def test_close_resolves_every_pending_future():
    small = VerifierPool(workers=1, timeout_s=30, memory_mb=1024).start()
    futures = [small.submit(HANG, "1"), small.submit("Answer: 1", "1")]
    time.sleep(0.3)
    small.close()
    for future in futures:
        assert future.done()
        with pytest.raises(RuntimeError, match="closed"):
            future.result(timeout=0)
    with pytest.raises(RuntimeError):
        small.submit("Answer: 1", "1")


def test_invalid_pool_settings_are_refused():
    with pytest.raises(ValueError):
        VerifierPool(workers=0)
    with pytest.raises(ValueError):
        VerifierPool(timeout_s=0)


class Interrupted(Exception):
    pass


def test_a_signal_at_any_point_of_the_start_leaves_no_child_behind():
    """A service raises from its signal handler while it starts (`services.startup`); wherever that lands in the
    spawning of the children (about 15 ms here), close() stops and reaps every child that was spawned."""

    def interrupt(_signum, _frame):
        raise Interrupted

    VerifierPool(workers=2)  # its queue starts multiprocessing's resource tracker, a child that stays
    before = set(children_of(os.getpid()))
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        for delay_ms in range(1, 41):
            pool = VerifierPool(workers=2)
            try:
                signal.setitimer(signal.ITIMER_REAL, delay_ms / 2000)
                pool.start()  # the children import the verifier for seconds: the alarm ends it
            except Interrupted:
                pass
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                pool.close()
            assert set(children_of(os.getpid())) == before, \
                f"an alarm after {delay_ms / 2} ms left children behind (or unreaped)"
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_close_does_not_wait_for_ever_on_pebbles_threads(monkeypatch):
    """pebble's join waits for its threads without a bound: one reading a message that a worker killed by close()
    had half written waited for the rest for ever, and the service's stop (and a test run) hung there."""
    from reward import sandbox

    monkeypatch.setattr(sandbox, "POOL_JOIN_S", 0.5)
    pool = VerifierPool(workers=1).start()
    stuck = threading.Event()
    monkeypatch.setattr(type(pool._pool), "join", lambda self, timeout=None: stuck.wait(60))
    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 15
    stuck.set()
