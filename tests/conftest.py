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


def pytest_collection_modifyitems(items):
    """Mark every test with the kind of the folder it lives in (the first one under tests/, so subfolders count as
    their kind's); skip `gpu` tests where no CUDA device is visible."""
    cuda = None
    for item in items:
        kind = _kind(item.path)
        if kind not in KINDS:
            raise pytest.UsageError(f"{item.nodeid}: tests live under tests/unit, tests/integration or tests/e2e")
        item.add_marker(kind)
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
