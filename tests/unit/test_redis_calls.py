"""Every Redis call goes through the retry layer: only `services/redis_local.py` builds clients (all of them
`RetryingRedis`, whose every command, pipeline and script retries), and every other module gets its client from
there. Read from the source, so a new raw client anywhere fails here."""

from __future__ import annotations

import ast
import socket
import time
from pathlib import Path

import pytest
import redis

from services.redis_local import RetryingPipeline, RetryingRedis, client_for, retrying

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "generator", "reward", "learner", "cli", "benchmarks", "deploy")
OWNER = ROOT / "services" / "redis_local.py"
# What builds a client or a pool (constructors and factories of redis-py).
BUILDERS = {"Redis", "StrictRedis", "from_url", "ConnectionPool", "BlockingConnectionPool", "Sentinel", "from_pool"}


def raw_client_calls(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if name in BUILDERS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(func)}(...)")
    return found


def test_no_module_builds_a_redis_client_outside_the_retry_layer():
    offenders = [
        call for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
        if path != OWNER for call in raw_client_calls(path)
    ]
    assert offenders == [], "build clients with services.redis_local (connect, client_for):\n" + "\n".join(offenders)


def test_the_owner_is_seen_by_the_check():
    assert raw_client_calls(OWNER)  # the scan does find client construction where it is allowed


def test_clients_of_the_layer_retry_every_command():
    client = client_for("redis://127.0.0.1:1/0")  # no connection is made here
    assert isinstance(client, RetryingRedis) and isinstance(client.pipeline(), RetryingPipeline)
    plain = redis.Redis()
    wrapped = retrying(plain)
    assert isinstance(wrapped, RetryingRedis) and wrapped.connection_pool is plain.connection_pool
    assert retrying(wrapped) is wrapped
    # the retry is on execute_command itself, which every command, script call and pubsub setup goes through
    assert RetryingRedis.execute_command is not redis.Redis.execute_command


def test_the_configured_password_reaches_the_client_and_one_in_the_url_wins():
    from services.config import load_settings
    from services.redis_local import connect

    client = connect(load_settings("tiny-cpu", redis={"url": "redis://redis:6379/0", "password": "from-secret"}))
    assert client.connection_pool.connection_kwargs["password"] == "from-secret"
    client = connect(load_settings("tiny-cpu", redis={"url": "redis://:in-url@redis:6379/0", "password": "other"}))
    assert client.connection_pool.connection_kwargs["password"] == "in-url"


def test_a_reply_that_never_comes_times_out_instead_of_blocking_for_ever():
    # A frozen host or a partition leaves a half-open socket: a peer that accepts and never answers.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        client = client_for(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", reply_timeout_s=0.5)
        once = redis.Redis(connection_pool=client.connection_pool)  # one attempt, without the retry layer
        started = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            once.ping()
        assert time.monotonic() - started < 5


def test_the_reply_timeout_outlasts_the_longest_blocking_read():
    from services.config import load_settings
    from services.redis_local import REPLY_TIMEOUT_S, connect

    client = connect(load_settings("tiny-cpu", redis={"url": "redis://redis:6379/0"}, streams={"block_ms": 5000}))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == REPLY_TIMEOUT_S + 5.0 and kwargs["socket_keepalive"]
    embedded = client_for("unix:///nowhere/redis.sock", reply_timeout_s=7.0)  # the embedded server's socket
    assert embedded.connection_pool.connection_kwargs["socket_timeout"] == 7.0
    with pytest.raises(redis.ConnectionError):  # the connection's options are accepted: it fails on the path alone
        redis.Redis(connection_pool=embedded.connection_pool).ping()


def test_only_a_busy_script_is_retried_as_busy_not_an_existing_group():
    from services.redis_local import _busy

    assert _busy(redis.ResponseError("BUSY Redis is busy running a script. You can only call SCRIPT KILL or ..."))
    assert _busy(redis.ResponseError("Command # 1 (HDEL dapo:r:issued t1) of pipeline caused error: BUSY Redis is "
                                     "busy running a script. You can only call SCRIPT KILL or SHUTDOWN NOSAVE."))
    assert not _busy(redis.ResponseError("BUSYGROUP Consumer Group name already exists"))  # answered, not retried
    assert not _busy(redis.ConnectionError("BUSY"))


@pytest.mark.parametrize("refusal", [
    redis.ConnectionError("Connection refused"),
    redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'."),
    redis.ResponseError("MISCONF Errors writing to the AOF file: No space left on device"),
])
def test_the_end_of_an_outage_is_noted_even_when_a_call_is_made_inside_its_retry(monkeypatch, refusal):
    """Redis away, full or unable to persist refuses the consumers' heartbeats too: the call that gets through
    after it notes the time (Stream._reclaim waits one visibility timeout from there), also when the learner freed
    a full Redis with calls of its own inside the retry."""
    from services import redis_local

    monkeypatch.setattr(redis_local, "_back_at", float("-inf"))
    monkeypatch.setattr(redis_local.time, "sleep", lambda seconds: None)  # tenacity's wait
    outcomes = iter([refusal, "nested", "ok"])

    def attempt():
        outcome = next(outcomes)
        if outcome == "nested":  # what the learner's on_full hook does on a full Redis: calls of its own
            redis_local._retrying_call(lambda: "trimmed")
            raise redis.exceptions.OutOfMemoryError("OOM command not allowed when used memory > 'maxmemory'.")
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    assert redis_local._retrying_call(attempt) == "ok"
    assert redis_local.seconds_since_outage() < 60


def test_a_client_past_its_stop_deadline_retries_no_command(monkeypatch):
    """A generator stopped during a Redis outage retried its read, then each hand-back, for 300 s apiece: always
    killed at the end of its pod's grace. Past the deadline its client was given, a refused command fails at its
    next retry; another client of the process retries as before."""
    from services import redis_local

    monkeypatch.setattr(redis_local.time, "sleep", lambda seconds: None)  # tenacity's wait
    stopping, other = client_for("redis://127.0.0.1:1/0"), client_for("redis://127.0.0.1:1/0")
    tries = []

    def away(*args, **options):
        tries.append(time.monotonic())
        if len(tries) == 3:
            stopping.give_up_retrying_at(time.monotonic())  # the stop's grace ends while the call retries
        if len(tries) == 8:
            return b"PONG"
        raise redis.ConnectionError("Connection refused")

    monkeypatch.setattr(redis.Redis, "execute_command", away)
    with pytest.raises(redis.ConnectionError):
        stopping.ping()
    assert len(tries) == 3
    stopping.give_up_retrying_at(time.monotonic() + 3600)  # a later deadline does not move it back
    with pytest.raises(redis.ConnectionError):
        stopping.ping()
    assert len(tries) == 4
    assert other.ping() and len(tries) == 8  # retried until it got through
    monkeypatch.undo()
    monkeypatch.setattr(redis_local.time, "sleep", lambda seconds: pytest.fail("a pipeline of the client retried"))
    pipe = stopping.pipeline(transaction=False)
    pipe.ping()
    with pytest.raises(redis.ConnectionError):
        pipe.execute()  # its pipelines too
