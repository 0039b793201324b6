"""Experiment tracking (learner/tracking.py) with a real Accelerator and real trackers, offline, read back from
what they wrote: TensorBoard's event files (EventAccumulator), W&B's offline run (WANDB_MODE=offline), an MLflow
file store."""

from __future__ import annotations

import json
import time

import pytest

from cli.main import build_parser, settings_from_args
from learner.tracking import (
    SAMPLES_KEY,
    TRACKER_MODULES,
    TrackerNotInstalled,
    Tracking,
    accelerator_kwargs,
    check_installed,
    tracking_dir,
)
from services.config import ConfigError, load_settings
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup

RECORDS = [
    {"step": 1, "version": 1, "reward_all": -0.5, "eval_accuracy": None, "refill_limit_hit": False, "time": 1e9},
    {"step": 2, "version": 2, "reward_all": 0.25, "eval_accuracy": 0.5, "refill_limit_hit": True, "time": 1e9},
]


def _group(prompt: str, texts: list[str], rewards: list[float]) -> ScoredGroup:
    task = PromptTask(prompt_id=prompt, prompt=prompt, ground_truth="4")
    samples = [Sample(token_ids=[1], logprobs=[-0.1], text=t, finish_reason="stop") for t in texts]
    scores = [Score(reward=r, correct=r > 0, overlong=False, rule="answer_line") for r in rewards]
    return ScoredGroup(rollout=RolloutGroup(task=task, policy_version=2, generator_id="g", samples=samples),
                       scores=scores)


GROUPS = [_group("2+2=?", ["Answer: 4", "Answer: 5", "Answer: 3"], [1.0, -1.0, -1.0]),
          _group("1+3=?", ["x | y\nAnswer: 4"], [1.0])]


def _track(tmp_path, names: list[str], records: list[dict] = RECORDS, resume_step: int | None = None,
           **overrides) -> tuple:
    from accelerate import Accelerator

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path / "run"), learner={"report_to": names}, **overrides)
    accelerator = Accelerator(cpu=True, **accelerator_kwargs(settings))
    tracking = Tracking(accelerator, settings, resume_step)
    for record in records:
        tracking.log_step(record)
    tracking.log_samples(GROUPS, step=2)
    tracking.finish()
    return settings, accelerator


def test_tensorboard_gets_every_step_number_and_the_eval_samples_as_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    settings, _ = _track(tmp_path, ["tensorboard"])
    (run,) = [p for p in tracking_dir(settings).iterdir() if p.is_dir()]
    assert run.name == settings.redis.run
    events = EventAccumulator(str(run), size_guidance={"tensors": 0, "scalars": 0})
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"version", "reward_all", "refill_limit_hit"} <= set(scalars)
    assert "time" not in scalars and "eval_accuracy" in scalars  # eval_accuracy only where it was measured
    assert [(e.step, e.value) for e in events.Scalars("reward_all")] == [(1, -0.5), (2, 0.25)]
    assert [(e.step, e.value) for e in events.Scalars("refill_limit_hit")] == [(1, 0.0), (2, 1.0)]
    assert [e.step for e in events.Scalars("eval_accuracy")] == [2]
    (text,) = events.Tensors(f"{SAMPLES_KEY}/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 2
    rows = table.splitlines()
    assert rows[0] == "| prompt | response | reward | correct |"
    assert len(rows) == 2 + 3  # header, rule, two responses of the first prompt, the one of the second
    assert "| 2+2=? | Answer: 4 | 1.0 | True |" in rows
    assert "| 1+3=? | x \\| y<br>Answer: 4 | 1.0 | True |" in rows


def test_a_resume_drops_from_tensorboard_the_steps_a_crash_discarded(tmp_path):
    """Steps 1-4 logged, a crash, a resume from the checkpoint of step 2: steps 3 and 4 are trained again, so
    TensorBoard keeps the new values only (as metrics.jsonl is cut back)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = [{"step": k, "reward_all": float(k)} for k in range(1, 5)]
    _track(tmp_path, ["tensorboard"], first)
    settings, _ = _track(tmp_path, ["tensorboard"], [{"step": k, "reward_all": -float(k)} for k in (3, 4)],
                         resume_step=2)
    (run,) = [p for p in tracking_dir(settings).iterdir() if p.is_dir()]
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_all")] == [(1, 1.0), (2, 2.0), (3, -3.0), (4, -4.0)]
    # a crash before the first checkpoint: the start over from step 1 keeps none of the crashed start's values
    _track(tmp_path, ["tensorboard"], [{"step": k, "reward_all": 10.0 * k} for k in (1, 2)])
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_all")] == [(1, 10.0), (2, 20.0)]


def test_wandb_offline_run_holds_the_steps_and_the_samples_table(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings, _ = _track(tmp_path, ["wandb"])
    (run,) = (tracking_dir(settings) / "wandb").glob("offline-run-*")
    # The history is in W&B's binary run log (wandb 0.31 ships no reader for it): its keys and values are there.
    (log_file,) = run.glob("run-*.wandb")
    expected = (b"reward_all", b"refill_limit_hit", b"0.25", b"-0.5")
    deadline = time.monotonic() + 20  # wandb-core may still be writing its log after finish() (seen on a loaded CI)
    while not all(key in log_file.read_bytes() for key in expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    history = log_file.read_bytes()
    assert all(key in history for key in expected), [key for key in expected if key not in history]
    (table_file,) = (run / "files" / "media" / "table" / "eval").glob("samples_2_*.table.json")
    table = json.loads(table_file.read_text())
    assert table["columns"] == ["prompt", "response", "reward", "correct"]
    assert table["data"][0] == ["2+2=?", "Answer: 4", 1.0, True] and len(table["data"]) == 3


def test_no_tracker_gets_a_secret(tmp_path, monkeypatch):
    """The token, a password in redis.url and redis.password: in no file any tracker wrote (TensorBoard's hparams.yml,
    W&B's offline run, MLflow's params), nor on /metrics; the hyperparameters show them redacted."""
    from prometheus_client import generate_latest

    secrets = ("token-tracked-5e0a1c77", "url-pass-tracked-93bd", "redis-pass-tracked-14fa")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _track(tmp_path, list(TRACKER_MODULES), token=secrets[0],
           redis={"url": f"redis://dapo:{secrets[1]}@redis:6379/0", "password": secrets[2]})
    written = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    hparams = next(data for p, data in written.items() if p.name == "hparams.yml")
    assert b"redis.url: redis://redis:6379/0" in hparams and b"token: '**********'" in hparams
    assert any(p.parent.name == "params" and p.name == "redis.password" for p in written)  # MLflow's params
    leaked = {str(p.relative_to(tmp_path)): s for p, data in written.items() for s in secrets if s.encode() in data}
    assert leaked == {}
    assert not [s for s in secrets if s.encode() in generate_latest()]


def test_no_trackers_means_no_tracking_files(tmp_path):
    settings, accelerator = _track(tmp_path, [])
    assert accelerator_kwargs(settings) == {} and accelerator.trackers == []
    assert not tracking_dir(settings).exists()


def test_a_missing_tracker_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setitem(TRACKER_MODULES, "mlflow", "dapo_tracking_test_absent_module")
    with pytest.raises(TrackerNotInstalled) as err:
        check_installed(["tensorboard", "mlflow"])
    assert str(err.value) == "learner.report_to: mlflow not installed; pip install 'dapo-services[track]'"
    assert isinstance(err.value, ConfigError)  # the CLI prints it and exits 2


def test_report_to_from_the_command_line_the_environment_and_its_choices(monkeypatch):
    monkeypatch.setenv("DAPO_TOKEN", "a-real-token-0123456789abcdef")  # 0.0.0.0 refuses weak tokens
    args = build_parser().parse_args(["learner", "--report-to", "tensorboard", "wandb"])
    assert settings_from_args(args).learner.report_to == ["tensorboard", "wandb"]
    args = build_parser().parse_args(["run", "--report-to", "tensorboard", "--set", "learner.total_steps=3"])
    settings = settings_from_args(args)
    assert (settings.learner.report_to, settings.learner.total_steps) == (["tensorboard"], 3)
    assert load_settings("tiny-cpu").learner.report_to == []
    with pytest.raises(SystemExit):
        build_parser().parse_args(["learner", "--report-to", "neptune"])
    monkeypatch.setenv("DAPO_LEARNER__REPORT_TO", '["tensorboard"]')
    assert load_settings("tiny-cpu").learner.report_to == ["tensorboard"]
    monkeypatch.setenv("DAPO_LEARNER__REPORT_TO", '["neptune"]')
    with pytest.raises(ConfigError):
        load_settings("tiny-cpu")


def test_mlflow_run_holds_the_step_metrics_the_config_and_the_samples_table(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a server needs no file store; this test does
    settings, _ = _track(tmp_path, ["mlflow"])
    (run,) = mlflow.search_runs(experiment_names=[settings.redis.run], output_format="list")
    history = mlflow.MlflowClient().get_metric_history(run.info.run_id, "reward_all")
    assert [(m.step, m.value) for m in history] == [(1, -0.5), (2, 0.25)]
    assert run.data.params["learner.report_to"] == "['mlflow']" and run.data.params["token"] == "**********"
    table = mlflow.artifacts.load_dict(f"{run.info.artifact_uri}/{SAMPLES_KEY}/step-2.json")
    assert table["columns"] == ["prompt", "response", "reward", "correct"]
    assert table["data"][0] == ["2+2=?", "Answer: 4", 1.0, True] and len(table["data"]) == 3


def test_a_resume_starts_an_mlflow_run_named_and_tagged_for_its_step(tmp_path, monkeypatch):
    """MLflow cannot drop the steps a crash discarded: the resumed process's run says where it took over."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    _track(tmp_path, ["mlflow"], [{"step": k, "reward_all": float(k)} for k in range(1, 5)])
    settings, _ = _track(tmp_path, ["mlflow"], [{"step": k, "reward_all": -float(k)} for k in (3, 4)], resume_step=2)
    runs = {r.info.run_name: r for r in mlflow.search_runs(experiment_names=[settings.redis.run], output_format="list")}
    first, resumed = settings.redis.run, f"{settings.redis.run}-resumed-at-2"
    assert set(runs) == {first, resumed}
    assert runs[first].data.tags["dapo.run"] == runs[resumed].data.tags["dapo.run"] == settings.redis.run
    assert "dapo.resumed_at_step" not in runs[first].data.tags and \
        runs[resumed].data.tags["dapo.resumed_at_step"] == "2"
    history = mlflow.MlflowClient().get_metric_history(runs[resumed].info.run_id, "reward_all")
    assert [(m.step, m.value) for m in history] == [(3, -3.0), (4, -4.0)]


def test_a_resume_starts_a_wandb_run_named_for_its_step_in_the_run_s_group(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    settings, _ = _track(tmp_path, ["wandb"], [{"step": 3, "reward_all": -3.0}], resume_step=2)
    (run,) = (tracking_dir(settings) / "wandb").glob("offline-run-*")
    (log_file,) = run.glob("run-*.wandb")
    expected = (f"{settings.redis.run}-resumed-at-2".encode(), b"reward_all")
    deadline = time.monotonic() + 20
    while not all(key in log_file.read_bytes() for key in expected) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(key in log_file.read_bytes() for key in expected)


def test_a_tracking_server_that_fails_mid_run_is_logged_and_training_goes_on(tmp_path, monkeypatch, caplog):
    """MLflow's client raises after minutes of retries while its server is down: the step was trained and is in
    metrics.jsonl, so the learner warns and goes on, and leaves the trackers alone for a while (each call would
    hold a step up for those minutes again)."""
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")

    def down(*args, **kwargs):
        raise mlflow.exceptions.MlflowException("API request to endpoint /api/2.0/mlflow/runs/log-batch failed")

    for call in ("log_metrics", "log_dict", "end_run"):
        monkeypatch.setattr(mlflow, call, down)
    with caplog.at_level("WARNING", logger="learner.tracking"):
        _track(tmp_path, ["mlflow"], records=RECORDS * 3)
    warnings = [r.getMessage() for r in caplog.records if "tracker" in r.getMessage()]
    assert len(warnings) == 1 and "tracker step 1 failed (1 failures so far" in warnings[0]  # then paused: no call
    assert "MlflowException" in warnings[0]  # (each of which would have retried for minutes)


def test_a_tracker_that_cannot_start_ends_no_training(tmp_path, monkeypatch, caplog):
    """W&B without its API key (no terminal to ask for one) raised from init_trackers, after the model had loaded:
    a traceback, exit 1, and a restart that loaded the model again, for ever under Compose or Kubernetes."""
    import wandb

    def no_key(*args, **kwargs):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", no_key)
    with caplog.at_level("ERROR", logger="learner.tracking"):
        _track(tmp_path, ["wandb"])  # its steps, samples and finish go nowhere, raising nothing
    assert any("could not start" in r.getMessage() and "No API key" in r.getMessage() for r in caplog.records)
