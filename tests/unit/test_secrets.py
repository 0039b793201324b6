"""Secrets: the placeholder token, or a weak one, never serves a reachable address, `dapo run` makes its own token,
files that could hold a secret are 0600, and no secret is shown: one place (the config's types) decides what is
secret, and every dump of the settings (config.yaml, the trackers' hyperparameters, logs, reprs) redacts it."""

from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import yaml

from cli.launcher import TOKEN_VARIABLES, service_children, write_launch_config
from cli.main import main as dapo
from learner.records import Records
from learner.tracking import flat_config
from services.config import DEFAULT_TOKEN, ConfigError, dump_settings, load_settings, secret_fields
from services.files import write_atomic
from services.http import MIN_TOKEN_CHARS, check_token, check_tokens, is_loopback
from services.keys import ROLES
from services.startup import scrub_secret_environment


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_default_token_is_fine_on_loopback(host):
    assert is_loopback(host)
    check_token(DEFAULT_TOKEN, host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.7", "generator.dapo.svc"])
def test_default_token_is_refused_on_a_reachable_address(host):
    assert not is_loopback(host)
    with pytest.raises(ConfigError, match="default token 'change-me'.*DAPO_TOKEN"):
        check_token(DEFAULT_TOKEN, host)
    check_token("3f1c9a7be02d4c58a6e1f0b9d27c4e83", host)  # a random one is fine


@pytest.mark.parametrize("token", ["a-real-secret", "x" * 64, "abcabcabcabcabcabc", "p" * (MIN_TOKEN_CHARS - 1)])
def test_a_weak_token_is_refused_on_a_reachable_address_only(token):
    with pytest.raises(ConfigError, match="weak token.*DAPO_TOKEN"):
        check_token(token, "0.0.0.0")
    check_token(token, "127.0.0.1")


def test_service_command_refuses_to_start_with_one_line(monkeypatch, capsys):
    hidden = []
    monkeypatch.setattr("cli.main.hide_from_same_user", lambda: hidden.append(True))  # not this test process
    monkeypatch.delenv("DAPO_TOKEN", raising=False)
    assert dapo(["reward", "--set", "reward.host=0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dapo: refusing to listen on 0.0.0.0") and "\n" not in err
    assert hidden == [True]  # a service hides its /proc from its own user before it reads a secret


def test_variables_that_look_like_credentials_are_scrubbed_whoever_set_them(monkeypatch):
    secret = {"HF_TOKEN": "hf_x", "WANDB_API_KEY": "k", "AWS_SECRET_ACCESS_KEY": "k", "AWS_ACCESS_KEY_ID": "k",
              "PGPASSWORD": "p", "GITHUB_TOKEN": "t", "SSH_AUTH_SOCK": "/tmp/agent", "DAPO_TOKEN_SHA256": "0" * 64,
              "DATABASE_URL": "postgres://user:hunter2@db:5432/x", "HTTPS_PROXY": "http://me:pw@proxy:3128",
              "dapo_redis__url": "redis://u:p@host:6379/0", "SENTRY_DSN": "https://k3y@o1.ingest.sentry.io/1",
              "OTEL_EXPORTER_OTLP_HEADERS": "Authorization=Bearer abc", "SERVICE_JWT": "e30.e30.x"}
    kept = {"PATH": "/usr/bin", "PWD": "/work", "TOKENIZERS_PARALLELISM": "false", "DAPO_WORKER_ID": "reward-1",
            "DAPO_EXIT_FILE": "/tmp/x", "DAPO_REDIS__RUN": "r", "NO_PROXY": "localhost", "HTTP_PROXY": "http://proxy:3128",
            "MONITOR_URL": "https://host/path?a=b@c", "DAPO_LEARNER__COMPUTE__SHARE_PROMPT_PASS": "true"}
    for name, value in {**secret, **kept}.items():
        monkeypatch.setenv(name, value)
    assert sorted(scrub_secret_environment()) == sorted(secret)
    assert all(name not in os.environ for name in secret) and all(os.environ[n] == v for n, v in kept.items())


def test_write_atomic_mode(tmp_path):
    secret = tmp_path / "secret.yaml"
    write_atomic(secret, "token: x", mode=0o600)
    assert mode_of(secret) == 0o600 and secret.read_text() == "token: x"
    secret.chmod(0o644)
    write_atomic(secret, "token: y", mode=0o600)  # replacing a readable file makes it private again
    assert mode_of(secret) == 0o600 and secret.read_text() == "token: y"
    assert [p.name for p in tmp_path.iterdir()] == ["secret.yaml"]


TOKEN, URL_PASSWORD, PASSWORD = "token-7c1e0f3a9b2d", "url-pass-51d0c8e2", "redis-pass-9e4b27a6"
SECRETS = (TOKEN, URL_PASSWORD, PASSWORD)


def secret_settings(tmp_path: Path):
    return load_settings("tiny-cpu", run_dir=str(tmp_path), token=TOKEN,
                         redis={"url": f"redis://dapo:{URL_PASSWORD}@redis:6379/0", "password": PASSWORD})


def leaks(text: str) -> list[str]:
    return [secret for secret in SECRETS if secret in text]


def test_the_config_types_decide_what_is_secret():
    settings = secret_settings(Path("run"))
    assert secret_fields(settings) == {"token": True, "redis": {"url": True, "password": True}}
    assert settings.token.get_secret_value() == TOKEN and settings.redis.password.get_secret_value() == PASSWORD
    assert settings.redis.url.get_secret_value() == f"redis://dapo:{URL_PASSWORD}@redis:6379/0"
    assert str(settings.redis.url) == "redis://redis:6379/0"  # where it is, not who logs in


def test_no_dump_of_the_settings_shows_a_secret(tmp_path):
    settings = secret_settings(tmp_path)
    Records.write_config(settings)
    config_yaml = (tmp_path / "config.yaml").read_text()
    hyperparameters = flat_config(settings)
    shown = {
        "repr": repr(settings), "str": str(settings), "json": settings.model_dump_json(),
        "dump_settings": dump_settings(settings), "config.yaml": config_yaml,
        "trackers": json.dumps(hyperparameters), "redis section": f"{settings.redis!r} {settings.redis}",
    }
    assert {where: leaks(text) for where, text in shown.items() if leaks(text)} == {}
    # Redacted, not dropped: a reader of the run sees that a secret was set, and where Redis is.
    redis_shown = yaml.safe_load(config_yaml)["redis"]
    assert (redis_shown["url"], redis_shown["password"]) == ("redis://redis:6379/0", "**********")
    assert hyperparameters["token"] == "**********" and hyperparameters["redis.url"] == "redis://redis:6379/0"


def test_launch_config_has_no_secret_and_children_get_them_in_their_environment(tmp_path, monkeypatch):
    settings = secret_settings(tmp_path)
    settings.weights_token = "weights-token-" + "9" * 20  # as `dapo run` makes one
    path = write_launch_config(settings, tmp_path)
    assert mode_of(path) == 0o600
    launch = yaml.safe_load(path.read_text())
    assert "weights-token-" not in path.read_text() and "weights_token" not in launch
    assert "token" not in launch and {"url", "password"}.isdisjoint(launch["redis"]) and not leaks(path.read_text())
    redis_url = settings.redis.url.get_secret_value()
    children = service_children(settings, path, dict.fromkeys(ROLES, redis_url), 1, 1, 8000)
    environments = {(c.env["DAPO_REDIS__URL"], c.env["DAPO_REDIS__PASSWORD"]) for c in children}
    assert environments == {(redis_url, PASSWORD)}
    learner = next(c for c in children if c.name == "learner")
    for name in ("DAPO_TOKEN_SHA256", "DAPO_WEIGHTS_TOKEN", "DAPO_REDIS__URL", "DAPO_REDIS__PASSWORD"):
        monkeypatch.setenv(name, learner.env[name])
    read = load_settings(path)  # what a child reads: the file, then its environment (the token by its sha256)
    assert read.token_sha256.get_secret_value() == hashlib.sha256(TOKEN.encode()).hexdigest()
    assert read.model_copy(update={"token": settings.token, "token_sha256": None}) == settings


def test_each_role_gets_the_tokens_of_its_audience_only(tmp_path, monkeypatch):
    """The learner the operator's token and the weights token; generators the weights token (it opens only the
    learner's weights) and the operator token's sha256; reward workers that sha256 alone. A token exported in the
    launcher's shell reaches no worker."""
    monkeypatch.setenv("DAPO_TOKEN", TOKEN)
    monkeypatch.setenv("DAPO_WEIGHTS_TOKEN", "w" * 32)
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    monkeypatch.setenv("dapo_token", TOKEN)  # pydantic-settings would read it too: in any case, none passes
    monkeypatch.setenv("Dapo_Redis__Url", "redis://someone-else:6379/0")
    children = service_children(settings, tmp_path / "c.yaml", dict.fromkeys(ROLES, "redis://r:6379/0"), 2, 1, 8000)
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    expected = {"learner": {"DAPO_TOKEN_SHA256": digest, "DAPO_WEIGHTS_TOKEN": "w" * 32},
                "generator": {"DAPO_TOKEN_SHA256": digest, "DAPO_WEIGHTS_TOKEN": "w" * 32},
                "reward": {"DAPO_TOKEN_SHA256": digest}}
    for child in children:
        tokens = {k: v for k, v in child.env.items() if k.upper() in TOKEN_VARIABLES}
        assert tokens == expected[child.name.split("-")[0]], child.name
        assert TOKEN not in child.env.values() and "someone-else" not in str(child.env), child.name
        if child.name != "learner":  # a worker's name is on its command line: `ps` shows it, its environment is hidden
            assert child.command[-2:] == ["--worker-id", child.name]


def test_a_shell_variable_of_a_field_reaches_no_child_so_set_holds_in_every_process(tmp_path, monkeypatch):
    """Children read the launch config, which the launcher resolved from the shell's variables and --set: a field's
    variable passed on would beat it (`DAPO_RUN_DIR=/a dapo run --set run_dir=/b` ran the services in /a)."""
    monkeypatch.setenv("DAPO_RUN_DIR", "/a")
    monkeypatch.setenv("dapo_learner__total_steps", "5")
    monkeypatch.setenv("DAPO_KEYS__PRIVATE_KEY", "k" * 43)  # one role's key would reach every role
    monkeypatch.setenv("DAPO_LOG_LEVEL", "DEBUG")  # the process's own: passed on
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    children = service_children(settings, tmp_path / "c.yaml", dict.fromkeys(ROLES, "redis://r:6379/0"), 1, 1, 8000)
    for child in children:
        names = {name.upper() for name in child.env}
        assert not names & {"DAPO_RUN_DIR", "DAPO_LEARNER__TOTAL_STEPS", "DAPO_KEYS__PRIVATE_KEY"}, child.name
        assert child.env["DAPO_LOG_LEVEL"] == "DEBUG" and child.env["DAPO_REDIS__URL"] == "redis://r:6379/0"


@pytest.mark.parametrize("variables, refusal", [
    ({"DAPO_TOKEN_SHA256": "3b0b3b2f1b3d7e9ac2f4a6c0e1d2b3a4c5d6e7f8091a2b3c4d5e6f708192a3b4"}, None),
    ({"DAPO_TOKEN_SHA256": "4ccd9e3c9f5fd3fb95e7d1a0b2c9d3f0e8a5b6c7d1e2f3a4b5c6d7e8f9a0b1c2"}, None),
    ({"DAPO_TOKEN": "3f1c9a7be02d4c58a6e1f0b9d27c4e83", "DAPO_WEIGHTS_TOKEN": "w" * 30}, "weak token.*DAPO_WEIGHTS"),
    ({"DAPO_TOKEN_SHA256": hashlib.sha256(b"change-me").hexdigest()}, "default token 'change-me' .its sha256"),
])
def test_every_token_a_service_admits_is_checked_on_a_reachable_address(monkeypatch, variables, refusal):
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    settings = load_settings("tiny-cpu")
    if refusal is None:
        check_tokens(settings, "0.0.0.0")  # given only a digest, the service holds no token to judge
    else:
        with pytest.raises(ConfigError, match=refusal):
            check_tokens(settings, "0.0.0.0")
    check_tokens(settings, "127.0.0.1")
    with pytest.raises(ConfigError, match="64 lower-case hex digits"):
        load_settings("tiny-cpu", token_sha256="ABC")


def test_each_child_gets_its_own_roles_redis_url(tmp_path):
    """`dapo run`'s embedded server has a Redis user per role: a child's URL is its role's, no other role's."""
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    urls = {role: f"unix://{role}:pw-{role}@/run/redis.sock" for role in ROLES}
    children = service_children(settings, tmp_path / "c.yaml", urls, 2, 1, 8000)
    for child in children:
        role = child.name.split("-")[0]
        assert child.env["DAPO_REDIS__URL"] == urls[role], child.name
        assert not any(f"pw-{other}" in value for other in ROLES if other != role for value in child.env.values())
