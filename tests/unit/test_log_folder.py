"""DAPO_LOG_DIR: a service's log lines also in a file on its volume, kept when its container goes (cli/main.py)."""

from __future__ import annotations

import logging
import socket

from cli.main import log_to_folder


def test_log_lines_also_go_to_the_folder(tmp_path, monkeypatch):
    root = logging.getLogger()
    before = list(root.handlers)
    if not before:
        logging.basicConfig()
    monkeypatch.setenv("DAPO_LOG_DIR", str(tmp_path / "logs"))
    log_to_folder("learner")
    try:
        logging.getLogger("learner.service").warning("checkpoint step-3")
        assert "checkpoint step-3" in (tmp_path / "logs" / f"learner-{socket.gethostname()}.log").read_text()
    finally:
        for handler in set(root.handlers) - set(before):
            root.removeHandler(handler)
            handler.close()


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv("DAPO_LOG_DIR", raising=False)
    handlers = list(logging.getLogger().handlers)
    log_to_folder("reward")
    assert logging.getLogger().handlers == handlers
