"""A run's checkpoints (learner/checkpoint.py): the latest, pruning, crash recovery, the refill limit's stop record,
and how `dapo run` reports a run it stopped."""

from __future__ import annotations

import logging

import pytest

from cli.launcher import reported_exit
from learner.checkpoint import LATEST, RANKS_SEEN, STOPPED, TRAINER_STATE, Checkpoints, check_shared, complete
from services.config import ConfigError
from services.errors import ExitCode


def checkpointed(run_dir, step: int, keep: int = 1) -> Checkpoints:
    checkpoints = Checkpoints(run_dir, keep=keep)
    checkpoints.dir.mkdir(parents=True, exist_ok=True)
    (checkpoints.dir / LATEST).write_text(f"step-{step}")
    return checkpoints


def test_a_stop_counts_only_at_the_checkpoint_it_names(tmp_path):
    checkpoints = checkpointed(tmp_path, 4)
    assert checkpoints.latest_step() == 4 and checkpoints.recorded_stop() is None
    checkpoints.record_stop(4, max_refills=10, reason="2 of 64 informative groups after 10 refill rounds")
    assert checkpoints.recorded_stop() == {"step": 4, "max_refills": 10,
                                           "reason": "2 of 64 informative groups after 10 refill rounds"}
    (checkpoints.dir / LATEST).write_text("step-6")  # the run went on past it (and crashed before clearing it)
    assert checkpoints.recorded_stop() is None
    checkpoints.clear_stop()
    checkpoints.clear_stop()  # nothing to clear: no error
    assert not (checkpoints.dir / STOPPED).exists()
    elsewhere = Checkpoints(tmp_path / "elsewhere")
    assert elsewhere.latest_step() is None and elsewhere.recorded_stop() is None and elsewhere.steps() == []


def test_an_unreadable_stop_record_does_not_keep_a_run_from_starting(tmp_path, caplog):
    checkpoints = checkpointed(tmp_path, 2)
    for garbage in ("{not json", '{"step": 2}', '["step", 2]'):
        (checkpoints.dir / STOPPED).write_text(garbage)
        with caplog.at_level(logging.WARNING):
            assert checkpoints.recorded_stop() is None
        assert "unreadable stop record" in caplog.text
        caplog.clear()


def test_dapo_run_reports_a_run_that_stayed_stopped_as_the_stop(tmp_path):
    checkpoints = checkpointed(tmp_path, 3)
    assert reported_exit(0, tmp_path) == 0  # finished
    checkpoints.record_stop(3, max_refills=2, reason="no informative group")
    assert reported_exit(0, tmp_path) == ExitCode.REFILL_LIMIT == 3  # stayed stopped where it would resume
    assert reported_exit(ExitCode.REFILL_LIMIT, tmp_path) == ExitCode.REFILL_LIMIT
    assert reported_exit(75, tmp_path) == 75  # any other exit is its own


def test_checkpoint_folders_are_named_and_listed_by_step(tmp_path):
    checkpoints = checkpointed(tmp_path, 10)
    for step in (10, 2):
        checkpoints.path(step).mkdir()
    for name in ("step-x", "other"):
        (checkpoints.dir / name).mkdir()
    (checkpoints.dir / "step-3").write_text("a file, not a checkpoint")
    assert checkpoints.path(10).name == "step-10" and checkpoints.steps() == [2, 10]
    assert checkpoints.latest_step() == 10


def test_commit_points_latest_at_the_step_and_keeps_the_newest(tmp_path):
    checkpoints = checkpointed(tmp_path, 0, keep=2)
    for step in (2, 4, 6):
        checkpoints.path(step).mkdir()
        checkpoints.commit(step)
        assert (checkpoints.dir / LATEST).read_text() == f"step-{step}"
    assert checkpoints.steps() == [4, 6] and checkpoints.latest_step() == 6
    checkpoints.keep = 0  # at least the one just committed stays
    checkpoints.commit(6)
    assert checkpoints.steps() == [6]


def test_a_crash_between_the_renames_leaves_a_complete_checkpoint(tmp_path):
    path = tmp_path / "step-4"
    with pytest.raises(FileNotFoundError):
        complete(path)
    old = tmp_path / "step-4.old"
    (old).mkdir()
    (old / TRAINER_STATE).write_text("{}")
    assert complete(path) == old  # renamed aside, the new one not yet in place: the previous one
    tmp = tmp_path / "step-4.tmp"
    tmp.mkdir()
    assert complete(path) == old  # a half-written new one is not taken
    (tmp / TRAINER_STATE).write_text("{}")
    assert complete(path) == tmp  # written whole (trainer_state.json comes last): the new one
    path.mkdir()
    assert complete(path) == path


def test_a_commit_deletes_the_steps_after_it_a_lineage_the_run_left(tmp_path):
    """Killed between a write and its commit, or started over with `resume: false`: the later steps are no
    checkpoint of this lineage and must not take the places `keep` leaves."""
    checkpoints = checkpointed(tmp_path, 20, keep=2)
    for step in (20, 22, 30):
        checkpoints.path(step).mkdir()
    checkpoints.commit(22)
    assert checkpoints.steps() == [20, 22] and checkpoints.latest_step() == 22


def test_a_commit_settles_what_killed_writes_left(tmp_path):
    """A write killed midway at a step the resumed run never writes again (SIGTERM's, the time limit's) left a
    whole checkpoint's worth of files; one killed between its renames left the complete copy aside, which takes
    its step's name and its place among the `keep` newest."""
    checkpoints = checkpointed(tmp_path, 20, keep=2)
    for name, whole in (("step-20", True), ("step-20.old", True), ("step-237.tmp", False), ("step-24.tmp", True),
                        ("step-24.old", True), ("step-22.old", True)):
        (checkpoints.dir / name).mkdir()
        if whole:
            (checkpoints.dir / name / TRAINER_STATE).write_text(name)
    checkpoints.path(26).mkdir()
    checkpoints.commit(26)
    assert sorted(p.name for p in checkpoints.dir.iterdir()) == [LATEST, "step-24", "step-26"]
    assert (checkpoints.path(24) / TRAINER_STATE).read_text() == "step-24.tmp"  # the newer complete copy


def test_starting_over_forgets_latest_so_a_restart_cannot_resume_the_run_before(tmp_path):
    checkpoints = checkpointed(tmp_path, 500)
    checkpoints.path(500).mkdir()
    checkpoints.forget_latest()
    checkpoints.forget_latest()  # nothing to forget: no error
    assert checkpoints.latest_step() is None and checkpoints.steps() == [500]
    checkpoints.path(5).mkdir()
    checkpoints.commit(5)  # this run's first checkpoint
    assert checkpoints.steps() == [5] and checkpoints.latest_step() == 5


def test_the_saved_state_is_read_from_the_copy_a_crash_between_the_renames_left(tmp_path):
    checkpoints = checkpointed(tmp_path, 4)
    tmp = checkpoints.dir / "step-4.tmp"
    tmp.mkdir()
    (tmp / TRAINER_STATE).write_text('{"format": 4, "extra_state": {"step": 4}}')
    assert checkpoints.extra_state(4) == {"step": 4}


@pytest.mark.parametrize("where", ["state", "last file"])
def test_a_checkpoint_write_that_fails_takes_its_half_away(tmp_path, monkeypatch, where):
    """A disk full midway (the shards, or the last file and its fsync, where NFS says it): what was written would
    keep the restart from writing anything (its config, its first weights version), under a name no later write
    of another step removes."""
    import errno
    from types import SimpleNamespace

    from learner import checkpoint

    def disk_full(folder, *args):
        (folder / "shard-0").write_bytes(b"x" * 1024)
        if where == "state":
            raise OSError(errno.ENOSPC, "No space left on device")

    served = SimpleNamespace(save_pretrained=lambda folder, state_dict: folder.mkdir(parents=True))
    accelerator = SimpleNamespace(is_main_process=True, process_index=0, wait_for_everyone=lambda: None,
                                  unwrap_model=lambda model: served)
    trainer = SimpleNamespace(accelerator=accelerator, model=None, optimizer=SimpleNamespace(optimizer=None),
                              scheduler=None, state_dict_for_publish=dict, served_dtype="float32",
                              model_path=tmp_path / "model")
    monkeypatch.setattr(checkpoint, "save_training_state", disk_full)
    monkeypatch.setattr(checkpoint, "_set_config_dtype", lambda folder, dtype: None)
    monkeypatch.setattr(checkpoint, "fsync_tree", lambda folder: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    with pytest.raises(OSError, match="No space"):
        checkpoint.write(trainer, tmp_path / "step-8", {})
    assert list(tmp_path.iterdir()) == []


def test_a_checkpoint_of_another_format_is_a_data_error_that_says_what_to_do(tmp_path):
    """An image upgraded mid-run: not a traceback restarted for ever, but exit 65 once (a restart fails the
    same way), naming the ways on."""
    import json

    from learner import checkpoint
    from services.data import DataError

    folder = tmp_path / "step-3"
    folder.mkdir()
    (folder / TRAINER_STATE).write_text(json.dumps({"format": 1, "extra_state": {}}))
    with pytest.raises(DataError, match="checkpoint format 1, and this release reads .*: finish the run with"):
        checkpoint.read(None, folder)


def test_starting_over_is_applied_once_not_at_every_restart_of_a_deployment(tmp_path):
    """A deployment applies `learner.checkpoints.resume: false` at every restart: once the run it started has a
    checkpoint, a restart resumes it (a finished run was trained again from scratch, its records cut)."""
    from learner.service import LearnerService
    from services.config import load_settings

    def learner():
        return LearnerService(load_settings("tiny-cpu", run_dir=str(tmp_path),
                                            learner={"checkpoints": {"resume": False}}))

    from learner.service import recipe

    checkpoints = checkpointed(tmp_path, 40)  # the run before
    checkpoints.path(40).mkdir()
    first = learner()
    assert not first.cfg.checkpoints.resume  # starts over
    checkpoints.forget_latest()
    checkpoints.mark_started_over(recipe(first.settings))  # (what its start_fresh does)
    assert not learner().cfg.checkpoints.resume  # restarted before the new run's first checkpoint: over again
    checkpoints.path(10).mkdir()
    checkpoints.commit(10)
    assert learner().cfg.checkpoints.resume  # the run it started resumes
    other = LearnerService(load_settings("tiny-cpu", run_dir=str(tmp_path), sampling={"temperature": 0.9},
                                         learner={"checkpoints": {"resume": False}}))
    assert not other.cfg.checkpoints.resume  # another recipe: another experiment starts over


class Rank:
    """accelerate's PartialState as check_shared uses it; `others` run at each barrier: ranks on other hosts."""

    def __init__(self, index, processes, others=()):
        self.process_index, self.num_processes, self.others = index, processes, others
        self.is_main_process = index == 0

    def wait_for_everyone(self):
        for other in self.others:
            other()


def test_a_run_folder_that_some_learner_rank_does_not_share_is_refused_at_the_start(tmp_path):
    """Rank 0 committed checkpoints without the shards of ranks whose run folder was their own node's volume: no
    resume could load them. Each rank leaves a mark; rank 0 must see every one."""
    elsewhere = tmp_path / "other-node"
    check_shared(tmp_path / "run", Rank(0, 1))  # one process: nothing to share
    (tmp_path / "run" / RANKS_SEEN).mkdir()
    (tmp_path / "run" / RANKS_SEEN / "rank-1").write_text("stale")  # a launch before, when it was shared
    with pytest.raises(ConfigError, match=r"learner ranks \[1\] do not share the run folder"):
        check_shared(tmp_path / "run", Rank(0, 2, others=[lambda: check_shared_mark(elsewhere, 1)]))
    shared = tmp_path / "shared"
    check_shared(shared, Rank(0, 2, others=[lambda: check_shared_mark(shared, 1)]))
    assert not (shared / RANKS_SEEN).exists()


def check_shared_mark(folder, rank):
    (folder / RANKS_SEEN).mkdir(parents=True, exist_ok=True)
    (folder / RANKS_SEEN / f"rank-{rank}").write_text("host")


def test_a_training_state_of_another_model_shape_is_a_damaged_checkpoint_not_a_crash_loop(tmp_path):
    """A model of the same name with other shapes (a rebuilt `tiny`, a replaced folder) failed inside DCP with a
    traceback: exit 1, restarted for ever, the model loaded each time."""
    import torch

    from learner.checkpoint import CheckpointDamaged, load_training_state, save_training_state

    def trainer_state(width: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    save_training_state(tmp_path / "state", *trainer_state(8), True, 0)
    load_training_state(tmp_path / "state", *trainer_state(8), 0)
    with pytest.raises(CheckpointDamaged, match="does not fit this model"):
        load_training_state(tmp_path / "state", *trainer_state(16), 0)


@pytest.mark.parametrize("raised", [OSError(5, "Input/output error"), MemoryError(), "stop"])
def test_an_error_while_reading_a_training_state_is_itself_not_a_damaged_checkpoint(tmp_path, monkeypatch, raised):
    """DCP wraps whatever a rank raised: an I/O error of the run volume, memory running out or a second Ctrl-C
    were all reported as a checkpoint of another model (exit 65: `dapo run` ended the run, the operator was told
    to start over)."""
    import torch
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    from learner.checkpoint import load_training_state, save_training_state
    from services.startup import Stopped

    raised = Stopped(2) if raised == "stop" else raised
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    save_training_state(tmp_path / "state", model, optimizer, scheduler, True, 0)

    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(HuggingFaceStorageReader, "read_data", fail)
    with pytest.raises(type(raised)):
        load_training_state(tmp_path / "state", model, optimizer, scheduler, 0)


def test_what_the_run_files_decide_is_decided_before_the_model_loads(tmp_path):
    """Kubernetes restarts a learner whatever its exit: a checkpoint of another format, a `latest` that names no
    checkpoint, a finished run or one the refill limit stopped were each learnt only after the model had loaded
    (at 32B: every restart loaded it, read the checkpoint and published a version)."""
    import json

    from learner.checkpoint import FORMAT, LATEST, STOPPED, CheckpointDamaged
    from learner.service import over_before_loading
    from services.config import load_settings

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), learner={"total_steps": 5, "eval_every": 5})
    checkpoints = Checkpoints(tmp_path)
    assert not over_before_loading(settings)  # no checkpoint: a fresh start
    checkpoints.dir.mkdir()
    (checkpoints.dir / LATEST).write_text("step-5; rm -rf")
    with pytest.raises(CheckpointDamaged, match="not a checkpoint"):
        over_before_loading(settings)
    (checkpoints.dir / LATEST).write_text("step-5")
    with pytest.raises(CheckpointDamaged, match="no checkpoint at"):
        over_before_loading(settings)
    checkpoints.path(5).mkdir()
    state = {"format": FORMAT - 1, "extra_state": {"last_eval_step": 4}}
    (checkpoints.path(5) / TRAINER_STATE).write_text(json.dumps(state))
    with pytest.raises(CheckpointDamaged, match="checkpoint format"):
        over_before_loading(settings)
    state["format"] = FORMAT
    (checkpoints.path(5) / TRAINER_STATE).write_text(json.dumps(state))
    assert not over_before_loading(settings)  # at total_steps, its last evaluation still to do: the learner does it
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 5, "eval_accuracy": 0.5}) + "\n")
    assert over_before_loading(settings)  # its last evaluation redone after a resume: metrics.jsonl has it
    (tmp_path / "metrics.jsonl").unlink()
    state["extra_state"]["last_eval_step"] = 5
    (checkpoints.path(5) / TRAINER_STATE).write_text(json.dumps(state))
    assert over_before_loading(settings)
    state["extra_state"]["recipe"] = {"sampling.temperature": 0.5}  # another experiment's: rank 0 refuses it
    (checkpoints.path(5) / TRAINER_STATE).write_text(json.dumps(state))
    assert not over_before_loading(settings)
    del state["extra_state"]["recipe"]
    (checkpoints.path(5) / TRAINER_STATE).write_text(json.dumps(state))
    settings.learner.total_steps = 10
    assert not over_before_loading(settings)  # raised: the run goes on
    settings.learner.batch.on_refill_limit = "stop"
    (checkpoints.dir / STOPPED).write_text(json.dumps({"step": 5, "max_refills": settings.learner.batch.max_refills,
                                                       "reason": "test"}))
    assert over_before_loading(settings)
    settings.learner.checkpoints.resume = False
    assert not over_before_loading(settings)  # starting over
    from learner.service import recipe

    checkpoints.mark_started_over(recipe(settings))  # ... once: this run is the one that start made
    assert over_before_loading(settings)
