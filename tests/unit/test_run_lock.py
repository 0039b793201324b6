"""One launcher per run folder (cli/launcher.py): a second `dapo run` on the folder is refused, naming the holder,
before it starts anything; the lock goes with its holder."""

from __future__ import annotations

import os

import pytest

from cli import launcher
from cli.launcher import RUN_LOCK, RunFolderBusy, lock_run_folder
from services.config import load_settings


def test_a_second_launcher_on_the_run_folder_is_refused_with_the_holder_named(tmp_path):
    held = lock_run_folder(tmp_path)
    with pytest.raises(RunFolderBusy, match=rf"in use by another `dapo run` \(dapo run pid {os.getpid()} on "):
        lock_run_folder(tmp_path)
    held.close()  # the holder ended
    again = lock_run_folder(tmp_path)
    assert (tmp_path / RUN_LOCK).read_text().count("dapo run pid") == 1  # the new holder only
    again.close()


def test_dapo_run_stops_before_it_starts_anything(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr("cli.bootstrap.ensure_model", lambda settings: started.append("model"))
    monkeypatch.setattr(launcher, "embedded_server", lambda settings: started.append("redis"))
    held = lock_run_folder(tmp_path)
    try:
        with pytest.raises(RunFolderBusy):
            launcher.main(load_settings("tiny-cpu", run_dir=str(tmp_path)), display=False)
    finally:
        held.close()
    assert started == []


def test_a_child_holding_the_lock_keeps_the_folder_locked_after_its_launcher_let_go(tmp_path):
    """A launcher SIGKILLed leaves its learner checkpointing (SIGTERM from PDEATHSIG): a `dapo run` started then would
    start the run over, or append, under it. The learner holds the lock too."""
    import sys

    from cli.launcher import Child

    held = lock_run_folder(tmp_path)
    learner = Child("learner", [sys.executable, "-c", "import time; time.sleep(30)"], dict(os.environ),
                    tmp_path / "learner.log", keep_fds=(held.fileno(),))
    learner.start()
    try:
        held.close()  # the launcher is gone
        with pytest.raises(RunFolderBusy):
            lock_run_folder(tmp_path)
    finally:
        learner.process.kill()
        learner.process.wait()
    lock_run_folder(tmp_path).close()  # the last holder ended
