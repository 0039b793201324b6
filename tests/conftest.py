"""Shared fixtures (a real embedded redis-server per test, settings pointing at it) and the kind markers.

Tests live by kind in `unit/` (no process, server or model: the whole folder runs in under a minute),
`integration/` (real Redis, HTTP, child processes, torch and vLLM) and `e2e/` (the installed command running
the system), grouped by subject in subfolders where a subject has many (`unit/deployment/`, `unit/benchmarks/`,
`integration/benchmarks/`); each test gets the marker of its kind's folder, subfolders included, so `-m unit`
equals `pytest tests/unit`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from services.config import load_settings  # noqa: E402
from services.keys import create_keys, keys_dir  # noqa: E402
from services.redis_local import EmbeddedRedis  # noqa: E402

KINDS = ("unit", "integration", "e2e")
TESTS = Path(__file__).resolve().parent


def _kind(path: Path) -> str | None:
    """The first folder under tests/ (tests/unit/deployment/test_k8s.py -> "unit"); None for a file outside one."""
    path = path.resolve()
    if not path.is_relative_to(TESTS) or len(path.relative_to(TESTS).parts) < 2:
        return None
    return path.relative_to(TESTS).parts[0]


# Under `-n 2 --dist loadgroup` (the README's command): every file with a slow test runs on one worker, one
# test after another (one heavy job at a time on 2 cores, a module's engine or model made once); the single-threaded
# ones (`dapo plan`'s processes, the tiny model's rebuild) and the other files, each whole, share the other
# worker's time.
HEAVY, SINGLE_THREADED = "heavy", "single-threaded"
SINGLE_THREADED_FILES = {"test_plan.py", "test_shipped_model.py"}


def pytest_collection_finish(session):
    """Under loadgroup, pytest-xdist names each grouped test `nodeid@group`; pytest 9.2 ignores the renaming
    (hence pytest < 9.2 in pyproject.toml), which would run two heavy files at once without a word."""
    if getattr(session.config.option, "loadgroup", False) and any(
            item.get_closest_marker("xdist_group") and "@" not in item.nodeid for item in session.items):
        raise pytest.UsageError("pytest-xdist did not group the tests (--dist loadgroup): check pytest's version")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items):
    """Mark every test with the kind of the folder it lives in (the first one under tests/, so subfolders count as
    their kind's) and its xdist group; skip `gpu` tests where no CUDA device is visible."""
    cuda = None
    heavy_files = {item.path for item in items if item.get_closest_marker("slow")}
    for item in items:
        kind = _kind(item.path)
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: tests live under tests/unit, tests/integration or tests/e2e")
        item.add_marker(kind)
        if item.path.name in SINGLE_THREADED_FILES:
            group = SINGLE_THREADED
        else:  # any other file is a unit of its own: its module's fixtures made once
            group = HEAVY if item.path in heavy_files else item.path.relative_to(TESTS).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))
        if item.get_closest_marker("gpu"):
            if cuda is None:
                import torch

                cuda = torch.cuda.is_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


@pytest.fixture
def short_tmp():
    """A short temporary folder (unix socket paths must stay under ~100 bytes)."""
    path = tempfile.mkdtemp(prefix="dapo-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def redis_server(short_tmp):
    server = EmbeddedRedis(os.path.join(short_tmp, "redis"), aof=True).start()
    yield server
    server.stop()


@pytest.fixture
def settings(redis_server, short_tmp):
    """Test settings: the tiny preset, the embedded Redis, short timeouts, the run's role keys made."""
    settings = load_settings(
        "tiny-cpu",
        run_dir=os.path.join(short_tmp, "run"),
        redis={"url": redis_server.url, "run": "test"},
        streams={"visibility_timeout_s": 1.0, "block_ms": 100, "high_water": 64, "max_deliveries": 3},
    )
    create_keys(keys_dir(settings))
    return settings


@pytest.fixture(autouse=True)
def _test_process_stays_dumpable(monkeypatch):
    """`dapo` commands run in this process (cli.main.main) would make it non-dumpable for the rest of the session
    (services.startup.hide_from_same_user); the services the tests start as processes of their own still hide."""
    import cli.main

    monkeypatch.setattr(cli.main, "hide_from_same_user", lambda: False)


@pytest.fixture(autouse=True)
def _no_outage_of_an_earlier_test(monkeypatch):
    """The end of the last Redis outage, and the first contact with Redis, are this process's
    (services.redis_local.seconds_since_outage, seconds_since_first_contact): one test's restarted server must not
    hold off the reclaims of the next, nor the first test's server those of the tests that just started it."""
    from services import redis_local

    monkeypatch.setattr(redis_local, "_back_at", float("-inf"))
    monkeypatch.setattr(redis_local, "_met_at", float("-inf"))
    monkeypatch.setattr(redis_local, "_server_clock", None)  # (a test's stepped clock is not the next one's jump)
