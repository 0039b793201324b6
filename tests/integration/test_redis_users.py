"""Redis users per role (services/redis_users.py) against the real redis-server: each role can do its job through
the project's own code, and cannot do the others' (or anything dangerous), even through a Lua script."""

from __future__ import annotations

import os
import secrets
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services.config import RedisUrl
from services.keys import create_keys, keys_dir
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup
from services.redis_local import EmbeddedRedis, client_for
from services.redis_users import REDIS_USERS, acl_file
from services.streams import ISSUED, Streams

DANGEROUS = (("FLUSHALL",), ("FLUSHDB",), ("CONFIG", "SET", "appendonly", "no"), ("DEBUG", "SLEEP", "0"),
             ("KEYS", "*"), ("SHUTDOWN", "NOSAVE"), ("ACL", "LIST"), ("MONITOR",))


@pytest.fixture
def server(short_tmp, settings):
    users = {user: secrets.token_hex(16) for user in REDIS_USERS}
    server = EmbeddedRedis(os.path.join(short_tmp, "acl-redis"), aof=False, users=users)
    server.run = settings.redis.run  # as the launcher makes them: for its run's keys only
    yield server.start()
    server.stop()


@pytest.fixture
def as_role(server, settings):
    create_keys(keys_dir(settings))

    def connect(role: str, signs_as: tuple = ()) -> tuple[redis.Redis, Streams]:
        client = client_for(server.role_url(role))
        return client, Streams(client, settings, signs_as=signs_as)

    return connect


def refused(call, *args, **kwargs) -> bool:
    try:
        call(*args, **kwargs)
    except redis.exceptions.NoPermissionError:
        return True
    return False


def test_each_role_does_its_job_and_nothing_of_the_others(server, as_role):
    task = PromptTask(task_id="t1", prompt_id="p1", prompt="1+1=", ground_truth="2")
    learner, learner_streams = as_role("learner", ("learner",))
    generator, generator_streams = as_role("generator", ("generator",))
    reward, reward_streams = as_role("reward", ("reward",))
    autoscaler, _ = as_role("autoscaler")

    # The pipeline, each stage under its own user.
    issued_key = learner_streams.key(ISSUED)
    learner_streams.stream("prompts", PromptTask).produce(task.for_generators(), register=(issued_key, "t1", task))
    learner.set(learner_streams.key("weights:latest"), b"{}")
    (delivery,) = generator_streams.stream("prompts", PromptTask).consume("g", count=1, block_ms=0)
    assert generator.get(generator_streams.key("weights:latest")) == b"{}"
    watching = generator.pubsub()
    watching.subscribe(generator_streams.key("weights"))  # the announcements channel (services/weights.py)
    assert watching.get_message(timeout=1)["type"] == "subscribe"
    watching.close()
    sample = Sample(token_ids=[1], logprobs=[-0.1], text="Answer: 2", finish_reason="stop")
    group = RolloutGroup(task=delivery.message, policy_version=0, generator_id="g", samples=[sample])
    assert generator_streams.stream("prompts", PromptTask).forward(
        delivery, generator_streams.stream("rollouts", RolloutGroup), group)
    (rolled,) = reward_streams.stream("rollouts", RolloutGroup).consume("r", count=1, block_ms=0)
    assert reward.hmget(reward_streams.key(ISSUED), ["t1"])[0]
    scored = ScoredGroup(rollout=rolled.message, scores=[Score(reward=1.0, correct=True, overlong=False, rule="boxed")])
    assert reward_streams.stream("rollouts", RolloutGroup).forward(
        rolled, reward_streams.stream("scored", ScoredGroup), scored)
    (got,) = learner_streams.stream("scored", ScoredGroup).consume("l", count=1, block_ms=0)
    assert got.message.rollout.task.task_id == "t1"
    assert learner.info("memory")["used_memory"] > 0  # its gauges
    assert autoscaler.xpending(learner_streams.key("prompts"), "generator")["pending"] == 0
    assert autoscaler.xinfo_groups(learner_streams.key("prompts"))[0]["name"] == b"generator"
    assert autoscaler.xlen(learner_streams.key("prompts")) == 0
    # Dead letters (one MULTI), hand-backs and reclaims, each by the role that consumes the stream.
    for i, (streams, name, model, consumer) in enumerate([(generator_streams, "prompts", PromptTask, "g"),
                                                          (reward_streams, "rollouts", RolloutGroup, "r"),
                                                          (learner_streams, "scored", ScoredGroup, "l")]):
        writer = {"prompts": learner_streams, "rollouts": generator_streams, "scored": reward_streams}[name]
        sent = {"prompts": task, "rollouts": group, "scored": scored}[name]
        writer.stream(name, model).produce(sent)
        writer.stream(name, model).produce(sent)
        stream, consumer = streams.stream(name, model), f"{consumer}-{i}"
        first, second = stream.consume(consumer, count=2, block_ms=0)
        stream.release(first)
        assert stream.release_all(consumer) == 1  # the other was handed back already
        stream.reject(stream.consume(consumer + "b", count=2, block_ms=0)[0], "test: a letter by its consumer")
    assert [d["stream"] for d in learner_streams.dead_letters()] == ["scored", "rollouts", "prompts"]
    assert len(learner_streams.dead_letters_after("0-0")[1]) == 3  # each signed by the stream's consumer role

    # What each must not do.
    key = learner_streams.key
    assert refused(generator.xadd, key("scored"), {"data": b"x", "sig": b"y"})  # a scored group
    assert refused(generator.hget, key(ISSUED), "t1")  # the ground truth
    assert refused(generator.set, key("weights:latest"), b"{}")  # an announcement
    assert refused(generator.eval, "return redis.call('XADD', KEYS[1], '*', 'data', 'x')", 1, key("scored"))
    assert refused(generator_streams.stream("rollouts", RolloutGroup).forward, rolled,
                   generator_streams.stream("scored", ScoredGroup), scored)  # the forward script into `scored`
    assert refused(reward.xadd, key("prompts"), {"data": b"x", "sig": b"y"})  # a task
    assert refused(reward.hset, key(ISSUED), "t1", b"x")  # issued is read-only to it
    assert refused(reward.get, key("weights:latest"))
    assert refused(reward.publish, key("weights"), b"{}")  # channels: the generators' and the learner's only
    assert refused(autoscaler.xreadgroup, "generator", "a", {key("prompts"): ">"})
    assert refused(autoscaler.xlen, key("scored"))
    assert refused(learner.set, "not-a-run-key", b"x")
    for client in (learner, generator, reward, autoscaler):
        for command in DANGEROUS:
            assert refused(client.execute_command, *command), command
    operator = client_for(server.url)  # the default user of an embedded run: the launcher's
    assert operator.info("server")["run_id"]
    for command in DANGEROUS:
        assert refused(operator.execute_command, *command), command


def test_the_deployment_acl_file_has_no_password_and_no_default_user(short_tmp):
    passwords = {user: secrets.token_hex(16) for user in REDIS_USERS}
    from services.redis_local import redis_server_binary, server_version

    text = acl_file(passwords, selectors=server_version(redis_server_binary()) >= (7, 0))
    default = text.splitlines()[0]  # off: no one logs in as it (its permissions are for the AOF replay)
    assert default.startswith("user default reset") and " off " in default and "nopass" not in default
    assert not any(p in text for p in passwords.values())
    path = os.path.join(short_tmp, "users.acl")
    with open(path, "w") as out:
        out.write(text)
    import subprocess

    sock = os.path.join(short_tmp, "acl.sock")
    proc = subprocess.Popen([redis_server_binary(), "--port", "0", "--unixsocket", sock, "--aclfile", path,
                             "--save", "", "--dir", short_tmp], stdout=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if os.path.exists(sock):
                break
            import time

            time.sleep(0.05)
        with pytest.raises(redis.exceptions.AuthenticationError):
            # the default user is off (refused at once: redis-py's default retries take seconds to give up)
            redis.Redis(unix_socket_path=sock, retry=Retry(NoBackoff(), 0)).ping()
        assert redis.Redis(unix_socket_path=sock, username="generator", password=passwords["generator"]).ping()
        assert refused(redis.Redis(unix_socket_path=sock, username="reward", password=passwords["reward"]).xadd,
                       "dapo:r:prompts", {"data": b"x"})
    finally:
        proc.terminate()
        proc.wait()


def test_the_learner_service_runs_under_its_own_user(server, settings):
    """The learner's own calls (lease, memory gauges, issued, held, dead letters, the announcement) as its user."""
    import torch

    from learner.lease import LearnerLease
    from learner.service import LearnerService

    create_keys(keys_dir(settings))
    as_learner = settings.model_copy(update={"redis": settings.redis.model_copy(
        update={"url": RedisUrl(server.role_url("learner"))})})
    lease = LearnerLease(as_learner, ttl_s=5, on_fenced=print, on_lost=print)
    assert lease.try_acquire() and lease.renew() == "renewed"
    service = LearnerService(as_learner)
    service.connect()  # INFO memory, the keyring, the publisher
    task = PromptTask(task_id="train-0", prompt_id="p0", prompt="1+1=", ground_truth="2")
    service.work.assembler.issued(["train-0"], 0)
    service.work.outbox.append(task)
    service.work.pump()  # issued + prompts in one script, scored read, dead letters scanned
    assert service.work.issued_task("train-0") == task
    service.publisher.publish({"w": torch.zeros(2)}, version=0)  # SET weights:latest, PUBLISH
    assert service.streams.server_run_id()
    assert lease.release()


def test_the_users_of_a_run_reach_no_key_of_another_run(server, as_role, settings):
    """A Redis shared by runs: every role's user of this run is refused every key of another one, the learner's
    included (its patterns name the run, not `dapo:*`)."""
    other = f"dapo:not-{settings.redis.run}:"
    learner, learner_streams = as_role("learner", ("learner",))
    learner.xadd(learner_streams.key("prompts"), {b"data": b"x"})  # its own run: allowed
    for role in ("learner", "generator", "reward", "autoscaler"):
        client, _ = as_role(role)
        assert refused(client.xlen, other + "prompts"), role
        assert refused(client.xadd, other + "dead", {b"data": b"x"}), role
    assert refused(learner.get, other + "weights:latest") and refused(learner.hgetall, other + "issued")
    assert refused(learner.publish, other + "weights", "x")


def test_a_worker_script_that_never_ends_is_ended_by_the_learner_and_redis_answers_again(server, as_role, caplog):
    """On Redis 6.2 (the embedded server) a worker may still run scripts (EVALSHA): one that never ends answers BUSY
    to every client past the busy-reply threshold. The learner's client asks the server to end it (SCRIPT KILL;
    workers may not) and its command goes through; the worker's script fails."""
    import threading

    generator, _ = as_role("generator")
    learner, learner_streams = as_role("learner", ("learner",))
    spin = generator.script_load("while true do end")
    failures = []

    def run_forever():
        try:
            generator.evalsha(spin, 0)
        except redis.ResponseError as err:
            failures.append(str(err))

    runner = threading.Thread(target=run_forever, daemon=True)
    runner.start()
    time.sleep(0.2)
    other_worker, _ = as_role("reward")
    assert refused(other_worker.execute_command, "SCRIPT", "KILL")  # a worker cannot end it (nor start it over)
    started = time.monotonic()
    assert learner.xlen(learner_streams.key("prompts")) == 0  # BUSY, the script ended, retried
    assert time.monotonic() - started < 10
    runner.join(timeout=10)
    assert failures and "killed" in failures[0].lower()
    assert "ended it (SCRIPT KILL)" in caplog.text


@pytest.mark.parametrize("folder", ["exp#1?x%41", "实验运行目录" * 5])
def test_every_role_reaches_an_embedded_server_in_a_folder_of_any_name(short_tmp, folder):
    """`#`, `?` and `%41` in a run folder's name cut the socket path in every child's URL short (all of them
    failed to connect, and the learner's restarts were blamed); 30 CJK characters are 90 bytes, and a socket path
    counted in characters passed the 107-byte limit, which redis-server cut short without a word."""
    users = {user: secrets.token_hex(16) for user in REDIS_USERS}
    server = EmbeddedRedis(os.path.join(short_tmp, folder, "redis"), aof=False, users=users).start(timeout=15)
    try:
        assert len(os.fsencode(server.socket_path)) <= 107
        assert client_for(server.url).ping()
        assert all(client_for(server.role_url(role)).ping() for role in users)
    finally:
        server.stop()
