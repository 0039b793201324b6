"""Reliable streams against a real (embedded) redis-server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgpack
import pytest
import redis

from services.config import KeysConfig, load_settings
from services.keys import ROLES, create_keys, keys_dir
from services.messages import PromptTask, RolloutGroup, Sample, entry_limits, to_wire
from services.redis_local import EmbeddedRedis, connect
from services.streams import ISSUED, READ_PAGE_BYTES, BackPressureTimeout, Streams, entry_ids_key, read_pages


def task(i: int) -> PromptTask:
    return PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt=f"{i}+1=?", ground_truth=str(i + 1))


def group_for(t: PromptTask) -> RolloutGroup:
    sample = Sample(token_ids=[1, 2, 3], logprobs=[-0.1, -0.2, -0.3], text="Answer: 1", finish_reason="stop")
    return RolloutGroup(task=t, policy_version=0, generator_id="g", samples=[sample])


@pytest.fixture
def streams(settings):
    return Streams(connect(settings), settings, signs_as=ROLES)


def test_produce_consume_forward_ack(streams):
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    for i in range(3):
        prompts.produce(task(i))
    got = prompts.consume("c1", count=10)
    assert [d.message.task_id for d in got] == ["t0", "t1", "t2"]
    assert all(d.deliveries == 1 for d in got)
    assert prompts.pending() == 3
    for d in got:
        assert prompts.forward(d, rollouts, group_for(d.message))
    assert prompts.pending() == 0 and prompts.room() == prompts.cfg.high_water  # acked entries are deleted
    out = rollouts.consume("r1", count=10)
    assert [d.message.task.task_id for d in out] == ["t0", "t1", "t2"]
    assert out[0].message.samples[0].logprobs == pytest.approx([-0.1, -0.2, -0.3])


def test_a_read_that_must_not_block_returns_at_once_and_a_blocking_one_wakes_on_a_new_entry(streams):
    # Redis times a BLOCK out only on its event loop's tick (100 ms at hz 10), and BLOCK 0 waits forever: a
    # generator with work in its engine reads with block_ms=0 and must get its answer at once
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    assert len(prompts.consume("c", count=10, block_ms=0)) == 1
    reads = []
    reader = threading.Thread(target=lambda: reads.append(prompts.consume("c", count=10, block_ms=0)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert reads == [[]], "an empty stream read with block_ms=0 did not return"
    started = time.monotonic()
    threading.Timer(0.3, lambda: prompts.produce(task(1))).start()
    (woken,) = prompts.consume("c", count=10, block_ms=5000)
    assert woken.message.task_id == "t1" and time.monotonic() - started < 3


def test_poison_messages_go_to_dead_and_consumer_keeps_going(streams):
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))  # creates the group

    def signed(payload: bytes) -> dict:  # a producer with the token that writes garbage
        return {b"data": payload, b"sig": prompts.signature(payload)}

    streams.redis.xadd(prompts.key, signed(b"\xff\x00 not msgpack"))
    bad_version = task(1).model_dump()
    bad_version["schema_version"] = 99
    pushed = streams.redis.xadd(prompts.key, signed(msgpack.packb(bad_version)))
    streams.redis.hset(entry_ids_key(streams.key(ISSUED)), "t1", pushed)  # recorded as the learner's push records it
    streams.redis.xadd(prompts.key, {b"other": b"no data field"})
    prompts.produce(task(2))
    got = prompts.consume("c1", count=10)
    assert [d.message.task_id for d in got] == ["t0", "t2"]
    dead = streams.dead_letters()
    assert len(dead) == 3
    reasons = " | ".join(d["reason"] for d in dead)
    assert "not msgpack" in reasons and "schema_version" in reasons and "forged: no signature" in reasons
    assert dead[-1]["data"] == b"\xff\x00 not msgpack"  # the original payload is kept
    assert all(d["stream"] == "prompts" for d in dead)
    assert prompts.pending() == 5  # the dead-lettered entries are parked for the learner to check the letters
    _, letters = streams.dead_letters_after("0-0")
    # the learner's own, signed entry that a consumer could not parse names its task; garbage and a forgery do not
    assert [streams.settle_dead_letter(fields) for _, fields in letters] == [None, "t1", None]
    assert prompts.pending() == 2 and streams.redis.xlen(prompts.key) == 2  # settled: acked and deleted


def test_a_parked_entry_no_learner_settled_is_dead_lettered_again_and_never_run(streams):
    """An entry a worker dead-lettered waits, parked, for the learner to check the letter. If no learner settles it
    within the visibility timeout (away, or in a long step), the consumer that reclaims it knows it by its count:
    it goes to `dead` again as `unsettled`, which retires nothing, and no worker runs it. The first letter still
    settles it; a group refused for its provenance, parked and reclaimed so, retires no task either."""
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0), register=(streams.key(ISSUED), "t0", task(0)))  # as the learner pushes a task
    rollouts.produce(group_for(task(1)))
    (delivery,) = prompts.consume("c1", count=10)
    prompts.reject(delivery, "engine failure on this task alone: test")
    (group,) = rollouts.consume("r1", count=10)
    rollouts.reject(group, "provenance: task t1 does not match the task as issued (test)")
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    assert prompts.consume("c2", count=10) == [] and rollouts.consume("r2", count=10) == []
    reasons = [d["reason"] for d in reversed(streams.dead_letters())]
    assert reasons[:2] == ["engine failure on this task alone: test",
                           "provenance: task t1 does not match the task as issued (test)"]
    assert [reason.split(":")[0] for reason in reasons[2:]] == ["unsettled", "unsettled"]
    _, letters = streams.dead_letters_after("0-0")
    assert [streams.settle_dead_letter(fields) for _, fields in letters] == ["t0", None, None, None]  # once
    assert prompts.pending() == rollouts.pending() == 0


def test_forged_or_tampered_entries_go_to_dead_with_the_reason(streams, settings):
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0))
    good = to_wire(task(1))
    streams.redis.xadd(prompts.key, {b"data": good})  # no signature
    tampered = to_wire(task(1).model_copy(update={"ground_truth": "999"}))
    streams.redis.xadd(prompts.key, {b"data": tampered, b"sig": prompts.signature(good)})  # altered after signing
    elsewhere = settings.model_copy(update={"keys": KeysConfig(dir=str(Path(settings.run_dir) / "other-keys"))})
    create_keys(keys_dir(elsewhere))
    outsider = Streams(streams.redis, elsewhere, signs_as=ROLES).stream("prompts", PromptTask)
    outsider.produce(task(2))  # signed, with a learner key this run does not trust
    replayed = to_wire(group_for(task(3)))
    streams.redis.xadd(prompts.key, {b"data": replayed, b"sig": rollouts.signature(replayed)})  # from another stream
    other_run = Streams(streams.redis, settings.model_copy(update={"redis": settings.redis.model_copy(
        update={"run": "other"})}), signs_as=ROLES).stream("prompts", PromptTask)  # the same keys, another run
    streams.redis.xadd(prompts.key, {b"data": good, b"sig": other_run.signature(good)})
    for junk in ("é".encode(), b"\xff\xfe"):  # not even ASCII: refused like any other bad signature, no TypeError
        streams.redis.xadd(prompts.key, {b"data": good, b"sig": junk})
    prompts.produce(task(4))
    assert [d.message.task_id for d in prompts.consume("c1", count=10)] == ["t0", "t4"]
    reasons = [d["reason"] for d in reversed(streams.dead_letters())]
    unknown = "forged: key id {!r} is not in the keyring (retired by a rotation, or never issued)"
    learner_kid = streams.signers["learner"].kid
    assert reasons == [
        "forged: no signature",
        f"forged: bad signature under {learner_kid} (tampered, or not signed with that key)",
        unknown.format(outsider.streams.signers["learner"].kid),
        f"forged: signed by the generator role's key {streams.signers['generator'].kid}, and only the learner role "
        "signs prompts",
        f"forged: bad signature under {learner_kid} (tampered, or not signed with that key)",
        unknown.format("é"), unknown.format("\ufffd\ufffd"),
    ]


def test_a_forged_entry_is_dead_lettered_as_forged_whatever_its_delivery_count(streams):
    """The learner trusts the task id of a dead letter not labelled forged (it stops waiting for that task), so a
    forged entry redelivered past max_deliveries must still be labelled forged."""
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))  # creates the group
    prompts.ack(*prompts.consume("c0", count=1, block_ms=0))
    entry = streams.redis.xadd(prompts.key, {b"data": to_wire(task(1)), b"sig": b"0" * 64})
    streams.redis.xreadgroup(prompts.group, "c0", {prompts.key: ">"}, count=10)  # c0 took it, then crashed
    idle = int(prompts.cfg.visibility_timeout_s * 1000) + 1
    streams.redis.xclaim(prompts.key, prompts.group, "c0", 0, [entry], idle=idle,
                         retrycount=prompts.cfg.max_deliveries + 1)  # as if redelivered past the limit
    prompts.produce(task(2))
    got = streams.stream("prompts", PromptTask).consume("c1", count=10, block_ms=0)
    assert [d.message.task_id for d in got] == ["t2"]
    assert [d["reason"] for d in streams.dead_letters()][0].startswith("forged")


def test_a_dead_consumers_entries_behind_many_live_ones_are_reclaimed(streams, settings):
    """One XAUTOCLAIM looks at 10 x count pending entries; the scan goes on from call to call, so entries of a dead
    consumer queued behind many that live consumers are working on are reclaimed without waiting for those."""
    slow = settings.model_copy(update={"streams": settings.streams.model_copy(update={"visibility_timeout_s": 60.0})})
    prompts = Streams(streams.redis, slow, signs_as=ROLES).stream("prompts", PromptTask)
    for i in range(40):
        prompts.produce(task(i))
    prompts.consume("alive", count=35, block_ms=0)  # being worked on: not idle
    prompts.consume("dead", count=5, block_ms=0)  # then its consumer died
    dead = [row["message_id"] for row in streams.redis.xpending_range(prompts.key, prompts.group, "-", "+", 100,
                                                                         consumername="dead")]
    streams.redis.xclaim(prompts.key, prompts.group, "dead", 0, dead, idle=61_000, justid=True)
    reclaimed = []
    for _ in range(10):  # a read a second in service; here at once
        prompts._reclaimed_at = float("-inf")
        reclaimed += [d.message.task_id for d in prompts.consume("taker", count=1, block_ms=0)]
    assert reclaimed == [f"t{i}" for i in range(35, 40)], reclaimed


def test_retrying_client_waits_for_a_restarted_redis(redis_server, settings):
    """Every command of the client (plain, pipeline, script) outlives a redis-server crash and restart."""
    client = connect(settings)
    client.set("k", "1")
    results: dict = {}

    def calls():
        results["get"] = client.get("k")
        pipe = client.pipeline()
        pipe.incr("k").incr("k")
        results["pipe"] = pipe.execute()
        results["script"] = client.register_script("return redis.call('GET', KEYS[1])")(keys=["k"])

    redis_server.stop(kill=True)
    thread = threading.Thread(target=calls)
    thread.start()
    time.sleep(1.0)
    assert thread.is_alive()  # waiting, not failed
    redis_server.start()
    thread.join(timeout=60)
    assert results == {"get": b"1", "pipe": [2, 3], "script": b"3"}


def test_a_lost_consumer_group_is_recreated(streams):
    """A Redis that came back without the group (NOGROUP) does not stop a consumer: the group is re-created."""
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0))
    (d,) = prompts.consume("c", count=1)
    streams.redis.xgroup_destroy(prompts.key, prompts.group)
    assert not prompts.forward(d, rollouts, group_for(d.message))  # its pending entry went with the group
    prompts.produce(task(1))
    got = prompts.consume("c", count=10)
    assert sorted(x.message.task_id for x in got) == ["t0", "t1"]  # the new group reads the stream from the start


def test_message_delivered_too_often_goes_to_dead(streams):
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    for attempt in range(prompts.cfg.max_deliveries):
        got = prompts.consume(f"crashy{attempt}", count=1, block_ms=10)
        assert len(got) == 1 and got[0].deliveries == attempt + 1
        time.sleep(prompts.cfg.visibility_timeout_s + 0.1)  # consumer "dies" holding it
    assert prompts.consume("last", count=1, block_ms=10) == []
    (dead,) = streams.dead_letters()
    assert "delivered 4 times" in dead["reason"]


def test_backpressure_waits_then_fails_clearly(streams):
    prompts = streams.stream("prompts", PromptTask)
    for i in range(prompts.cfg.high_water):
        prompts.produce(task(i))
    with pytest.raises(BackPressureTimeout, match="stayed at 64"):
        prompts.produce(task(999), timeout=0.3)
    assert prompts.room() == 0

    def drain_one():
        time.sleep(0.3)
        (d,) = prompts.consume("c", count=1)
        prompts.ack(d)

    threading.Thread(target=drain_one).start()
    start = time.monotonic()
    prompts.produce(task(1000), timeout=10)  # waits for the consumer, then goes through
    assert time.monotonic() - start >= 0.25
    assert streams.redis.xlen(prompts.key) == prompts.cfg.high_water  # nothing was trimmed


def test_the_group_streams_wait_at_their_own_mark(settings):
    """`rollouts` and `scored` hold whole groups (MBs each at the 32B recipe): their producers wait at
    streams.group_high_water, while `prompts` keeps high_water."""
    grouped = Streams(connect(settings), settings.model_copy(update={"streams": settings.streams.model_copy(
        update={"group_high_water": 2})}), signs_as=ROLES)
    prompts, rollouts = grouped.stream("prompts", PromptTask), grouped.stream("rollouts", RolloutGroup)
    for i in range(2):
        assert rollouts.produce(group_for(task(i)))
    with pytest.raises(BackPressureTimeout, match="stayed at 2"):
        rollouts.produce(group_for(task(2)), timeout=0.3)
    assert rollouts.room() == 0 and prompts.room() == settings.streams.high_water == 64


def test_whole_entries_are_read_in_pages_sized_by_the_largest_entry_a_stream_can_need(streams, monkeypatch):
    """Redis builds a whole reply in its memory before sending it: 256 of the 32B recipe's groups in one XRANGE were
    1.1 GB past maxmemory, and every role's writes were refused while the learner read `held` at a checkpoint."""
    key = streams.key("held")
    for i in range(5):
        streams.redis.xadd(key, {"data": b"x%d" % i})
    pages = []
    xrange = streams.redis.xrange
    monkeypatch.setattr(streams.redis, "xrange", lambda *a, **k: pages.append(k["count"]) or xrange(*a, **k))
    entries = list(read_pages(streams.redis, key, "+", READ_PAGE_BYTES // 2))
    assert [fields[b"data"] for _, fields in entries] == [b"x%d" % i for i in range(5)]
    assert pages == [2, 2, 2]
    pages.clear()
    assert len(list(read_pages(streams.redis, key, "+", 10))) == 5 and pages == [256]
    big = load_settings("dapo-qwen2.5-32b")
    assert entry_limits(big)["held"] > READ_PAGE_BYTES // 4  # the recipe's held is read 1 to 3 groups at a time


def test_reclaimed_message_cannot_be_forwarded_twice(streams):
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0))
    (slow,) = prompts.consume("slow", count=1)
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    (fast,) = prompts.consume("fast", count=1)
    assert fast.deliveries == 2
    assert prompts.forward(fast, rollouts, group_for(fast.message))
    assert not prompts.forward(slow, rollouts, group_for(slow.message))  # late result dropped
    assert streams.redis.xlen(rollouts.key) == 1


def test_a_reject_of_an_entry_another_consumer_reclaimed_leaves_it_to_that_consumer(streams):
    """A generator frozen past the visibility timeout wakes and rejects its stale delivery (an invalid task, the
    culprit of an engine failure): the entry was parked away from the consumer that had reclaimed it, whose rollout
    was then dropped, and the letter retired the task."""
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0))
    (frozen,) = prompts.consume("frozen", count=1)
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    (live,) = prompts.consume("live", count=1)
    assert not prompts.reject(frozen, "invalid task: a stale verdict")
    assert streams.dead_letters() == []
    assert prompts.forward(live, rollouts, group_for(live.message))
    prompts.produce(task(1))
    (held,) = prompts.consume("live", count=1)
    assert prompts.reject(held, "invalid task: its holder's")
    assert [letter["reason"] for letter in streams.dead_letters()] == ["invalid task: its holder's"]


def test_a_reject_checks_its_holder_in_the_same_step_that_parks_the_entry(streams, settings, monkeypatch):
    """A consumer frozen right after it checked that it held the entry, and before its letter parked it (checked
    apart, two round trips): another reclaimed the entry meanwhile, and the park took it from that live one. Here
    the other consumer reclaims right after the reject's first command to Redis: either the letter is written and
    the entry parked, or the live consumer holds it and there is no letter; never both."""
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    (frozen,) = prompts.consume("frozen", count=1)
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    live = Streams(connect(settings), settings, signs_as=ROLES).stream("prompts", PromptTask)
    client, send, reclaimed = streams.redis, streams.redis.execute_command, []

    def send_then_reclaim(*args, **options):
        reply = send(*args, **options)
        if not reclaimed:
            reclaimed.append(live.consume("live", count=1))
        return reply

    monkeypatch.setattr(client, "execute_command", send_then_reclaim)
    written = prompts.reject(frozen, "invalid task: a verdict from before the freeze")
    letters = streams.dead_letters()
    assert written == bool(letters) and written != bool(reclaimed[0])
    if written:
        assert prompts.parked() == [frozen.id]


def test_a_forward_retried_after_its_reply_was_lost_is_not_taken_for_a_reclaim(streams):
    """The client retries a command whose reply a dropped connection lost: the script ran, the entry is gone. An
    idempotent forward (the learner's) then answers that its result is downstream, without writing it twice; a
    plain one answers False, and a late result of a reclaimed entry is still dropped either way."""
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(0))
    (d,) = prompts.consume("only", count=1)
    assert prompts.forward(d, rollouts, group_for(d.message), idempotent=True)
    assert prompts.forward(d, rollouts, group_for(d.message), idempotent=True)  # the retry: no second write
    assert not prompts.forward(d, rollouts, group_for(d.message))
    assert streams.redis.xlen(rollouts.key) == 1
    prompts.produce(task(1))
    (mine,) = prompts.consume("slow", count=1)
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    (theirs,) = prompts.consume("fast", count=1)
    assert prompts.forward(theirs, rollouts, group_for(theirs.message), idempotent=True)
    assert not prompts.forward(mine, rollouts, group_for(mine.message), idempotent=True)  # forwarded by another
    assert streams.redis.xlen(rollouts.key) == 2
    prompts.produce(task(2))
    (lost,) = prompts.consume("only", count=1)
    streams.redis.xack(prompts.key, prompts.group, lost.id)  # gone without a forward (a Redis that lost it)
    streams.redis.xdel(prompts.key, lost.id)
    assert not prompts.forward(lost, rollouts, group_for(lost.message), idempotent=True)


def test_release_hands_message_back_at_once(streams):
    from prometheus_client import REGISTRY

    def counted(name):
        return REGISTRY.get_sample_value(name, {"stream": "prompts"}) or 0.0

    before = counted("dapo_stream_redeliveries_total"), counted("dapo_stream_released_total")
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    (d,) = prompts.consume("leaving", count=1)
    prompts.release(d)
    (again,) = prompts.consume("other", count=1, block_ms=10)
    assert again.message.task_id == "t0"
    # taken up as a hand-back, not as the work of a consumer that died (DapoRedeliveries)
    assert (counted("dapo_stream_redeliveries_total"), counted("dapo_stream_released_total")) == (
        before[0], before[1] + 1)
    prompts.ack(again)
    prompts.produce(task(1))
    prompts.consume("silent", count=1)  # and never heard of again
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    (reclaimed,) = prompts.consume("other", count=1, block_ms=10)
    assert reclaimed.message.task_id == "t1" and counted("dapo_stream_redeliveries_total") == before[0] + 1


def test_a_hand_back_of_an_entry_another_consumer_reclaimed_leaves_it_to_that_consumer(streams):
    """A generator whose claim lapsed (no heartbeat through a Redis outage) hands back a task it still lists: the
    consumer that reclaimed it keeps it, its forward and its delivery count, and a letter it parked stays parked."""
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    for i in range(2):
        prompts.produce(task(i))
    lapsed = prompts.consume("lapsed", count=2)
    time.sleep(prompts.cfg.visibility_timeout_s + 0.1)
    running, parked = prompts.consume("live", count=2)
    prompts.reject(parked, "invalid task: for this test")
    owners = {row["message_id"].decode(): (row["consumer"], row["times_delivered"])
              for row in streams.redis.xpending_range(prompts.key, prompts.group, "-", "+", 10)}
    for stale in lapsed:
        prompts.release(stale, unused=True)
    assert prompts.release_all("lapsed") == 0
    assert {row["message_id"].decode(): (row["consumer"], row["times_delivered"])
            for row in streams.redis.xpending_range(prompts.key, prompts.group, "-", "+", 10)} == owners
    assert prompts.forward(running, rollouts, group_for(running.message))


def test_an_unused_hand_back_is_not_a_delivery(streams):
    # A task that waited for a newer policy version and was handed back unused, again and again, never reaches
    # max_deliveries (3); work handed back after it started keeps its count, and reaches `dead` as before.
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))  # waits
    for _ in range(5):
        (d,) = prompts.consume("waiting", count=1, block_ms=10)
        assert d.message.task_id == "t0" and d.deliveries <= 2
        prompts.release(d, unused=True)  # retaken by our own next read at once
    prompts.produce(task(1))  # starts, and is handed back
    seen = []
    for _ in range(6):
        for d in prompts.consume("other", count=2, block_ms=10):
            seen.append((d.message.task_id, d.deliveries))
            prompts.release(d, unused=d.message.task_id == "t0")  # each retaken at our next read
    assert {n for t, n in seen if t == "t0"} <= {1, 2} and len([t for t, _ in seen if t == "t0"]) == 6
    assert [n for t, n in seen if t == "t1"] == [1, 2, 3]
    assert [letter["reason"] for letter in streams.dead_letters()] == ["delivered 4 times (max 3)"]


def test_recover_returns_own_pending_after_restart(streams):
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    prompts.consume("learner-0", count=1)
    (d,) = prompts.recover("learner-0")
    assert d.message.task_id == "t0"
    assert prompts.recover("someone-else") == []


CONSUMER_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from services.config import load_settings
    from services.messages import PromptTask
    from services.redis_local import connect
    from services.streams import Streams
    settings = load_settings("tiny-cpu", run_dir=sys.argv[2], redis={"url": sys.argv[1], "run": "test"})
    prompts = Streams(connect(settings), settings, signs_as=("generator",)).stream("prompts", PromptTask)
    got = prompts.consume("doomed", count=1, block_ms=5000)
    print("claimed", got[0].message.task_id, flush=True)
    time.sleep(600)  # holds the message until SIGKILL
    """
)


def test_sigkilled_consumer_work_is_completed_once_by_another(streams, settings):
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    prompts.produce(task(7))
    proc = subprocess.Popen(
        [sys.executable, "-c", CONSUMER_SCRIPT, settings.redis.url.get_secret_value(), settings.run_dir],
        stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "claimed t7"
        assert prompts.consume("survivor", count=1, block_ms=10) == []  # still held by the live consumer
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        got = []
        while not got and time.monotonic() < deadline:
            got = prompts.consume("survivor", count=1, block_ms=200)
        assert got and got[0].message.task_id == "t7" and got[0].deliveries == 2
        assert prompts.forward(got[0], rollouts, group_for(got[0].message))
    finally:
        proc.kill()
    assert [d.message.task.task_id for d in rollouts.consume("r", count=10)] == ["t7"]
    assert prompts.pending() == 0


def test_redis_restart_mid_consumption_loses_nothing(redis_server, settings):
    """Kill redis-server (SIGKILL) while a consumer works; restart it from its AOF; everything arrives once."""
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    total = 40
    for i in range(total):
        prompts.produce(task(i))
    forwarded: list[str] = []
    errors: list[BaseException] = []

    def worker():
        try:
            own = Streams(connect(settings), settings, signs_as=ROLES)
            src, dst = own.stream("prompts", PromptTask), own.stream("rollouts", RolloutGroup)
            while len(forwarded) < total:
                for d in src.consume("worker", count=2, block_ms=100):
                    time.sleep(0.02)
                    if src.forward(d, dst, group_for(d.message)):
                        forwarded.append(d.message.task_id)
        except BaseException as err:  # surfaced to the test below
            errors.append(err)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while len(forwarded) < 10 and not errors and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(forwarded) >= 10, errors or "the worker forwarded fewer than 10 tasks in 60 s"
    redis_server.stop(kill=True)
    time.sleep(0.5)  # the worker now retries with backoff
    restarted = EmbeddedRedis(redis_server.data_dir, aof=True).start()
    thread.join(timeout=60)
    restarted.stop()
    assert not errors, errors
    assert sorted(forwarded) == sorted(f"t{i}" for i in range(total))
    restarted.start()
    try:
        out = [d.message.task.task_id for d in rollouts.consume("check", count=1000, block_ms=10)]
    finally:
        restarted.stop()
    assert sorted(out) == sorted(forwarded)  # exactly once downstream


def test_touch_keeps_long_work_from_being_reclaimed(streams):
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    (d,) = prompts.consume("busy", count=1)
    for _ in range(3):  # work three times longer than the visibility timeout, with heartbeats
        time.sleep(prompts.cfg.visibility_timeout_s / 2)
        assert prompts.touch("busy", [d.id]) == 1
        prompts._reclaimed_at = float("-inf")
        assert prompts.consume("thief", count=1, block_ms=10) == []
    assert prompts.touch("thief", [d.id]) == 0  # only the owner's heartbeat counts
    assert prompts.ack(d)


def test_embedded_redis_requires_its_password_kept_in_an_owner_only_file(redis_server):
    import redis

    conf = redis_server.data_dir / "redis.conf"
    assert conf.stat().st_mode & 0o077 == 0  # readable by its owner only
    assert redis_server.password in conf.read_text()
    cmdline = Path(f"/proc/{redis_server.process.pid}/cmdline").read_bytes().decode(errors="replace")
    assert redis_server.password not in cmdline
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    once = Retry(NoBackoff(), 0)  # refused at once: redis-py's default retries take seconds to give up
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(unix_socket_path=str(redis_server.socket_path), retry=once).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(unix_socket_path=str(redis_server.socket_path), password="a-guess", retry=once).ping()
    assert redis.Redis.from_url(redis_server.url).ping()


def test_embedded_redis_in_a_deep_run_folder_listens_on_a_short_private_socket(tmp_path):
    """A unix socket path holds 107 bytes: a run folder deeper than that still gets its server, on a socket every
    process of the run derives from the folder alone."""
    import redis

    from services.redis_local import EmbeddedRedis

    deep = tmp_path / ("a-run-folder-with-a-long-name-" * 4) / "redis"
    with EmbeddedRedis(deep, aof=False) as server:
        assert len(str(server.socket_path)) <= 100 and not str(server.socket_path).startswith(str(deep))
        assert server.socket_path.parent.stat().st_mode & 0o777 == 0o700
        assert EmbeddedRedis(deep).url == server.url  # another process of the run: same socket, saved password
        assert redis.Redis.from_url(server.url).ping()
    assert EmbeddedRedis(tmp_path / "redis").socket_path == (tmp_path / "redis" / "redis.sock").resolve()


def test_a_generator_restarting_under_a_dead_ones_name_hands_its_tasks_back_before_its_engine(settings):
    """A SIGKILLed generator's tasks do not wait for its replacement's engine (minutes) or the visibility timeout:
    the replacement hands them back first thing, and a live generator takes them on its next read."""
    from generator.service import hand_back_previous

    settings = settings.model_copy(
        update={"streams": settings.streams.model_copy(update={"visibility_timeout_s": 600})})
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    prompts = streams.stream("prompts", PromptTask)
    for i in range(3):
        prompts.produce(task(i))
    prompts.produce(task(3))
    assert len(prompts.consume("generator-0", count=3)) == 3  # then generator-0 is killed, holding them
    assert [d.message.task_id for d in prompts.consume("generator-1", count=10)] == ["t3"]
    assert prompts.consume("generator-1", count=10, block_ms=1) == []  # 600 s before a reclaim, without a hand-back

    assert hand_back_previous(streams.redis, settings, "generator-0") == 3  # the replacement, before its engine
    prompts._reclaimed_at = float("-inf")  # generator-1's next reclaim scan (within a second in a live worker)
    taken = prompts.consume("generator-1", count=10, block_ms=1)
    assert sorted(d.message.task_id for d in taken) == ["t0", "t1", "t2"]
    assert all(d.deliveries == 2 for d in taken)  # as a recovery by the replacement itself would count them
    assert hand_back_previous(streams.redis, settings, "generator-0") == 0


# -- bounded Redis --------------------------------------------------------------------------------------------
def test_embedded_redis_is_bounded_and_refuses_writes_beyond_maxmemory_without_evicting(short_tmp):
    """maxmemory with noeviction, at a small scale: a full server refuses writes (OOM) and keeps every key."""
    import redis

    with EmbeddedRedis(Path(short_tmp) / "small", aof=False, maxmemory_mb=4) as server:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        used, maxmemory = Streams(client, load_settings("tiny-cpu", run_dir=short_tmp), signs_as=()).memory()
        assert maxmemory == 4 * 1024 * 1024 and 0 < used < maxmemory
        written = 0
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for written in range(100):
                client.set(f"k{written}", b"x" * 256 * 1024)
        assert 4 <= written < 20 and client.exists(*[f"k{i}" for i in range(written)]) == written  # none evicted


def test_a_producer_waits_out_a_full_redis_and_then_produces_once(settings, redis_server):
    """A write refused for maxmemory is retried, not raised, in a stream script too (where redis-py reports it as a
    plain `Error running script ...: -OOM command not allowed`): the producer waits until Redis has room (here,
    maxmemory lifted after a second) and its entry is written once."""
    import redis

    streams = Streams(connect(settings), settings, signs_as=ROLES)
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))  # the stream and its consumer group exist
    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 100_000)
    from services.streams import _PRODUCE

    with pytest.raises(redis.ResponseError, match="OOM command not allowed"):  # the script, no retries (Redis 6.2:
        raw.register_script(_PRODUCE)(keys=[prompts.key], args=[100, b"x", b"-"])  # not an OutOfMemoryError)
    timer = threading.Timer(1.0, raw.config_set, ("maxmemory", 0))
    timer.start()
    started = time.monotonic()
    prompts.produce(task(1))
    timer.join()
    assert time.monotonic() - started >= 0.9 and raw.xlen(streams.key("prompts")) == 2


def test_the_dead_stream_is_trimmed_to_about_its_maxlen(settings):
    settings = settings.model_copy(update={"streams": settings.streams.model_copy(update={"dead_maxlen": 10})})
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))  # the group
    payloads = [to_wire(task(i)) for i in range(250)]
    for i, payload in enumerate(payloads):
        prompts.dead(f"{i}-0", payload, "test")
    # MAXLEN ~ trims whole macro nodes (stream-node-max-entries: 100): at most one node beyond the maxlen stays
    assert 10 <= streams.redis.xlen(streams.key("dead")) <= 110
    newest = streams.dead_letters(count=1)[0]
    assert newest["task_id"] == "t249" and newest["data"] == payloads[-1]


def test_a_large_dead_payload_goes_to_a_file_named_by_its_sha256_and_the_letter_stays_signed(settings):
    import hashlib

    settings = settings.model_copy(
        update={"streams": settings.streams.model_copy(update={"dead_payload_max_bytes": 64})})
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    rollouts = streams.stream("rollouts", RolloutGroup)
    payload = to_wire(group_for(task(7)))
    assert len(payload) > 64
    rollouts.dead("1-0", payload, "delivered 4 times (max 3)", 4)
    _, [(_, fields)] = streams.dead_letters_after("0-0")  # the signature covers the task id and the sha256
    digest = hashlib.sha256(payload).hexdigest()
    path = Path(settings.run_dir) / "dead-letters" / f"{digest}.msgpack"
    assert fields[b"data"] == b"" and fields[b"task_id"] == b"t7"
    assert fields[b"payload_sha256"].decode() == digest and int(fields[b"payload_bytes"]) == len(payload)
    assert fields[b"payload_file"].decode() == str(path)
    assert path.read_bytes() == payload and path.stat().st_mode & 0o077 == 0
    streams.redis.xadd(streams.key("dead"), {**fields, b"task_id": b"t8"})  # another task id under the same signature
    assert [letter[b"task_id"] for _, letter in streams.dead_letters_after("0-0")[1]] == [b"t7"]


def test_the_dead_payload_folder_keeps_the_newest_files_within_its_budget(settings):
    """A writer of forged entries cannot fill the consumer's disk through the payload files."""
    cfg = settings.streams.model_copy(update={"dead_payload_max_bytes": 0, "dead_payload_dir_mb": 2000 / 2**20,
                                              "dead_maxlen": 5})
    streams = Streams(connect(settings), settings.model_copy(update={"streams": cfg}), signs_as=ROLES)
    rollouts = streams.stream("rollouts", RolloutGroup)
    folder = Path(settings.run_dir) / "dead-letters"
    payloads = [to_wire(group_for(task(100 + i))) for i in range(12)]
    for i, payload in enumerate(payloads):
        rollouts.dead(f"{i + 1}-0", payload, "test")
        files = list(folder.glob("*.msgpack"))
        assert sum(f.stat().st_size for f in files) <= max(2000, len(payload)) and len(files) <= 5
        assert Path(streams.dead_letters()[0]["payload_file"]).read_bytes() == payload  # the newest is kept
    assert len(list(folder.glob("*.msgpack"))) >= 2000 // max(map(len, payloads))


def test_a_large_dead_payload_that_cannot_be_written_is_dropped_with_its_sha256_and_size(settings):
    import hashlib

    settings = settings.model_copy(
        update={"streams": settings.streams.model_copy(update={"dead_payload_max_bytes": 0})})
    Path(settings.run_dir).mkdir(parents=True, exist_ok=True)
    (Path(settings.run_dir) / "dead-letters").write_text("a file where the folder should be")
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    payload = to_wire(task(3))
    streams.stream("prompts", PromptTask).dead("1-0", payload, "test")
    (letter,) = streams.dead_letters()
    assert letter["data"] == b"" and letter["payload_file"] == "" and letter["task_id"] == "t3"
    assert letter["payload_sha256"] == hashlib.sha256(payload).hexdigest() and \
        int(letter["payload_bytes"]) == len(payload)


def test_the_runs_embedded_redis_refuses_to_store_a_value_larger_than_any_stream_needs(short_tmp):
    """The consumer's size check still receives the whole entry; the run's own server never stores one larger than
    the largest a stream can need (proto-max-bulk-len, from the settings), so no worker can make it that large."""
    import redis

    from services.messages import entry_limits
    from services.redis_local import embedded_server

    settings = load_settings("tiny-cpu", run_dir=os.path.join(short_tmp, "run"))
    largest = max(entry_limits(settings).values())
    server = embedded_server(settings).start()
    try:
        assert largest < server.max_value_bytes < 4 * largest
        client = redis.Redis(unix_socket_path=str(server.socket_path), password=server.password)
        client.xadd("s", {"data": b"x" * largest})  # the largest entry the settings allow goes in
        with pytest.raises((redis.ResponseError, redis.ConnectionError)):
            client.xadd("s", {"data": b"x" * (server.max_value_bytes + 1)})
        client = redis.Redis(unix_socket_path=str(server.socket_path), password=server.password)
        assert client.xlen("s") == 1 and client.ping()  # refused, not stored, and the server answers the next
    finally:
        server.stop()


def test_an_entry_larger_than_its_stream_can_need_is_dead_lettered_by_its_size_alone(streams, settings):
    """A signed rollout far larger than n x max_tokens tokens: dead-lettered with its size and sha256, neither
    decoded nor kept (no file), and the consumer goes on."""
    import hashlib

    from services.messages import entry_limits

    limit = entry_limits(settings)["rollouts"]
    assert limit < 2 * 2**20  # tiny-cpu: 8 responses of at most 64 tokens, a prompt room of 2,048
    rollouts = streams.stream("rollouts", RolloutGroup)
    rollouts.produce(group_for(task(0)))
    huge = group_for(task(1))
    huge = huge.model_copy(update={"samples": [huge.samples[0].model_copy(update={"text": "9" * 2 * limit})]})
    payload = to_wire(huge)
    streams.redis.xadd(rollouts.key, {b"data": payload, b"sig": rollouts.signature(payload)})  # genuinely signed
    rollouts.produce(group_for(task(2)))
    assert [d.message.task.task_id for d in rollouts.consume("c1", count=10)] == ["t0", "t2"]
    (letter,) = streams.dead_letters()
    assert letter["reason"].startswith(f"oversize: {len(payload):,} bytes, more than the {limit:,}")
    assert letter["data"] == b"" and letter["payload_file"] == "" and letter["task_id"] == ""  # nothing decoded
    assert letter["payload_sha256"] == hashlib.sha256(payload).hexdigest()
    assert not (Path(settings.run_dir) / "dead-letters").exists()  # nor written to disk


def test_a_forged_entry_whose_task_id_is_no_id_is_dead_lettered_without_it(streams, settings):
    """The letter copies an entry's task id: a forged rollout naming `[True] * ~limit` as its id (each True 6
    characters as text) made a letter larger than Redis takes, and the consumer stuck on it for good."""
    from services.messages import entry_limits

    limit = entry_limits(settings)["rollouts"]
    rollouts = streams.stream("rollouts", RolloutGroup)
    rollouts.produce(group_for(task(0)))
    payload = msgpack.packb({"task": {"task_id": [True] * (limit - 200)}})
    assert len(payload) <= limit
    streams.redis.xadd(rollouts.key, {b"data": payload, b"sig": b"nobody"})
    streams.redis.xadd(rollouts.key, {b"data": msgpack.packb({"task": {"task_id": "x" * 129}}), b"sig": b"nobody"})
    rollouts.produce(group_for(task(2)))
    assert [d.message.task.task_id for d in rollouts.consume("c1", count=10)] == ["t0", "t2"]
    letters = streams.dead_letters()
    assert len(letters) == 2 and all(d["reason"].startswith("forged") and d["task_id"] == "" for d in letters)


def test_the_learner_exports_every_run_streams_depth_dead_and_held_included(streams):
    """A worker refreshes the gauges of the stream it reads, only while it reads; `dead` and `held` nobody reads."""
    from prometheus_client import REGISTRY

    prompts = streams.stream("prompts", PromptTask)
    for i in range(3):
        prompts.produce(task(i))
    prompts.consume("gen", count=1)
    prompts.reject(prompts.consume("gen", count=1)[0], "invalid task: for this test")
    streams.export_depths(("prompts", "rollouts", "dead", "held"))

    def sample(name, stream):
        return REGISTRY.get_sample_value(name, {"stream": stream})

    assert (sample("dapo_stream_depth", "prompts"), sample("dapo_stream_pending", "prompts")) == (3.0, 2.0)
    assert sample("dapo_stream_depth", "dead") == 1.0 and sample("dapo_stream_depth", "held") == 0.0


@pytest.mark.parametrize("attack", ["xack without xdel", "xclaim lastid past the backlog"])
def test_entries_a_group_read_past_without_holding_them_are_deleted_when_they_fill_the_stream(streams, attack):
    """A worker's bare XACK, or XCLAIM ... LASTID <the stream's last id> (the group skips its unread backlog):
    the entries are neither pending nor unread but count against the high-water mark, and no producer could add
    to the stream again, for good."""
    prompts = streams.stream("prompts", PromptTask)
    for i in range(prompts.cfg.high_water):
        prompts.produce(task(i))
    if attack == "xack without xdel":
        ids = [d.id for d in prompts.consume("insider", count=prompts.cfg.high_water)]
        streams.redis.xack(prompts.key, prompts.group, *ids)
    else:
        prompts.consume("insider", count=1)  # the group exists, one entry pending
        last = streams.redis.xinfo_stream(prompts.key)["last-generated-id"].decode()
        streams.redis.execute_command("XCLAIM", prompts.key, prompts.group, "x", 0, "0-1", "JUSTID", "LASTID", last)
    assert prompts.room() == 0 and prompts.consume("honest", count=10, block_ms=0) == []
    deleted = streams.delete_orphans(["prompts"])
    expected = prompts.cfg.high_water - (0 if attack == "xack without xdel" else 1)  # (the pending one stays)
    assert deleted == {"prompts": expected} and prompts.room() == expected
    prompts.produce(task(100))
    assert [d.message.task_id for d in prompts.consume("honest", count=10, block_ms=0)] == ["t100"]


def test_consumers_holding_nothing_and_foreign_groups_are_swept(streams, monkeypatch):
    """XCLAIM under ever new (and long) names, or XGROUP CREATE under any name: each costs memory that Redis does
    not refuse at maxmemory (an insider grew it past maxmemory that way), and processes that ended leave theirs."""
    import services.streams

    prompts = streams.stream("prompts", PromptTask)
    for i in range(2):
        prompts.produce(task(i))
    (held,) = prompts.consume("live", count=1)
    (claimed,) = prompts.consume("before", count=1)
    for i in range(5):  # the same entry claimed by one new name after another: each older one holds nothing
        streams.redis.xclaim(prompts.key, prompts.group, f"{'x' * 300}{i}", 0, [claimed.id], justid=True)
    streams.redis.xgroup_create(prompts.key, "y" * 300, id="0")
    assert streams.sweep_groups(["prompts"]) == 1 + 4  # the foreign group and 4 long names holding nothing
    names = {c["name"].decode() for c in streams.redis.xinfo_consumers(prompts.key, prompts.group)}
    assert names == {"live", "x" * 300 + "4", "before"}  # what holds entries stays, and the briefly idle
    monkeypatch.setattr(services.streams, "CONSUMER_IDLE_MS", 0)
    time.sleep(0.01)
    assert streams.sweep_groups(["prompts"]) == 1  # `before`, idle past the limit, holding nothing
    assert [g["name"].decode() for g in streams.redis.xinfo_groups(prompts.key)] == [prompts.group]
    assert prompts.ack(held)  # the live consumer's entry is still its own


def test_writes_wait_while_redis_cannot_persist_them_and_land_once_it_can(redis_server, short_tmp):
    """A disk full under Redis' files answers every write `MISCONF ...`: refused whole, like a full Redis, and a pause
    to wait out, not a fault that ends the worker (a generator would restart its engine and its tasks gain a
    delivery each time). Made here by an RDB save that cannot write, then a folder to write in again."""
    from services.redis_local import client_for

    raw = redis.Redis.from_url(redis_server.url)
    gone = os.path.join(short_tmp, "gone")
    os.mkdir(gone)
    raw.config_set("save", "3600 1")
    raw.config_set("dir", gone)
    os.rmdir(gone)
    raw.bgsave()
    deadline = time.monotonic() + 10
    while raw.info("persistence")["rdb_last_bgsave_status"] == "ok" and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(redis.ResponseError, match="MISCONF"):
        raw.xadd("s", {"a": 0})
    client, written = client_for(redis_server.url), []

    def write() -> None:
        client.xadd("s", {"a": 1})
        pipe = client.pipeline(transaction=True)
        pipe.xadd("s", {"a": 2}).hset("h", "k", "v")
        written.append(pipe.execute())

    worker = threading.Thread(target=write, daemon=True)
    worker.start()
    time.sleep(1.0)
    assert not written and raw.xlen("s") == 0
    os.mkdir(gone)
    raw.config_set("dir", gone)  # (Redis works in the folder removed under it until it is told again)
    raw.bgsave()
    worker.join(30)
    assert written and raw.xlen("s") == 2 and raw.hget("h", "k") == b"v"


def test_entries_live_consumers_hold_are_not_reclaimed_right_after_an_outage(redis_server, settings):
    """Redis dates a delivery and keeps the date through a restart: after an outage longer than the visibility
    timeout every pending entry looks abandoned, a live generator's too. Consumers back from it wait one timeout
    for the owners' heartbeats before they reclaim; a dead owner's entry is still taken after that."""
    streams = Streams(connect(settings), settings, signs_as=ROLES)
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    prompts.produce(task(1))
    (live,) = prompts.consume("live", count=1)
    (dead,) = prompts.consume("dead", count=1)
    timeout = prompts.cfg.visibility_timeout_s
    thief = streams.stream("prompts", PromptTask)
    redis_server.stop()
    restarted = threading.Timer(timeout + 0.5, redis_server.start)
    restarted.start()
    thief.redis.ping()  # a consumer that was waiting on Redis through the outage, 1.5 timeouts long
    restarted.join()
    thief._reclaimed_at = float("-inf")
    assert thief.consume("thief", count=2, block_ms=10) == []  # both look idle 1.5 timeouts; neither is taken
    assert prompts.touch("live", [live.id]) == 1  # the live owner's heartbeat, back on a restarted Redis
    time.sleep(timeout * 0.6)
    prompts.touch("live", [live.id])
    time.sleep(timeout * 0.6)
    thief._reclaimed_at = float("-inf")
    assert [d.id for d in thief.consume("thief", count=2, block_ms=10)] == [dead.id]
    assert prompts.ack(live)


def test_a_process_that_just_met_redis_takes_hand_backs_at_once_and_others_entries_after_their_heartbeats(
        streams, monkeypatch):
    """A process started just after a Redis restart cannot know of it: the entries live consumers hold may look
    as idle as the outage was long. For half a visibility timeout after its first contact (the owners' heartbeats
    come every third of one) it takes only what was handed back; after an outage, the same."""
    from services import redis_local

    prompts = streams.stream("prompts", PromptTask)
    for i in range(3):
        prompts.produce(task(i))
    (held,) = prompts.consume("owner", count=1)
    (returned,) = prompts.consume("owner", count=1)
    prompts.release(returned, retake=False)
    timeout = prompts.cfg.visibility_timeout_s
    time.sleep(timeout * 1.1)  # the owner's entry now looks abandoned (it might be Redis' restart that says so)
    newcomer = streams.stream("prompts", PromptTask)
    monkeypatch.setattr(redis_local, "_met_at", time.monotonic())
    taken = newcomer.consume("newcomer", count=3, block_ms=10)
    assert returned.id in [d.id for d in taken] and held.id not in [d.id for d in taken]
    monkeypatch.setattr(redis_local, "_met_at", time.monotonic() - timeout / 2)
    newcomer._reclaimed_at = float("-inf")
    assert [d.id for d in newcomer.consume("newcomer", count=1, block_ms=10)] == [held.id]


def test_entries_live_consumers_hold_are_not_reclaimed_when_the_servers_clock_steps_ahead(streams, redis_server,
                                                                                            monkeypatch):
    """Redis dates a delivery by its wall clock: stepped ahead past the visibility timeout (no outage), every
    pending entry looks abandoned. A consumer that sees the server's clock gain on its own waits for the owners'
    heartbeats, as after an outage."""
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    (held,) = prompts.consume("live", count=1)
    thief = streams.stream("prompts", PromptTask)
    thief._reclaimed_at = float("-inf")
    assert thief.consume("thief", count=1, block_ms=10) == []  # reads the server's clock
    step_ms = int(prompts.cfg.visibility_timeout_s * 3000)
    raw = redis.Redis.from_url(redis_server.url)
    raw.xclaim(prompts.key, prompts.group, "live", 0, [held.id], idle=step_ms, justid=True)  # as the step makes it
    seconds, micros = raw.time()
    monkeypatch.setattr(type(thief.redis), "time", lambda client: (seconds + step_ms // 1000, micros))
    thief._reclaimed_at = float("-inf")
    assert thief.consume("thief", count=1, block_ms=10) == []
    assert prompts.touch("live", [held.id]) == 1  # its heartbeat re-dates it


def test_a_hand_back_is_taken_at_once_after_an_outage(streams, monkeypatch):
    from services import redis_local

    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    (held,) = prompts.consume("owner", count=1)
    prompts.release(held, retake=False)
    monkeypatch.setattr(redis_local, "_back_at", time.monotonic())
    other = streams.stream("prompts", PromptTask)
    assert [d.id for d in other.consume("other", count=1, block_ms=10)] == [held.id]


def test_entries_deleted_while_pending_are_acknowledged_not_handed_around(streams, redis_server):
    """Trimmed (a run forgotten, an overfull stream) while a consumer held them: Redis 6.2, the embedded server,
    keeps such entries pending and hands them out empty; they would go from consumer to consumer for good."""
    prompts = streams.stream("prompts", PromptTask)
    for i in range(4):
        prompts.produce(task(i))
    prompts.consume("dead", count=2)
    prompts.consume("restarted", count=2)
    raw = redis.Redis.from_url(redis_server.url)
    raw.xtrim(prompts.key, maxlen=0)
    assert prompts.recover("restarted") == []
    time.sleep(prompts.cfg.visibility_timeout_s * 1.1)
    prompts.produce(task(4))
    (working,) = prompts.consume("live", count=1, block_ms=10)  # work of its own under way meanwhile
    prompts._reclaimed_at = float("-inf")
    assert prompts.consume("live", count=4, block_ms=10) == []
    (left,) = raw.xpending_range(prompts.key, prompts.group, min="-", max="+", count=10)
    assert (left["message_id"].decode(), left["times_delivered"]) == (working.id, 1)  # its count as it was


def test_a_process_whose_signing_key_was_retired_stops_signing(streams, settings):
    """`dapo keys retire` of the key a running worker signs with: everything it wrote would be dead-lettered as
    forged and its tasks come back only at their deadlines. Its next signature says so instead (KeysError: exit
    69, and its supervisor starts it on the current key)."""
    from services.keys import KeysError, retire, rotate

    old = streams.signer("generator", "rollouts").kid
    rotate(keys_dir(settings), "generator")
    retire(keys_dir(settings), old)
    streams.keyring.refresh()
    with pytest.raises(KeysError, match=f"generator key {old} was retired"):
        streams.stream("rollouts", RolloutGroup).produce(group_for(task(0)))


def test_a_redis_user_made_before_time_was_granted_still_reclaims(streams, monkeypatch, caplog):
    """A deployment's Redis users are made once (its secrets): a worker of a newer release whose user may not
    read the clock goes on without the jump check, saying so once, instead of failing every read."""
    prompts = streams.stream("prompts", PromptTask)
    prompts.produce(task(0))
    prompts.consume("dead", count=1)
    refused = []

    def no_time(client):
        refused.append(1)
        raise redis.exceptions.NoPermissionError("this user has no permissions to run the 'time' command")

    monkeypatch.setattr(type(prompts.redis), "time", no_time)
    time.sleep(prompts.cfg.visibility_timeout_s * 1.1)
    thief = streams.stream("prompts", PromptTask)
    taken = []
    for _ in range(2):
        thief._reclaimed_at = float("-inf")
        taken += thief.consume("thief", count=1, block_ms=10)
    assert len(taken) == 1 and len(refused) == 1 and "may not read the server's clock" in caplog.text
