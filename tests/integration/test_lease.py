"""The learner's single-writer lease (learner/lease.py) against a real embedded redis-server, with a TTL of 1 s."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from learner.lease import INSTANCE_ENV, LEASE_KEY, LearnerLease, LeaseGone, LeaseHeld
from services.errors import Unavailable
from services.keys import ROLES
from services.streams import Streams

TTL = 1.0


class Fences:
    """An on_fenced callback that records the holder instead of ending the process."""

    def __init__(self):
        self.holders: list[str] = []
        self.fired = threading.Event()

    def __call__(self, holder: str) -> None:
        self.holders.append(holder)
        self.fired.set()


def lease(settings, fences: Fences | None = None, losses: Fences | None = None) -> LearnerLease:
    return LearnerLease(settings, ttl_s=TTL, on_fenced=fences or Fences(), on_lost=losses or Fences())


def for_run(settings, run: str):
    return settings.model_copy(update={"redis": settings.redis.model_copy(update={"run": run})})


def test_the_key_is_the_runs_own(settings):
    first = lease(settings)
    assert first.key == Streams(first.redis, settings, signs_as=ROLES).key(LEASE_KEY) == "dapo:test:learner-lease"


def test_a_second_learner_cannot_take_a_live_lease_and_is_told_who_holds_it(settings):
    first = lease(settings).acquire()
    try:
        second = lease(settings)
        started = time.monotonic()
        with pytest.raises(LeaseHeld) as err:
            second.acquire()
        waited = time.monotonic() - started
        assert TTL <= waited < TTL + 1.5  # it waited one TTL (the holder might have just died), then gave up
        assert first.instance in str(err.value) and "holds the run test" in str(err.value)
        assert isinstance(err.value, Unavailable)  # exit 69 with this one line (cli/main.py)
        assert first.holder() == first.instance
    finally:
        first.release()


def test_a_released_lease_is_taken_at_once(settings):
    first = lease(settings).acquire()
    assert first.release() and first.holder() is None
    second = lease(settings)
    started = time.monotonic()
    second.acquire()
    try:
        assert time.monotonic() - started < 0.5 and second.holder() == second.instance
        assert not first.release()  # no longer ours: the release leaves the new holder's lease alone
        assert second.holder() == second.instance
    finally:
        second.release()


def test_a_holder_that_stops_renewing_is_replaced_after_the_ttl(settings):
    dead = lease(settings).acquire()
    time.sleep(TTL)  # renewed meanwhile: still held after its first TTL
    assert dead.holder() == dead.instance
    dead.stop_renewing()  # the process died: no renewal, no release
    second = lease(settings)
    started = time.monotonic()
    second.acquire()
    try:
        assert time.monotonic() - started <= TTL + 0.5
        assert second.holder() == second.instance
    finally:
        second.release()


def test_a_holder_whose_lease_another_took_is_fenced_at_its_next_renewal(settings):
    fences = Fences()
    holder = lease(settings, fences).acquire()
    try:
        holder.redis.set(holder.key, "other-host-1-abcd", px=60_000)  # another learner took the run
        assert fences.fired.wait(timeout=TTL)  # renewals every TTL/6
        assert fences.holders == ["other-host-1-abcd"]
        assert holder.redis.get(holder.key) == b"other-host-1-abcd"  # the fenced one wrote nothing
        assert holder.renew() == "fenced" and fences.holders[-1] == "other-host-1-abcd"
    finally:
        holder.stop_renewing()
        assert not holder.release()


def test_a_lease_found_lapsed_is_lost_not_silently_taken_again(settings):
    # Gone after the watchdog's bound means the TTL ran out on us (a frozen process): another learner may have
    # written meanwhile, so the holder ends (its supervisor restarts it); it is not a fence (nobody else holds it).
    fences, losses = Fences(), Fences()
    holder = lease(settings, fences, losses)
    holder.interval_s = 3600  # renewals only as the test calls them
    holder.acquire()
    try:
        holder._renewed_at -= TTL  # frozen past TTL/2 since the last renewal
        holder.redis.delete(holder.key)
        assert holder.renew() == "lapsed" and losses.fired.is_set() and not fences.fired.is_set()
        assert holder.holder() == holder.instance  # put back until this process is gone: nobody slips in
    finally:
        holder.release()


def test_a_lease_gone_right_after_a_renewal_is_put_back_not_lost(settings):
    """Redis keeps a TTL as a date: its clock stepped ahead by more than the TTL expires the lease of a learner
    that renewed a moment ago (or Redis lost the key). Nobody held it: put back, and the run goes on."""
    losses = Fences()
    holder = lease(settings, losses=losses)
    holder.interval_s = 3600
    holder.acquire()
    try:
        holder.redis.delete(holder.key)
        assert holder.renew() == "renewed" and not losses.fired.is_set()
        assert holder.holder() == holder.instance and holder.redis.pttl(holder.key) > 0
    finally:
        holder.release()


def test_a_process_frozen_past_half_its_ttl_commits_nothing_even_before_its_watchdog_runs(settings):
    losses = Fences()
    holder = lease(settings, losses=losses).acquire()
    try:
        holder.check()
        assert not losses.fired.is_set()
        holder.stop_renewing()  # as if frozen: no renewal, no watchdog turn yet
        holder._stop.clear()
        holder._renewed_at -= TTL  # woken up past TTL/2, about to commit a checkpoint
        holder.check()
        assert losses.fired.is_set()
    finally:
        holder.release()


def test_a_commit_asks_redis_whose_run_it_is_the_moment_before(settings):
    """A learner frozen past its TTL (a VM paused) whose successor took the run wakes with its watchdog not run
    yet: a write just before its clock was read again (a checkpoint's commit, which removes the later steps it
    finds: the successor's) went through in most trials. The commit now asks Redis first."""
    fences = Fences()
    holder = lease(settings, fences)
    holder.interval_s = 3600  # no renewal but the test's
    holder.acquire()
    try:
        holder.check()  # its own clock: renewed a moment ago
        holder.redis.set(holder.key, "successor@other-host:1", px=60_000)
        holder.check()
        assert not fences.fired.is_set()  # the clock alone cannot tell
        holder.confirm()
        assert fences.holders == ["successor@other-host:1"]
    finally:
        holder.stop_renewing()


def test_a_commit_waits_for_nothing_once_another_thread_found_the_lease_lost(settings):
    """The watchdog marks the lease lost, then logs its last line (up to a second), then ends the process: a commit
    asked for in between passed `check` and `confirm` (the mark read as a release) and went through."""
    losses = Fences()
    holder = lease(settings, losses=losses)
    holder.interval_s = 3600
    holder.acquire()
    try:
        holder._renewed_at -= TTL  # frozen past TTL/2
        watchdog = threading.Thread(target=holder.check)  # the watchdog's turn, on its own thread
        watchdog.start()
        watchdog.join()
        assert losses.fired.is_set()
        with pytest.raises(LeaseGone, match="lost"):
            holder.confirm()  # the commit's thread, before the process has ended
    finally:
        holder.release()


def test_a_learner_cut_off_from_redis_ends_before_its_lease_can_lapse(settings, redis_server):
    # Cut off from Redis (a partition; the disk still there), it cannot know whether another learner takes the
    # run once the TTL is over: with no renewal through for TTL/2 it ends (its supervisor restarts it), not later.
    fences, losses = Fences(), Fences()
    holder = lease(settings, fences, losses).acquire()
    try:
        redis_server.stop(kill=True)
        cut_off = time.monotonic()
        assert losses.fired.wait(timeout=2 * TTL), "the lost lease went unnoticed"
        assert time.monotonic() - cut_off < TTL and losses.holders[0] > TTL / 2
        assert not fences.fired.is_set()
    finally:
        redis_server.start()
        holder.release()


def test_a_full_redis_does_not_cost_the_learner_its_lease(settings, redis_server):
    # Redis at maxmemory refuses every write that needs memory; a renewal is a PEXPIRE, which needs none, so a flood
    # that fills Redis does not end the learner (the learner then trims it: services/streams.py `trim_overfull`).
    import redis

    fences, losses = Fences(), Fences()
    holder = lease(settings, fences, losses).acquire()
    raw = redis.Redis.from_url(redis_server.url)
    try:
        raw.xadd("flood", {"data": b"x" * 200_000})
        raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 100_000)
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            raw.set("any-write", "x")
        assert not losses.fired.wait(timeout=2 * TTL) and not fences.fired.is_set()
        assert holder.renew() == "renewed"
    finally:
        raw.config_set("maxmemory", 0)
        holder.release()


def test_different_runs_do_not_conflict(settings):
    first = lease(settings).acquire()
    other = lease(for_run(settings, "other"))
    started = time.monotonic()
    other.acquire()
    try:
        assert time.monotonic() - started < 0.5
        assert first.holder() == first.instance and other.holder() == other.instance and first.key != other.key
    finally:
        first.release()
        other.release()


def test_the_learner_service_claims_the_run_before_it_writes_and_releases_it(settings):
    from learner.service import LearnerService

    settings = settings.model_copy(update={"learner": settings.learner.model_copy(update={"lease_ttl_s": TTL})})
    service = LearnerService(settings)
    service.claim_run()
    try:
        client = service.lease.redis
        assert client.get(service.lease.key) == service.lease.instance.encode()
        with pytest.raises(LeaseHeld, match=service.lease.instance):
            LearnerService(settings).claim_run()
    finally:
        service.release_run()
    assert client.get(Streams(client, settings, signs_as=ROLES).key(LEASE_KEY)) is None and service.lease is None


def test_a_restart_under_the_same_supervisor_takes_its_own_lease_back_at_once(settings, monkeypatch):
    # `dapo run` gives every restart of its learner one identity: a learner it restarts after a crash is back at
    # once, not one TTL later; a learner of another launcher (another identity) still waits and fails.
    monkeypatch.setenv(INSTANCE_ENV, "host-launcher1-abcd")
    crashed = lease(settings).acquire()
    crashed.stop_renewing()  # SIGKILLed: no release...
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_value = f"host-launcher1-abcd@{socket.gethostname()}:{int(gone.stdout)}"  # ...and its process is gone
    crashed.redis.set(crashed.key, dead_value, px=10_000)  # what it has left: waiting for it would take 10 s
    restarted = lease(settings)
    started = time.monotonic()
    restarted.acquire()
    try:
        assert time.monotonic() - started < TTL / 4 and restarted.holder() == restarted.instance
        monkeypatch.setenv(INSTANCE_ENV, "host-launcher2-ef01")
        with pytest.raises(LeaseHeld):
            lease(settings).acquire()
    finally:
        restarted.release()


def test_a_predecessor_that_may_be_alive_is_waited_for_like_any_holder(settings, monkeypatch):
    # Its process cannot be looked up (another host: the identity set by hand in two pods) or is alive (a rank 0
    # that outlived its torchrun): no take-over, the lease must lapse first.
    monkeypatch.setenv(INSTANCE_ENV, "host-launcher1-abcd")
    elsewhere = lease(settings)
    elsewhere.redis.set(elsewhere.key, "host-launcher1-abcd@another-host:1234", px=int(0.8 * TTL * 1000))
    started = time.monotonic()
    elsewhere.acquire()
    try:
        assert time.monotonic() - started >= 0.7 * TTL and elsewhere.holder() == elsewhere.instance
    finally:
        elsewhere.release()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    survivor = lease(settings)
    survivor.instance = f"host-launcher1-abcd@{socket.gethostname()}:{alive.pid}"  # a live process of this host
    survivor.acquire()
    try:
        with pytest.raises(LeaseHeld, match=survivor.instance):
            lease(settings).acquire()
        assert survivor.holder() == survivor.instance
    finally:
        survivor.release()
        alive.kill()
        alive.wait()
