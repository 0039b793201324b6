"""The reward stream worker against a real (embedded) Redis: rollouts in, scored groups out, acknowledged."""

from __future__ import annotations

import os
import signal
import threading
import time

import msgpack
import pytest
import redis

import reward.worker as reward_worker_module
from reward.sandbox import Verification, VerifierPool
from reward.scoring import Scorer
from reward.worker import RewardWorker
from services.keys import ROLES, keys_dir
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup, to_wire
from services.streams import ISSUED, Streams

HANG = "Answer: $(x+y+z)^{999}$"  # sympy expands ~500k terms: only the sandbox's time limit ends it


@pytest.fixture(scope="module")
def pool():
    with VerifierPool(workers=2, timeout_s=1.0, memory_mb=1024) as p:
        yield p


@pytest.fixture
def streams(settings):
    client = redis.Redis.from_url(settings.redis.url.get_secret_value())
    yield Streams(client, settings, signs_as=ROLES)
    client.close()


def rollout(task_id: str, truth: str, texts: list[str], max_tokens: int = 64, lengths: list[int] | None = None):
    lengths = lengths or [5] * len(texts)
    samples = [
        Sample(token_ids=list(range(n)), logprobs=[-0.5] * n, text=text,
               finish_reason="length" if n >= max_tokens else "stop")
        for text, n in zip(texts, lengths)
    ]
    task = PromptTask(task_id=task_id, prompt_id=f"p-{task_id}", prompt="q", ground_truth=truth,
                      sampling=SamplingParams(n=len(texts), max_tokens=max_tokens))
    return RolloutGroup(task=task, policy_version=3, generator_id="gen-test", samples=samples)


def issued(streams: Streams, group: RolloutGroup) -> RolloutGroup:
    """Record the group's task as the learner issues it (ground truth included); the group as a generator writes it
    (its task without the ground truth, as the generator got it)."""
    streams.redis.hset(streams.key(ISSUED), group.task.task_id, to_wire(group.task))
    return group.model_copy(update={"task": group.task.for_generators()})


def drain(worker: RewardWorker, expected: int, timeout: float = 30.0) -> int:
    done, deadline = 0, time.monotonic() + timeout
    while done < expected and time.monotonic() < deadline:
        done += worker.run_once(block_ms=100)
    return done


def test_rollouts_in_scored_out_and_acked(settings, streams, pool):
    rollouts = streams.stream("rollouts", RolloutGroup)
    groups = [
        rollout("t1", "25", ["...\n**Answer:** 025", "Answer: 24", "\\boxed{3} no \\boxed{25}", "3+4 = 7 and"]),
        rollout("t2", "\\frac{1}{2}", ["Answer: 0.5", "Answer: $\\frac{2}{4}$"], lengths=[60, 64]),
        rollout("t3", "7", [HANG, "Answer: 7"]),
    ]
    for group in groups:
        rollouts.produce(issued(streams, group))

    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    assert drain(worker, 3) == 3

    # Acknowledged (and deleted): nothing pending, nothing left in the rollouts stream.
    assert rollouts.pending() == 0
    assert streams.redis.xlen(rollouts.key) == 0

    scored = {d.message.rollout.task.task_id: d.message
              for d in streams.stream("scored", ScoredGroup).consume("learner-test", count=10, block_ms=200)}
    assert sorted(scored) == ["t1", "t2", "t3"]
    t1 = scored["t1"]
    assert t1.reward_worker_id == "reward-test" and t1.rollout.policy_version == 3
    assert [s.correct for s in t1.scores] == [True, False, True, False]
    assert [s.rule for s in t1.scores] == ["answer_line", "answer_line", "boxed", "none"]
    assert [s.reward for s in t1.scores] == [1.0, -1.0, 1.0, -1.0]
    assert t1.rollout.samples[0].token_ids == list(range(5))  # the rollout travels on intact
    # L_max is the task's own max_tokens (64), L_cache is reward.overlong_buffer (16 in tiny-cpu).
    t2 = scored["t2"]
    assert [s.correct for s in t2.scores] == [True, True]
    assert t2.scores[0].reward == pytest.approx(1.0 - 12 / 16) and not t2.scores[0].overlong
    assert t2.scores[1].reward == pytest.approx(0.0) and t2.scores[1].overlong
    t3 = scored["t3"]
    assert [s.rule for s in t3.scores] == ["timeout", "answer_line"]
    assert [s.correct for s in t3.scores] == [False, True]
    assert [g.rollout.task.ground_truth for g in scored.values()] == ["25", "\\frac{1}{2}", "7"]  # from `issued`
    # each carries its rollout's own signature on: the learner checks the generator's word for the samples
    assert [streams.rollout_refusal(g) for g in scored.values()] == [None] * 3
    altered = t1.rollout.model_copy(update={"policy_version": 4})
    assert streams.rollout_refusal(t1.model_copy(update={"rollout": altered})).startswith("forged: bad signature")


def test_the_ground_truth_comes_from_the_learner_and_only_to_the_task_as_issued(settings, streams, pool):
    """Generators get no ground truth: the worker scores against the one the learner issued. A rollout whose task
    differs from the task as issued (a ground truth claimed, another prompt) gets none: it goes to `dead` as
    provenance without it, as does a rollout of a task the learner never issued (or already settled)."""
    rollouts = streams.stream("rollouts", RolloutGroup)
    genuine = issued(streams, rollout("truth", "\\frac{62674}{2}", ["Answer: 9", "Answer: 31337"]))
    rollouts.produce(genuine.model_copy(update={"task": genuine.task.model_copy(update={"ground_truth": "9"})}))
    rollouts.produce(genuine.model_copy(update={"task": genuine.task.model_copy(update={"prompt_token_ids": [7]})}))
    rollouts.produce(genuine)
    rollouts.produce(rollout("never-issued", "1", ["Answer: 1"]))
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    assert drain(worker, 1) == 1
    (scored,) = streams.stream("scored", ScoredGroup).consume("learner-test", count=10, block_ms=200)
    assert scored.message.rollout.task.ground_truth == "\\frac{62674}{2}"
    assert [s.correct for s in scored.message.scores] == [False, True]
    letters = streams.dead_letters()
    assert sorted(letter["reason"] for letter in letters) == [
        "provenance: task truth does not match the task as issued (differs in ground_truth)",
        "provenance: task truth does not match the task as issued (differs in prompt_token_ids)",
        "provenance: unknown task id 'never-issued' (not issued by this run's learner, or settled)"]
    assert not any("62674" in repr(letter) for letter in letters)  # the altered groups never carried it
    assert rollouts.pending() == 3  # parked until the learner settles the letters: provenance retires no task
    assert [streams.settle_dead_letter(fields) for _, fields in streams.dead_letters_after("0-0")[1]] == [None] * 3
    assert rollouts.pending() == 0 and streams.redis.xlen(rollouts.key) == 0


def test_a_malformed_rollout_goes_to_dead(settings, streams, pool):
    rollouts = streams.stream("rollouts", RolloutGroup)
    rollouts.produce(issued(streams, rollout("good", "1", ["Answer: 1"])))
    garbage = b"\xc1 not msgpack"
    streams.redis.xadd(rollouts.key, {b"data": garbage, b"sig": rollouts.signature(garbage)})  # signed garbage
    bad_schema = rollout("bad", "1", ["Answer: 1"]).model_dump()
    bad_schema["schema_version"] = 99
    payload = msgpack.packb(bad_schema, use_bin_type=True)
    streams.redis.xadd(rollouts.key, {b"data": payload, b"sig": rollouts.signature(payload)})
    # valid, signed, but not the bytes `to_wire` writes (fields in another order): the learner could not re-encode
    # them to check the signature the scored group carries, so the reward role refuses it before scoring
    reordered = issued(streams, rollout("reordered", "1", ["Answer: 1"])).model_dump(context={"wire": True})
    payload = msgpack.packb(dict(reversed(reordered.items())), use_bin_type=True)
    streams.redis.xadd(rollouts.key, {b"data": payload, b"sig": rollouts.signature(payload)})

    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    assert drain(worker, 1) == 1
    worker.run_once(block_ms=100)

    dead = streams.dead_letters()
    assert len(dead) == 3
    assert dead[0]["reason"].startswith("provenance: the rollout's bytes are not as `to_wire` writes them")
    assert all(d["stream"] == "rollouts" and "unparseable RolloutGroup" in d["reason"] for d in dead[1:])
    # the learner settles the letters: a signed group the reward could not parse (or vouch for) retires no task,
    # even one its bytes name (any generator could write it: the genuine group may still come), and its entry is
    # deleted
    assert [d["task_id"] for d in dead] == ["reordered", "bad", ""]
    assert [streams.settle_dead_letter(fields) for _, fields in streams.dead_letters_after("0-0")[1]] == [None] * 3
    assert streams.redis.xlen(rollouts.key) == 0 and rollouts.pending() == 0
    scored = streams.stream("scored", ScoredGroup).consume("learner-test", count=10, block_ms=200)
    assert [d.message.rollout.task.task_id for d in scored] == ["good"]


def test_a_rollout_that_does_not_answer_its_task_is_given_up_unscored(settings, streams):
    """n=1 asked, a thousand samples of verifier-timeout text sent: scored, they held the pool for a thousand
    timeouts before the learner refused the group. The worker refuses it as the learner would, before any scoring, and
    the letter gives the task up (the generator that took the prompt answered it so)."""
    class Refusing:
        def submit(self, items):
            raise AssertionError(f"{len(items)} items of a malformed group reached the verifier pool")

    rollouts = streams.stream("rollouts", RolloutGroup)
    genuine = issued(streams, rollout("flood", "1", ["Answer: 1"]))
    flood = genuine.model_copy(update={"samples": genuine.samples * 1000})
    rollouts.produce(flood)
    worker = RewardWorker(settings, Refusing(), streams, consumer="reward-test")
    while not worker._recovered:  # what this consumer name held before a restart first (none)
        worker.run_once(block_ms=100)
    worker.run_once(block_ms=100)
    (letter,) = streams.dead_letters()
    assert letter["reason"] == "malformed: task flood asked for n=1 samples; the group has 1000"
    assert [streams.settle_dead_letter(fields) for _, fields in streams.dead_letters_after("0-0")[1]] == ["flood"]


def test_run_in_a_thread_and_stop(settings, streams, pool):
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    streams.stream("rollouts", RolloutGroup).produce(issued(streams, rollout("bg", "2", ["Answer: 2"])))
    deadline = time.monotonic() + 20
    while worker.groups_done < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert worker.groups_done == 1 and worker.last_poll > 0
    worker.stop()
    thread.join(timeout=5)
    assert not thread.is_alive()


def test_a_worker_whose_key_was_retired_ends_instead_of_reading_on(settings, streams, pool):
    """Its loop retries what may pass (a bad turn); a dependency it cannot do without ends it (exit 69), or it
    would take every rollout and forward none, each coming back only after the visibility timeout."""
    from services.keys import KeysError, retire, rotate

    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-retired")
    old = streams.signer("reward", "scored").kid
    rotate(keys_dir(settings), "reward")
    retire(keys_dir(settings), old)
    streams.keyring.refresh()
    streams.stream("rollouts", RolloutGroup).produce(issued(streams, rollout("rk", "2", ["Answer: 2"])))
    ended = []
    thread = threading.Thread(target=lambda: ended.append(pytest.raises(KeysError, worker.run)), daemon=True)
    thread.start()
    thread.join(timeout=30)
    worker.stop()
    assert not thread.is_alive() and ended and "was retired" in str(ended[0].value)


def test_a_reward_worker_reads_nothing_while_scored_is_at_its_high_water_mark(settings, streams, pool):
    """Back-pressure reaches the workers: with the learner behind (or down) the reward tier scored whatever came,
    `scored` grew without bound, and the learner's trim at a full Redis deleted unread groups."""
    settings.streams.high_water = 1
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.scored.produce(ScoredGroup(rollout=rollout("old", "1", ["Answer: 1"]), scores=[Score(reward=1.0,
                                      correct=True, overlong=False, rule="answer_line")]))
    worker.rollouts.produce(issued(streams, rollout("a", "1", ["Answer: 1"])))
    assert worker.run_once(block_ms=10) == 0
    assert streams.redis.xlen(streams.key("rollouts")) == 1
    assert streams.redis.xpending(streams.key("rollouts"), "reward")["pending"] == 0  # not even read
    (waiting,) = worker.scored.consume("learner-test", count=1, block_ms=0)
    worker.scored.ack(waiting)
    assert drain(worker, 1) == 1


def test_stop_releases_the_groups_not_yet_forwarded(settings, streams, pool):
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.rollouts.produce(issued(streams, rollout("a", "1", ["Answer: 1"])))
    worker.rollouts.produce(issued(streams, rollout("b", "2", ["Answer: 2"])))
    deliveries = worker.rollouts.consume("reward-test", count=2, block_ms=100)
    assert len(deliveries) == 2
    worker.stop()
    assert worker.process(deliveries) == 0  # stopping: nothing is forwarded, everything is handed back
    again = worker.rollouts.consume("reward-other", count=2, block_ms=100)
    assert sorted(d.message.task.task_id for d in again) == ["a", "b"]
    assert streams.redis.xlen(streams.key("scored")) == 0


def test_a_stop_before_a_groups_verification_began_does_not_count_as_its_delivery(settings, streams):
    """A scale-down is not the group's fault: interrupted max_deliveries times, it went to dead without failing."""
    class Waiting(Scorer):  # verification never begins: the stop finds every group not started
        def __init__(self):
            self.cfg = settings.reward

        def submit(self, items):
            return Verification()

    worker = RewardWorker(settings, Waiting(), streams, consumer="reward-test")
    worker.rollouts.produce(issued(streams, rollout("a", "1", ["Answer: 1"])))
    deliveries = worker.rollouts.consume("reward-test", count=1, block_ms=100)
    worker.stop()
    assert worker.process(deliveries) == 0
    (again,) = worker.rollouts.consume("reward-other", count=1, block_ms=100)
    assert again.deliveries == 1


def test_a_stop_while_a_group_is_being_verified_keeps_its_delivery_count(settings, streams, pool):
    """Work that began keeps its count (a group that hangs whoever verifies it must still reach `dead`); the batch's
    own future never runs, so asking it to cancel said `not begun` even with its items in the children."""
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.rollouts.produce(issued(streams, rollout("h", "1", ["Answer: $(x+y+z)^{999}$"])))  # runs to the limit
    deliveries = worker.rollouts.consume("reward-test", count=1, block_ms=100)
    submit = worker.scorer.submit

    def submit_then_stop(items):
        pending = submit(items)
        deadline = time.monotonic() + 10
        while not pending.started() and time.monotonic() < deadline:
            time.sleep(0.01)
        worker.stop()
        return pending

    worker.scorer.submit = submit_then_stop
    assert worker.process(deliveries) == 0
    (again,) = worker.rollouts.consume("reward-other", count=1, block_ms=2000)
    assert again.deliveries == 2


def test_a_group_whose_verifier_pool_fails_is_handed_back_not_scored_wrong(settings, streams):
    """A verifier child dies while idle, just as a group comes in: its answers get no verdict, not `wrong`."""
    with VerifierPool(workers=1, timeout_s=30, memory_mb=1024) as alone:
        worker = RewardWorker(settings, Scorer(alone, settings.reward), streams, consumer="reward-test")
        worker.rollouts.produce(issued(streams, rollout("f", "4", ["Answer: 4", "Answer: 5"])))
        deliveries = worker.rollouts.consume("reward-test", count=1, block_ms=100)
        (idle_pid,) = alone.worker_pids()
        os.kill(idle_pid, signal.SIGKILL)
        if not worker.process(deliveries):  # forwarded if a new pool took the items, else handed back: again
            assert drain(worker, 1) == 1
        scored = worker.scored.consume("learner-test", count=10, block_ms=100)
        assert [[s.correct for s in d.message.scores] for d in scored] == [[True, False]]


def test_a_pool_failure_hands_the_group_back_without_counting_a_delivery(settings, streams, pool, monkeypatch):
    """The pool failing under a group is not the group's fault: however many times it happens, the group is not
    dead-lettered for it (an error of the group itself still counts)."""
    from reward.sandbox import VerifierUnavailable

    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.rollouts.produce(issued(streams, rollout("u", "1", ["Answer: 1", "Answer: 2"])))
    collect = worker.scorer.collect
    failures = settings.streams.max_deliveries + 1

    def failing(items, pending, started):
        nonlocal failures
        if failures:
            failures -= 1
            pending.cancel()
            raise VerifierUnavailable("verifier processes died; pool restarted")
        return collect(items, pending, started)

    monkeypatch.setattr(worker.scorer, "collect", failing)
    assert drain(worker, 1) == 1
    assert not streams.dead_letters()
    scored = worker.scored.consume("learner-test", count=10, block_ms=100)
    assert [[s.correct for s in d.message.scores] for d in scored] == [[True, False]]
    # A group that meets a failing pool every time still ends in `dead` once its uncounted hand-backs are spent.
    monkeypatch.setattr(reward_worker_module, "UNCOUNTED_POOL_FAILURES", 1)
    failures = 100
    worker.rollouts.produce(issued(streams, rollout("v", "1", ["Answer: 1"])))
    deadline = time.monotonic() + 30
    while not streams.dead_letters() and time.monotonic() < deadline:
        worker.run_once(block_ms=100)
    (dead,) = streams.dead_letters()
    assert dead["reason"].startswith("delivered") and failures == 100 - 1 - settings.streams.max_deliveries


def test_a_group_being_verified_keeps_its_claim_while_its_slow_items_run(settings, streams, pool, monkeypatch):
    """The claims were renewed only between groups: one group of items that each run to the verifier's limit
    (ceil(n / workers) limits in a row) outlasted the visibility timeout and was taken over and verified again."""
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.touch_every_s = 0.2
    hang = "Answer: $(x+y+z)^{999}$"  # runs to the pool's 1 s limit
    worker.rollouts.produce(issued(streams, rollout("slow", "1", [hang, hang, hang])))
    (delivery,) = worker.rollouts.consume("reward-test", count=1, block_ms=100)
    touch, touched = worker.rollouts.touch, []
    monkeypatch.setattr(worker.rollouts, "touch", lambda consumer, ids: touched.append(list(ids)) or touch(consumer,
                                                                                                            ids))
    assert worker.process([delivery]) == 1
    assert touched.count([delivery.id]) >= 2


def test_a_long_read_renews_its_claim_on_the_groups_still_to_score(settings, streams, pool, monkeypatch):
    """Between groups, the worker resets the idle time of the groups it has not scored yet, so a read of slow items
    is not reclaimed (and scored twice) by another worker."""
    worker = RewardWorker(settings, Scorer(pool, settings.reward), streams, consumer="reward-test")
    worker.touch_every_s = 0.05
    for name in ("x", "y", "z"):
        worker.rollouts.produce(issued(streams, rollout(name, "1", ["Answer: 1", "Answer: 3"])))
    deliveries = worker.rollouts.consume("reward-test", count=3, block_ms=100)
    collect, touch, touches = worker.scorer.collect, worker.rollouts.touch, []

    def slow(items, pending, started):
        time.sleep(0.1)
        return collect(items, pending, started)

    def recorded(consumer, ids):
        touches.append((list(ids), touch(consumer, ids)))
        return touches[-1][1]

    monkeypatch.setattr(worker.scorer, "collect", slow)
    monkeypatch.setattr(worker.rollouts, "touch", recorded)
    assert worker.process(deliveries) == 3
    ids = [d.id for d in deliveries]
    assert touches == [(ids[1:], 2), (ids[2:], 1)]  # each time, the groups still held, all still ours
