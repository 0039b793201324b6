"""The learner service: helpers (fast), then the whole loop with a real embedded Redis, a real vLLM generator
process and a real reward worker process on the tiny model (slow).

The slow tests share one generator and one reward worker (starting vLLM costs most of a minute on CPU); each
test runs its own learner process with its own run folder, after the streams are drained of the previous
test's leftovers. Learner, generator and reward start exactly as deployed: `python -m cli <service>`
with DAPO_ environment overrides.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import pytest
import redis
import torch
from signing import vouched

from learner.batch import Push, task_id_of
from learner.checkpoint import CHECKPOINTS, STOPPED, Checkpoints
from learner.evaluation import EvalRound
from learner.records import LEDGER_FILE, METRICS_FILE, truncate_jsonl
from learner.service import LearnerService, TrainProblems, data_spec
from learner.workset import ISSUED, task_id_in_payload
from services.broadcast import Broadcaster
from services.config import load_settings, moved_keys
from services.data import Problem
from services.http import free_port
from services.keys import ROLES
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, Score, ScoredGroup, to_wire
from services.streams import Streams, _dead_letter_fields
from services.weights import channel, latest_key

REPO = Path(__file__).resolve().parents[2]


# -- helpers (fast) --------------------------------------------------------------------------------------------
def test_truncate_jsonl_keeps_the_checkpointed_prefix_and_drops_a_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"step": s, "x": s * 2}) + "\n" for s in range(5)]
    path.write_text("".join(lines) + '{"step": 5, "x"')  # a SIGKILL mid-write
    with open(path) as reader:  # a tailer keeps its handle across the cut
        assert truncate_jsonl(path, 2) == 3
        assert reader.read() == "".join(lines[:3])
    assert truncate_jsonl(path, -1) == 0 and path.read_text() == ""
    assert truncate_jsonl(tmp_path / "missing.jsonl", 3) == 0


def test_task_ids_are_read_from_raw_payloads_of_every_stream():
    task = PromptTask(task_id="t-1", prompt_id="p", prompt="1+1=?", ground_truth="2")
    sample = Sample(token_ids=[1], logprobs=[-0.1], text="Answer: 2", finish_reason="stop")
    rollout = RolloutGroup(task=task, policy_version=0, generator_id="g", samples=[sample])
    scored = ScoredGroup(rollout=rollout, scores=[Score(reward=1.0, correct=True, overlong=False, rule="answer_line")])
    assert task_id_in_payload("prompts", to_wire(task)) == "t-1"
    assert task_id_in_payload("rollouts", to_wire(rollout)) == "t-1"
    assert task_id_in_payload("scored", to_wire(scored)) == "t-1"
    assert task_id_in_payload("held", to_wire(scored)) == "t-1"
    assert task_id_in_payload("scored", b"\xff\x00 not msgpack") is None
    assert task_id_in_payload("scored", msgpack.packb({"rollout": {}})) is None


def test_train_problems_cursor_restores_the_same_stream_of_problems():
    problems = [Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(5)]
    first = TrainProblems(problems, seed=3)
    seen = [first.next().id for _ in range(7)]  # crosses an epoch boundary
    assert sorted(seen[:5]) == sorted(p.id for p in problems)  # an epoch is a permutation
    resumed = TrainProblems(problems, seed=3)
    resumed.seek(first.cursor())
    assert [resumed.next().id for _ in range(6)] == [first.next().id for _ in range(6)]


def test_a_cursor_taken_on_another_order_starts_the_next_epoch_instead_of_redrawing_some_problems(caplog):
    """data.seed changed (or the data set's size) between a checkpoint and its resume: the rest of the epoch on
    the new order would draw some problems again and never others."""
    problems = [Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(6)]
    first = TrainProblems(problems, seed=3)
    [first.next() for _ in range(4)]
    for other in (TrainProblems(problems, seed=4), TrainProblems(problems[:5], seed=3)):
        other.seek(first.cursor())
        assert (other.epoch, other.index) == (1, 0)
    assert "another order" in caplog.text
    same = TrainProblems(problems, seed=3)
    same.seek(first.cursor())
    assert (same.epoch, same.index) == (0, 4)


def test_prompts_the_generators_cannot_fit_are_left_out_at_load_and_the_tiny_model_refuses_a_template_it_cannot_spell(
        settings, caplog):
    """A prompt longer than generator.max_model_len - max_tokens was refused by every generator, dead-lettered, and
    issued again every epoch; the tiny model's character tokenizer dropped the letters of the DAPO instruction it
    does not know from every prompt, silently."""
    from transformers import AutoTokenizer

    from learner.service import PromptBuilder
    from services.data import DataError
    from services.models import model_dir

    service = LearnerService(settings)
    service.prompt_builder = PromptBuilder(AutoTokenizer.from_pretrained(model_dir(settings)), settings)
    short, long = Problem(id="s", problem="1+2", answer="3"), Problem(id="l", problem="1+2" * 100, answer="3")
    assert [p.id for p in service.fitting([short, long], settings.sampling.max_tokens, "training")] == ["s"]
    assert "1 of the 2 training problems have prompts longer than" in caplog.text
    with pytest.raises(DataError, match="no held-out problem"):
        service.fitting([long], settings.eval_sampling.max_tokens, "held-out")
    settings.data.prompt_template = "dapo"
    tiny = LearnerService(settings)
    tiny.connect()
    with pytest.raises(DataError, match="not in the tiny model's alphabet"):
        tiny.load()


def test_a_resume_with_another_recipe_is_refused_before_anything_is_loaded(settings):
    """Nothing compared the settings a checkpoint was trained with: an ablation row (compose's one run folder) or
    a changed temperature resumed another experiment's weights and went on under the same name."""
    from learner.service import recipe
    from services.config import ConfigError

    service = LearnerService(settings)
    folder = service.checkpoints.path(3)
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"format": 1, "extra_state": {"recipe": recipe(settings)}}))
    (service.checkpoints.dir / "latest").write_text("step-3")
    run = settings.redis.run
    settings.sampling.temperature = 0.7
    settings.learner.loss.clip_high = 0.2
    settings.learner.batch.filter_metric = "reward"
    settings.redis.run = "renamed"  # another run's name on this run folder (compose's DAPO_RUN)
    refusal = (rf"learner.batch.filter_metric 'acc' -> 'reward'; learner.loss.clip_high 0.28 -> 0.2; "
               rf"redis.run '{run}' -> 'renamed'; sampling.temperature 1.0 -> 0.7")
    with pytest.raises(ConfigError, match=refusal):
        service.check_recipe()  # what `main` does first: no Redis, no config.yaml written, no model loaded
    assert not (Path(settings.run_dir) / "config.yaml").exists()
    with pytest.raises(ConfigError, match=refusal):
        service.resume()
    settings.sampling.temperature, settings.learner.loss.clip_high = 1.0, 0.28
    settings.learner.batch.filter_metric, settings.redis.run = "acc", run
    saved = json.loads((folder / "trainer_state.json").read_text())
    del saved["extra_state"]["recipe"]["sampling.top_p"]  # a setting a later release added: not a change
    (folder / "trainer_state.json").write_text(json.dumps(saved))
    loaded = []
    service.ranks = SimpleNamespace(load=lambda trainer, path: loaded.append(path) or {"step": 3})
    with pytest.raises(KeyError):  # past the check: the checkpoint loads (a stand-in's state, too short to go on)
        service.resume()
    assert loaded == [folder]


def test_a_followers_signal_stops_after_the_step_and_leaves_this_process_its_own_first_signal(settings):
    """Kubernetes stops the learner's pods together (podManagementPolicy Parallel): the second pod's SIGTERM
    reached rank 0 with a command before rank 0's own, which then counted as the second signal, "now", and the run
    ended without its checkpoint."""
    import signal

    from services.startup import Stopped

    service = LearnerService(settings)
    service.follower_signalled(signal.SIGTERM)
    assert service.stopping.is_set() and service.stopped_by == signal.SIGTERM
    service.signalled(signal.SIGINT, None)  # its own first: the step ends, the checkpoint is written
    assert service.stopped_by == signal.SIGINT
    with pytest.raises(Stopped):
        service.signalled(signal.SIGTERM, None)  # its own second: now


def test_another_tiny_model_under_the_same_name_is_another_recipe(settings):
    """The recipe named the model only: a `tiny` of other shapes passed the check and failed inside the checkpoint
    loader (or, with the shapes kept and another tokenizer seed, trained on silently)."""
    from learner.service import recipe, recipe_changes

    saved = recipe(settings)
    other = settings.model_copy(deep=True)
    other.tiny.hidden_size, other.tiny.seed = 64, 1
    assert recipe_changes(saved, other) == ["tiny.hidden_size 128 -> 64", "tiny.seed 0 -> 1"]
    other.tiny.hidden_size, other.tiny.seed, other.tiny.warmup_steps = 128, 0, 5  # the warm-up: the start only
    assert recipe_changes(saved, other) == []


def test_a_restart_before_the_first_checkpoint_with_another_recipe_is_refused(settings):
    """Before its first checkpoint (10 steps, 36 hours at the 32B recipe) a restart with a lowered max_tokens
    re-admitted the groups `held` kept and took the tasks still queued, all sampled and scored by the settings
    before, with no word: the run's first steps mixed two experiments."""
    from services.config import ConfigError

    problems = [Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(10)]
    learner_drawing(settings, problems, seed=5).start_fresh()  # the run's start, killed before any checkpoint
    LearnerService(settings).check_recipe()  # the same settings: a restart goes on
    changed = settings.model_copy(deep=True)
    changed.sampling.max_tokens = settings.sampling.max_tokens // 2
    with pytest.raises(ConfigError, match=r"no checkpoint yet\) was started with other settings \(sampling.max_tok"):
        LearnerService(changed).check_recipe()
    changed.learner.checkpoints.resume = False  # starting over is the way on, and its recipe is the run's then
    learner_drawing(changed, problems, seed=5).start_fresh()
    changed.learner.checkpoints.resume = True
    LearnerService(changed).check_recipe()


def test_time_limit_ends_the_run_with_an_evaluation_and_a_checkpoint(tmp_path):
    from learner.service import LearnerService

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), learner={"time_limit_minutes": 0.5})
    service = LearnerService(settings)
    service.step = 3  # neither an evaluation nor a checkpoint step
    service.train_started = time.monotonic()
    final = service.finished()
    assert not (final or service.eval_due(final) or service.checkpoint_due(final))
    service.train_started -= 31
    final = service.finished()
    assert final and service.eval_due(final) and service.checkpoint_due(final)
    unlimited = LearnerService(load_settings("tiny-cpu", run_dir=str(tmp_path)))
    unlimited.step, unlimited.train_started = 3, 0.0
    assert not unlimited.finished()


def test_the_step_the_time_limit_will_end_pushes_no_prompts_for_a_next_one(tmp_path):
    """With learner.time_limit_minutes, the step that the training clock will pass it in (if it takes as long as
    the one before) is the last: the prompts it would push ahead would be generated for no step of this process."""
    from learner.service import LearnerService

    service = LearnerService(load_settings("tiny-cpu", run_dir=str(tmp_path), learner={"time_limit_minutes": 0.5}))
    service.step, service.last_step_seconds = 3, 10.0
    service.train_started = time.monotonic() - 15
    assert not service.last_step_likely()  # 15 s + 10 s < 30 s
    service.train_started -= 6
    assert service.last_step_likely() and not service.finished()  # 21 s + 10 s: this step ends past the limit
    service.step = service.cfg.total_steps - 1
    service.cfg.time_limit_minutes = 0
    assert service.last_step_likely()  # the last of total_steps


def test_a_resume_redoes_the_evaluation_a_stop_cut_short(tmp_path):
    """SIGTERM during an evaluation checkpoints the step without it: the resumed learner evaluates first (the
    baseline at step 0 included), but not a step whose evaluation was done, or that had none due."""
    from learner.records import METRICS_FILE

    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), learner={"eval_every": 3, "total_steps": 10})
    service = LearnerService(settings)
    assert service.eval_missing(resumed=False)  # a fresh start: the baseline
    assert service.eval_missing(resumed=True)  # stopped during the baseline: step-0 checkpoint, no line
    service.records.evaluation({"step": 0, "version": 0, "eval_accuracy": 0.2})
    assert not service.eval_missing(resumed=True)
    assert service.records.has_evaluation(0) and (tmp_path / METRICS_FILE).exists()
    service.step, service.last_eval_step = 6, 3  # step 6's evaluation was cut short
    assert service.eval_missing(resumed=True)
    service.records.evaluation({"step": 6, "version": 6, "eval_accuracy": 0.3})  # redone, then killed again
    assert not service.eval_missing(resumed=True)  # before a checkpoint recorded it: not a second line
    service.records.cut_after(5)
    service.last_eval_step = 6
    assert not service.eval_missing(resumed=True)
    service.step = 7  # no evaluation due at step 7
    assert not service.eval_missing(resumed=True)
    service.step = 10  # the last step's
    assert service.eval_missing(resumed=True)


def test_an_evaluation_first_waits_until_no_train_prompt_is_in_flight(tmp_path):
    # an evaluation is left out of the training clock: nothing may be generated for training during one
    service = LearnerService(load_settings("tiny-cpu", run_dir=str(tmp_path)))

    class InFlight:  # the working set as drain_train reads it (no Redis here)
        def __init__(self, task_ids):
            self.task_ids = list(task_ids)

        @property
        def train_in_flight(self) -> bool:
            return bool(self.task_ids)

    service.work = InFlight(["a", "b", "c"])
    seen = []

    def one_arrives():
        seen.append(len(service.work.task_ids))
        service.work.task_ids.pop()

    service.pump = one_arrives
    assert service.drain_train() >= 0 and seen == [3, 2, 1] and not service.work.train_in_flight
    service.work.task_ids.append("d")
    service.stopping.set()
    service.drain_train()  # a stop ends the wait
    assert service.work.task_ids == ["d"]


def test_data_specs_and_public_url():
    assert data_spec("synthetic", "train") == "synthetic-train"
    assert data_spec("aime2024", "eval") == "aime2024"
    s = load_settings("tiny-cpu", learner={"port": 8123})
    assert s.learner.public_base_url() == "http://127.0.0.1:8123"
    s = load_settings("tiny-cpu", learner={"public_url": "http://learner:8000/"})
    assert s.learner.public_base_url() == "http://learner:8000"


def scored_group(task: PromptTask, correct: list[bool]) -> ScoredGroup:
    samples = [Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], text="Answer: 2", finish_reason="stop") for _ in correct]
    scores = [Score(reward=1.0 if c else -1.0, correct=c, overlong=False, rule="answer_line") for c in correct]
    return ScoredGroup(rollout=RolloutGroup(task=task, policy_version=0, generator_id="g", samples=samples),
                       scores=scores)


def learner_drawing(settings, problems: list[Problem], seed: int) -> LearnerService:
    """A connected learner service drawing its train tasks from `problems` (prompts as token ids 5, 6)."""
    service = LearnerService(settings)
    service.connect()
    service.train_problems = TrainProblems(problems, seed=seed)
    service.prompt_builder = lambda problem: (problem.problem, [5, 6])
    return service


def test_a_resume_does_not_draw_again_the_problems_issued_after_the_checkpoint(settings):
    """Their groups survive the crash (held, or still in the pipeline) and are trained by the resumed learner, so
    it continues the data after the last problem issued, not after the checkpoint's cursor."""
    problems = [Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(20)]

    def learner() -> LearnerService:
        return learner_drawing(settings, problems, seed=3)

    first = learner()
    checkpointed = first.train_problems.cursor()  # the checkpoint is written here, then 2 pushes follow
    first.push_train(Push(count=3, refill=False))
    first.push_train(Push(count=2, refill=True))
    issued = [task.prompt_id for task in first.work.outbox]
    first.work.flush_outbox()
    assert len(issued) == 5 and not first.work.outbox
    following = first.train_problems.next().id  # what the first learner would have drawn next

    resumed = learner()
    resumed.seek_data(checkpointed)
    assert resumed.train_problems.next().id == following
    other_data = TrainProblems(problems[:10], seed=3)  # another data set: the issued cursor does not apply
    assert not other_data.seek_past(first.work.issued_data_cursor())
    first.work.forget_run()  # a fresh start
    fresh = learner()
    fresh.seek_data(checkpointed)
    assert fresh.train_problems.next().id == issued[0]


def test_the_data_goes_on_after_a_kill_before_the_first_checkpoint_and_past_only_what_was_pushed(settings):
    """A learner killed before its first checkpoint: the next one starts without one, yet the groups of the
    problems issued come back, so it draws after them (not from the first problem again). A push the full prompts
    stream cut short: the checkpoint's cursor stops before the problems still queued (a resume draws them), and
    Redis keeps the cursor after the last one pushed."""
    problems = [Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(40)]
    settings.streams.high_water = 4

    def learner() -> LearnerService:
        return learner_drawing(settings, problems, seed=5)

    first = learner()
    first.push_train(Push(count=6, refill=False))
    drawn = [task.prompt_id for task in first.work.outbox]
    first.work.flush_outbox()  # 4 pushed, 2 queued behind the full stream
    assert len(first.work.outbox) == 2
    checkpointed = first.work.data_cursor(first.train_problems.cursor())
    after_pushed = first.work.issued_data_cursor()
    for cursor in (checkpointed, after_pushed):  # both continue with the first problem not pushed
        fresh = TrainProblems(problems, seed=5)
        fresh.seek(cursor)
        assert fresh.next().id == drawn[4]

    second = learner()  # first was killed before any checkpoint: resume on, none to resume from
    second.start_fresh()
    assert second.train_problems.next().id == drawn[4]
    settings.learner.checkpoints.resume = False  # starting over: from the first problem
    third = learner()
    third.start_fresh()
    assert third.train_problems.next().id == TrainProblems(problems, seed=5).next().id
    assert (third.checkpoints.dir / "started-over").is_file()  # applied once (learner/checkpoint.py)


def test_publishing_overlaps_the_next_step_where_staleness_allows_but_not_a_round_over_nccl(settings):
    service = LearnerService(settings)
    service.cfg.batch.max_staleness = 1
    assert settings.weights.overlap_delivery and service.overlap_publish  # the default
    service.broadcaster = SimpleNamespace(backend="gloo")
    assert service.overlap_publish
    service.broadcaster = SimpleNamespace(backend="nccl")  # collective on GPUs: on the step's path
    assert not service.overlap_publish
    service.broadcaster = None
    service.cfg.batch.max_staleness = 0  # the paper's synchronous loop
    assert not service.overlap_publish
    service.cfg.batch.max_staleness, settings.weights.overlap_delivery = 1, False
    assert not service.overlap_publish


def test_the_policy_at_the_start_goes_by_the_files_alone_and_every_update_by_a_round(settings):
    """Generators up before the learner serve its starting policy already (version 0 from the model folder, or the
    checkpoint's after a learner restart) and join no round for it: a round at the start waited out its join
    timeout on each and paused them all, and broadcasts stopped for MEMBER_PAUSE_S after every learner restart."""
    service = LearnerService(settings)
    service.connect()
    rounds = []
    service.broadcaster = SimpleNamespace(broadcast=lambda tensors, version: rounds.append(version))
    service.ranks = SimpleNamespace(weights=lambda trainer: {"w": torch.zeros(4)}, world=1)
    service.publish_initial()
    assert rounds == [] and service.announced == 0 and 0 in service.publisher.versions()
    service.policy.current = 1
    service.publish()
    assert rounds == [1] and service.announced == 1
    # a round that fails in a way it does not expect: the files are still every generator's way in
    service.broadcaster = SimpleNamespace(broadcast=lambda tensors, version: 1 / 0)
    service.policy.current = 2
    service.publish()
    assert service.announced == 2 and 2 in service.publisher.versions()


def test_a_checkpoint_waits_for_the_delivery_in_the_background_before_it_gathers_the_weights(settings):
    """The host holds one served copy of the weights at a time: a checkpoint at a step that neither evaluates nor
    ends the run (every N steps, or Redis's memory pressed) gathered a second one while the delivery still held the
    first (2 x 61 GiB at 32B)."""
    service = LearnerService(settings)
    service.cfg.batch.max_staleness = 1
    service.connect()
    service.train_problems = TrainProblems([Problem(id="1", problem="1+0=?", answer="1")], seed=0)
    delivered = threading.Event()
    deliver = service.publisher.publish
    service.publisher.publish = lambda weights, version: (time.sleep(0.5), deliver(weights, version),
                                                          delivered.set())[1]
    saved_while_delivering = []
    service.ranks = SimpleNamespace(
        weights=lambda trainer: {"w": torch.zeros(4)}, world=1,
        save=lambda trainer, path, extra: (saved_while_delivering.append(not delivered.is_set()),
                                           Path(path).mkdir(parents=True)))
    assert service.overlap_publish
    service.policy.current = 1
    service.publish(overlap=True)
    service.step = 1
    service.checkpoint()
    assert saved_while_delivering == [False]


def test_a_task_asks_for_no_version_the_generators_were_not_told_of(settings):
    """While version 5 is delivered in the background (weights.overlap_delivery), tasks ask for 4, the newest
    announced: a learner killed before the delivery ended leaves no task waiting for a version never announced
    (a resumed learner may not reach it before the run ends: such tasks held the pipeline for good)."""
    service = LearnerService(settings)
    service.connect()
    service.train_problems = TrainProblems([Problem(id=str(i), problem=f"{i}+0=?", answer=str(i)) for i in range(9)],
                                           seed=3)
    service.prompt_builder = lambda problem: (problem.problem, [5, 6])
    service.policy.current, service.announced = 5, 4
    service.push_train(Push(count=2, refill=False))
    assert {task.min_version for task in service.work.outbox} == {4}
    service.work.flush_outbox()
    service.announced = 5  # delivered: the next tasks ask for it
    service.push_train(Push(count=1, refill=True))
    assert [task.min_version for task in service.work.outbox] == [5]
    service.work.flush_outbox()


def reward_stream(service, settings):
    """The `scored` stream as a reward worker writes it (signed with the reward role's key; its Streams also holds
    the generator role's, to vouch for rollouts as a generator would have: `vouched`)."""
    return Streams(service.redis, settings, signs_as=("reward", "generator")).stream("scored", ScoredGroup)


def produce_scored(service, settings, group: ScoredGroup) -> None:
    """`group` written to `scored` as a reward worker forwards a genuine rollout it scored."""
    scored = reward_stream(service, settings)
    scored.produce(vouched(scored.streams, group))


def learner_that_issued(settings) -> tuple[LearnerService, PromptTask]:
    """A connected learner service that pushed one task (recorded in `issued`, then produced; counted in flight)."""
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)  # load() reads it from the model's config
    issued = PromptTask(task_id="train-1", prompt_id="p1", prompt="1+1=", prompt_token_ids=[5, 6], ground_truth="2",
                        sampling=SamplingParams(n=2, max_tokens=64))
    service.work.outbox.append(issued)
    service.work.assembler.issued(["train-1"], 0)
    service.work.flush_outbox()
    return service, issued


def test_learner_trains_only_groups_it_issued_and_that_match(settings):
    """Forged scored groups (unknown task id, bad signature, a rollout that does not fit its task) are dead-lettered
    with the exact reason and never reach the batch; the genuine group does."""
    service, issued = learner_that_issued(settings)
    assert service.work.issued_task("train-1") == issued
    assert service.redis.hexists(service.streams.key(ISSUED), "train-1")

    scored = reward_stream(service, settings)
    made_up = issued.model_copy(update={"task_id": "train-made-up"})
    scored.produce(vouched(scored.streams, scored_group(made_up, [True, False])))
    other_prompt = issued.model_copy(update={"prompt_token_ids": [7, 8]})
    scored.produce(vouched(scored.streams, scored_group(other_prompt, [True, False])))
    genuine = to_wire(scored_group(issued, [True, False]))
    tampered = to_wire(scored_group(issued.model_copy(update={"ground_truth": "3"}), [True, False]))
    service.redis.xadd(scored.key, {b"data": tampered, b"sig": scored.signature(genuine)})
    service.work.pump()
    # The refused groups named a real task: it is not taken for lost, its genuine group is still to come.
    assert "train-1" in service.work.assembler.in_flight and service.work.issued_task("train-1") == issued
    scored.produce(vouched(scored.streams, scored_group(issued, [True, False])))
    service.work.pump()

    reasons = [d["reason"] for d in reversed(service.streams.dead_letters())]
    assert reasons == [  # the signature is checked on reading, before the learner looks at the group
        f"forged: bad signature under {scored.streams.signers['reward'].kid} (tampered, or not signed with that key)",
        "provenance: unknown task id 'train-made-up' (not issued by this run's learner)",
        "provenance: task train-1 does not match the task as issued (differs in prompt_token_ids)",
    ]
    assert [task.rollout.task for _, _, task in service.work.assembler.ready] == [issued]
    assert service.redis.xlen(service.work.held.key) == 1 and service.redis.xlen(scored.key) == 0


def issue_tasks(service, count: int) -> list[PromptTask]:
    """`count` train tasks issued by the learner and pushed to `prompts` (train-0, train-1, ...)."""
    tasks = [PromptTask(task_id=f"train-{i}", prompt_id=f"p{i}", prompt="1+1=", ground_truth="2") for i in range(count)]
    service.work.assembler.issued([t.task_id for t in tasks], 0)
    service.work.outbox.extend(tasks)
    service.work.flush_outbox()
    return tasks


def generator_takes(settings, redis_client, count: int = 100) -> list:
    """A generator reads up to `count` tasks from `prompts` (and never answers): they are held, no longer queued."""
    prompts = Streams(redis_client, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    return list(prompts.consume("gen", count=count, block_ms=0))


def test_a_task_no_generator_has_read_waits_past_its_deadline_and_one_read_does_not(settings):
    """Tasks still queued in `prompts` (generators that start late, or too few) were counted lost at the deadline
    while their entries stayed first in line: the refills waited behind entries whose groups would be refused as
    unknown, and a run of slow groups made no update at all. A queued task waits; its clock starts again when it was
    last seen unread. An unread entry that was deleted (trimmed) is no longer queued."""
    settings.learner.batch.task_deadline_min_s = 1.0
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    issue_tasks(service, 3)
    trimmed = service.redis.hget(service.work.entry_ids_key, "train-2")
    service.redis.xdel(service.work.prompts.key, trimmed)
    time.sleep(1.1)
    service.work.expire_overdue()
    assert sorted(service.work.assembler.in_flight) == ["train-0", "train-1"]  # queued: waiting, not lost
    assert service.work.assembler.stats.lost == 1  # train-2, trimmed unread
    (taken,) = generator_takes(settings, service.redis, count=1)  # a generator takes one, and then dies
    time.sleep(0.3)
    service.work.expire_overdue()
    assert service.work.assembler.stats.lost == 1  # a whole deadline from when it was last seen queued
    time.sleep(2.0)  # (the loss before any round trip doubled the deadline: learner/deadlines.py)
    service.work.expire_overdue()
    assert service.work.assembler.stats.lost == 2 and taken.message.task_id not in service.work.assembler.in_flight
    assert len(service.work.assembler.in_flight) == 1  # the other is still queued


def test_a_held_group_dropped_at_a_restart_stays_held_until_a_checkpoint_lists_it(settings):
    """A restart finds a held group too stale for the restored version: it is dropped in the next ledger line, and
    deleted from `held` only by the next checkpoint's release, so a second kill before that drops it (and ledgers
    it) again instead of losing it from every record."""
    first = LearnerService(settings)
    first.connect()
    first.work.limit_vocabulary(100)
    (task,) = issue_tasks(first, 1)
    produce_scored(first, settings, scored_group(task, [True, False] * 8))
    first.work.pump()
    assert len(list(first.work.held.entries())) == 1
    for attempt in range(2):  # two kills in a row, no checkpoint between
        restarted = LearnerService(settings)
        restarted.connect()
        restarted.work.limit_vocabulary(100)
        restarted.policy.current = settings.learner.batch.max_staleness + 5  # the group is too old for it
        restarted.work.restore(skip=set(), counted=set())
        assert restarted.work.take_drops()["stale"] == [task.task_id], attempt
        assert len(list(restarted.work.held.entries())) == 1
        assert task.task_id in restarted.work.consumed_since_checkpoint
    assert restarted.work.release() == 1 and not list(restarted.work.held.entries())



def test_held_groups_read_back_at_a_restart_leave_the_ratio_estimate_alone(settings):
    """`held` holds only groups that were informative when they arrived (and after a kill, those of the discarded
    lineage come back too stale): a biased sample, so re-admitting them must not move the estimate that sizes the
    pushes (it dropped from 0.8 to 0.1 at a resume, and the next steps pushed up to 4x what they needed)."""
    first = LearnerService(settings)
    first.connect()
    first.work.limit_vocabulary(100)
    tasks = issue_tasks(first, 4)
    for task in tasks:
        produce_scored(first, settings, scored_group(task, [True, False] * 8))
    first.work.pump()
    restarted = LearnerService(settings)
    restarted.connect()
    restarted.work.limit_vocabulary(100)
    before = restarted.work.assembler.ratio.state()
    restarted.policy.current = settings.learner.batch.max_staleness + 5  # half of them too old for it
    restarted.work.restore(skip=set(), counted=set())
    assert len(restarted.work.take_drops()["stale"]) == 4
    assert restarted.work.assembler.ratio.state() == before
    assert restarted.work.assembler.stats.stale_dropped == 4  # still counted in the step's statistics


def test_a_second_held_entry_of_a_task_is_deleted_alone_at_a_restart(settings):
    """Two entries of one task in `held` (a forward retried after its reply was lost): the restart keeps the first
    for training and deletes the duplicate alone, not the task's kept entry with it at the next checkpoint."""
    first = LearnerService(settings)
    first.connect()
    first.work.limit_vocabulary(100)
    (task,) = issue_tasks(first, 1)
    group = scored_group(task, [True, False] * 8)
    first.work.held.produce(group)
    first.work.held.produce(group)
    restarted = LearnerService(settings)
    restarted.connect()
    restarted.work.limit_vocabulary(100)
    restarted.work.restore(skip=set(), counted=set())
    assert [task_id_of(g) for _, _, g in restarted.work.assembler.ready] == [task.task_id]
    assert len(list(restarted.work.held.entries())) == 1 and not restarted.work.consumed_since_checkpoint


def test_only_dead_letters_a_service_signed_make_a_task_lost(settings):
    """A dead prompt makes the learner stop waiting for its task; a dead letter that anyone with Redis access
    added (unsigned, or signed with another key) must not, or it could cancel any task whose id it read."""
    service = LearnerService(settings)
    service.connect()
    tasks = issue_tasks(service, 3)
    dead_key = service.streams.key("dead")
    letter = {b"stream": b"prompts", b"entry_id": b"1-0", b"reason": b"delivered 4 times (max 3)",
              b"deliveries": b"4", b"data": to_wire(tasks[0])}
    service.redis.xadd(dead_key, letter)  # unsigned
    # signed, by a role that does not consume `prompts` (the reward worker's key): not the generators' word
    outsider = Streams(service.redis, settings, signs_as=("reward",))
    body = {**letter, b"stream": b"prompts", b"data": to_wire(tasks[1])}
    signature = outsider.signer("reward", "test").sign(dead_key, *_dead_letter_fields(body))
    service.redis.xadd(dead_key, {**body, b"sig": signature})
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    (delivery,) = [d for d in prompts.consume("gen", count=10, block_ms=0) if d.message.task_id == "train-2"]
    prompts.dead(delivery.id, delivery.payload, "engine failure on this task alone: test")  # a generator's own
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == ["train-0", "train-1"]
    assert service.work.assembler.stats.lost == 1


def test_a_generator_letter_retires_only_an_entry_it_held_and_parked(settings):
    """A dead letter is its writer's word, so the learner reads the task it retires from the entry the writer
    parked in the consumer group, never from the letter: a letter for an entry its signer was never delivered, or
    had already answered, or whose task id field names another task, retires nothing more than what was parked."""
    from services import metrics
    from services.streams import DEAD_LETTERED

    service = LearnerService(settings)
    service.connect()
    tasks = issue_tasks(service, 4)
    generator = Streams(service.redis, settings, signs_as=("generator",))
    prompts = generator.stream("prompts", PromptTask)
    held = {d.message.task_id: d for d in prompts.consume("gen-a", count=2, block_ms=0)}  # train-0, train-1
    assert sorted(held) == ["train-0", "train-1"]
    never_delivered = next(eid for eid, f in service.redis.xrange(prompts.key) if b"train-2" in f[b"data"])
    refused = metrics.STREAM_LETTERS_REFUSED.labels("prompts")._value.get()

    # A rogue generator signs letters for an entry another holds and for one never delivered, each with the task's
    # genuine bytes: neither is parked under its group, so neither retires a task.
    rogue = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    # (A letter's entry id is its writer's word too: one that is none is refused before Redis reads it.)
    for entry_id, task in ((held["train-0"].id, tasks[0]), (never_delivered.decode(), tasks[2]), ("- +", tasks[2]),
                            ("99999999999999999999-0", tasks[2])):  # past 2^64: not an id either
        letter = {b"stream": "prompts", b"entry_id": entry_id, b"reason": "delivered 4 times (max 3)",
                  b"deliveries": 4, b"task_id": task.task_id, b"data": to_wire(task.for_generators())}
        service.redis.xadd(service.streams.key("dead"), {**letter, b"sig": rogue.streams.dead_letter_signature(letter)})
    # The holder answers train-1 (its rollout forwarded, the entry deleted), then dead-letters it too (`dead`:
    # `reject` writes no letter for an entry its consumer no longer holds): nothing parked.
    rollouts = generator.stream("rollouts", RolloutGroup)
    answered = held["train-1"]
    assert prompts.forward(answered, rollouts, scored_group(tasks[1], [True, False]).rollout)
    assert not prompts.reject(answered, "engine failure on this task alone: replayed")
    prompts.dead(answered.id, answered.payload, "engine failure on this task alone: replayed", answered.deliveries,
                 signature=answered.signature)
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == [t.task_id for t in tasks]
    assert service.work.assembler.stats.lost == 0
    assert metrics.STREAM_LETTERS_REFUSED.labels("prompts")._value.get() == refused + 5

    # The holder's own letter for train-0 parks the entry (still in Redis) until the learner settles it. A letter
    # whose task id field names train-3 retires the task of the entry it parked, not train-3.
    prompts.reject(held["train-0"], "engine failure on this task alone: test")
    (pending,) = service.redis.xpending_range(prompts.key, "generator", min="-", max="+", count=10,
                                              consumername=DEAD_LETTERED)
    assert pending["message_id"].decode() == held["train-0"].id
    last = next(d for d in service.streams.dead_letters() if d["entry_id"] == held["train-0"].id)
    assert last["task_id"] == "train-0" and last["entry_sig"].encode() == prompts.streams.redis.xrange(
        prompts.key, min=held["train-0"].id, max=held["train-0"].id)[0][1][b"sig"]
    service.redis.xdel(service.streams.key("dead"), last["id"])  # rewritten, naming train-3, re-signed by the holder
    letter = {k.encode(): v for k, v in last.items() if k not in ("id", "sig")}
    letter[b"task_id"] = "train-3"
    service.redis.xadd(service.streams.key("dead"), {**letter, b"sig": prompts.streams.dead_letter_signature(letter)})
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == ["train-1", "train-2", "train-3"]
    assert service.work.assembler.stats.lost == 1
    assert service.redis.xrange(prompts.key, min=held["train-0"].id, max=held["train-0"].id) == []  # settled


def test_a_worker_letter_retires_a_task_only_through_the_entry_that_carried_it(settings):
    """A parked entry retires a task only when it was that task's carrier in the pipeline: not a copy of its prompts
    entry that a generator added (same bytes, same signature), not a rollout group that does not parse or does not
    answer the task as issued (any generator can write one naming any task), and not a scored entry that does not
    parse (any holder of the reward key can write one). A rollout group answering its task retires it."""
    service = LearnerService(settings)
    service.connect()
    tasks = issue_tasks(service, 3)
    generator = Streams(service.redis, settings, signs_as=("generator",))
    reward = Streams(service.redis, settings, signs_as=("reward",))
    prompts = generator.stream("prompts", PromptTask)
    # A generator copies train-0's entry, fields and signature, reads the copy back and dead-letters it.
    (genuine,) = [(eid.decode(), f) for eid, f in service.redis.xrange(prompts.key) if b"train-0" in f[b"data"]]
    assert len(prompts.consume("gen-a", count=3, block_ms=0)) == 3  # the genuine entries, held by gen-a
    copy = service.redis.xadd(prompts.key, genuine[1]).decode()
    (copied,) = prompts.consume("gen-b", count=1, block_ms=0)
    assert copied.id == copy and copied.message.task_id == "train-0"
    prompts.reject(copied, "engine failure on this task alone: a copy")
    # Generator-signed rollouts: one naming train-1 that does not parse (the reward role dead-letters it), one of
    # train-1 whose prompt differs, and train-2's genuine answer, both dead-lettered after too many deliveries.
    by_generator = generator.stream("rollouts", RolloutGroup)
    garbage = msgpack.packb({"task": {"task_id": "train-1"}}, use_bin_type=True)
    service.redis.xadd(by_generator.key, {b"data": garbage, b"sig": by_generator.signature(garbage)})
    by_generator.produce(scored_group(tasks[1].model_copy(update={"prompt": "2+2="}), [True, False]).rollout)
    by_generator.produce(scored_group(tasks[2].for_generators(), [True, False]).rollout)
    altered, answer = reward.stream("rollouts", RolloutGroup).consume("reward-a", count=3, block_ms=0)
    unparsed = next(d for d in reward.dead_letters() if d["stream"] == "rollouts")
    assert unparsed["reason"].startswith("unparseable") and unparsed["task_id"] == "train-1"
    for delivery in (altered, answer):
        reward.stream("rollouts", RolloutGroup).reject(delivery, "delivered 4 times (max 3)")
    # A reward-signed scored entry naming train-1 that does not parse: the learner's own letter names train-1.
    scored = reward.stream("scored", ScoredGroup)
    garbage = msgpack.packb({"rollout": {"task": {"task_id": "train-1"}}}, use_bin_type=True)
    service.work.pump()  # (the learner's read makes the stream and its group)
    service.redis.xadd(scored.key, {b"data": garbage, b"sig": scored.signature(garbage)})
    service.work.pump()
    assert any(d["stream"] == "scored" and d["task_id"] == "train-1" for d in service.streams.dead_letters())
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == ["train-0", "train-1"]
    assert service.work.assembler.stats.lost == 1  # train-2, by its own answer
    assert service.redis.xrange(prompts.key, min=copy, max=copy) == []  # the copy is deleted all the same
    assert service.redis.xrange(prompts.key, min=genuine[0], max=genuine[0])  # the genuine entry is still held
    assert service.redis.xlen(by_generator.key) == 0  # every parked rollout deleted


def test_a_dead_letter_of_a_scored_group_carries_no_ground_truth(settings):
    """Ground truth is for the reward role and the learner: the learner's letter of a group it refused keeps
    everything of the group but the task's ground truth (worker users of Redis 6.2 can read `dead`)."""
    service, issued = learner_that_issued(settings)
    refused = issued.model_copy(update={"prompt_token_ids": [7, 8]})  # does not match: refused for provenance
    produce_scored(service, settings, scored_group(refused, [True, False]))
    service.work.pump()
    (letter,) = service.streams.dead_letters()
    assert letter["reason"].startswith("provenance:")
    kept = msgpack.unpackb(letter["data"], raw=False)
    assert kept["rollout"]["task"]["ground_truth"] == "" and kept["rollout"]["task"]["task_id"] == "train-1"
    assert b"Answer: 2" in letter["data"] and service.work.issued_task("train-1").ground_truth == "2"


def test_a_task_whose_entry_a_worker_deleted_is_given_up_at_its_deadline(settings):
    """A worker can delete an entry it read (XDEL, a trim, a destroyed group): that task's group never comes. Past
    its deadline (learner/deadlines.py) it counts as lost, in the step and in a running evaluation alike, and is
    forgotten in `issued`, so a group that still comes is refused; a task that came back is not touched."""
    settings.learner.batch.task_deadline_min_s = 0.5
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    tasks = issue_tasks(service, 2)
    round_ = EvalRound(step=0, version=0, expected={"eval-0"})
    service.work.eval_round = round_  # as `evaluating` sets it
    service.work.push([PromptTask(task_id="eval-0", prompt_id="e0", prompt="2+2=", ground_truth="4", split="eval")])
    service.work.flush_outbox()
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    taken = {d.message.task_id: d for d in prompts.consume("gen", count=10, block_ms=0)}
    service.redis.xdel(prompts.key, taken["train-0"].id, taken["eval-0"].id)
    produce_scored(service, settings, scored_group(tasks[1], [True, False] * 8))
    service.work.pump()
    service.work.expire_overdue()
    assert sorted(service.work.assembler.in_flight) == ["train-0"]  # not late yet
    assert [task_id_of(group) for _, _, group in service.work.assembler.ready] == ["train-1"]
    time.sleep(0.6)
    service.work.expire_overdue()
    assert service.work.assembler.in_flight == {} and service.work.assembler.stats.lost == 1
    assert round_.lost == {"eval-0"} and round_.done
    assert service.work.issued_task("train-0") is None and service.work.issued_task("train-1") is not None
    produce_scored(service, settings, scored_group(tasks[0], [True, False] * 8))  # it came after all
    service.work.pump()
    assert service.streams.dead_letters()[0]["reason"].startswith("provenance: unknown task id 'train-0'")


def test_tasks_a_previous_learner_issued_are_forgotten_at_their_deadline_when_no_group_comes(settings):
    """A learner process that died left tasks in `issued` (and their entry ids): the next one gives each a deadline
    from its start. A group that comes in time is still trained; past the deadline the others are forgotten."""
    settings.learner.batch.task_deadline_min_s = 0.5
    first = LearnerService(settings)
    first.connect()
    tasks = issue_tasks(first, 2)
    entries = first.work.entry_ids_key
    assert sorted(first.redis.hkeys(entries)) == [b"train-0", b"train-1"]
    second = LearnerService(settings)  # the process after a crash
    second.connect()
    second.work.limit_vocabulary(100)
    second.work.restore(skip=set(), counted=set())
    generator_takes(settings, second.redis)
    produce_scored(second, settings, scored_group(tasks[1], [True, False] * 8))
    second.work.pump()
    time.sleep(0.6)
    second.work.expire_overdue()
    assert second.work.issued_task("train-0") is None and not second.redis.hexists(entries, "train-0")
    assert [task_id_of(group) for _, _, group in second.work.assembler.ready] == ["train-1"]


def test_streams_whose_last_id_a_worker_set_to_the_maximum_are_repaired_and_the_run_goes_on(settings):
    """A worker may XADD to a stream it writes with an explicit id; the largest possible one makes every later
    `XADD *` fail. The learner notices (on its next push, and every REPAIR_SCAN_SECONDS for every stream of the
    run), deletes what is dated in the future, sets the stream and its consumer groups back, and work flows again:
    the next task reaches the generators, the next scored group the learner."""
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    issue_tasks(service, 1)
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    assert [d.message.task_id for d in prompts.consume("gen", count=10, block_ms=0)] == ["train-0"]
    largest = "18446744073709551615-18446744073709551615"
    service.redis.xadd(prompts.key, {b"data": b"junk"}, id=largest)
    prompts.consume("gen", count=10, block_ms=0)  # the group has read past it now (it is dead-lettered)
    scored = reward_stream(service, settings)
    scored.produce(scored_group(PromptTask(task_id="x", prompt_id="x", prompt="x", ground_truth="0"), [True]))
    service.redis.xadd(scored.key, {b"data": b"junk"}, id=largest)
    with pytest.raises(redis.ResponseError):
        scored.produce(scored_group(PromptTask(task_id="y", prompt_id="y", prompt="y", ground_truth="0"), [True]))

    task = PromptTask(task_id="train-1", prompt_id="p1", prompt="1+1=", ground_truth="2")
    service.work.assembler.issued(["train-1"], 0)
    service.work.outbox.append(task)
    service.work.flush_outbox()  # refused by Redis: repaired, the task stays queued
    service.work.flush_outbox()
    assert [d.message.task_id for d in prompts.consume("gen", count=10, block_ms=0)] == ["train-1"]
    service.work._repaired_at = 0.0  # the periodic check, due now
    service.work.pump()
    late = PromptTask(task_id="train-2", prompt_id="p2", prompt="1+1=", ground_truth="2")
    service.work.assembler.issued(["train-2"], 0)
    service.work.outbox.append(late)
    service.work.flush_outbox()
    scored.produce(vouched(scored.streams, scored_group(late, [True, False] * 8)))
    service.work.pump()
    assert "train-2" not in service.work.assembler.in_flight  # its group came through the repaired stream
    assert service.redis.xrange(prompts.key, min=largest, max="+") == []


@pytest.mark.parametrize("attack", ["xclaim lastid", "xgroup create"])
def test_a_consumer_group_a_worker_moved_past_the_end_of_its_stream_is_set_back(settings, attack):
    """A worker may XCLAIM on the stream it reads, and make the next role's consumer group: with LASTID, or a group
    made at the largest id, the group's cursor lies past every id the stream will make, and XREADGROUP delivers
    nothing new for good (every task dies at its deadline, is pushed again, and is never delivered). The learner's
    periodic check sets the group back to its newest pending entry: what was pending stays with its consumer, what
    the attack skipped is delivered, once."""
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    largest = "18446744073709551615-18446744073709551615"
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    if attack == "xgroup create":  # before any group exists (a run's start)
        service.redis.delete(prompts.key)
        service.redis.xgroup_create(prompts.key, "generator", id=largest, mkstream=True)
    issue_tasks(service, 2)
    if attack == "xclaim lastid":
        (held,) = prompts.consume("gen-a", count=1, block_ms=0)
        service.redis.execute_command("XCLAIM", prompts.key, "generator", "spy", 0, "0-1", "JUSTID",  # none pending
                                      "LASTID", largest, parse_justid=True)
    assert prompts.consume("gen-b", count=10, block_ms=0) == []  # stalled
    service.work._repaired_at = 0.0  # the periodic check, due now
    service.work.pump()
    delivered = [d.message.task_id for d in prompts.consume("gen-b", count=10, block_ms=0)]
    assert delivered == (["train-1"] if attack == "xclaim lastid" else ["train-0", "train-1"])
    if attack == "xclaim lastid":
        assert prompts.ack(held)  # still its consumer's
    assert prompts.consume("gen-c", count=10, block_ms=0) == []  # nothing twice


def test_a_group_that_read_a_new_entry_during_the_check_is_not_set_back(settings, monkeypatch):
    """The check reads the stream's last id and its groups in two calls: an entry added and read between them put a
    legitimate group past the last id it had read, and the group was set back (the entry delivered twice)."""
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    issue_tasks(service, 1)
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    assert len(prompts.consume("gen-a", count=1, block_ms=0)) == 1
    injected = []

    def then_traffic(real):  # a push and a generator's read land between the check's two calls
        def call(key, *args, **kwargs):
            reply = real(key, *args, **kwargs)
            if key == prompts.key and not injected:
                injected.append(key)
                issue_tasks(service, 2)
                prompts.consume("gen-b", count=5, block_ms=0)
            return reply
        return call

    for name in ("xinfo_stream", "xinfo_groups"):
        monkeypatch.setattr(service.redis, name, then_traffic(getattr(service.redis, name)))
    assert service.streams.repair_future_ids(["prompts"]) == []


def test_no_re_split_splice_or_replay_of_a_signed_dead_letter_makes_a_task_lost(settings):
    """The attack on the old signature (stream, reason, data joined by newlines), with only Redis access: write a
    victim task's bytes unsigned into `prompts`, let a generator dead-letter them (a letter a service signed, but
    `forged:`, which the learner ignores), then move its text between fields, change any field, drop one, or copy in
    a letter of another run with the same token. None verifies: every victim stays in flight, still issued."""
    service = LearnerService(settings)
    service.connect()
    victims = issue_tasks(service, 2)
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    service.redis.xadd(prompts.key, {b"data": b"junk\n" + to_wire(victims[0])})  # unsigned: dead-lettered as forged
    assert [d.message.task_id for d in prompts.consume("gen", count=10, block_ms=0)] == ["train-0", "train-1"]
    dead_key = service.streams.key("dead")
    ((genuine_id, genuine),) = service.redis.xrange(dead_key)
    assert genuine[b"reason"] == b"forged: no signature"
    stream, reason = genuine[b"stream"], genuine[b"reason"]
    re_split = {**genuine, b"stream": stream + b"\n" + reason, b"reason": b"junk", b"data": to_wire(victims[0])}
    old_body = [b"stream", b"reason", b"data"]  # what the old signature covered, joined by newlines: the same bytes
    assert b"\n".join(re_split[k] for k in old_body) == b"\n".join(genuine[k] for k in old_body)
    variants = [
        re_split,
        {**genuine, b"reason": b"delivered 4 times (max 3)"},  # spliced
        {k: v for k, v in genuine.items() if k != b"reason"},  # a field left out
        {**genuine, b"entry_id": b"1-0"}, {**genuine, b"deliveries": b"9"},
        {**genuine, b"data": to_wire(victims[1])},
    ]
    other = Streams(service.redis, settings.model_copy(update={"redis": settings.redis.model_copy(
        update={"run": "other-run"})}), signs_as=ROLES)  # the same token: its letters are genuine there, not here
    other_prompts = other.stream("prompts", PromptTask)
    other_prompts.dead("1-0", to_wire(victims[1]), "delivered 4 times (max 3)", 4)
    variants += [fields for _, fields in service.redis.xrange(other.key("dead"))]
    for fields in variants:
        service.redis.xadd(dead_key, fields)
    assert [eid for eid, _ in service.streams.dead_letters_after("0-0")[1]] == [genuine_id.decode()]
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == ["train-0", "train-1"] and service.work.assembler.stats.lost == 0
    assert all(service.redis.hexists(service.work.issued_key, t.task_id) for t in victims)


def test_generators_get_no_ground_truth_the_issued_task_keeps_it(settings):
    service = LearnerService(settings)
    service.connect()
    task = PromptTask(task_id="train-0", prompt_id="p0", prompt="1+1=", ground_truth="2")
    service.work.outbox.append(task)
    service.work.flush_outbox()
    (delivery,) = service.streams.stream("prompts", PromptTask).consume("gen", count=10, block_ms=0)
    assert delivery.message == task.for_generators() and delivery.message.ground_truth == ""
    assert service.work.issued_task("train-0") == task  # where the reward workers read it


def test_a_dead_letter_whose_payload_went_to_a_file_still_names_its_task(settings):
    """A large payload is kept out of Redis (streams.dead_payload_max_bytes): the letter's signed task id still
    makes the learner stop waiting for the task."""
    streams = settings.streams.model_copy(update={"dead_payload_max_bytes": 0})
    settings = settings.model_copy(update={"streams": streams})
    service = LearnerService(settings)
    service.connect()
    issue_tasks(service, 1)
    prompts = Streams(service.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    (delivery,) = prompts.consume("gen", count=10, block_ms=0)
    prompts.dead(delivery.id, delivery.payload, "engine failure on this task alone: test")
    (letter,) = service.streams.dead_letters()
    assert letter["data"] == b"" and Path(letter["payload_file"]).read_bytes() == delivery.payload
    service.work.scan_dead_letters()
    assert not service.work.assembler.in_flight and service.work.assembler.stats.lost == 1


def test_a_workers_letter_no_learner_settled_is_settled_at_the_restart(settings, caplog):
    """A generator parks a task's entry with a dead letter just before the learner ends (or while it is down). The
    restarted learner reads on from the newest letter at its start, so it settles, at start, the letters of entries
    still parked: the task is given up at once (not at its deadline), the entry is not dead-lettered again as
    `unsettled`, and letters the last learner settled are not read again."""
    caplog.set_level("INFO", logger="learner.workset")
    first = LearnerService(settings)
    first.connect()
    issue_tasks(first, 3)
    prompts = Streams(first.redis, settings, signs_as=("generator",)).stream("prompts", PromptTask)
    deliveries = prompts.consume("gen", count=10, block_ms=0)
    prompts.dead(deliveries[0].id, deliveries[0].payload, "engine failure on this task alone: test")
    first.work.scan_dead_letters()  # settled by the first learner
    assert first.work.issued_task("train-0") is None
    prompts.dead(deliveries[1].id, deliveries[1].payload, "engine failure on this task alone: test")
    # the first learner ends before its next scan
    restarted = LearnerService(settings)
    restarted.connect()
    restarted.work.limit_vocabulary(100)
    restarted.work.scan_dead_letters()  # reads on from the newest letter: not this one
    assert restarted.work.issued_task("train-1") is not None and prompts.parked() == [deliveries[1].id]
    restarted.work.restore(skip=set(), counted=set())
    assert restarted.work.issued_task("train-1") is None and prompts.parked() == []
    assert restarted.work.issued_task("train-2") is not None
    assert any(r.getMessage().startswith("1 dead letters no learner had settled") for r in caplog.records)
    assert not [r for r in caplog.records if "retires no task" in r.getMessage()]


def test_the_learner_weighs_the_runs_keys_and_names_the_largest_when_redis_fills(settings, caplog, monkeypatch):
    """What fills Redis is on /metrics (bytes per stream and hash of the run) and, past 80 % of maxmemory, named in
    the log with its size, before writes are refused."""
    from services import metrics

    service = LearnerService(settings)
    service.connect()
    service.work.outbox.append(PromptTask(task_id="train-0", prompt_id="p0", prompt="x" * 200_000, ground_truth="2"))
    service.work.flush_outbox()
    sizes = service.work.weigh_keys()
    assert sizes["prompts"] > 200_000 and sizes["issued"] > 200_000 and sizes["scored"] < 200_000
    assert metrics.REDIS_KEY_MEMORY.labels("prompts")._value.get() == sizes["prompts"]
    assert not [r for r in caplog.records if "maxmemory" in r.getMessage()]
    monkeypatch.setattr(service.streams, "memory", lambda: (900 * 2**20, 1000 * 2**20))
    service.work.weigh_keys()
    (warning,) = [r.getMessage() for r in caplog.records if "maxmemory" in r.getMessage()]
    assert warning.startswith("Redis uses 90% of its maxmemory (1000 MB); the largest keys of this run: ")
    assert "prompts 0.2 MB" in warning or "issued 0.2 MB" in warning
    service.work.weigh_keys()  # once a minute
    assert len([r for r in caplog.records if "maxmemory" in r.getMessage()]) == 1


def test_a_stream_a_producer_overfilled_is_trimmed_when_redis_is_nearly_full(settings, caplog, monkeypatch):
    """A worker that XADDs past its stream's high-water mark (outside the scripts) fills Redis: past 95 % of
    maxmemory the learner trims such a stream back to what its producers may make it, names it and counts it; a
    stream within its limit, and `held`, are left alone; below 95 % nothing is trimmed."""
    from services import metrics

    service = LearnerService(settings)
    service.connect()
    flood = service.streams.key("rollouts")
    high_water = settings.streams.high_water
    for i in range(high_water + 40):
        service.redis.xadd(flood, {"data": b"x" * 100, "sig": b"-"})
    service.redis.xadd(service.streams.key("scored"), {"data": b"within its limit", "sig": b"-"})
    service.work.weigh_keys()
    assert service.redis.xlen(flood) == high_water + 40  # Redis is not full: nothing trimmed
    before = metrics.REDIS_TRIMMED.labels("rollouts")._value.get()
    monkeypatch.setattr(service.streams, "memory", lambda: (960 * 2**20, 1000 * 2**20))
    service.work.weigh_keys()
    assert service.redis.xlen(flood) == high_water and service.redis.xlen(service.streams.key("scored")) == 1
    assert metrics.REDIS_TRIMMED.labels("rollouts")._value.get() - before == 40
    assert any("trimmed 40 entries of rollouts" in r.getMessage() for r in caplog.records)


def test_a_write_refused_by_a_full_redis_waits_while_the_learner_frees_it(settings, redis_server, caplog):
    """A worker that floods its output stream (XADD outside the scripts) with large entries fills Redis to
    maxmemory with fewer entries than its high-water mark, and Redis refuses every write (OOM). A worker's write
    then waits, retrying, instead of failing; the learner's own next write trims the stream that fills Redis
    (RetryingRedis.on_full: its older half, as often as needed) and goes through, and then so does the worker's."""
    import threading

    import redis

    from services.redis_local import retrying

    service = LearnerService(settings)
    service.connect()
    raw = redis.Redis.from_url(redis_server.url)  # no retries: the flood itself
    flood = service.streams.key("rollouts")
    for _ in range(20):  # fewer than the high-water mark: nothing longer than its producers may make it
        raw.xadd(flood, {"data": b"x" * 100_000, "sig": b"-"})
    raw.config_set("maxmemory", service.streams.memory()[0] - 500_000)  # full: every write refused, none evicted
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.xadd(flood, {"data": b"x", "sig": b"-"})
    worker = retrying(redis.Redis.from_url(redis_server.url))  # a client of its own: no learner's hook
    done = threading.Event()
    thread = threading.Thread(target=lambda: (worker.xadd(service.streams.key("dead"), {"data": b"late"}), done.set()),
                              daemon=True)
    thread.start()
    assert not done.wait(1.0)  # refused, and retrying
    service.work.outbox.append(PromptTask(task_id="train-0", prompt_id="p0", prompt="1 + 1", ground_truth="2"))
    service.work.flush_outbox()  # refused at first: the learner trims the flood, and it goes through
    assert service.work.issued_task("train-0") is not None
    assert raw.xlen(flood) <= 10
    assert done.wait(10.0) and raw.xlen(service.streams.key("dead")) == 1
    thread.join()
    assert any("Redis is full" in r.getMessage() for r in caplog.records)
    assert any("trimmed" in r.getMessage() and "of rollouts" in r.getMessage() for r in caplog.records)


def test_a_learner_starts_on_a_redis_a_worker_filled_while_none_ran(settings, redis_server):
    """A flood that filled Redis while no learner ran: the learner's first writes (its lease, then its streams)
    free Redis first, as every write of the learner's does, instead of retrying until they give up."""
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    flood = Streams(raw, settings, signs_as=()).key("rollouts")
    for _ in range(40):  # 4 MB: a Redis of 4.5 MB holds a step of these settings' (1 MB of `held`)
        raw.xadd(flood, {"data": b"x" * 100_000, "sig": b"-"})
    raw.config_set("maxmemory", int(raw.info("memory")["used_memory"]) - 500_000)
    with pytest.raises(redis.exceptions.OutOfMemoryError):
        raw.set("any-write", "x")
    service = LearnerService(settings)
    service.claim_run()
    try:
        service.connect()
        assert service.lease.holder() == service.lease.instance and raw.xlen(flood) <= 20
    finally:
        service.release_run()


def test_a_learner_refuses_a_redis_too_small_for_a_step_and_checkpoints_early_under_memory_pressure(settings):
    """At start, a step of the largest groups beyond redis.held_memory_share of maxmemory is refused with the
    figures; running, Redis past that share makes the step's checkpoint due (it releases `held`)."""
    from learner.redis_budget import MB
    from services import metrics
    from services.errors import Unavailable

    batch = settings.learner.batch.model_copy(update={"prompts_per_step": 100_000})
    big = settings.model_copy(update={"learner": settings.learner.model_copy(update={"batch": batch})})
    with pytest.raises(Unavailable, match=r"Redis is too small for this run: one step's groups need up to 2,\d{3} MB "
                                          r"\(100000 x 0.02 MB\) in `held`, against 0.5 of Redis' maxmemory 1,024 MB"):
        LearnerService(big).connect()
    service = LearnerService(settings.model_copy(deep=True))
    service.connect()
    assert metrics.REDIS_MAXMEMORY._value.get() == 1024 * MB and metrics.REDIS_USED_MEMORY._value.get() > 0
    assert not service.held_memory_pressed()
    service.settings.redis.held_memory_share = 1e-6  # an empty Redis uses about a megabyte
    assert service.held_memory_pressed()


def test_a_learner_refuses_a_redis_that_evicts_keys_when_full(settings, redis_server):
    """A Redis of one's own with maxmemory-policy allkeys-lru accepts every write when full and deletes keys instead:
    `held`, `issued` and the streams' consumer groups vanished with no error anywhere."""
    import redis

    from services.errors import Unavailable

    raw = redis.Redis.from_url(redis_server.url)
    raw.config_set("maxmemory-policy", "allkeys-lru")
    try:
        with pytest.raises(Unavailable, match="maxmemory-policy allkeys-lru"):
            LearnerService(settings).connect()
    finally:
        raw.config_set("maxmemory-policy", "noeviction")
    LearnerService(settings).connect()


def test_a_group_whose_samples_the_trainer_cannot_use_is_refused_and_its_task_given_up(settings):
    """A sample with fewer logprobs than token ids would make every train step on it fail, at every restart (it
    stays held): refused on arrival, and its task is not waited for (no genuine group of it will come)."""
    service, issued = learner_that_issued(settings)
    short = scored_group(issued, [True, False])
    short.rollout.samples[0].logprobs.pop()
    produce_scored(service, settings, short)
    service.work.pump()
    service.work.scan_dead_letters()
    (dead,) = service.streams.dead_letters()
    assert dead["reason"] == "malformed: task train-1 sample 0 has 2 token ids and 1 logprobs"
    assert not service.work.assembler.ready and "train-1" not in service.work.assembler.in_flight
    assert service.redis.xlen(service.work.held.key) == 0


def test_a_signed_group_of_its_own_task_with_the_wrong_number_of_samples_gives_the_task_up(settings):
    """The generator that took the prompt answered it with n=3 samples for n=2 (version skew, an engine fault): no
    other group of the task will come, so the learner must not wait for one (an evaluation's drain would hang)."""
    service, issued = learner_that_issued(settings)
    produce_scored(service, settings, scored_group(issued, [True, False, False]))
    service.work.pump()
    service.work.scan_dead_letters()
    (dead,) = service.streams.dead_letters()
    assert dead["reason"] == "malformed: task train-1 asked for n=2 samples; the group has 3 samples and 3 scores"
    assert not service.work.assembler.ready and "train-1" not in service.work.assembler.in_flight


def test_a_signed_group_outside_the_bounds_is_dead_lettered_before_it_is_held(settings):
    """Token ids outside the vocabulary, more tokens than max_tokens, NaN logprobs: each would crash (or poison)
    the update. Refused on arrival with the reason, never held, and the task given up."""
    service, issued = learner_that_issued(settings)
    huge = scored_group(issued, [True, False])
    huge.rollout.samples[1].token_ids[0] = 10**9
    produce_scored(service, settings, huge)
    long = scored_group(issued, [True, False])
    long.rollout.samples[0].token_ids[:] = [1] * 1002
    long.rollout.samples[0].logprobs[:] = [-0.1] * 1002
    produce_scored(service, settings, long)
    nan = scored_group(issued, [True, False])
    nan.rollout.samples[0].logprobs[0] = float("nan")
    produce_scored(service, settings, nan)
    service.work.pump()
    service.work.scan_dead_letters()
    assert [d["reason"] for d in reversed(service.streams.dead_letters())] == [
        "malformed: task train-1 sample 1 token id 1000000000 at position 0 is outside the vocabulary [0, 100)",
        "malformed: task train-1 sample 0 has 1002 tokens, more than the task's max_tokens 64",
        "malformed: task train-1 sample 0 has a logprob that is not a finite number",
    ]
    assert not service.work.assembler.ready and "train-1" not in service.work.assembler.in_flight
    assert service.redis.xlen(service.work.held.key) == 0 and service.work.issued_task("train-1") is None


class FailingRanks:
    """The ranks of a learner whose update raises on a group (an embedding lookup out of range, say)."""

    world = 1

    def train_step(self, trainer, groups):
        raise IndexError("index out of range in self")


def test_a_group_that_crashes_the_update_is_quarantined_after_one_retry(settings):
    """An update that raises counts against its batch's groups in Redis; the restarted learner retries them once,
    then dead-letters them with the error instead of re-admitting them at every restart. A retry that goes
    through clears the count."""
    first, issued = learner_that_issued(settings)
    first.ranks = FailingRanks()
    produce_scored(first, settings, scored_group(issued, [True, False]))
    first.work.pump()
    assert first.redis.xlen(first.work.held.key) == 1

    def restart() -> LearnerService:
        service = LearnerService(settings)
        service.connect()
        service.work.limit_vocabulary(100)
        service.work.restore(skip=set(), counted=set())
        service.ranks = FailingRanks()
        return service

    def crash(service: LearnerService) -> None:
        batch = service.work.assembler.take_batch(0, partial=True)
        with pytest.raises(IndexError):
            service.train(batch)

    crash(first)
    retried = restart()  # the retry: re-admitted once
    assert [task_id_of(g) for _, _, g in retried.work.assembler.ready] == ["train-1"]
    assert not retried.streams.dead_letters()
    crash(retried)
    quarantined = restart()
    assert not quarantined.work.assembler.ready and quarantined.redis.xlen(quarantined.work.held.key) == 0
    (dead,) = quarantined.streams.dead_letters()
    assert dead["reason"] == ("quarantined: 2 updates failed with this group in their batch (the last: IndexError: "
                              "index out of range in self)")
    quarantined.work.scan_dead_letters()
    assert quarantined.work.issued_task("train-1") is None  # given up: the task is settled
    assert not quarantined.redis.exists(quarantined.work.suspects_key)


def test_an_update_out_of_memory_counts_against_no_group(settings):
    """Out of memory is the settings' fault (micro_batch_tokens too large for the card): counted against the
    groups, every batch would be quarantined in turn and its generation lost; the process ends, the groups wait."""
    import torch

    service, issued = learner_that_issued(settings)
    produce_scored(service, settings, scored_group(issued, [True, False]))
    service.work.pump()
    batch = service.work.assembler.take_batch(0, partial=True)
    for refusal in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
                    RuntimeError("[enforce fail at alloc_cpu.cpp:119] data. DefaultCPUAllocator: can't allocate "
                                 "memory: you tried to allocate 2147483648 bytes.")):
        service.ranks = SimpleNamespace(world=1, train_step=lambda trainer, groups: (_ for _ in ()).throw(refusal))
        with pytest.raises(type(refusal)):
            service.train(batch)
    assert not service.work.suspects and not service.redis.exists(service.work.suspects_key)


def test_an_update_that_goes_through_on_retry_clears_the_failure(settings):
    first, issued = learner_that_issued(settings)
    produce_scored(first, settings, scored_group(issued, [True, False]))
    first.work.pump()
    first.work.suspect(["train-1"], "RuntimeError: a transient fault")
    retried = LearnerService(settings)
    retried.connect()
    retried.work.limit_vocabulary(100)
    retried.work.restore(skip=set(), counted=set())
    assert retried.work.suspects == {"train-1"}

    class Ranks:
        def train_step(self, trainer, groups):
            return {"loss": 0.0}

    retried.ranks = Ranks()
    retried.train(retried.work.assembler.take_batch(0, partial=True))
    assert not retried.work.suspects and not retried.redis.exists(retried.work.suspects_key)


def test_a_version_published_before_redis_lost_it_is_not_reused(settings):
    # The crashed lineage published v4 (on disk) but Redis came back without its announcement: a fresh start or a
    # resume at v2 must not publish v2..v4 again, which generators holding v4 would ignore.
    service = LearnerService(settings)
    service.connect()
    service.publisher.publish({"w": torch.zeros(2)}, version=4)
    service.redis.delete(latest_key(service.streams.prefix))
    service.policy.current = 2
    service.ensure_monotonic_version()
    assert service.policy.current == 5 and service.policy.jumps == [(2, 5)]


def test_a_version_a_broadcast_round_streamed_before_its_announcement_is_not_reused(settings):
    """The learner was killed after a round streamed v6 into the engines but before v6's files and announcement: a
    resume at v2 publishes after v6 (the engines holding v6 ignore any version up to it)."""
    service = LearnerService(settings)
    service.connect()
    settings.weights.broadcast_port = 0  # any free one
    broadcaster = Broadcaster(settings, service.redis, service.publisher.signer, service.streams.prefix,
                              channel(service.streams.prefix))
    broadcaster.members = lambda: {"generator-0": 1}  # a member that then never joins: the round fails
    broadcaster.since = {"generator-0": 0.0}  # (as `members` records it)
    broadcaster.join_timeout_s = broadcaster.timeout_s = 0.5
    broadcaster.broadcast({"w": torch.zeros(2)}, version=6)
    service.policy.current = 2
    service.ensure_monotonic_version()
    assert service.policy.current == 7 and service.policy.jumps == [(2, 7)]


def test_tasks_lost_with_a_redis_crash_are_no_longer_waited_for(settings, redis_server):
    """A machine crash can cost Redis its last second of AOF: tasks pushed then (and their `issued` records,
    written atomically with them) are gone, and the learner stops waiting for them once it sees the restart."""
    service = LearnerService(settings)
    service.connect()
    written = (Path(settings.run_dir) / "config.yaml").read_text()
    assert redis_server.password in settings.redis.url.get_secret_value() and redis_server.password not in written
    tasks = [PromptTask(task_id=f"train-{i}", prompt_id=f"p{i}", prompt="1+1=", ground_truth="2") for i in range(3)]
    service.work.assembler.issued([t.task_id for t in tasks], 0)
    service.work.outbox.extend(tasks[:2])
    service.work.flush_outbox()
    service.work.outbox.append(tasks[2])  # still queued: never pushed, must not count as lost
    service.work.scan_dead_letters()  # learns the server's run id
    (entry_id, _), _ = service.redis.xrange(service.work.prompts.key)  # the crash lost train-0's push:
    service.redis.xdel(service.work.prompts.key, entry_id)
    service.redis.hdel(service.work.issued_key, "train-0")
    redis_server.stop(kill=True)
    redis_server.start()
    service.work.scan_dead_letters()
    assert sorted(service.work.assembler.in_flight) == ["train-1", "train-2"]
    assert service.work.assembler.stats.lost == 1


# -- the whole loop (slow) -------------------------------------------------------------------------------------
def flatten(prefix: str, tree: dict) -> dict[str, str]:
    """{"learner": {"port": 1}} -> {"DAPO_LEARNER__PORT": "1"}"""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}__{key.upper()}" if prefix else f"DAPO_{key.upper()}"
        if isinstance(value, dict):
            out.update(flatten(name, value))
        else:
            out[name] = json.dumps(value) if isinstance(value, (list, bool)) else str(value)
    return out


class Pipeline:
    """A Redis server, one generator and one reward worker; learners are started per test."""

    RUN = "lt"

    def __init__(self, root: Path):
        from services.keys import create_keys
        from services.redis_local import EmbeddedRedis

        self.root = root
        self.redis_server = EmbeddedRedis(root / "redis", aof=True).start()
        create_keys(root / "keys")  # every service has a run folder of its own: the role keys are shared
        self.processes: list[subprocess.Popen] = []
        self.logs = root / "logs"
        self.logs.mkdir()
        # One learner at a time, always on this port: the generator pulls from nowhere else (learner.public_url).
        self.learner_port = free_port()
        self.common = {
            "redis": {"url": self.redis_server.url, "run": self.RUN},
            "keys": {"dir": str(root / "keys")},
            # A SIGKILLed learner holds the run's lease one TTL: the restarted one waits that long (learner/lease.py).
            "learner": {"public_url": f"http://127.0.0.1:{self.learner_port}", "lease_ttl_s": 5},
            "streams": {"visibility_timeout_s": 30, "block_ms": 200, "high_water": 256},
            "token": "test-token-0123456789abcdef",
        }

    @property
    def redis(self):
        import redis

        return redis.Redis.from_url(self.redis_server.url)

    def env(self, tree: dict) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("DAPO_")}
        env.update(flatten("", self.common))
        env.update(flatten("", tree))
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env["DAPO_LOG_LEVEL"] = "INFO"
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def spawn(self, service: str, tree: dict, log_name: str) -> subprocess.Popen:
        log = open(self.logs / f"{log_name}.log", "ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "cli", service, "--config", "tiny-cpu"],
            cwd=REPO, env=self.env(tree), stdout=log, stderr=subprocess.STDOUT,
        )
        self.processes.append(process)
        return process

    def start_workers(self) -> None:
        self.generator_port = free_port()
        self.generator = self.spawn(
            "generator",
            {"run_dir": str(self.root / "generator"),
             "generator": {"port": self.generator_port, "tasks_per_batch": 16}},
            "generator",
        )
        self.reward = self.spawn(
            "reward", {"run_dir": str(self.root / "reward"), "reward": {"port": free_port(), "workers": 1}}, "reward"
        )

    def wait_ready(self, timeout: float = 900.0) -> None:
        """The generator's engine is up (its start is most of a minute alone, longer on a busy machine): the first
        test's learner must not spend its own time limit on it."""
        from generator.service import wait_ready

        if not wait_ready(f"http://127.0.0.1:{self.generator_port}", timeout):
            pytest.fail(f"the generator was not ready in {timeout:.0f}s:\n{self.tail('generator')}")

    def check_workers(self) -> None:
        for name, process in (("generator", self.generator), ("reward", self.reward)):
            if process.poll() is not None:
                pytest.fail(f"{name} exited with {process.returncode}:\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.logs / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def drain(self, timeout: float = 120.0) -> None:
        """Wait until no task is in the pipeline, then empty what the previous learner left behind."""
        r = self.redis
        key = lambda name: f"dapo:{self.RUN}:{name}"  # noqa: E731
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_workers()
            if r.xlen(key("prompts")) == 0 and r.xlen(key("rollouts")) == 0:
                break
            time.sleep(0.5)
        else:
            pytest.fail("the previous test's tasks did not drain")
        time.sleep(1.0)  # a group the reward worker is still writing
        for name in ("scored", "held"):
            if r.exists(key(name)):
                r.xtrim(key(name), maxlen=0)

    def learner(self, run_dir: Path, learner: dict, **sections) -> subprocess.Popen:
        # learner fields by name, each put in its section
        tree = {"run_dir": str(run_dir), **moved_keys({"learner": {"port": self.learner_port, **learner}}, warn=False),
                **sections}
        return self.spawn("learner", tree, f"learner-{run_dir.name}")

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self.redis_server.stop()


@pytest.fixture(scope="module")
def pipeline():
    from cli.bootstrap import ensure_model

    # services only look the model up; `dapo bootstrap` builds it
    ensure_model(load_settings("tiny-cpu"), progress=False)
    root = Path(tempfile.mkdtemp(prefix="dapo-lt-"))
    pipe = Pipeline(root)
    try:
        pipe.start_workers()
        pipe.wait_ready()
        yield pipe
    finally:
        pipe.close()
        shutil.rmtree(root, ignore_errors=True)


# Small: B = 4 prompts of n = 4 samples, at most 48 tokens, 3 steps; a short evaluation.
SMALL = {
    "sampling": {"n": 4, "max_tokens": 48},
    "eval_sampling": {"n": 2, "max_tokens": 48},
    "data": {"eval_size": 8},
}
LEARNER = {"prompts_per_step": 4, "mini_batches": 1, "total_steps": 3, "eval_every": 2, "checkpoint_every": 2,
           "batch_warmup_steps": 0}  # B from step 1 (the preset warms the batch up; tested on its own below)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_exit(pipe: Pipeline, process: subprocess.Popen, name: str, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while process.poll() is None:
        pipe.check_workers()
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"{name} did not finish in {timeout:.0f}s:\n{pipe.tail(name)}")
        time.sleep(0.5)
    return process.returncode


def run_learner(pipe: Pipeline, run_dir: Path, learner: dict, timeout: float = 240.0, **sections) -> int:
    pipe.drain()
    process = pipe.learner(run_dir, learner, **{**SMALL, **sections})
    return wait_exit(pipe, process, f"learner-{run_dir.name}", timeout)


def step_lines(records: list[dict]) -> list[dict]:
    return [r for r in records if r["step"] > 0]


def assert_trained_once(run_dir: Path) -> list[str]:
    ledger = read_jsonl(run_dir / LEDGER_FILE)
    trained = [t for line in ledger for t in line["trained"]]
    assert len(trained) == len(set(trained)), "a group was trained twice"
    return trained


@pytest.mark.slow
def test_synchronous_steps(pipeline, tmp_path):
    run_dir = tmp_path / "sync"
    code = run_learner(pipeline, run_dir, {**LEARNER, "max_staleness": 0})
    assert code == 0, pipeline.tail(f"learner-{run_dir.name}")
    records = read_jsonl(run_dir / METRICS_FILE)
    steps = step_lines(records)
    assert [r["step"] for r in steps] == [1, 2, 3]
    baseline = records[0]
    assert baseline["step"] == 0 and 0.0 <= baseline["eval_accuracy"] <= 1.0 and baseline["eval_samples"] == 16
    for before, r in zip([baseline] + steps, steps):
        assert r["groups_trained"] == 4 and not r["refill_limit_hit"]
        assert r["version"] == before["version"] + 1  # one update, one published version per step
        assert r["staleness"] == 0.0  # on-policy: every group sampled by the version it trains
        assert r["reward_all"] is not None and r["reward_trained"] is not None and r["lr"] > 0
        assert 0 < r["informative_ratio"] <= 1
        for key in ("entropy", "clip_frac_low", "clip_frac_high", "response_length", "step_seconds",
                    "tokens_per_second", "refills", "stale_dropped", "time", "accuracy_train"):
            assert r[key] is not None, key
        # where the step went (learner/records.py PHASES)
        assert r["wait_generation_seconds"] + r["wait_verification_seconds"] == pytest.approx(r["wait_seconds"])
        assert 0 < r["forward_seconds"] + r["backward_seconds"] + r["optimizer_seconds"] <= r["train_seconds"]
        assert r["publish_seconds"] > 0 and r["learner_idle_seconds"] >= r["wait_seconds"]
        # synchronous: the step delivers its own version before it goes on
        assert [d["delivered_version"] for d in r["deliveries"]] == [r["delivered_version"]] == [r["version"]]
        assert 0 < r["delivery_seconds"] <= r["publish_seconds"]
        assert r["publish_bytes"] > 0 and r["publish_gather_seconds"] < r["publish_seconds"]
        assert r["world_size"] == 1
    # the generator worked for these steps (its first group only set its baseline)
    assert sum(r["generator_busy_seconds"] for r in steps) > 0
    assert steps[1]["eval_accuracy"] is not None and steps[2]["eval_accuracy"] is not None  # every 2 and the end
    assert steps[0]["eval_accuracy"] is None and "eval_drain_seconds" not in steps[0]
    assert steps[1]["eval_drain_seconds"] >= 0 and steps[1]["learner_idle_seconds"] >= steps[1]["eval_seconds"]
    assert len(assert_trained_once(run_dir)) == 12
    assert (run_dir / "config.yaml").is_file()
    assert (run_dir / "checkpoints" / "latest").read_text() == "step-3"
    assert (run_dir / "weights" / f"v{steps[-1]['version']}" / "model.safetensors.index.json").is_file()


@pytest.mark.slow
def test_asynchronous_steps(pipeline, tmp_path):
    run_dir = tmp_path / "async"
    code = run_learner(pipeline, run_dir, {**LEARNER, "max_staleness": 1, "eval_every": 0, "total_steps": 4})
    assert code == 0, pipeline.tail(f"learner-{run_dir.name}")
    steps = step_lines(read_jsonl(run_dir / METRICS_FILE))
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["groups_trained"] == 4 for r in steps)
    assert all(0.0 <= r["staleness"] <= 1.0 for r in steps)
    assert all(r["eval_accuracy"] is None for r in steps)
    assert len(assert_trained_once(run_dir)) == 16
    # generation overlapped training: some groups were sampled by the previous version
    assert any(r["staleness"] > 0 for r in steps), [r["staleness"] for r in steps]
    # and publishing overlapped the next step (weights.overlap_delivery, on by default): each step's record reports
    # the delivery of the version before its own, which ended in the background; the last step delivers its own
    # before the learner ends, after the one before it (that step's record lists both)
    versions = [r["version"] for r in steps]
    delivered = [[d["delivered_version"] for d in r.get("deliveries", [])] for r in steps]
    assert delivered == [[], versions[:1], versions[1:2], versions[2:]]
    assert all(d["delivery_seconds"] > 0 for r in steps for d in r.get("deliveries", []))
    assert "announce_wait_seconds" in steps[-1] and "announce_wait_seconds" not in steps[0]
    announced = json.loads(pipeline.redis.get(latest_key(f"dapo:{Pipeline.RUN}:")))
    assert announced["version"] == steps[-1]["version"]


@pytest.mark.slow
def test_batch_warm_up_grows_the_batch_and_a_resume_goes_on_where_it_left_it(pipeline, tmp_path):
    run_dir = tmp_path / "warm-up"
    warm = {**LEARNER, "batch_warmup_steps": 3, "max_staleness": 1, "eval_every": 0, "checkpoint_every": 1}
    assert run_learner(pipeline, run_dir, {**warm, "total_steps": 1}) == 0, pipeline.tail(f"learner-{run_dir.name}")
    # resumed with 2 updates a step: an update setting outside the recipe may change, and the log says so
    assert run_learner(pipeline, run_dir, {**warm, "total_steps": 4, "mini_batches": 2}) == 0, \
        pipeline.tail(f"learner-{run_dir.name}")
    assert "other update settings than its checkpoint's, from step 2 on: learner.batch.mini_batches 1 -> 2" in \
        (pipeline.logs / f"learner-{run_dir.name}.log").read_text(errors="replace")
    steps = step_lines(read_jsonl(run_dir / METRICS_FILE))
    # B_t = ceil(4 t / 3): 2, 3, then 4; the restart after step 1 resumes at step 2's target, not step 1's
    assert [(r["step"], r["groups_trained"]) for r in steps] == [(1, 2), (2, 3), (3, 4), (4, 4)]
    assert len(assert_trained_once(run_dir)) == 13


LIMIT = {**LEARNER, "eval_every": 0, "total_steps": 2, "max_refills": 0,
         # at most 2 prompts per step (factor 0.5, no refill): the batch of 4 can never fill
         "oversample_min": 0.5, "oversample_max": 0.5}


@pytest.mark.slow
def test_refill_limit_stop_exits_with_a_clear_error_and_stays_stopped_and_train_trains_on_what_is_in_hand(
        pipeline, tmp_path):
    """on_refill_limit stop: exit 3, the run stays stopped when restarted as it was; train (the same run folder,
    restarted under it): each step trains on what is in hand. One run folder serves both (a learner start costs
    most of the time)."""
    run_dir = tmp_path / "limit-stop"
    code = run_learner(pipeline, run_dir, {**LIMIT, "on_refill_limit": "stop"})
    assert code == 3
    assert "informative groups after 0 refill rounds" in pipeline.tail(f"learner-{run_dir.name}")
    assert step_lines(read_jsonl(run_dir / METRICS_FILE)) == []
    assert Checkpoints(run_dir).recorded_stop()["step"] == 0
    # Restarted (Compose's `restart: on-failure`): the run is over, as after total_steps.
    log = pipeline.logs / f"learner-{run_dir.name}.log"
    before = log.stat().st_size
    assert run_learner(pipeline, run_dir, {**LIMIT, "on_refill_limit": "stop"}) == 0
    assert "it stays stopped" in log.read_bytes()[before:].decode(errors="replace")
    assert step_lines(read_jsonl(run_dir / METRICS_FILE)) == []
    # Under a setting that would not have stopped there, the run goes on from its checkpoint, past the stop, and
    # each step trains on what is in hand.
    assert run_learner(pipeline, run_dir, {**LIMIT, "on_refill_limit": "train"}) == 0
    steps = step_lines(read_jsonl(run_dir / METRICS_FILE))
    assert [r["step"] for r in steps] == [1, 2]
    assert not (run_dir / CHECKPOINTS / STOPPED).exists()
    assert all(r["refill_limit_hit"] and r["refills"] == 0 and r["groups_trained"] <= 2 for r in steps)
    assert all(r["groups_scored"] == 2 for r in steps)
    for before, r in zip(steps, steps[1:]):
        assert r["version"] == before["version"] + (1 if r["groups_trained"] else 0)


def held_task_ids(pipe: Pipeline) -> list[str]:
    rows = pipe.redis.xrange(f"dapo:{Pipeline.RUN}:held")
    return [task_id_in_payload("held", fields[b"data"]) for _, fields in rows]


@pytest.mark.slow
def test_resume_after_sigkill_trains_every_group_once(pipeline, tmp_path):
    run_dir = tmp_path / "resume"
    total = 6
    learner = {**LEARNER, "max_staleness": 1, "eval_every": 0, "total_steps": total, "checkpoint_every": 2}
    pipeline.drain()
    first = pipeline.learner(run_dir, learner, **SMALL)
    deadline = time.monotonic() + 240
    # Kill once a step after the latest checkpoint (step 3, or 5 if the learner got there first) is trained: that
    # step is lost and trained again. The learner is frozen (SIGSTOP) while the files are read, so what is read is
    # what the kill leaves; a moment right after a checkpoint, with nothing trained since, is let go on.
    while True:
        pipeline.check_workers()
        assert first.poll() is None, pipeline.tail("learner-resume")
        assert time.monotonic() < deadline, pipeline.tail("learner-resume")
        first.send_signal(signal.SIGSTOP)
        latest = run_dir / "checkpoints" / "latest"
        checkpoint_step = int(latest.read_text().split("-")[1]) if latest.exists() else 0
        before = read_jsonl(run_dir / LEDGER_FILE)
        if checkpoint_step >= 2 and any(line["step"] > checkpoint_step for line in before):
            break
        first.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    first.send_signal(signal.SIGKILL)
    first.wait()
    assert checkpoint_step < total
    trained_after_checkpoint = [t for line in before if line["step"] > checkpoint_step for t in line["trained"]]
    state = run_dir / "checkpoints" / f"step-{checkpoint_step}" / "trainer_state.json"
    checkpoint = json.loads(state.read_text())["extra_state"]
    held_at_kill = set(held_task_ids(pipeline))
    assert set(trained_after_checkpoint) <= held_at_kill  # trained after the checkpoint: still held
    assert not held_at_kill & set(checkpoint["consumed"])  # consumed by the checkpoint: released
    announced_before = json.loads(pipeline.redis.get(f"dapo:{Pipeline.RUN}:weights:latest"))["version"]

    second = pipeline.learner(run_dir, learner, **SMALL)  # no drain: the pipeline keeps its in-flight tasks
    assert wait_exit(pipeline, second, "learner-resume", 240) == 0, pipeline.tail("learner-resume")
    log = pipeline.tail("learner-resume", 400)
    assert "resuming from" in log and f"step {checkpoint_step}" in log
    steps = step_lines(read_jsonl(run_dir / METRICS_FILE))
    assert [r["step"] for r in steps] == list(range(1, total + 1))  # the lost step was cut and redone
    # versions stay monotonic: generators load the restored policy
    assert steps[checkpoint_step]["version"] > announced_before
    trained = assert_trained_once(run_dir)
    ledger = read_jsonl(run_dir / LEDGER_FILE)
    dropped = {t for line in ledger for k in line if k.startswith(("dropped_", "stale_")) for t in line[k]}
    consumed = set(trained) | dropped
    held_at_end = set(held_task_ids(pipeline))
    lost = held_at_kill - consumed - held_at_end
    assert not lost, f"held groups neither trained, dropped nor still held: {sorted(lost)}"
    assert set(trained_after_checkpoint) <= consumed | held_at_end
    # the groups of the lost step came back from `held` and were trained by the restored model
    assert set(trained_after_checkpoint) & set(trained), "no group of the lost step was trained again"


@pytest.mark.slow
def test_http_while_running_and_sigterm_checkpoints_then_exits(pipeline, tmp_path):
    import httpx

    run_dir = tmp_path / "term"
    port = pipeline.learner_port
    pipeline.drain()
    process = pipeline.learner(run_dir, {**LEARNER, "eval_every": 0, "total_steps": 100,
                                         "checkpoint_every": 0}, **SMALL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while not read_jsonl(run_dir / LEDGER_FILE):
        assert process.poll() is None and time.monotonic() < deadline, pipeline.tail("learner-term")
        time.sleep(0.2)
    assert httpx.get(f"{base}/readyz").status_code == 200
    assert httpx.get(f"{base}/v1/status").status_code == 401  # it describes the run: the token's holders only
    auth = {"Authorization": f"Bearer {pipeline.common['token']}"}
    status = httpx.get(f"{base}/v1/status", headers=auth).json()
    assert status["ready"] and status["step"] >= 1 and status["total_steps"] == 100
    assert httpx.get(f"{base}/v1/weights/latest").status_code == 401  # the token guards the weights
    latest = httpx.get(f"{base}/v1/weights/latest", headers=auth).json()
    # the current version may still await its gather, and the one before it its delivery in the background
    assert latest["version"] >= status["version"] - 2
    assert "dapo_learner_step" in httpx.get(f"{base}/metrics").text
    process.send_signal(signal.SIGTERM)
    assert wait_exit(pipeline, process, "learner-term", 120) == 128 + signal.SIGTERM, pipeline.tail("learner-term")
    last_step = read_jsonl(run_dir / METRICS_FILE)[-1]["step"]
    assert 1 <= last_step < 100
    # the last step's version announced before the end (in the record too, unless the signal came after its step)
    announced = json.loads(pipeline.redis.get(latest_key(f"dapo:{Pipeline.RUN}:")))
    assert announced["version"] == read_jsonl(run_dir / METRICS_FILE)[-1]["version"]
    assert (run_dir / "checkpoints" / "latest").read_text() == f"step-{last_step}"  # checkpoint_every 0: SIGTERM's
    assert "stopped by signal" in pipeline.tail("learner-term")


def test_starting_over_trains_nothing_of_the_run_before(settings):
    """`resume: false` (what a refused recipe change advises): the run before's held groups, its issued tasks (a
    group of one still in the pipeline) and the prompts waiting in its streams must not train in the new run."""
    service, issued = learner_that_issued(settings)
    produce_scored(service, settings, scored_group(issued, [True, False]))
    service.work.pump()
    assert service.redis.xlen(service.work.held.key) == 1
    old = PromptTask(task_id="train-2", prompt_id="p2", prompt="1+1=", prompt_token_ids=[5, 6], ground_truth="2",
                     sampling=SamplingParams(n=2, max_tokens=8))
    service.work.outbox.append(old)
    service.work.flush_outbox()
    service.work.forget_run()
    assert service.redis.xlen(service.work.held.key) == 0 and service.redis.xlen(service.work.prompts.key) == 0
    assert service.work.issued_task("train-2") is None
    fresh = LearnerService(settings)
    fresh.connect()
    fresh.work.limit_vocabulary(100)
    fresh.work.restore(skip=set(), counted=set())
    produce_scored(fresh, settings, scored_group(old, [True, False]))  # the old run's group, late
    fresh.work.pump()
    assert not fresh.work.assembler.ready
    assert [d["reason"] for d in fresh.streams.dead_letters()] == [
        "provenance: unknown task id 'train-2' (not issued by this run's learner)"]


def test_the_stream_gauges_are_read_while_nothing_pumps(settings, monkeypatch):
    """An update of a large model takes an hour with no pump: the depths come from a thread of their own."""
    from prometheus_client import REGISTRY

    import learner.service

    monkeypatch.setattr(learner.service, "STREAM_GAUGES_S", 0.05)
    service, _ = learner_that_issued(settings)
    service.export_stream_gauges()
    try:
        deadline = time.monotonic() + 10
        while REGISTRY.get_sample_value("dapo_stream_depth", {"stream": "prompts"}) != 1.0:
            assert time.monotonic() < deadline, "no depth read"
            time.sleep(0.05)
        service.streams.stream("prompts", PromptTask).produce(
            PromptTask(task_id="extra", prompt_id="x", prompt="x", ground_truth=""))
        while REGISTRY.get_sample_value("dapo_stream_depth", {"stream": "prompts"}) != 2.0:
            assert time.monotonic() < deadline, "the depth was not read again"
            time.sleep(0.05)
    finally:
        service.stop_http()


def test_a_group_scored_under_other_reward_settings_is_refused_and_its_task_given_up(settings):
    """A reward worker started with another overlong buffer (or the punishment off, or the other answer rule) would
    train the policy on another reward than the run's: refused on arrival with both rewards named."""
    service, issued = learner_that_issued(settings)
    other = scored_group(issued, [True, False])
    other.scores[0] = other.scores[0].model_copy(update={"reward": 0.5})  # the penalty of another buffer
    produce_scored(service, settings, other)
    service.work.pump()
    service.work.scan_dead_letters()
    (dead,) = service.streams.dead_letters()
    assert dead["reason"].startswith("misscored: task train-1 sample 0 has the reward 0.5 for a correct 2-token "
                                     "response (max_tokens 64); these reward settings give 1 (soft_overlong")
    assert not service.work.assembler.ready and "train-1" not in service.work.assembler.in_flight
    assert service.redis.xlen(service.work.held.key) == 0


def test_groups_in_hand_survive_a_redis_clock_stepped_back(settings):
    """Only workers' streams can hold an id a client chose. `held` is the learner's alone: after the Redis host's
    clock stepped back (NTP, a VM restored) its entries look dated in the future, and the periodic repair must not
    delete them with the groups they hold."""
    service, issued = learner_that_issued(settings)
    produce_scored(service, settings, scored_group(issued, [True, False]))
    service.work.pump()
    (entry_id, fields), = service.redis.xrange(service.work.held.key)
    seconds, _ = service.redis.time()
    ahead = f"{(int(seconds) + 3600) * 1000}-0"  # made an hour before the clock went back an hour
    service.redis.xadd(service.work.held.key, fields, id=ahead)
    service.redis.xdel(service.work.held.key, entry_id)
    service.work._repaired_at = 0.0  # the periodic check, due now
    service.work.pump()
    assert [eid.decode() for eid, _ in service.redis.xrange(service.work.held.key)] == [ahead]


def test_a_previous_learners_tasks_count_as_expired_and_those_in_hand_are_not_waited_for(settings):
    """After a restart the tasks a previous process issued get a deadline from the start: past it, each is counted
    in dapo_learner_tasks_expired_total (no step of this process awaited it, but it is lost all the same); a task
    whose group the previous process left in `held` came back, and has no deadline to pass."""
    settings.learner.batch.task_deadline_min_s = 0.5
    first, issued = learner_that_issued(settings)
    produce_scored(first, settings, scored_group(issued, [True, False]))
    first.work.pump()  # train-1: its group in `held`
    issue_tasks(first, 1)  # train-0: no group will come
    second = LearnerService(settings)  # the process after a crash
    second.connect()
    second.work.limit_vocabulary(100)
    second.work.restore(skip=set(), counted=set())
    generator_takes(settings, second.redis)
    from services import metrics

    before = metrics.LEARNER_TASKS_EXPIRED._value.get()
    time.sleep(0.6)
    second.work.expire_overdue()
    assert metrics.LEARNER_TASKS_EXPIRED._value.get() - before == 1
    assert second.work.issued_task("train-0") is None and second.work.issued_task("train-1") == issued


def test_a_release_redis_lost_with_its_last_second_is_done_again_when_the_restart_is_seen(settings):
    """A checkpoint's release deletes the groups it lists from `held`; a Redis host crash can lose that with the
    AOF's last second. No later checkpoint lists them, so a later resume would train them again: the learner deletes
    them again when it sees the restart."""
    service, issued = learner_that_issued(settings)
    produce_scored(service, settings, scored_group(issued, [True, False]))
    service.work.pump()
    (_, fields), = service.redis.xrange(service.work.held.key)
    service.work.check_redis_restart()  # the server as it is now
    service.work.consumed(["train-1"])
    assert service.work.release() == 1
    service.redis.xadd(service.work.held.key, fields)  # the deletion lost: the AOF kept the group
    service.work._redis_run_id = "a server before the crash"
    service.work.check_redis_restart()
    assert service.redis.xlen(service.work.held.key) == 0


def test_tasks_in_flight_survive_a_redis_clock_stepped_back(settings, monkeypatch):
    """A Redis clock stepped back an hour leaves every entry made before it an hour ahead of the clock: honest,
    since the learner had read the clock that far; only ids past the latest time it read (and the tolerance) are a
    client's choice, repaired."""
    service = LearnerService(settings)
    service.connect()
    issue_tasks(service, 1)
    service.streams.future_horizon_ms()  # the learner's scans read the clock all along
    seconds, micros = service.redis.time()
    monkeypatch.setattr(service.streams.redis, "time", lambda: (seconds - 3600, micros))
    assert service.streams.repair_future_ids(["prompts"]) == []
    assert service.redis.xlen(service.work.prompts.key) == 1
    forged = f"{(seconds + 600) * 1000}-0"  # ten minutes past any time the clock read
    service.redis.xadd(service.work.prompts.key, {b"data": b"junk"}, id=forged)
    assert service.streams.repair_future_ids(["prompts"]) == ["prompts"]
    assert service.redis.xlen(service.work.prompts.key) == 1
    # a learner started after the step (a restart, a lease lost) knows how far the clock had read all the same
    monkeypatch.setattr(type(service.streams.redis), "time", lambda client: (seconds - 3600, micros))
    restarted = LearnerService(settings)
    restarted.connect()
    assert restarted.streams.repair_future_ids(["prompts"]) == []
    assert restarted.redis.xlen(restarted.work.prompts.key) == 1
