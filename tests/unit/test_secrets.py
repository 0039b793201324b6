"""Secrets: the placeholder token never serves a reachable address, `dapo run` makes its own token, and files
that could hold a secret are 0600."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import yaml

from cli.launcher import service_children, write_launch_config
from cli.main import main as dapo
from services.config import DEFAULT_TOKEN, ConfigError, load_settings
from services.http import check_token, is_loopback
from services.weights_layout import write_atomic


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
    check_token("a-real-secret", host)  # any other token is the operator's choice


def test_service_command_refuses_to_start_with_one_line(monkeypatch, capsys):
    monkeypatch.delenv("DAPO_TOKEN", raising=False)
    assert dapo(["reward", "--set", "reward.host=0.0.0.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dapo: refusing to listen on 0.0.0.0") and "\n" not in err


def test_write_atomic_mode(tmp_path):
    secret = tmp_path / "secret.yaml"
    write_atomic(secret, "token: x", mode=0o600)
    assert mode_of(secret) == 0o600 and secret.read_text() == "token: x"
    secret.chmod(0o644)
    write_atomic(secret, "token: y", mode=0o600)  # replacing a readable file makes it private again
    assert mode_of(secret) == 0o600 and secret.read_text() == "token: y"
    assert [p.name for p in tmp_path.iterdir()] == ["secret.yaml"]


def test_launch_config_has_no_token_and_children_get_it_in_their_environment(tmp_path):
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), token="run-secret")
    path = write_launch_config(settings, tmp_path)
    assert mode_of(path) == 0o600
    assert "token" not in yaml.safe_load(path.read_text()) and "run-secret" not in path.read_text()
    children = service_children(settings, path, "redis://127.0.0.1:1", 1, 1, 8000)
    assert {c.env["DAPO_TOKEN"] for c in children} == {"run-secret"}
