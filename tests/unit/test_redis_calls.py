"""Every Redis call goes through the retry layer: only `services/redis_local.py` builds clients (all of them
`RetryingRedis`, whose every command, pipeline and script retries), and every other module gets its client from
there. Read from the source, so a new raw client anywhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

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
