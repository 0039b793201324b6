"""`dapo learner`: the training loop around the DAPO update, and the learner's HTTP app (weights, health, metrics).

One step:
  1. collect: push prompt tasks sized by the batch assembler (learner/batch.py), read scored groups, keep the
     informative fresh ones, refill until B are in hand (or the refill limit: train on what is in hand, or stop);
  2. with max_staleness > 0, push the next step's prompts now, so generation overlaps training;
  3. train (learner/trainer.py), publish the new weights (services/weights.py), generators pull them;
  4. evaluate every eval_every steps (and at step 0 and at the end), write {run_dir}/metrics.jsonl;
  5. checkpoint every checkpoint_every steps (and at the end, and on SIGTERM).

Exactly-once training across crashes. A scored group the learner keeps is moved atomically from `scored` into
the durable stream `dapo:{run}:held` (ack + XADD in one script), so nothing stays pending for long. `held` is
the working set: groups in hand, carried, and consumed since the last checkpoint. A checkpoint lists the task ids
consumed (trained, or aged out) since the previous one; once it is written those entries are deleted from `held`.
On resume: load the checkpoint, read `held`, delete the entries the checkpoint lists (a crash between writing it
and deleting them), re-admit the rest. Groups trained after the checkpoint are re-admitted and trained again by
the restored model, so the surviving lineage trains each group once; metrics.jsonl and ledger.jsonl are cut
back to the checkpoint's step so they describe that lineage. Task ids are deduplicated on every admission.

Provenance. The learner trains only what it asked for: every task it pushes is recorded first in the hash
`dapo:{run}:issued` (task id -> the task as sent), which lives in Redis and so survives a learner restart. A
scored group whose task id is not there, or whose task or rollout does not match the issued task (prompt,
token ids, sampling, n samples and n scores), goes to `dead` with the reason (`provenance: ...`). Entries are
removed once the group is settled (dropped, evaluated, or trained and checkpointed). Task and record are
written in one script, so after a Redis restart the tasks in flight missing from `issued` were lost with it.

Versions stay monotonic across a resume: if generators were told of a version newer than the checkpoint's (a
lineage the crash discarded), the restored policy is published as the next version after it, so that every
generator loads it (they ignore older announcements) and staleness is still measured in versions.

Files under run_dir: config.yaml (resolved settings), metrics.jsonl (one object per step), ledger.jsonl (task ids
trained and dropped per step), checkpoints/step-N and checkpoints/latest, weights/vN (services/weights.py).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any, Iterator

import msgpack

from learner.batch import Batch, BatchAssembler, Push, RefillLimitReached, task_id_of
from learner.evaluation import EvalRound
from learner.tracking import Tracking
from services import metrics
from services.config import Settings, dump_settings
from services.data import Problem, load_problems, render_prompt
from services.messages import PromptTask, SamplingParams, ScoredGroup, from_wire
from services.http import BackgroundServer, create_app
from services.models import model_dir
from services.redis_local import connect, wait_for_redis, without_password
from services.startup import raise_stopped
from services.streams import FIELD, Delivery, Streams, consumer_name
from services.weights import WeightPublisher, latest_announcement, weights_router
from services.weights_layout import write_atomic

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
LATEST = "latest"
METRICS_FILE = "metrics.jsonl"
LEDGER_FILE = "ledger.jsonl"
HELD = "held"
ISSUED = "issued"
EXIT_REFILL_LIMIT = 3
CONSUME_BATCH = 64
DEAD_SCAN_SECONDS = 1.0
PROGRESS_LOG_SECONDS = 30.0


# -- small pure helpers ----------------------------------------------------------------------------------------
def data_spec(value: str, split: str) -> str:
    """`synthetic` means the split of the built-in task; anything else is a named set or a path."""
    return f"synthetic-{split}" if value == "synthetic" else value


def provenance_error(group: ScoredGroup, issued: PromptTask | None) -> str | None:
    """Why a scored group must not be trained (None if it may): the learner never issued its task id, or the
    group's task or rollout does not match the task as issued."""
    task, rollout = group.rollout.task, group.rollout
    if issued is None:
        return f"provenance: unknown task id {task.task_id!r} (not issued by this run's learner)"
    if task != issued:
        changed = [name for name in PromptTask.model_fields if getattr(task, name) != getattr(issued, name)]
        return f"provenance: task {task.task_id} does not match the task as issued (differs in {', '.join(changed)})"
    n = issued.sampling.n
    if len(rollout.samples) != n or len(group.scores) != n:
        return (f"provenance: task {task.task_id} asked for n={n} samples; the group has {len(rollout.samples)} "
                f"samples and {len(group.scores)} scores")
    return None


def task_id_in_payload(stream: str, payload: bytes) -> str | None:
    """The task id inside a raw stream payload (prompts: PromptTask, rollouts: RolloutGroup, scored/held:
    ScoredGroup), read without schema validation; None if it cannot be found."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        if stream == "prompts":
            return str(data["task_id"])
        if stream == "rollouts":
            return str(data["task"]["task_id"])
        return str(data["rollout"]["task"]["task_id"])
    except Exception:  # garbage in a dead letter: nothing to learn from it
        return None


def truncate_jsonl(path: Path, last_step: int) -> int:
    """Cut a per-step JSONL file after the last line whose step <= last_step (and any partial line written by a
    crash). In place, so a reader holding the file open keeps its handle. Returns the lines kept."""
    if not path.exists():
        return 0
    keep_bytes, kept = 0, 0
    with path.open("rb") as handle:
        for line in handle:
            try:
                step = json.loads(line)["step"]
            except (ValueError, KeyError, TypeError):
                break
            if not line.endswith(b"\n") or step > last_step:
                break
            keep_bytes += len(line)
            kept += 1
    os.truncate(path, keep_bytes)
    return kept


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class TrainProblems:
    """Training problems in a seeded order, epoch after epoch. The cursor (epoch, index) is checkpointed; the
    order of an epoch is a function of (seed, epoch), so the cursor alone restores the stream of problems."""

    def __init__(self, problems: list[Problem], seed: int):
        if not problems:
            raise ValueError("the training set is empty")
        self.problems = problems
        self.seed = seed
        self.epoch, self.index = 0, 0
        self._order = self._order_of(0)

    def _order_of(self, epoch: int) -> list[int]:
        order = list(range(len(self.problems)))
        random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def next(self) -> Problem:
        if self.index >= len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._order_of(self.epoch)
        problem = self.problems[self._order[self.index]]
        self.index += 1
        return problem

    def cursor(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed, "size": len(self.problems)}

    def seek(self, cursor: dict) -> None:
        self.epoch, self.index = int(cursor["epoch"]), int(cursor["index"])
        self._order = self._order_of(self.epoch)


class PromptBuilder:
    """Problem -> (prompt text, prompt token ids), cached: the learner needs the ids to train on the prompt."""

    def __init__(self, tokenizer, settings: Settings):
        self.tokenizer = tokenizer
        self.template = settings.data.prompt_template
        self.raw_template = settings.data.raw_template
        self._cache: dict[str, tuple[str, list[int]]] = {}

    def __call__(self, problem: Problem) -> tuple[str, list[int]]:
        cached = self._cache.get(problem.id)
        if cached is None:
            text = render_prompt(problem, self.tokenizer, self.template, raw_template=self.raw_template)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            cached = self._cache[problem.id] = (text, list(ids))
        return cached


# -- the service -----------------------------------------------------------------------------------------------
class LearnerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.cfg = settings.learner
        self.run_dir = Path(settings.run_dir)
        self.checkpoint_dir = self.run_dir / CHECKPOINTS
        self.stopping = threading.Event()
        self.ready, self.ready_reason = False, "starting"
        self.step = 0
        self.last_checkpoint_step: int | None = None
        self.last_eval_step: int | None = None
        self.consumed_since_checkpoint: set[str] = set()
        self.step_drops: dict[str, list[str]] = {"uninformative": [], "stale": [], "duplicate": []}
        self.outbox: deque[PromptTask] = deque()
        self.eval_round: EvalRound | None = None
        self._dead_cursor = "0-0"
        self._dead_scanned_at = 0.0
        self._redis_run_id: str | None = None
        self.trainer = None
        self.tracking: Tracking | None = None
        self.assembler = BatchAssembler.from_settings(self.cfg)
        self.http: BackgroundServer | None = None
        self.train_started = time.monotonic()

    # -- setup -------------------------------------------------------------------------------------------------
    def connect(self) -> None:
        """Run folder, Redis, streams, the weight publisher (everything the HTTP app needs)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        # The resolved settings, minus the secrets (services read them from the environment).
        redis_cfg = self.settings.redis
        redacted = self.settings.model_copy(update={"token": "<redacted>", "redis": redis_cfg.model_copy(update={
            "password": None, "url": redis_cfg.url and without_password(redis_cfg.url)})})
        write_atomic(self.run_dir / "config.yaml", dump_settings(redacted))
        self.redis = connect(self.settings)
        self.streams = Streams(self.redis, self.settings)
        self.prompts = self.streams.stream("prompts", PromptTask)
        self.scored = self.streams.stream("scored", ScoredGroup)
        self.held = self.streams.stream(HELD, ScoredGroup)
        self.issued_key = self.streams.key(ISSUED)
        self.consumer = consumer_name("learner")
        self.publisher = WeightPublisher(self.settings, self.redis, self.cfg.public_base_url())

    def create_app(self):
        app = create_app(
            "learner",
            token=self.settings.token,
            ready=lambda: (self.ready, self.ready_reason),
            max_body_bytes=int(self.settings.max_body_mb * 1024 * 1024),
        )
        app.include_router(weights_router(self.publisher, app.state.require_token))

        @app.get("/v1/status", tags=["learner"])
        def status() -> dict:
            return self.status()

        return app

    def start_http(self) -> None:
        self.http = BackgroundServer(
            self.create_app(), self.cfg.host, self.cfg.port, name="learner-http", lifespan="off"
        ).start()
        log.info("learner HTTP on %s:%d (weights at %s)", self.cfg.host, self.cfg.port, self.cfg.public_base_url())

    def stop_http(self) -> None:
        if self.http is not None:
            self.http.stop()

    def load(self) -> None:
        """The model, tokenizer, trainer and data (slow)."""
        from transformers import AutoTokenizer

        from learner.trainer import Trainer

        self.ready_reason = "loading the model"
        model_path = model_dir(self.settings)
        self.prompt_builder = PromptBuilder(AutoTokenizer.from_pretrained(model_path), self.settings)
        self.trainer = Trainer(self.settings, model_path)
        self.tracking = Tracking(self.trainer.accelerator, self.settings)
        data = self.settings.data
        self.train_problems = TrainProblems(load_problems(data_spec(data.train, "train"), self.settings), data.seed)
        self.eval_problems: list[Problem] = []
        if self.cfg.eval_every > 0:
            problems = load_problems(data_spec(data.eval, "eval"), self.settings)
            self.eval_problems = problems[: data.eval_size] if data.eval_size > 0 else problems
        self._dead_cursor = self._last_dead_id()

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Resume or start, then train until total_steps (or SIGTERM). Returns the process exit code."""
        resumed = self.resume() if self.cfg.resume else self.start_fresh()
        self.publish_initial()
        self.ready, self.ready_reason = True, f"weights v{self.trainer.version} published"
        try:
            if not resumed and self.step == 0 and self.cfg.eval_every > 0:
                self.baseline_eval()
            self.train_started = time.monotonic()
            while not self.finished() and not self.stopping.is_set():
                if not self.run_step():
                    break
        except RefillLimitReached as err:
            log.error("stopping at step %d: %s", self.step + 1, err)
            metrics.LEARNER_REFILL_LIMIT.inc()
            self.checkpoint_if_new()
            return EXIT_REFILL_LIMIT
        self.checkpoint_if_new()
        if self.stopping.is_set():
            log.info("stopped by signal at step %d (checkpoint written)", self.step)
        else:
            log.info("done: %d steps, policy version %d", self.step, self.trainer.version)
        return 0

    def run_step(self) -> bool:
        """One training step; False when a stop was requested before it could train."""
        started, t0 = time.time(), time.perf_counter()
        version = self.trainer.version
        batch = self.collect()
        if batch is None:
            return False
        waited = time.perf_counter() - t0
        # Drops since the previous batch was taken: the same window as batch.stats.
        drops, self.step_drops = self.step_drops, {k: [] for k in self.step_drops}
        self.push_train(self.assembler.plan(version, ahead=True))  # overlap (a no-op when max_staleness = 0)
        self.flush_outbox()
        result: dict[str, float] = {}
        if batch.groups:
            result = self.trainer.train_step(batch.groups)
            self.publish()
        else:
            log.warning("step %d: refill limit with no informative group in hand: no update", self.step + 1)
        step_seconds = time.perf_counter() - t0
        self.step += 1
        self.consumed_since_checkpoint.update(batch.task_ids)
        self.consumed_since_checkpoint.update(task_id_of(g) for g in batch.stale_at_take)
        record = self.step_record(batch, result, version, started, waited, step_seconds)
        if self.eval_due():
            summary = self.evaluate()
            if summary is not None:
                record.update(summary)
        self.write_step(record, batch, drops)
        self.export_metrics(record, batch)
        log.info(
            "step %d v%d: %d groups (refills %d%s), reward all %.3f trained %.3f, %.1fs%s",
            self.step, self.trainer.version, len(batch.groups), batch.refills,
            ", LIMIT" if batch.refill_limit_hit else "", record["reward_all"] or 0.0, record["reward_trained"] or 0.0,
            step_seconds, f", eval {record['eval_accuracy']:.3f}" if record.get("eval_accuracy") is not None else "",
        )
        if self.checkpoint_due():
            self.checkpoint()
        return True

    def collect(self) -> Batch | None:
        """Push and refill until B informative groups are in hand (or the refill limit). None on stop."""
        version = self.trainer.version
        while not self.stopping.is_set():
            status = self.assembler.status(version)
            if status == "train":
                return self.assembler.take_batch(version)
            if status == "limit":
                return self.assembler.take_at_limit(version, self.cfg.on_refill_limit)
            push = self.assembler.plan(version)
            if push.count:
                self.push_train(push)
            self.pump()
        return None

    # -- streams -----------------------------------------------------------------------------------------------
    def push_train(self, push: Push) -> None:
        if push.count <= 0:
            return
        version = self.trainer.version
        tasks = [self.make_task(self.train_problems.next(), "train", version) for _ in range(push.count)]
        self.assembler.issued([t.task_id for t in tasks], version)
        self.outbox.extend(tasks)
        if push.refill:
            metrics.LEARNER_REFILLS.inc()
            log.info(
                "refill %d: %d prompts (ratio %.3f)", self.assembler.refills, push.count, self.assembler.ratio.value
            )

    def make_task(self, problem: Problem, split: str, version: int) -> PromptTask:
        text, ids = self.prompt_builder(problem)
        s = self.settings.sampling if split == "train" else self.settings.eval_sampling
        return PromptTask(
            task_id=f"{split}-{uuid.uuid4().hex}",
            prompt_id=problem.id,
            prompt=text,
            prompt_token_ids=ids,
            ground_truth=problem.answer,
            sampling=SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens),
            split=split,
            min_version=version,
        )

    def flush_outbox(self) -> None:
        """Produce queued tasks while the prompts stream has room (never block on back-pressure: keep reading)."""
        room = self.prompts.room() if self.outbox else 0
        while self.outbox and room > 0:
            task = self.outbox.popleft()
            self.prompts.produce(task, register=(self.issued_key, task.task_id))  # recorded as issued, atomically
            room -= 1

    def issued_task(self, task_id: str) -> PromptTask | None:
        raw = self.redis.hget(self.issued_key, task_id)
        return from_wire(PromptTask, raw) if raw else None

    def settle(self, task_ids) -> None:
        """Forget issued tasks whose groups are settled (dropped, evaluated, lost, or trained and checkpointed)."""
        task_ids = list(task_ids)
        for i in range(0, len(task_ids), 500):
            self.redis.hdel(self.issued_key, *task_ids[i : i + 500])

    def pump(self) -> None:
        """Flush the outbox, read scored groups (blocking up to block_ms), look for dead prompts."""
        self.flush_outbox()
        for delivery in self.scored.consume(self.consumer, count=CONSUME_BATCH):
            self.handle(delivery)
        if time.monotonic() - self._dead_scanned_at >= DEAD_SCAN_SECONDS:
            self.scan_dead_letters()

    def handle(self, delivery: Delivery[ScoredGroup]) -> None:
        group = delivery.message
        task_id = task_id_of(group)
        if task_id not in self.assembler.seen:  # a duplicate of a settled group is dropped below, not checked
            reason = provenance_error(group, self.issued_task(task_id))
            if reason is not None:
                self.scored.reject(delivery, reason)
                return
        if group.rollout.task.split == "eval":
            if self.eval_round is None or not self.eval_round.add(group):
                log.debug("ignoring eval group %s (not part of a running evaluation)", task_id)
            self.scored.ack(delivery)
            self.settle([task_id])
            return
        verdict = self.assembler.admit(group, self.trainer.version)
        if verdict == "informative":
            if not self.scored.forward(delivery, self.held, group):
                self.assembler.retract(task_id)  # reclaimed meanwhile: it comes back and is admitted then
            return
        self.scored.ack(delivery)
        if verdict != "duplicate":
            self.settle([task_id])
        self.step_drops[verdict].append(task_id)
        if verdict == "uninformative":
            metrics.LEARNER_UNINFORMATIVE.inc()
        elif verdict == "stale":
            metrics.LEARNER_STALE.inc()

    def _last_dead_id(self) -> str:
        rows = self.redis.xrevrange(self.streams.key("dead"), count=1)
        return rows[0][0].decode() if rows else "0-0"

    def check_redis_restart(self) -> None:
        """After a Redis restart, prompts pushed after the last write its AOF kept (a machine crash loses up to
        a second with appendfsync everysec) will never come back: stop waiting for them. A task and its record
        in `issued` are written atomically, so a task missing from `issued` was never pushed as far as Redis
        knows."""
        run_id = self.redis.info("server")["run_id"]
        previous, self._redis_run_id = self._redis_run_id, run_id
        if previous is None or previous == run_id:
            return
        waiting = list(self.assembler.in_flight)
        if self.eval_round is not None:
            waiting += [t for t in self.eval_round.expected if t not in self.eval_round.received]
        queued = {task.task_id for task in self.outbox}  # not pushed yet: not in `issued` either
        waiting = [task_id for task_id in waiting if task_id not in queued]
        known = self.redis.hmget(self.issued_key, waiting) if waiting else []
        gone = [task_id for task_id, raw in zip(waiting, known) if raw is None]
        lost = self.assembler.lost(gone) + (self.eval_round.mark_lost(gone) if self.eval_round is not None else 0)
        log.warning("Redis restarted (run id %s); %d tasks in flight were lost with it", run_id[:8], lost)

    def scan_dead_letters(self) -> None:
        """Prompts that died in the pipeline (poison, too many deliveries) will never be scored: stop waiting.
        Groups refused as forged or for their provenance say nothing reliable about the task they name: it may be
        a real one, whose genuine group is still to come."""
        self._dead_scanned_at = time.monotonic()
        self.check_redis_restart()
        rows = self.redis.xrange(self.streams.key("dead"), min=f"({self._dead_cursor}", max="+", count=1000)
        lost = []
        for entry_id, fields in rows:
            self._dead_cursor = entry_id.decode()
            if fields.get(b"reason", b"").startswith((b"forged", b"provenance")):
                continue
            stream = fields.get(b"stream", b"").decode(errors="replace")
            task_id = task_id_in_payload(stream, fields.get(b"data", b""))
            if task_id is not None:
                lost.append(task_id)
        if lost:
            self.settle(lost)
            gone = self.assembler.lost(lost)
            eval_gone = self.eval_round.mark_lost(lost) if self.eval_round is not None else 0
            if gone or eval_gone:
                log.warning("%d train and %d eval tasks died in the pipeline (see the dead stream)", gone, eval_gone)

    # -- held: the durable working set -------------------------------------------------------------------------
    def held_entries(self, page: int = 256) -> Iterator[tuple[str, dict]]:
        start = "-"
        while True:
            rows = self.redis.xrange(self.held.key, min=start, max="+", count=page)
            for entry_id, fields in rows:
                yield entry_id.decode(), fields
            if len(rows) < page:
                return
            start = "(" + rows[-1][0].decode()

    def delete_held(self, task_ids: set[str]) -> int:
        if not task_ids:
            return 0
        doomed = [eid for eid, fields in self.held_entries() if task_id_in_payload(HELD, fields.get(FIELD)) in task_ids]
        for i in range(0, len(doomed), 500):
            self.redis.xdel(self.held.key, *doomed[i : i + 500])
        return len(doomed)

    def readmit_held(self, skip: set[str], counted: set[str]) -> dict[str, int]:
        """Re-admit the working set after a restart: skip (and delete) what the checkpoint consumed; groups in
        `counted` were already counted in the checkpointed statistics (carried), the others are counted again."""
        outcome = {"kept": 0, "skipped": 0, "dropped": 0, "garbled": 0}
        doomed = []
        version = self.trainer.version
        for entry_id, fields in self.held_entries():
            payload = fields.get(FIELD, b"")
            forged = self.held.forged(fields)
            if forged:
                self.held.dead(entry_id, payload, forged)
                outcome["garbled"] += 1
                continue
            task_id = task_id_in_payload(HELD, payload)
            if task_id is None:
                self.held.dead(entry_id, payload, "unparseable held group")
                outcome["garbled"] += 1
                continue
            if task_id in skip:
                doomed.append(entry_id)
                outcome["skipped"] += 1
                continue
            try:
                group = ScoredGroup.model_validate(msgpack.unpackb(payload, raw=False))
            except ValueError as err:
                self.held.dead(entry_id, payload, f"unparseable held group: {err}"[:2000])
                outcome["garbled"] += 1
                continue
            verdict = self.assembler.admit(group, version, fresh=task_id not in counted)
            if verdict == "informative":
                outcome["kept"] += 1
            else:
                doomed.append(entry_id)
                outcome["dropped"] += 1
                self.step_drops[verdict].append(task_id)
        for i in range(0, len(doomed), 500):
            self.redis.xdel(self.held.key, *doomed[i : i + 500])
        return outcome

    def claim_pending(self) -> int:
        """Take over every scored group a previous learner process was given and never settled (there is one
        learner, so whoever holds them is dead) and handle them now instead of after the visibility timeout."""
        self.scored.pending()  # creates the consumer group if needed
        # At most CONSUME_BATCH entries are ever pending (each read is settled before the next), so one call
        # takes them all. JUSTID: a claim is not a delivery (the counter toward max_deliveries stays put).
        claimed = len(self.redis.xautoclaim(
            self.scored.key, self.scored.group, self.consumer, 0, "0-0", count=10 * CONSUME_BATCH, justid=True
        ))
        for delivery in self.scored.recover(self.consumer, count=max(claimed, 1)):
            self.handle(delivery)
        return claimed

    # -- resume, publish, checkpoint ---------------------------------------------------------------------------
    def start_fresh(self) -> bool:
        self.load_held_state(skip=set(), counted=set())
        for name in (METRICS_FILE, LEDGER_FILE):
            truncate_jsonl(self.run_dir / name, -1)
        return False

    def resume(self) -> bool:
        pointer = self.checkpoint_dir / LATEST
        if not pointer.is_file():
            return self.start_fresh()
        path = self.checkpoint_dir / pointer.read_text().strip()
        extra = self.trainer.load_checkpoint(path)
        self.step = int(extra["step"])
        self.last_checkpoint_step = self.step
        self.last_eval_step = extra.get("last_eval_step")
        self.train_problems.seek(extra["data_cursor"])
        self.assembler.load_state(extra["assembler"])
        for name in (METRICS_FILE, LEDGER_FILE):
            truncate_jsonl(self.run_dir / name, self.step)
        log.info("resuming from %s: step %d, policy version %d", path, self.step, self.trainer.version)
        for task_id in extra["consumed"]:
            self.assembler.seen.add(task_id)  # a late duplicate of a trained group stays out
        self.load_held_state(skip=set(extra["consumed"]), counted=set(extra["carried"]))
        return True

    def load_held_state(self, skip: set[str], counted: set[str]) -> None:
        self.ensure_monotonic_version()
        outcome = self.readmit_held(skip, counted)
        claimed = self.claim_pending()
        if any(outcome.values()) or claimed:
            log.info(
                "working set: %d groups re-admitted, %d already consumed, %d dropped, %d garbled; %d pending claimed",
                outcome["kept"], outcome["skipped"], outcome["dropped"], outcome["garbled"], claimed,
            )

    def ensure_monotonic_version(self) -> None:
        announced = latest_announcement(self.redis, self.streams.prefix, self.publisher.key)
        if announced is not None and announced.version > self.trainer.version:
            log.warning(
                "generators were told of v%d (a lineage the restart discarded); the restored policy (v%d) is "
                "published as v%d",
                announced.version, self.trainer.version, announced.version + 1,
            )
            self.assembler.jumped(self.trainer.version, announced.version + 1)
            self.trainer.version = announced.version + 1

    def publish_initial(self) -> None:
        self.ready_reason = "publishing weights"
        self.publish()

    def publish(self) -> None:
        version = self.trainer.version
        self.publisher.publish(self.trainer.state_dict_for_publish(), version)
        metrics.LEARNER_VERSION.set(version)

    def checkpoint_due(self) -> bool:
        every = self.cfg.checkpoint_every
        return self.finished() or (every > 0 and self.step % every == 0)

    def finished(self) -> bool:
        """total_steps reached, or learner.time_limit_minutes of training spent by this process."""
        limit = self.cfg.time_limit_minutes
        over_time = limit > 0 and time.monotonic() - self.train_started >= 60.0 * limit
        return self.step >= self.cfg.total_steps or over_time

    def checkpoint_if_new(self) -> None:
        if self.trainer is not None and self.last_checkpoint_step != self.step:
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Write step-N, point `latest` at it (atomically), then settle `held` and prune old checkpoints."""
        name = f"step-{self.step}"
        path = self.checkpoint_dir / name
        extra = {
            "step": self.step,
            "version": self.trainer.version,
            "data_cursor": self.train_problems.cursor(),
            "assembler": self.assembler.state(),  # the informative-ratio estimate
            "consumed": sorted(self.consumed_since_checkpoint),
            "carried": self.assembler.carried_ids,
            "last_eval_step": self.last_eval_step,
            "saved_at": time.time(),
        }  # RNG: the trainer saves torch/python/numpy RNG state; the data order is a function of (seed, epoch)
        started = time.perf_counter()
        self.trainer.save_checkpoint(path, extra)
        write_atomic(self.checkpoint_dir / LATEST, name)
        deleted = self.delete_held(self.consumed_since_checkpoint)
        self.settle(self.consumed_since_checkpoint)
        self.consumed_since_checkpoint = set()
        self.last_checkpoint_step = self.step
        self.prune_checkpoints(keep=name)
        log.info(
            "checkpoint %s (%.1fs); %d consumed groups released from held",
            path, time.perf_counter() - started, deleted,
        )
        return path

    def prune_checkpoints(self, keep: str) -> None:
        steps = sorted(
            int(p.name.split("-", 1)[1]) for p in self.checkpoint_dir.iterdir()
            if p.is_dir() and p.name.startswith("step-") and p.name.split("-", 1)[1].isdigit()
        )
        for step in steps[: max(0, len(steps) - max(1, self.cfg.keep_checkpoints))]:
            if f"step-{step}" != keep:
                shutil.rmtree(self.checkpoint_dir / f"step-{step}", ignore_errors=True)

    # -- evaluation --------------------------------------------------------------------------------------------
    def eval_due(self) -> bool:
        every = self.cfg.eval_every
        return every > 0 and (self.step % every == 0 or self.finished())

    def baseline_eval(self) -> None:
        summary = self.evaluate()
        if summary is None:
            return
        record = {"step": 0, "version": self.trainer.version, **summary, "time": time.time()}
        self.append_jsonl(METRICS_FILE, record)
        self.tracking.log_step(record)
        metrics.LEARNER_ACCURACY.labels("eval").set(summary["eval_accuracy"] or 0.0)
        log.info(
            "baseline eval: accuracy %.3f on %d problems", summary["eval_accuracy"] or 0.0, summary["eval_problems"]
        )

    def evaluate(self) -> dict | None:
        """avg@n accuracy of the current version on the held-out problems, through generators and reward
        workers. Train groups keep being admitted meanwhile. None if there is nothing to evaluate or on stop."""
        if not self.eval_problems:
            return None
        version = self.trainer.version
        tasks = [self.make_task(p, "eval", version) for p in self.eval_problems]
        self.eval_round = round_ = EvalRound(self.step, version, {t.task_id for t in tasks}, started_at=time.time())
        self.outbox.extend(tasks)
        started, logged = time.perf_counter(), time.perf_counter()
        try:
            while not round_.done:
                if self.stopping.is_set():
                    return None
                self.pump()
                if time.perf_counter() - logged > PROGRESS_LOG_SECONDS:
                    logged = time.perf_counter()
                    log.info("eval at step %d: %d/%d problems back", self.step, len(round_.received), len(tasks))
        finally:
            self.eval_round = None
            queued = {t.task_id for t in tasks}
            self.outbox = deque(t for t in self.outbox if t.task_id not in queued)
        self.last_eval_step = self.step
        summary = round_.summary()
        summary["eval_seconds"] = time.perf_counter() - started
        self.tracking.log_samples(round_.examples, self.step)
        return summary

    # -- records -----------------------------------------------------------------------------------------------
    def step_record(
        self, batch: Batch, result: dict, version: int, started: float, waited: float, step_seconds: float
    ) -> dict[str, Any]:
        stats = batch.stats
        trained_rewards = [s.reward for g in batch.groups for s in g.scores]
        lags = [self.assembler.lag(g, version) for g in batch.groups]
        tokens = result.get("tokens")
        return {
            "step": self.step,
            "version": self.trainer.version,
            "reward_all": stats.reward_all,
            "reward_trained": _mean(trained_rewards),
            "accuracy_train": stats.accuracy_all,
            "eval_accuracy": None,
            "informative_ratio": stats.informative_share,
            "informative_ratio_estimate": batch.informative_ratio,
            "refills": batch.refills,
            "stale_dropped": stats.stale_dropped,
            "uninformative_dropped": stats.uninformative,
            "duplicates": stats.duplicates,
            "lost": stats.lost,
            "groups_scored": stats.scored,
            "staleness": _mean([float(x) for x in lags]),
            "entropy": result.get("entropy"),
            "response_length": result.get("response_length_mean"),
            "clip_frac_low": result.get("clip_frac_low"),
            "clip_frac_high": result.get("clip_frac_high"),
            "approx_kl": result.get("approx_kl"),
            "grad_norm": result.get("grad_norm"),
            "loss": result.get("loss"),
            "lr": result.get("lr"),
            "step_seconds": step_seconds,
            "wait_seconds": waited,
            "train_seconds": result.get("step_seconds"),
            "tokens_per_second": (tokens / step_seconds) if tokens and step_seconds > 0 else None,
            "train_tokens_per_second": result.get("tokens_per_second"),
            "groups_trained": len(batch.groups),
            "refill_limit_hit": batch.refill_limit_hit,
            "time": time.time(),
            "started": started,
        }

    def append_jsonl(self, name: str, record: dict) -> None:
        with open(self.run_dir / name, "a") as handle:
            handle.write(json.dumps(record) + "\n")
            handle.flush()

    def write_step(self, record: dict, batch: Batch, drops: dict[str, list[str]]) -> None:
        self.append_jsonl(METRICS_FILE, record)
        self.tracking.log_step(record)
        self.append_jsonl(LEDGER_FILE, {
            "step": self.step,
            "version": self.trainer.version,
            "trained": batch.task_ids,
            "stale_at_take": [task_id_of(g) for g in batch.stale_at_take],
            **{f"dropped_{k}": v for k, v in drops.items()},
        })

    def export_metrics(self, record: dict, batch: Batch) -> None:
        def set_if(gauge, value) -> None:
            if value is not None:
                gauge.set(value)

        metrics.LEARNER_STEP.set(self.step)
        set_if(metrics.LEARNER_REWARD.labels("all"), record["reward_all"])
        set_if(metrics.LEARNER_REWARD.labels("trained"), record["reward_trained"])
        set_if(metrics.LEARNER_ACCURACY.labels("train"), record["accuracy_train"])
        set_if(metrics.LEARNER_ACCURACY.labels("eval"), record.get("eval_accuracy"))
        set_if(metrics.LEARNER_INFORMATIVE, record["informative_ratio"])
        set_if(metrics.LEARNER_STALENESS, record["staleness"])
        set_if(metrics.LEARNER_ENTROPY, record["entropy"])
        set_if(metrics.LEARNER_RESPONSE_LENGTH, record["response_length"])
        set_if(metrics.LEARNER_CLIP_FRACTION.labels("low"), record["clip_frac_low"])
        set_if(metrics.LEARNER_CLIP_FRACTION.labels("high"), record["clip_frac_high"])
        set_if(metrics.LEARNER_KL, record["approx_kl"])
        set_if(metrics.LEARNER_LR, record["lr"])
        set_if(metrics.LEARNER_GRAD_NORM, record["grad_norm"])
        set_if(metrics.LEARNER_STEP_SECONDS, record["step_seconds"])
        set_if(metrics.LEARNER_TOKENS_PER_SECOND, record["tokens_per_second"])
        if batch.refill_limit_hit:
            metrics.LEARNER_REFILL_LIMIT.inc()
        if batch.stale_at_take:
            metrics.LEARNER_STALE.inc(len(batch.stale_at_take))

    def status(self) -> dict:
        return {
            "ready": self.ready,
            "step": self.step,
            "total_steps": self.cfg.total_steps,
            "version": self.trainer.version if self.trainer is not None else None,
            "in_hand": len(self.assembler.ready),
            "in_flight": len(self.assembler.in_flight),
            "informative_ratio": self.assembler.ratio.value,
            "refills": self.assembler.refills,
            "evaluating": self.eval_round is not None,
        }


def main(settings: Settings) -> int:
    """`dapo learner`: serve weights over HTTP and train until learner.total_steps (SIGTERM: checkpoint, exit).

    Until the model is loaded a signal stops it at once (`services.startup`); then the first one finishes the
    step and checkpoints, a second one stops at once."""
    model_dir(settings)  # the dependencies first: fail in a second, not after loading
    wait_for_redis(settings)
    service = LearnerService(settings)

    def request_stop(signum, frame) -> None:
        if service.stopping.is_set():
            raise_stopped(signum, frame)
        log.info("signal %d: finishing the current step, then checkpoint and exit (again: now)", signum)
        service.stopping.set()

    service.connect()
    service.start_http()
    try:
        service.load()
        signal.signal(signal.SIGTERM, request_stop)
        signal.signal(signal.SIGINT, request_stop)
        return service.run()
    finally:
        service.stop_http()
        if service.tracking is not None:
            service.tracking.finish()
