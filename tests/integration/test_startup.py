"""Startup fails fast and clearly, and stops at once on a signal: real `dapo` processes, real signals.

Each service checks the model path (learner, generator) and Redis before it loads anything heavy; an
unreachable dependency ends it with exit code 69 and one line naming what was tried and what to do.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.faults import children_of
from services.config import load_settings
from services.errors import ExitCode, Unavailable
from services.http import free_port
from services.keys import create_keys
from services.redis_local import wait_for_redis

SERVICES = ["learner", "generator", "reward"]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    """A folder that passes the model lookup (the checks fail before anything would load it)."""
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text("{}")
    return folder


def closed_port_url() -> str:
    return f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there


def start(service: str, tmp: Path, *overrides: str, keys: bool = True) -> tuple[subprocess.Popen, Path]:
    if keys:
        create_keys(tmp / "run" / "keys")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DAPO_")}
    env.update(PYTHONUNBUFFERED="1", DAPO_RUN_DIR=str(tmp / "run"), DAPO_TOKEN="startup-test-token-0123456789")
    sets = [arg for o in (f"{service}.port={free_port()}", *overrides) for arg in ("--set", o)]
    stderr = tmp / f"{service}.err"
    with open(stderr, "wb") as err:
        process = subprocess.Popen([sys.executable, "-m", "cli", service, "--config", "tiny-cpu", *sets],
                                   env=env, stdout=subprocess.DEVNULL, stderr=err)
    return process, stderr


def message_lines(stderr: Path) -> list[str]:
    """What the user reads besides the timestamped log lines."""
    return [line for line in stderr.read_text().splitlines() if not line[:4].isdigit()]


def wait_for_text(path: Path, text: str, process: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while text not in path.read_text():
        assert process.poll() is None, path.read_text()
        assert time.monotonic() < deadline, f"no {text!r} in:\n{path.read_text()}"
        time.sleep(0.05)


@pytest.mark.parametrize("service", SERVICES)
def test_unreachable_redis_ends_the_service_with_one_line(service, model, tmp_path):
    url = closed_port_url()
    started = time.monotonic()
    process, stderr = start(service, tmp_path, f"redis.url={url}", "redis.connect_timeout_s=2",
                            f"model.name_or_path={model}")
    assert process.wait(timeout=60) == ExitCode.UNAVAILABLE, stderr.read_text()
    assert time.monotonic() - started < 60
    (line,) = message_lines(stderr)
    assert line.startswith(f"dapo {service}: Redis at {url} did not answer within 2 s") and "redis.url" in line
    assert "Traceback" not in stderr.read_text()


def test_the_redis_password_is_in_no_startup_message(redis_server, caplog):
    """Neither a password in redis.url nor redis.password reaches a log line or the one-line error, whether Redis
    refuses it or does not answer."""
    wrong = "wrong-pass-0c6d1f"
    refused = load_settings("tiny-cpu", redis={"url": redis_server.url.replace(redis_server.password, wrong)})
    silent = load_settings("tiny-cpu", redis={"url": f"redis://dapo:{wrong}@127.0.0.1:{free_port()}/0",
                                              "password": redis_server.password, "connect_timeout_s": 0.3})
    caplog.set_level("INFO")
    messages = []
    for settings in (refused, silent):
        with pytest.raises(Unavailable) as err:
            wait_for_redis(settings)
        messages.append(str(err.value))
    assert "refused the user or password" in messages[0] and "did not answer" in messages[1]
    assert "does not answer" in caplog.text
    assert not [s for s in (wrong, redis_server.password) for text in (*messages, caplog.text) if s in text]


@pytest.mark.parametrize("service", SERVICES)
def test_a_missing_key_ends_the_service_before_anything_starts(service, tmp_path):
    """No Redis waited for (nor an embedded one started), no lease, no model: the key is checked first."""
    process, stderr = start(service, tmp_path, f"redis.url={closed_port_url()}", "redis.connect_timeout_s=25",
                            f"model.name_or_path={tmp_path / 'no-such-model'}", keys=False)
    assert process.wait(timeout=20) == ExitCode.UNAVAILABLE, stderr.read_text()
    (line,) = message_lines(stderr)
    assert line.startswith(f"dapo {service}: no {service} key: ") and "dapo keys init" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("service", ["learner", "generator"])
def test_a_missing_model_ends_the_service_before_it_waits_for_redis(service, tmp_path):
    missing = tmp_path / "no-such-model"
    process, stderr = start(service, tmp_path, f"redis.url={closed_port_url()}", "redis.connect_timeout_s=25",
                            f"model.name_or_path={missing}")
    assert process.wait(timeout=20) == ExitCode.UNAVAILABLE, stderr.read_text()  # before the 25 s Redis wait
    (line,) = message_lines(stderr)
    assert line.startswith(f"dapo {service}: model folder '{missing}' does not exist") and "model.name_or_path" in line


@pytest.mark.parametrize("service, signum", [("learner", signal.SIGINT), ("generator", signal.SIGTERM),
                                             ("reward", signal.SIGINT), ("learner", signal.SIGTERM)])
def test_a_signal_stops_the_service_at_once_while_it_waits_for_redis(service, signum, model, tmp_path):
    process, stderr = start(service, tmp_path, f"redis.url={closed_port_url()}", "redis.connect_timeout_s=25",
                            f"model.name_or_path={model}")
    wait_for_text(stderr, "retrying for up to 25 s", process)
    sent = time.monotonic()
    process.send_signal(signum)
    assert process.wait(timeout=15) == 128 + signum, stderr.read_text()
    assert time.monotonic() - sent < 15  # not at the end of the 25 s retry (a loaded machine takes seconds to exit)
    assert message_lines(stderr) == [f"dapo {service}: stopped by {signal.Signals(signum).name}"]


def test_a_signal_stops_the_reward_service_while_its_verifier_processes_start(redis_server, tmp_path):
    process, stderr = start("reward", tmp_path, f"redis.url={redis_server.url}", "reward.workers=2")
    wait_for_text(stderr, "starting 2 verifier processes", process)
    deadline = time.monotonic() + 30
    while not (children := children_of(process.pid)):
        assert time.monotonic() < deadline and process.poll() is None, stderr.read_text()
        time.sleep(0.02)
    assert "reward service on" not in stderr.read_text()  # still starting
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=15) == 128 + signal.SIGTERM, stderr.read_text()
    assert message_lines(stderr) == ["dapo reward: stopped by SIGTERM"]
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in children):  # the verifier processes go with it
        assert time.monotonic() < deadline, f"left behind: {children}"
        time.sleep(0.1)


def test_a_signal_during_a_deferred_block_lands_after_it():
    from services.startup import signals_deferred

    class Alarm(Exception):
        pass

    def raise_alarm(_signum, _frame):
        raise Alarm

    previous = signal.signal(signal.SIGALRM, raise_alarm)
    reached_end = False
    try:
        with pytest.raises(Alarm):
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGALRM)
                time.sleep(0.05)  # a handler allowed to run would raise here
                reached_end = True
        assert reached_end
        assert signal.getsignal(signal.SIGALRM) is raise_alarm  # the handler is back
    finally:
        signal.signal(signal.SIGALRM, previous)


# A service started as a user (nobody when the test runs as root, which may read any process), holding a secret in
# its environment, hidden (`hide_from_same_user`) or not.
HOLDER = """
import ctypes, os, sys
sys.path.insert(0, {repo!r})
from services.startup import PR_SET_DUMPABLE, hide_from_same_user
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
    ctypes.CDLL(None).prctl(PR_SET_DUMPABLE, 1, 0, 0, 0)  # a uid change clears it: as if started as that user
if sys.argv[1] == "hidden":
    assert hide_from_same_user()
print("ready", flush=True)
sys.stdin.read()
"""
# Another process of the same user (a sibling role, code run in a verifier) reading the holder's environment.
READER = """
import os, sys
if os.geteuid() == 0:
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
try:
    print(open(f"/proc/{sys.argv[1]}/environ", "rb").read().decode(errors="replace"))
except PermissionError:
    print("refused")
"""


@pytest.mark.parametrize("hidden", [False, True], ids=["as-started", "hidden"])
def test_a_hidden_service_environment_is_unreadable_to_processes_of_its_own_user(hidden):
    repo = str(Path(__file__).resolve().parents[2])
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(repo=repo), "hidden" if hidden else "shown"],
                              env={**os.environ, "DAPO_TOKEN": "s3cret-token-of-the-holder"},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        read = subprocess.run([sys.executable, "-c", READER, str(holder.pid)], capture_output=True, text=True,
                              timeout=30)
        assert read.returncode == 0, read.stderr
        if hidden:
            assert read.stdout.strip() == "refused"
        else:  # the same reader sees the secret of a process that did not hide: the test can fail
            assert "s3cret-token-of-the-holder" in read.stdout
    finally:
        holder.kill()
        holder.wait()
