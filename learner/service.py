"""`dapo learner`: the training loop around the DAPO update, and the learner's HTTP app (weights, health, metrics).

One step (rank 0; learner/ranks.py for the other ranks):
  1. collect: push prompt tasks sized by the batch assembler (learner/batch.py), read scored groups, keep the
     informative fresh ones, refill until B are in hand (or the refill limit: train on what is in hand, or stop);
  2. with max_staleness > 0, push the next step's prompts now, so generation overlaps training;
  3. train (learner/trainer.py, on every rank), publish the new weights (services/weights.py), generators pull;
  4. evaluate every eval_every steps (and at step 0 and at the end), write the records (learner/records.py);
  5. checkpoint every checkpoint_every steps (and at the end, and on SIGTERM).

The rooms: the working set of tasks issued and groups held, exactly once across crashes (learner/workset.py),
the records (learner/records.py), the policy version (learner/policy.py, its one owner), the ranks
(learner/ranks.py), the run's single-writer lease (learner/lease.py: one learner per run, taken before anything
is written, released on a clean exit), and here the loop that drives them.

Versions stay monotonic across a resume: if generators were told of a version newer than the checkpoint's (a
lineage the crash discarded), the restored policy is republished as the next version after it (PolicyVersion).

Files under run_dir: config.yaml, metrics.jsonl, ledger.jsonl (learner/records.py), checkpoints/step-N,
checkpoints/latest and the refill limit's stop record (learner/checkpoint.py), weights/vN (services/weights.py).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
import random
import shutil
import signal
import threading
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from learner.batch import Batch, Push, RefillLimitReached
from learner.checkpoint import STARTED_OVER, STOPPED, Checkpoints, check_loadable, check_shared
from learner.devices import out_of_memory
from learner.evaluation import EvalRound
from learner.lease import LearnerLease
from learner.policy import PolicyVersion
from learner.ranks import RankChannel, follow
from learner.records import Records, step_record, wait_split, with_delivery
from learner.redis_budget import MB, eviction_refusal, held_budget, largest_group_bytes, memory_pressed
from learner.workset import RUN_STREAMS, WorkingSet
from services import metrics
from services.broadcast import Broadcaster, newest_streamed
from services.config import TINY_NAME, ConfigError, Settings, default_max_model_len
from services.data import DataError, Problem, check_alphabet, load_problems, render_prompt, shared_problems
from services.errors import ExitCode, Unavailable
from services.http import BackgroundServer, callers, create_app, server_options
from services.keys import load_signer
from services.messages import PromptTask, SamplingParams
from services.models import model_dir, safe_decode
from services.redis_local import connect, retrying, wait_for_redis
from services.startup import die_with_launcher, raise_stopped
from services.streams import Streams
from services.weights import WeightPublisher, channel, latest_announcement, shareable_state_dict, weights_router

log = logging.getLogger(__name__)
STREAM_GAUGES_S = 5.0  # how often the run streams' depths are read for the gauges (export_stream_gauges)

PROGRESS_LOG_SECONDS = 30.0


def data_spec(value: str, split: str) -> str:
    """`synthetic` means the split of the built-in task; anything else is a named set or a path."""
    return f"synthetic-{split}" if value == "synthetic" else value


TINY_IDENTITY = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "max_position", "seed")


def recipe(settings: Settings) -> dict:
    """The settings that say what a checkpoint's policy was trained on and for: the model, the sampling, the loss,
    the reward and its shaping, dynamic sampling, the training data, and the run it belongs to (`redis.run`: its
    streams, `issued` tasks and lease). A resume that changes one of them would go on as another experiment under
    the same name (an ablation row resuming another's checkpoint, a run renamed in a shared run folder)."""
    reward = settings.reward
    return {
        "model.name_or_path": settings.model.name_or_path,
        # the embedded model's shapes and tokenizer: another `tiny` is another model under the same name
        **({f"tiny.{key}": getattr(settings.tiny, key) for key in TINY_IDENTITY}
           if settings.model.name_or_path == TINY_NAME else {}),
        **{f"sampling.{key}": value for key, value in settings.sampling.model_dump(mode="json").items()},
        **{f"learner.loss.{key}": value for key, value in settings.learner.loss.model_dump(mode="json").items()},
        "learner.batch.dynamic_sampling": settings.learner.batch.dynamic_sampling,
        "learner.batch.filter_metric": settings.learner.batch.filter_metric,
        **{f"reward.{key}": getattr(reward, key)
           for key in ("answer_rule", "soft_overlong", "overlong_buffer", "overlong_penalty")},
        "data.train": settings.data.train, "data.prompt_template": settings.data.prompt_template,
        "data.raw_template": settings.data.raw_template,  # the prompt, where the template is (or resolves to) raw
        # the built-in task's problems: another difficulty is another data set under the same name
        **({f"data.{key}": value for key, value in settings.data.model_dump(mode="json").items()
            if key.startswith("synthetic_") and key != "synthetic_eval_size"}  # (that one sizes the held-out set)
           if settings.data.train.startswith("synthetic") else {}),
        "redis.run": settings.redis.run,
    }


UPDATE_SETTINGS = ("learner.batch.prompts_per_step", "learner.batch.mini_batches", "learner.batch.epochs",
                   "learner.batch.max_staleness", "learner.batch.uncorrected_staleness", "learner.optimizer.grad_clip")


def update_settings(settings: Settings) -> dict:
    """The settings of the update rule outside the recipe: a resume may change them (a smaller batch after an
    out-of-memory), and says so (`LearnerService.resume`), as the optimizer's own (learner/checkpoint.py)."""
    return {key: operator.attrgetter(key)(settings) for key in UPDATE_SETTINGS}


def stays_stopped(checkpoints: Checkpoints, cfg) -> bool:
    """The refill limit stopped this run at the checkpoint it would resume from, and these settings (`cfg`: the
    learner's) would stop it there again (learner/checkpoint.py): the run is over."""
    stop = checkpoints.recorded_stop()
    if stop is None or cfg.batch.on_refill_limit != "stop" or cfg.batch.max_refills > stop["max_refills"]:
        return False
    log.warning("the refill limit stopped this run at step %d (%s): it stays stopped; "
                "raise learner.batch.max_refills, set learner.batch.on_refill_limit=train or delete %s to go on "
                "from there, learner.checkpoints.resume=false to "
                "start over", stop["step"], stop["reason"], checkpoints.dir / STOPPED)
    return True


def over_before_loading(settings: Settings) -> bool:
    """What the run's files alone decide, on every rank, before the model loads (Kubernetes restarts a learner
    whatever its exit: at 32B each restart loaded the model, read the checkpoint and published a version only to
    learn this): a checkpoint this release cannot load raises CheckpointDamaged (exit 65); a run that is over, by
    the refill limit (`stays_stopped`) or at total_steps with its last evaluation done (in the checkpoint, or in
    metrics.jsonl: redone after a resume), returns True (exit 0). A checkpoint of another recipe is not over: rank 0
    refuses it (`LearnerService.check_recipe`, exit 2)."""
    cfg = settings.learner
    checkpoints = Checkpoints(Path(settings.run_dir))
    resuming = cfg.checkpoints.resume or checkpoints.started_over_already(recipe(settings)) is not None
    step = checkpoints.latest_step() if resuming else None
    if step is None:
        return False
    _, meta = check_loadable(checkpoints.path(step))
    if recipe_changes(meta["extra_state"].get("recipe") or {}, settings):
        return False
    if stays_stopped(checkpoints, cfg):
        return True
    evaluated = cfg.eval_every == 0 or meta["extra_state"].get("last_eval_step") == step or \
        Records(settings).has_evaluation(step)
    if step >= cfg.total_steps and evaluated:
        log.info("the run is over: its checkpoint of step %d is at learner.total_steps, evaluated (raise "
                 "learner.total_steps to go on)", step)
        return True
    return False


def recipe_changes(saved: dict, settings: Settings) -> list[str]:
    """`key saved -> now` for each recipe setting of a checkpoint's (`saved`) that differs now (a setting a later
    release added is not in it: no change)."""
    return setting_changes(saved, recipe(settings))


def setting_changes(saved: dict, now: dict) -> list[str]:
    """`key saved -> now` for each of the `saved` settings that differs `now` (one missing there: None)."""
    return [f"{key} {value!r} -> {now.get(key)!r}" for key, value in sorted(saved.items()) if now.get(key) != value]


def held_out_problems(settings: Settings) -> list[Problem]:
    """The evaluation set: data.eval, its first data.eval_size problems (0 = all)."""
    problems = load_problems(data_spec(settings.data.eval, "eval"), settings)
    return problems[: settings.data.eval_size] if settings.data.eval_size > 0 else problems


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
        """Go on from `cursor`. One of another order (data.seed changed, or the data set's size: a file edited,
        de-duplication switched) would redraw some problems of the epoch and skip others: the next epoch begins."""
        epoch, index = int(cursor["epoch"]), int(cursor["index"])
        if cursor.get("seed", self.seed) != self.seed or cursor.get("size", len(self.problems)) != len(self.problems):
            log.warning("the data cursor %s was taken on another order (now seed %s, %d problems): the training "
                        "data starts over at epoch %d", cursor, self.seed, len(self.problems), epoch + 1)
            epoch, index = epoch + 1, 0
        self.epoch, self.index = epoch, index
        self._order = self._order_of(self.epoch)

    def seek_past(self, cursor: dict) -> bool:
        """Seek to `cursor` if it lies ahead on this same order (same seed and data size); whether it did."""
        same_order = cursor.get("seed") == self.seed and cursor.get("size") == len(self.problems)
        ahead = (int(cursor["epoch"]), int(cursor["index"])) > (self.epoch, self.index)
        if same_order and ahead:
            self.seek(cursor)
        return same_order and ahead


class PromptBuilder:
    """Problem -> (prompt text, prompt token ids), the most recent CACHED_PROMPTS cached (the held-out set, issued
    again at every evaluation): the learner needs the ids to train on the prompt."""

    CACHED_PROMPTS = 4096  # not the whole data set: 17k problems of DAPO-Math-17k held some 150 MB of ids

    def __init__(self, tokenizer, settings: Settings):
        self.tokenizer = tokenizer
        self.template = settings.data.prompt_template
        self.raw_template = settings.data.raw_template
        self._cache: OrderedDict[str, tuple[str, list[int]]] = OrderedDict()

    def __call__(self, problem: Problem) -> tuple[str, list[int]]:
        # By the problem's text: ids are the data files' own, and a train and an eval file may both count from 0.
        cached = self._cache.get(problem.problem)
        if cached is None:
            text = self._render(problem)
            cached = self._cache[problem.problem] = (text, self._encode(text))
            if len(self._cache) > self.CACHED_PROMPTS:
                self._cache.popitem(last=False)
        self._cache.move_to_end(problem.problem)
        return cached

    def ids(self, problem: Problem) -> list[int]:
        """The prompt's token ids, not cached here: the length check at load reads every problem once, and caching
        them all would hold the whole data set's ids (a drawn problem is encoded again, once)."""
        cached = self._cache.get(problem.problem)
        return cached[1] if cached is not None else self._encode(self._render(problem))

    def _render(self, problem: Problem) -> str:
        return render_prompt(problem, self.tokenizer, self.template, raw_template=self.raw_template)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


# -- the service (rank 0) --------------------------------------------------------------------------------------
class LearnerService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.cfg = settings.learner
        self.run_dir = Path(settings.run_dir)
        self.checkpoints = Checkpoints(self.run_dir, keep=self.cfg.checkpoints.keep)
        if not self.cfg.checkpoints.resume and (at := self.checkpoints.started_over_already(recipe(settings))):
            log.warning("learner.checkpoints.resume is false, and it started this run over already (%s, with these "
                        "settings): the run it started resumes. To start over again, delete %s (or `latest` beside "
                        "it, as `dapo run` does)", at, self.checkpoints.dir / STARTED_OVER)
            self.cfg.checkpoints.resume = True
        self._gauges_stop = threading.Event()
        self.broadcaster: Broadcaster | None = None  # transport collective: rank 0 of every weights round
        self.publishing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="publish")
        self.delivering: Future | None = None  # the delivery in the background, while it runs
        self.announced = 0  # the newest version announced to the generators (set by `deliver`, in its thread)
        self.stopping = threading.Event()
        self.stopped_by = signal.SIGTERM  # the signal that set `stopping`
        self.signals_received = 0  # by this process (`signalled`)
        self.ready, self.ready_reason = False, "starting"
        self.step = 0
        self.last_checkpoint_step: int | None = None
        self.last_eval_step: int | None = None
        self.policy = PolicyVersion()
        self.trainer = None
        self.work: WorkingSet | None = None  # with Redis (connect)
        self.ranks: RankChannel | None = None
        self.records = Records(settings)
        self.http: BackgroundServer | None = None
        self.lease: LearnerLease | None = None
        self.train_started = time.monotonic()
        self.eval_seconds = 0.0  # spent evaluating since train_started: not training time
        self.last_step_seconds = 0.0  # the step before's, to foresee the time limit (`last_step_likely`)

    @property
    def overlap_publish(self) -> bool:
        """weights.overlap_delivery with max_staleness >= 1: a version's delivery overlaps the next step. Not a
        broadcast round over NCCL: one in a thread beside the trainer's collectives on the same GPU is not yet
        measured (concurrent NCCL communicators on one device can deadlock), so it stays on the step's path."""
        nccl = self.broadcaster is not None and self.broadcaster.backend == "nccl"
        return self.settings.weights.overlap_delivery and self.cfg.batch.max_staleness >= 1 and not nccl

    # -- setup -------------------------------------------------------------------------------------------------
    def claim_run(self) -> None:
        """Take the run's single-writer lease (learner/lease.py) before anything of the run is written: LeaseHeld
        (exit 69) while another learner holds it."""
        # Redis may be full already (a worker's flood while no learner ran): the lease's write trims it first, as
        # every write of the learner's does (`connect`).
        lease = LearnerLease(self.settings)
        lease.on_full = Streams(lease.redis, self.settings, signs_as=()).trim_overfull
        self.lease = lease.acquire()

    def release_run(self) -> None:
        # A delivery still running (the process ends on an error or a second signal) finishes first: nothing of
        # this learner is announced after its lease is gone (a successor numbers its versions after the last).
        self.publishing.shutdown(wait=True, cancel_futures=True)
        if self.lease is not None:
            self.lease.release()
            self.lease = None

    def connect(self) -> None:
        """Run folder, Redis, streams, the weight publisher (everything the HTTP app needs)."""
        self.checkpoints.dir.mkdir(parents=True, exist_ok=True)
        Records.write_config(self.settings)
        self.redis = connect(self.settings)
        self.streams = Streams(self.redis, self.settings, signs_as=("learner",))
        # A write of the learner's refused by a full Redis first trims what producers overfilled (FUNCTION LOAD's
        # below included): the learner is the one process that frees Redis, and must not wait on itself.
        self.redis.on_full = self.streams.trim_overfull
        self.streams.scripts.load()  # the learner owns the stream functions: this release's, before any worker's call
        self.work = WorkingSet(self.streams, self.cfg, self.policy, self.settings.reward)
        self.publisher = WeightPublisher(self.settings, self.redis, self.cfg.public_base_url())
        if self.settings.weights.transport == "collective" and self.broadcaster is None:
            self.broadcaster = Broadcaster(self.settings, retrying(self.redis), self.publisher.signer,
                                           self.streams.prefix, channel(self.streams.prefix))
        self.check_redis_memory()

    def signalled(self, signum, frame) -> None:
        """SIGTERM or SIGINT to this process: finish the current step, checkpoint and exit; a second one: now."""
        if self.signals_received:
            raise_stopped(signum, frame)
        self.signals_received += 1
        log.info("signal %d: finishing the current step, then checkpoint and exit (again: now)", signum)
        self.stopped_by = signum
        self.stopping.set()

    def follower_signalled(self, signum: int) -> None:
        """A follower rank's process got `signum` (learner/ranks.py): stop as if signalled, but a signal to this
        process after it is still its first (Kubernetes stops the learner's pods together, in no order)."""
        if not self.stopping.is_set():
            log.info("a follower rank got signal %d: finishing the current step, then checkpoint and exit", signum)
            self.stopped_by = signum
            self.stopping.set()

    def check_redis_memory(self) -> None:
        """Redis' eviction policy (one that evicts any key refuses the start), and the largest `held` these
        settings allow against its maxmemory (learner/redis_budget.py): a step that cannot fit refuses the start
        (Unavailable, with the figures), a checkpoint interval that may not fit is a warning."""
        verdict, why = eviction_refusal(self.streams.eviction_policy())
        if verdict == "refuse":
            raise Unavailable(why)
        if verdict == "warn":
            log.warning("Redis memory: %s", why)
        _, maxmemory = self.work.redis_memory()
        verdict, figures = held_budget(self.settings, maxmemory, largest_group_bytes(self.settings))
        if verdict == "refuse":
            raise Unavailable(f"Redis is too small for this run: {figures}")
        log.log(logging.WARNING if verdict == "warn" else logging.INFO, "Redis memory: %s", figures)

    def create_app(self):
        app = create_app(
            "learner",
            token=callers(self.settings, weights_readers=True),  # the operator, and generators to the weights only
            ready=lambda: (self.ready, self.ready_reason),
            max_body_bytes=int(self.settings.max_body_mb * 1024 * 1024),
            docs=self.settings.http_docs,
        )
        app.include_router(weights_router(self.publisher))

        @app.get("/v1/status", tags=["learner"])
        def status() -> dict:
            return self.status()

        return app

    def start_http(self) -> None:
        self.http = BackgroundServer(
            self.create_app(), self.cfg.host, self.cfg.port, name="learner-http", lifespan="off",
            **server_options(self.settings),
        ).start(wait_s=30)  # a port already taken fails the start here, not silently in uvicorn's thread
        log.info("learner HTTP on %s:%d (weights at %s)", self.cfg.host, self.cfg.port, self.cfg.public_base_url())

    def stop_http(self) -> None:
        self._gauges_stop.set()
        if self.http is not None:
            self.http.stop()

    def export_stream_gauges(self) -> None:
        """Every STREAM_GAUGES_S, from a thread of its own, the run streams' depths (`Streams.export_depths`): an
        update of a large model takes an hour in which nothing pumps, and the streams fill meanwhile."""
        def loop() -> None:
            while not self._gauges_stop.wait(STREAM_GAUGES_S):
                try:
                    self.streams.export_depths(RUN_STREAMS)
                except Exception as err:  # Redis away: the next turn tries again
                    log.debug("stream gauges not read: %s", err)

        threading.Thread(target=loop, name="stream-gauges", daemon=True).start()

    def load(self) -> None:
        """The tokenizer and data (a bad data file fails here, in seconds), then the model and trainer (slow)."""
        from transformers import AutoConfig, AutoTokenizer

        from learner.tracking import Tracking

        self.ready_reason = "loading the model"
        model_path = model_dir(self.settings)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.work.limit_vocabulary(AutoConfig.from_pretrained(model_path).vocab_size)  # the embedding table's rows
        self.work.decode = functools.partial(safe_decode, tokenizer)  # a sample's text must be its tokens
        self.prompt_builder = PromptBuilder(tokenizer, self.settings)
        data = self.settings.data
        train = load_problems(data_spec(data.train, "train"), self.settings)
        self.eval_problems: list[Problem] = []
        if self.cfg.eval_every > 0:
            self.eval_problems = held_out_problems(self.settings)
        if self.settings.model.name_or_path == TINY_NAME:  # its tokenizer knows the synthetic task's characters only
            vocabulary = {tokenizer.decode([i]) for i in tokenizer.get_vocab().values()}
            check_alphabet([*train, *self.eval_problems], vocabulary)
            if missing := set(self.prompt_builder(train[0])[0]) - vocabulary:
                raise DataError(f"the prompt template (data.prompt_template {data.prompt_template}) has characters "
                                f"{''.join(sorted(missing))!r} that are not in the tiny model's alphabet: its "
                                "tokenizer would drop them from every prompt (use `raw`, with a data.raw_template "
                                "in its alphabet)")
        train = self.fitting(train, self.settings.sampling.max_tokens, "training")
        self.eval_problems = self.fitting(self.eval_problems, self.settings.eval_sampling.max_tokens, "held-out")
        if shared := shared_problems(train, self.eval_problems):
            log.warning("%d of the %d held-out problems are also training problems (data.train %s, data.eval %s): "
                        "the held-out accuracy is partly measured on the training set", shared,
                        len(self.eval_problems), data.train, data.eval)
        self.train_problems = TrainProblems(train, data.seed)
        self.trainer = build_trainer(self.settings)
        self.ranks = RankChannel(self.trainer.accelerator)
        self.records.tracking = Tracking(self.trainer.accelerator, self.settings, self.checkpointed_step())

    def fitting(self, problems: list[Problem], max_tokens: int, kind: str) -> list[Problem]:
        """The problems whose prompt leaves `max_tokens` of room in the generators' context (max_model_len): a
        longer one would be refused by every generator, dead-lettered and issued again every epoch (verl filters
        them alike: filter_overlong_prompts). Says how many were left out."""
        room = default_max_model_len(self.settings) - max_tokens
        kept = [problem for problem in problems if len(self.prompt_builder.ids(problem)) <= room]
        if len(kept) < len(problems):
            log.warning("%d of the %d %s problems have prompts longer than the %d tokens the generators leave them "
                        "(generator.max_model_len - max_tokens %d): left out", len(problems) - len(kept),
                        len(problems), kind, room, max_tokens)
        if problems and not kept:
            raise DataError(f"no {kind} problem has a prompt of at most {room} tokens (generator.max_model_len - "
                            f"max_tokens {max_tokens})")
        return kept

    # -- the run -----------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Resume or start, then train until total_steps (or SIGTERM). Returns the process exit code."""
        if self.cfg.checkpoints.resume and self.stays_stopped():  # decided before the resume touches the run
            self.ranks.stop()
            return 0
        self.checkpoints.clear_stop()  # the run goes on past any stop recorded
        self.checkpoints.settle_interrupted_writes()
        resumed = self.resume() if self.cfg.checkpoints.resume else self.start_fresh()
        self.records.resumed(self.step)
        self.publish_initial()
        self.ready, self.ready_reason = True, f"weights v{self.policy.current} published"
        try:
            if self.cfg.eval_every > 0 and self.eval_missing(resumed):
                self.evaluation_line()
            self.train_started, self.eval_seconds = time.monotonic(), 0.0
            if not self.finished():  # a resume at the end trains nothing
                while not self.stopping.is_set() and self.run_step():
                    pass
        except RefillLimitReached as err:
            self.finish_delivery()
            log.error("stopping at step %d: %s", self.step + 1, err)
            metrics.LEARNER_REFILL_LIMIT.inc()
            self.checkpoint_if_new()
            self.checkpoints.record_stop(self.step, self.cfg.batch.max_refills, str(err))
            self.ranks.stop()
            return ExitCode.REFILL_LIMIT
        self.finish_delivery()
        self.checkpoint_if_new()
        self.ranks.stop()
        if self.stopping.is_set():
            log.info("stopped by signal at step %d (checkpoint written)", self.step)
            if not self.finished():
                # Not 0: the run is not over (a supervisor, `dapo run` among them, restarts a learner that
                # something else stopped; the one that sent the signal knows it did).
                return ExitCode.SIGNALLED + self.stopped_by
        else:
            log.info("done: %d steps, policy version %d", self.step, self.policy.current)
        return 0

    def run_step(self) -> bool:
        """One training step; False when it was the last one, or a stop was requested before it could train."""
        started, t0 = time.time(), time.perf_counter()
        version = self.policy.current
        batch = self.collect()
        if batch is None:
            return False
        waited = time.perf_counter() - t0
        staleness_wait = 0.0
        if not self.last_step_likely():  # no step after it: no prompts for one
            ahead = self.work.plan_ahead(version)  # overlap (a no-op when max_staleness = 0)
            delivering = self.delivering
            if (ahead.count and delivering is not None
                    and version - self.announced >= self.settings.learner.batch.max_staleness):
                # Its tasks would ask for a version before `version` (push_train's rule), whose groups are too
                # stale for the next step that trains them: this version's delivery ends first (its figures and
                # any error are taken as ever, by the next publish or pump). Publishing's time on the step.
                delivery_waited = time.perf_counter()
                delivering.exception()
                staleness_wait = time.perf_counter() - delivery_waited
            self.push_train(ahead)
        self.work.flush_outbox()
        result: dict[str, float] = {}
        publish_seconds, broadcast = staleness_wait, {}
        if batch.groups:
            result = self.train(batch)
            self.policy.advance()
            published = time.perf_counter()
            broadcast = self.publish(overlap=self.overlap_publish)
            publish_seconds += time.perf_counter() - published
        else:
            log.warning("step %d: refill limit with no informative group in hand: no update", self.step + 1)
        step_seconds = time.perf_counter() - t0
        self.last_step_seconds = step_seconds
        self.step += 1
        lags = self.work.finish(batch, version)
        timing = {"step_seconds": step_seconds, "wait_seconds": waited, **wait_split(waited, batch.groups),
                  "publish_seconds": publish_seconds, **broadcast, "time": time.time(), "started": started,
                  "world_size": self.ranks.world}
        record = step_record(self.step, self.policy.current, batch, lags, result, timing)
        final = self.finished()  # decided once: the evaluation, the checkpoint and the loop agree on the last step
        evaluating = self.eval_due(final)
        if evaluating:
            record["eval_drain_seconds"] = self.drain_train()
        if evaluating or final or self.stopping.is_set():
            # The step's version is announced before an evaluation's tasks ask for it (push_train's rule; generators
            # could not sample it sooner anyway) and before the run ends (generators pull it while this learner
            # still serves it).
            waited_delivery = time.perf_counter()
            record = with_delivery(record, self.wait_delivered())
            record["announce_wait_seconds"] = time.perf_counter() - waited_delivery
        if evaluating:
            summary = self.evaluate()
            if summary is not None:
                record.update(summary)
        idle = waited + record.get("eval_drain_seconds", 0.0) + record.get("eval_seconds", 0.0)
        record["learner_idle_seconds"] = idle  # waiting on the pipeline
        record.update(self.work.generator_clocks.take())
        self.records.step(record, batch, self.work.take_drops())  # taken last: the drain's and evaluation's too
        log.info(
            "step %d v%d: %d groups (refills %d%s), reward all %.3f trained %.3f, %.1fs%s",
            self.step, self.policy.current, len(batch.groups), batch.refills,
            ", LIMIT" if batch.refill_limit_hit else "", record["reward_all"] or 0.0, record["reward_trained"] or 0.0,
            step_seconds, f", eval {record['eval_accuracy']:.3f}" if record.get("eval_accuracy") is not None else "",
        )
        if self.checkpoint_due(final) or self.held_memory_pressed():
            self.checkpoint()
        return not final

    def train(self, batch: Batch) -> dict[str, float]:
        """The update on every rank. One that raises counts against each group of the batch before the process
        ends (learner/workset.py: after one retry such groups are quarantined, not re-admitted at every restart).
        Out of memory is the settings' fault, not the groups': quarantined, every batch's would be lost in turn."""
        metrics.learner_updating(True)
        try:
            result = self.ranks.train_step(self.trainer, batch.groups)
        except Exception as err:
            if out_of_memory(err):
                log.critical("the update ran out of memory (%s): lower learner.compute.micro_batch_tokens, or turn on "
                             "gradient checkpointing or offload (`dapo plan` says what fits); the batch's groups are "
                             "trained after the restart", (str(err).splitlines() or [type(err).__name__])[0][:300])
                raise
            self.work.suspect(batch.task_ids, f"{type(err).__name__}: {err}"[:1000])
            raise
        finally:
            metrics.learner_updating(False)
        self.work.trained(batch.task_ids)
        return result

    def collect(self) -> Batch | None:
        """Push and refill until B informative groups are in hand (or the refill limit). None on stop."""
        version = self.policy.current
        while not self.stopping.is_set():
            outcome = self.work.next_batch(version)
            if isinstance(outcome, Batch):
                return outcome
            self.push_train(outcome)
            self.pump()
        return None

    def pump(self) -> None:
        if self.delivering is not None and self.delivering.done() and self.delivering.exception() is not None:
            self.wait_delivered()  # a delivery that failed fails the learner now, as one on the step's path would
        self.work.pump()
        self.ranks.keepalive()  # the other ranks wait in a broadcast meanwhile

    def push_train(self, push: Push) -> None:
        if push.count <= 0:
            return
        version = self.policy.current
        # A task asks for no version the generators have not been told of: while the current one is delivered in
        # the background (max_staleness >= 1), the one before. Were this process killed before that delivery
        # ended, a task asking for the current version would wait for one never announced.
        ready = min(version, self.announced)
        tasks, cursors, before = [], [], self.train_problems.cursor()
        for _ in range(push.count):
            tasks.append(self.make_task(self.train_problems.next(), "train", ready))
            after = self.train_problems.cursor()
            cursors.append((before, after))
            before = after
        self.work.issue(tasks, version, cursors)
        if push.refill:
            metrics.LEARNER_REFILLS.inc()
            status = self.work.status()
            log.info("refill %d: %d prompts (ratio %.3f)", status["refills"], push.count, status["informative_ratio"])

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

    # -- resume, publish, checkpoint ---------------------------------------------------------------------------
    def start_fresh(self) -> bool:
        """No checkpoint to start from. Resuming, a process of this run may have died before its first checkpoint:
        its groups are re-admitted (held) or still come (issued), so the data goes on after the problems it issued.
        Not resuming (`checkpoints.resume: false`), the run starts over from its first problem, with nothing of the
        run before (`WorkingSet.forget_run`)."""
        self.ensure_monotonic_version()
        if self.cfg.checkpoints.resume:
            self.seek_data(self.train_problems.cursor())
        else:
            self.work.forget_run()
            self.checkpoints.forget_latest()
            self.checkpoints.dir.mkdir(parents=True, exist_ok=True)
            self.checkpoints.mark_started_over(recipe(self.settings))
        self.checkpoints.mark_run_recipe(recipe(self.settings))
        self.work.restore(skip=set(), counted=set())
        self.records.cut_after(-1)
        return False

    def checkpointed_step(self) -> int | None:
        """The step this process will resume from (None: a fresh start)."""
        return self.checkpoints.latest_step() if self.cfg.checkpoints.resume else None

    def check_recipe(self) -> None:
        """Refuse the checkpoint this learner would resume if it was trained with other settings (`recipe`), or,
        before the run's first checkpoint, a start with settings other than the run's start had: its groups, held
        or still to come, were sampled and scored by those. Done first (`main`), before the run's config.yaml is
        rewritten, a tracker's run made or the model loaded."""
        if not self.cfg.checkpoints.resume:
            return  # the run starts over, with nothing of the one before
        step = self.checkpointed_step()
        if step is None:
            what, saved = (f"the run of {self.checkpoints.dir} (no checkpoint yet) was started",
                           self.checkpoints.run_recipe())
        else:  # (none before 11-29)
            what, saved = (f"the checkpoint {self.checkpoints.path(step)} was trained",
                           self.checkpoints.extra_state(step).get("recipe"))
        if saved is not None and (changes := recipe_changes(saved, self.settings)):
            raise ConfigError(f"{what} with other settings "
                              f"({'; '.join(changes)}): going on would be another experiment under this run's name. "
                              "Give it its own run_dir (and redis.run), or start over here (once: "
                              "learner.checkpoints.resume=false, docs/deploy.md)")

    def resume(self) -> bool:
        step = self.checkpoints.latest_step()
        if step is None:
            return self.start_fresh()
        path = self.checkpoints.path(step)
        self.check_recipe()
        extra = self.ranks.load(self.trainer, path)
        self.step = int(extra["step"])
        self.policy.restore(extra["policy"])
        self.last_checkpoint_step = self.step
        self.last_eval_step = extra.get("last_eval_step")
        self.seek_data(extra["data_cursor"])
        self.records.cut_after(self.step)
        log.info("resuming from %s: step %d, policy version %d", path, self.step, self.policy.current)
        if changed := setting_changes(extra.get("update", {}), update_settings(self.settings)):
            log.warning("resumed with other update settings than its checkpoint's, from step %d on: %s", self.step + 1,
                        "; ".join(changed))
        self.ensure_monotonic_version()
        self.work.resume(self.step, extra)
        return True

    def stays_stopped(self) -> bool:
        return stays_stopped(self.checkpoints, self.cfg)

    def seek_data(self, checkpointed: dict) -> None:
        """The checkpoint's data cursor, or further on: the problems issued after the checkpoint come back (their
        groups are held or still in the pipeline), so they are not drawn again."""
        self.train_problems.seek(checkpointed)
        issued = self.work.issued_data_cursor()
        if issued is not None and self.train_problems.seek_past(issued):
            log.info("data cursor %s -> %s: problems issued after the checkpoint are not drawn again",
                     checkpointed, issued)

    def ensure_monotonic_version(self) -> None:
        """Generators may have been told of any version announced in Redis, published in the weights folder (a
        Redis that lost its last writes forgot the newest) or streamed in a broadcast round (before its files and
        announcement): the restored policy is published after all of them."""
        announced = latest_announcement(self.redis, self.streams.prefix, self.publisher.keyring)
        streamed = newest_streamed(retrying(self.redis), self.streams.prefix)
        told = [*self.publisher.versions(), *([announced.version] if announced else []),
                *([streamed] if streamed is not None else [])]
        newest = max(told, default=-1)
        if newest > self.policy.current:
            log.warning(
                "generators were told of v%d (a lineage the restart discarded); the restored policy (v%d) is "
                "published as v%d",
                newest, self.policy.current, newest + 1,
            )
            self.policy.republish_as(newest + 1)

    def publish_initial(self) -> None:
        """The policy at the start, by the files alone: a round for it would wait out its join timeout on every
        generator up already (at a fresh start they serve version 0 from the model folder, after a restart the
        version the checkpoint holds; neither joins a round for what it serves), and pause them all."""
        self.ready_reason = "publishing weights"
        self.publish(broadcast=False)

    def publish(self, overlap: bool = False, broadcast: bool = True) -> dict:
        """Announce the current policy: its weights gathered in the served dtype (every rank takes part; host
        copies), then delivered (`deliver`). `overlap` (max_staleness >= 1): the delivery runs in the background
        while the next step collects and trains on groups of the versions before; the previous delivery is waited
        for first, so versions are announced in order. Returns the figures for the step record: the gather's (the
        served bytes each rank gathers) and those of the deliveries that ended in this call (`with_delivery`).

        Transport shared-fs on several ranks: every rank writes its own share into the version's folder instead
        (learner/publish.py: no rank gathers the whole model); rank 0 then completes and announces it, with no
        overlap (the gather's figures include the writing)."""
        version = self.policy.current
        delivered = self.wait_delivered()  # first: the host holds one served copy of the weights at a time
        started = time.perf_counter()
        if self.settings.weights.transport == "shared-fs" and self.ranks.world > 1:
            folder = self.publisher.begin(version)
            try:
                writers, written = self.ranks.write_shards(self.trainer, folder, self.publisher.shard_bytes)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)  # (finish_version removes it from there on)
                raise
            figures = with_delivery({"publish_gather_seconds": time.perf_counter() - started,
                                     "publish_bytes": float(written)}, delivered)
            return with_delivery(figures, self.deliver(None, version, written=(folder, writers),
                                                       broadcast=broadcast))
        weights = self.ranks.weights(self.trainer)
        figures = with_delivery({"publish_gather_seconds": time.perf_counter() - started,
                                 "publish_bytes": float(sum(t.numel() * t.element_size() for t in weights.values()))},
                                delivered)
        if overlap:
            self.delivering = self.publishing.submit(self.deliver, weights, version, broadcast=broadcast)
            return figures
        return with_delivery(figures, self.deliver(weights, version, broadcast=broadcast))

    def deliver(self, weights: dict | None, version: int, written: tuple | None = None,
                broadcast: bool = True) -> dict[str, float]:
        """A broadcast round first (transport collective; not `broadcast`: none), then the files and the
        announcement (every transport: the way in for generators outside the round); `written`: (folder, every
        rank's `Written`), files the ranks wrote, only to complete. Its figures, naming the version delivered."""
        started = time.perf_counter()
        rounds = self.broadcaster if broadcast else None
        try:
            round_ = rounds.broadcast(shareable_state_dict(weights), version) if rounds else None
        except Exception:  # whatever failed it, the files below are every generator's way in
            log.exception("the broadcast round of v%d failed: every generator takes it through the files", version)
            round_ = None
        if written is not None:
            self.publisher.finish(version, *written)
        else:
            self.publisher.publish(weights, version)
        self.announced = version
        metrics.LEARNER_VERSION.set(version)
        return {"delivered_version": version, "delivery_seconds": time.perf_counter() - started,
                **(round_.figures() if round_ is not None else {})}

    def wait_delivered(self) -> dict[str, float]:
        """Wait for the delivery running in the background, if any (its error is raised here, as a delivery on the
        step's path would raise it); its figures."""
        delivering, self.delivering = self.delivering, None
        return delivering.result() if delivering is not None else {}

    def finish_delivery(self) -> None:
        """The last version trained is announced before the run ends. A delivery still running here came after the
        last step's record was written (a SIGTERM past the step's own check): its figures go to the log."""
        late = self.wait_delivered()
        if late:
            log.info("v%d announced after step %d's record: delivery %.2fs", late["delivered_version"], self.step,
                     late["delivery_seconds"])

    def checkpoint_due(self, final: bool) -> bool:
        every = self.cfg.checkpoints.every
        return final or (every > 0 and self.step % every == 0)

    def held_memory_pressed(self) -> bool:
        """Redis uses redis.held_memory_share of its maxmemory: a checkpoint now releases from `held` the groups
        consumed since the last one, before Redis refuses writes."""
        used, maxmemory = self.work.redis_memory()
        share = self.settings.redis.held_memory_share
        if not memory_pressed(used, maxmemory, share):
            return False
        log.warning("Redis uses %.0f of its %.0f MB maxmemory (redis.held_memory_share %g): checkpoint step %d "
                    "early to release `held`", used / MB, maxmemory / MB, share, self.step)
        return True

    def last_step_likely(self) -> bool:
        """Whether the step under way is the run's last: total_steps, a stop asked for, or learner.time_limit_minutes
        that the training clock will pass if this step takes as long as the one before (a wrong guess costs only
        the next step's overlap; pushed, a whole step of prompts would be generated for no step of this process)."""
        return self.step + 1 >= self.cfg.total_steps or self.stopping.is_set() or self.over_time(self.last_step_seconds)

    def over_time(self, ahead: float = 0.0) -> bool:
        """learner.time_limit_minutes of training (evaluations excluded) in this process, `ahead` seconds from now."""
        limit = self.cfg.time_limit_minutes
        trained = time.monotonic() - self.train_started - self.eval_seconds
        return limit > 0 and trained + ahead >= 60.0 * limit

    def finished(self) -> bool:
        """total_steps reached, or learner.time_limit_minutes of training in this process (`over_time`)."""
        return self.step >= self.cfg.total_steps or self.over_time()

    def checkpoint_if_new(self) -> None:
        if self.trainer is not None and self.last_checkpoint_step != self.step:
            self.checkpoint()

    def checkpoint(self) -> Path:
        """Write step-N (every rank), point `latest` at it (atomically) and prune old ones, then settle `held`."""
        path = self.checkpoints.path(self.step)
        extra = {
            "step": self.step,
            "policy": self.policy.state(),
            "data_cursor": self.work.data_cursor(self.train_problems.cursor()),  # not the problems still queued
            **self.work.checkpoint_state(),  # the informative-ratio estimate, the groups consumed and carried
            "last_eval_step": self.last_eval_step,
            "recipe": recipe(self.settings),
            "update": update_settings(self.settings),
            "saved_at": time.time(),
        }  # RNG: the trainer saves torch/python/numpy RNG state per rank; the data order is a function of (seed, epoch)
        started = time.perf_counter()
        if self.delivering is not None:  # the host holds one served copy at a time, and the checkpoint gathers one
            self.delivering.exception()  # (its figures and any error are the next publish's, or pump's, as ever)
        if self.lease is not None:
            self.lease.check()  # a learner that lost the run writes no step-N over the new holder's
        self.ranks.save(self.trainer, path, extra)
        self.records.sync()  # the ledger of the steps it holds outlives a power loss as the checkpoint does
        if self.lease is not None:
            self.lease.confirm()  # (nor commits one it wrote while losing it: asked of Redis, the moment before)
        self.checkpoints.commit(self.step)  # durable before held is released
        released = self.work.release()
        self.last_checkpoint_step = self.step
        log.info(
            "checkpoint %s (%.1fs); %d consumed groups released from held",
            path, time.perf_counter() - started, released,
        )
        return path

    # -- evaluation --------------------------------------------------------------------------------------------
    def eval_due(self, final: bool) -> bool:
        every = self.cfg.eval_every
        return every > 0 and (self.step % every == 0 or final)

    def eval_missing(self, resumed: bool) -> bool:
        """The baseline (step 0) has no evaluation yet, or a stop cut short the evaluation of the checkpointed step
        (the last one included): do it before training on."""
        if self.step == 0:
            return not (resumed and self.records.has_evaluation(0))
        # At total_steps only: the time limit counts this process's training, which has not begun.
        # metrics.jsonl too: a resume that redid it and was killed before the next checkpoint wrote it already.
        return (resumed and self.last_eval_step != self.step and self.eval_due(self.step >= self.cfg.total_steps)
                and not self.records.has_evaluation(self.step))

    def evaluation_line(self) -> None:
        """Evaluate the current version and record it on a line of its own: the baseline at step 0, or the
        evaluation of a step that a stop interrupted (its step line has none)."""
        summary = self.evaluate()
        if summary is None:
            return
        self.records.evaluation({"step": self.step, "version": self.policy.current, **summary, "time": time.time()})
        log.info("eval at step %d: accuracy %.3f on %d problems", self.step, summary["eval_accuracy"] or 0.0,
                 summary["eval_problems"])

    def drain_train(self) -> float:
        """Wait until no train prompt is in flight (their groups are admitted); the seconds it took.

        Run before an evaluation. Its seconds are left out of the training clock (learner.time_limit_minutes, the
        benchmarks' minutes), so nothing may be generated for training meanwhile: the push made before the update
        is finished here, on the training clock, where the next step's wait would have finished it.
        """
        started = time.perf_counter()
        while self.work.train_in_flight and not self.stopping.is_set():
            self.pump()
        return time.perf_counter() - started

    def evaluate(self) -> dict | None:
        """avg@n accuracy of the current version on the held-out problems, through generators and reward
        workers. Train groups keep being admitted meanwhile. None if there is nothing to evaluate or on stop."""
        if not self.eval_problems:
            return None
        version = self.policy.current
        tasks = [self.make_task(p, "eval", version) for p in self.eval_problems]
        round_ = EvalRound(self.step, version, {t.task_id for t in tasks}, started_at=time.time())
        started, logged = time.perf_counter(), time.perf_counter()
        with self.work.evaluating(round_, tasks):
            while not round_.done:
                if self.stopping.is_set():
                    return None
                self.pump()
                if time.perf_counter() - logged > PROGRESS_LOG_SECONDS:
                    logged = time.perf_counter()
                    log.info("eval at step %d: %d/%d problems back", self.step, len(round_.received), len(tasks))
        self.last_eval_step = self.step
        summary = round_.summary()
        summary["eval_seconds"] = time.perf_counter() - started
        self.eval_seconds += summary["eval_seconds"]
        self.records.tracking.log_samples(round_.examples, self.step)
        return summary

    def status(self) -> dict:
        return {
            "ready": self.ready,
            "step": self.step,
            "total_steps": self.cfg.total_steps,
            "version": self.policy.current,
            "world_size": self.ranks.world if self.ranks is not None else None,
            **(self.work.status() if self.work is not None else {}),
        }


def build_trainer(settings: Settings):
    from learner.trainer import Trainer

    return Trainer(settings, model_dir(settings))


def refuse_before_load(settings: Settings, processes: int) -> None:
    """What the compute settings cannot run on `processes` ranks, refused (ConfigError: exit 2, not restarted)
    before the model loads: after it, the error came minutes later at 32B, at every restart."""
    compute = settings.learner.compute
    if refusal := compute.ranks_refusal(processes):
        raise ConfigError(f"{refusal}: accelerate launch --num_processes")
    if compute.sequence_parallel > 1:
        from transformers import AutoConfig

        from learner.sequence_parallel import check_heads

        check_heads(AutoConfig.from_pretrained(model_dir(settings)), compute.sequence_parallel)


def main(settings: Settings) -> int:
    """`dapo learner`: serve weights over HTTP and train until learner.total_steps (SIGTERM: checkpoint, exit).

    Under `accelerate launch` every process joins the process group first; rank 0 runs the service, the others
    follow it (learner/ranks.py). Until the model is loaded a signal stops rank 0 at once (`services.startup`);
    then the first one finishes the step and checkpoints, a second one stops at once (after a weights delivery
    still running in the background: nothing of this learner is announced after its lease is gone)."""
    from datetime import timedelta

    import torch
    from accelerate import PartialState

    from learner import sharding

    die_with_launcher()  # a rank outlives no torchrun: SIGTERM, as torchrun's own stop, when it is killed
    load_signer(settings, "learner")  # its key first: a missing one fails before Redis, the lease or the model
    model_dir(settings)  # the dependencies first: fail in a second, not after loading
    # The process group first (gloo on CPU, NCCL on GPUs), with the timeout every collective gets.
    compute = settings.learner.compute
    timeout = timedelta(seconds=compute.collective_timeout_seconds)
    if torch.cuda.is_available() and compute.fsdp and compute.fsdp_offload and "LOCAL_RANK" in os.environ:
        # accelerate's group would be NCCL's alone (it adds gloo only under its own FSDP, which the trainer replaces)
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group(sharding.backend("cuda", offload=True), timeout=timeout)
    state = PartialState(cpu=not torch.cuda.is_available(), timeout=timeout)
    refuse_before_load(settings, state.num_processes)
    if state.num_processes > 1:
        check_shared(Path(settings.run_dir), state)
    if over_before_loading(settings):  # every rank alike: they read the same files
        return 0
    if not state.is_main_process:
        trainer = build_trainer(settings)
        return follow(trainer, RankChannel(trainer.accelerator))

    wait_for_redis(settings)
    service = LearnerService(settings)
    service.claim_run()  # first: a second learner on this run stops here, before it writes anything

    try:
        service.check_recipe()  # a checkpoint of another experiment: refused before the run's files are touched
        service.connect()
        service.start_http()
        service.export_stream_gauges()
        service.load()
        service.ranks.on_follower_signal = service.follower_signalled
        signal.signal(signal.SIGTERM, service.signalled)
        signal.signal(signal.SIGINT, service.signalled)
        return service.run()
    finally:
        try:
            service.stop_http()
            if service.records.tracking is not None:
                service.records.tracking.finish()
        finally:
            service.release_run()  # the last act: nothing of the run is written after it
