"""The learner's step loop with its pipeline stood in for (learner/service.py `run_step`): a stand-in trainer and
ranks, and one stand-in for generators and reward workers that answers every pushed prompt. What is under test is
the loop's own order: which version the tasks it pushes ask for, and what it pushes when."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from signing import vouched

from learner.checkpoint import FORMAT, TRAINER_STATE, complete
from learner.service import LearnerService, TrainProblems
from services.data import Problem
from services.messages import PromptTask, RolloutGroup, Sample, Score, ScoredGroup, from_wire
from services.streams import Streams


class StandInRanks:
    """Trains nothing: records the task ids of each update."""

    world = 1

    def __init__(self):
        self.updates = []

    def train_step(self, trainer, groups):
        self.updates.append([g.rollout.task.task_id for g in groups])
        return {"loss": 0.0}

    def weights(self, trainer):
        return {"w": torch.zeros(4)}

    def save(self, trainer, path, extra):
        Path(path).mkdir(parents=True, exist_ok=True)
        (Path(path) / TRAINER_STATE).write_text(json.dumps({"format": FORMAT, "extra_state": extra}))

    def load(self, trainer, path):
        return json.loads((complete(Path(path)) / TRAINER_STATE).read_text())["extra_state"]

    def stop(self):
        pass

    def keepalive(self):
        pass


def looping_learner(settings, steps: int, **batch) -> tuple[LearnerService, list[tuple[int, int, int]]]:
    """A learner of `steps` steps whose pushed prompts are answered at once by the newest version announced (six in
    ten informative), as generators that take each task when it is pushed. Returns it and the pushes it makes:
    (its policy version at the push, the tasks' min_version, how many, in a step's collect or ahead of its update)."""
    settings.learner.total_steps, settings.learner.eval_every = steps, 0
    settings.learner.checkpoints.every = 0
    for key, value in {"prompts_per_step": 8, "warmup_steps": 0, **batch}.items():
        setattr(settings.learner.batch, key, value)
    service = LearnerService(settings)
    service.connect()
    service.work.limit_vocabulary(100)
    service.train_problems = TrainProblems([Problem(id=str(i), problem=f"{i}+0=?", answer=str(i))
                                            for i in range(400)], seed=1)
    service.prompt_builder = lambda problem: (problem.problem, [5, 6])
    service.eval_problems, service.trainer, service.ranks = [], object(), StandInRanks()
    pipeline = Streams(service.redis, settings, signs_as=("reward", "generator"))
    scored, prompts_key, answered = pipeline.stream("scored", ScoredGroup), service.streams.key("prompts"), [0]

    def answer() -> None:
        for entry_id, fields in service.redis.xrange(prompts_key):
            service.redis.xdel(prompts_key, entry_id)
            issued = service.work.issued_task(from_wire(PromptTask, fields[b"data"]).task_id)
            if issued is None:
                continue
            answered[0] += 1
            correct = [i % 2 == 0 for i in range(issued.sampling.n)] if answered[0] % 10 < 6 else [True] * 2
            samples = [Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], text="x", finish_reason="stop")] * len(correct)
            scores = [Score(reward=1.0 if c else -1.0, correct=c, overlong=False, rule="answer_line") for c in correct]
            group = RolloutGroup(task=issued, policy_version=max(service.announced, issued.min_version),
                                 generator_id="g", samples=samples)
            scored.produce(vouched(pipeline, ScoredGroup(rollout=group, scores=scores)))

    flush, pushes, collecting = service.work.flush_outbox, [], [False]
    service.work.flush_outbox = lambda: (flush(), answer())
    push, collect = service.push_train, service.collect

    def recorded(plan):
        if plan.count:
            at = service.policy.current
            pushes.append((at, min(at, service.announced), plan.count, "collect" if collecting[0] else "ahead"))
        push(plan)

    def collected():
        collecting[0] = True
        try:
            return collect()
        finally:
            collecting[0] = False

    service.push_train, service.collect = recorded, collected
    return service, pushes


def test_the_prompts_pushed_ahead_ask_for_the_version_the_next_step_can_train(settings, monkeypatch):
    """max_staleness 1, the version delivered in the background (weights.overlap_delivery) and slower than the
    collect: prompts pushed ahead of the update asked for the version before, were sampled by it at once, and
    came back two versions old at the next step, always dropped as stale."""
    service, pushes = looping_learner(settings, steps=6, max_staleness=1)
    assert service.overlap_publish
    deliver = service.deliver

    def slow(weights, version, **kwargs):
        if version > 0:
            time.sleep(0.3)
        return deliver(weights, version, **kwargs)

    monkeypatch.setattr(service, "deliver", slow)
    assert service.run() == 0
    rows = [json.loads(line) for line in (Path(settings.run_dir) / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 7))
    ahead = [(at, asked) for at, asked, _, when in pushes if when == "ahead"]
    assert ahead and all(asked == at for at, asked in ahead)  # not the version before: trained at v+1, lag 1
    assert sum(row["stale_dropped"] for row in rows) <= sum(count for *_, count, _ in pushes) // 4


def test_the_last_step_pushes_nothing_ahead_for_a_step_that_never_comes(settings):
    service, pushes = looping_learner(settings, steps=3, max_staleness=1)
    assert service.run() == 0
    assert [at for at, _, _, when in pushes if when == "ahead"] == [0, 1]  # steps 1 and 2 for the next; 3 none
