"""The refill limit's stop record (learner/checkpoint_layout.py) and how `dapo run` reports a run it stopped."""

from __future__ import annotations

import logging

from cli.launcher import reported_exit
from learner.checkpoint_layout import (
    CHECKPOINTS,
    LATEST,
    STOPPED,
    checkpoint_name,
    checkpoint_steps,
    clear_stop,
    latest_step,
    record_stop,
    recorded_stop,
)
from services.errors import ExitCode


def checkpointed(run_dir, step: int):
    folder = run_dir / CHECKPOINTS
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LATEST).write_text(f"step-{step}")
    return folder


def test_a_stop_counts_only_at_the_checkpoint_it_names(tmp_path):
    folder = checkpointed(tmp_path, 4)
    assert latest_step(folder) == 4 and recorded_stop(folder) is None
    record_stop(folder, 4, max_refills=10, reason="2 of 64 informative groups after 10 refill rounds")
    assert recorded_stop(folder) == {"step": 4, "max_refills": 10,
                                     "reason": "2 of 64 informative groups after 10 refill rounds"}
    (folder / LATEST).write_text("step-6")  # the run went on past it (and crashed before clearing it)
    assert recorded_stop(folder) is None
    clear_stop(folder)
    clear_stop(folder)  # nothing to clear: no error
    assert not (folder / STOPPED).exists()
    assert latest_step(tmp_path / "elsewhere") is None and recorded_stop(tmp_path / "elsewhere") is None


def test_an_unreadable_stop_record_does_not_keep_a_run_from_starting(tmp_path, caplog):
    folder = checkpointed(tmp_path, 2)
    for garbage in ("{not json", '{"step": 2}', '["step", 2]'):
        (folder / STOPPED).write_text(garbage)
        with caplog.at_level(logging.WARNING):
            assert recorded_stop(folder) is None
        assert "unreadable stop record" in caplog.text
        caplog.clear()


def test_dapo_run_reports_a_run_that_stayed_stopped_as_the_stop(tmp_path):
    folder = checkpointed(tmp_path, 3)
    assert reported_exit(0, tmp_path) == 0  # finished
    record_stop(folder, 3, max_refills=2, reason="no informative group")
    assert reported_exit(0, tmp_path) == ExitCode.REFILL_LIMIT == 3  # stayed stopped where it would resume
    assert reported_exit(ExitCode.REFILL_LIMIT, tmp_path) == ExitCode.REFILL_LIMIT
    assert reported_exit(75, tmp_path) == 75  # any other exit is its own


def test_checkpoint_folders_are_named_and_listed_by_step(tmp_path):
    folder = checkpointed(tmp_path, 10)
    for name in (checkpoint_name(10), checkpoint_name(2), "step-x", "other"):
        (folder / name).mkdir()
    (folder / "step-3").write_text("a file, not a checkpoint")
    assert checkpoint_name(10) == "step-10" and checkpoint_steps(folder) == [2, 10]
    assert latest_step(folder) == 10
