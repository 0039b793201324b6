"""The learner's working set: the tasks it issued, the scored groups it holds, and what the pipeline lost.

Exactly-once training across crashes. A scored group the learner keeps is moved atomically from `scored` into
the durable stream `dapo:{run}:held` (ack + XADD in one script), so nothing stays pending for long. `held` is
the working set: groups in hand, carried, and consumed since the last checkpoint. A checkpoint lists the task ids
consumed (trained, or aged out) since the previous one; once it is written those entries are deleted from `held`
(`release`). On resume: load the checkpoint, read `held`, delete the entries the checkpoint lists (a crash between
writing it and deleting them), re-admit the rest (`restore`). Groups trained after the checkpoint are re-admitted
and trained again by the restored model, so the surviving lineage trains each group once. Task ids are
deduplicated on every admission.

Provenance. The learner trains only what it asked for: every task it pushes is recorded first in the hash
`dapo:{run}:issued` (task id -> the task as sent), which lives in Redis and so survives a learner restart. A
scored group whose task id is not there, or whose task or rollout does not match the issued task (prompt,
token ids, sampling, n samples and n scores), goes to `dead` with the reason (`provenance: ...`); so does one
whose rollout is not as its generator signed it (`forged: ...`: a reward worker vouches for its scores only, the
generator's signature travels with the rollout, `Streams.rollout_refusal`). Entries are
removed once the group is settled (dropped, evaluated, or trained and checkpointed). Task and record are
written in one script, so after a Redis restart the tasks in flight missing from `issued` were lost with it.

Admission. A group of the task as issued is also checked for what the trainer needs (`shape_error`: n samples and
n scores, token ids in the model's vocabulary, at most max_tokens per sample, finite logprobs and rewards) before
it is held; one that fails goes to `dead` (`malformed: ...`) and its task is given up; so does one scored under other
reward settings than the learner's (`misscored: ...`, `reward_error`). Quarantine: an update that
raises counts a failure against every group of its batch (the hash `dapo:{run}:suspects`, in Redis: the process
dies next); the restarted learner retries them once, and dead-letters a group with QUARANTINE_AFTER failures
(`quarantined: ...`, with the error) instead of re-admitting it at every restart.

Losses. Prompts that died in the pipeline (poison, too many deliveries) and tasks a Redis restart lost are no
longer waited for: the batch assembler (and a running evaluation) stop counting on them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import msgpack
import numpy as np
import redis

from learner.batch import Batch, BatchAssembler, Push, task_id_of
from learner.deadlines import Deadlines
from learner.evaluation import EvalRound
from learner.policy import PolicyVersion
from learner.records import GeneratorClocks
from services import metrics
from services.config import LearnerConfig, RewardConfig
from services.messages import PromptTask, RolloutGroup, ScoredGroup, from_wire
from services.rewards import score_error
from services.streams import (
    CONSUMER_GROUPS,
    FIELD,
    FUTURE_ID_TOLERANCE_MS,
    ISSUED,
    MEMORY_TRIM_SHARE,
    Delivery,
    Streams,
    consumer_name,
    entry_ids_key,
    id_order,
    task_id_in_payload,
)

log = logging.getLogger(__name__)

HELD = "held"
SUSPECTS = "suspects"  # task id -> {"failures", "reason"}: updates that raised with the group in their batch
QUARANTINE_AFTER = 2  # such failures before a held group is dead-lettered (`quarantined: ...`): one retry
DATA_CURSOR = "data-cursor"  # where the training data stands after the last task pushed (TrainProblems.cursor)
CONSUME_BATCH = 64
DEAD_SCAN_SECONDS = 1.0
LETTERS_PER_SCAN = 256  # dead letters settled per scan (a few round trips each): a flood of them cannot stall a step
REPAIR_SCAN_SECONDS = 10.0  # how often the run's streams are checked for a last id set in the future (and weighed)
MAX_ABS_REWARD = 1e6  # a rule reward of +-1 plus the overlong penalty; far beyond it only a forged score
MAX_LOGPROB = 1e-3  # a log-probability is <= 0: above it by more than rounding, an engine's bug (logits, a sign)
MEMORY_WARN_SHARE = 0.8  # Redis past this share of its maxmemory: the log names its largest keys (DapoRedisMemoryHigh)
MEMORY_WARN_EVERY_S = 60.0
RUN_STREAMS = ("prompts", "rollouts", "scored", "dead", HELD)
# The streams a worker may add to (on Redis 6.2, which has no ACL selectors, its whole role's keys): those alone can
# hold an id a client chose. `held` is the learner's alone, written with XADD *: a clock stepped back makes its
# entries look dated in the future, and deleting them would lose groups in hand (`Streams.repair_future_ids`).
STAGE_STREAMS = tuple(CONSUMER_GROUPS)  # prompts, rollouts, scored: each read by a stage through its consumer group
WORKER_WRITTEN_STREAMS = (*STAGE_STREAMS, "dead")
DROP_KINDS = ("uninformative", "stale", "duplicate")


def provenance_error(group: ScoredGroup, issued: PromptTask | None, vocab_size: int,
                     rollout_refusal: Callable[[ScoredGroup], str | None]) -> str | None:
    """Why a scored group must not be trained (None if it may): the learner never issued its task id, the
    group's task does not match the task as issued (`provenance: ...`), its rollout is not as a generator wrote
    it (`forged: ...`, `rollout_refusal`: `Streams.rollout_refusal`; for both the genuine group may still come),
    or its samples are unusable (`malformed: ...`, `shape_error`: the task is given up, as for a dead prompt)."""
    task = group.rollout.task
    if issued is None:
        return f"provenance: unknown task id {task.task_id!r} (not issued by this run's learner)"
    if task != issued:
        changed = [name for name in PromptTask.model_fields if getattr(task, name) != getattr(issued, name)]
        return f"provenance: task {task.task_id} does not match the task as issued (differs in {', '.join(changed)})"
    return rollout_refusal(group) or shape_error(group, vocab_size)


def shape_error(group: ScoredGroup, vocab_size: int) -> str | None:
    """Why the trainer could not use a group of the task as issued (`malformed: ...`), None if it can: n samples and
    n scores, every token id in the embedding table [0, vocab_size), at most the task's max_tokens per sample, one
    finite logprob (at most 0) per token, finite rewards. Signed, and for the task as issued: the generator that took
    the prompt answered it so; none other will. Checked before the group is held, so no such group ever reaches an
    update (an out-of-range id raises in the embedding lookup, a NaN poisons the weights)."""
    rollout, task = group.rollout, group.rollout.task
    n = task.sampling.n
    if len(rollout.samples) != n or len(group.scores) != n:
        return (f"malformed: task {task.task_id} asked for n={n} samples; the group has {len(rollout.samples)} "
                f"samples and {len(group.scores)} scores")
    if error := rollout.malformed():
        return error
    for i, (sample, score) in enumerate(zip(rollout.samples, group.scores)):
        where = f"malformed: task {task.task_id} sample {i}"
        ids = sample.token_ids
        if ids and not 0 <= min(ids) <= max(ids) < vocab_size:  # ids may be any int: no fixed-width array
            position = next(j for j, token in enumerate(ids) if not 0 <= token < vocab_size)
            return (f"{where} token id {ids[position]} at position {position} is outside the vocabulary "
                    f"[0, {vocab_size})")
        if not np.isfinite(sample.logprobs).all():
            return f"{where} has a logprob that is not a finite number"
        if sample.logprobs and max(sample.logprobs) > MAX_LOGPROB:  # trained on, its importance weights are noise
            return f"{where} has the logprob {max(sample.logprobs):g}, above 0 (not a log-probability)"
        if not math.isfinite(score.reward):
            return f"{where} has the reward {score.reward}, not a finite number"
        if abs(score.reward) > MAX_ABS_REWARD:  # 1.7e308 and -1 give NaN advantages: a whole mini-batch skipped
            return f"{where} has the reward {score.reward:g}, beyond any rule's (at most {MAX_ABS_REWARD:g} in size)"
    return None


def text_error(group: ScoredGroup, decode: Callable[[list[int]], str] | None) -> str | None:
    """Why a sample's text is not its tokens decoded (`malformed: ...`; None if every one is, or no tokenizer is
    loaded): the reward is the text's, the update the tokens'. A generator that wrote a correct text beside other
    tokens would choose which tokens are rewarded, the reward role's call."""
    if decode is None:
        return None
    for i, sample in enumerate(group.rollout.samples):
        if sample.text != decode(sample.token_ids):
            return (f"malformed: task {group.rollout.task.task_id} sample {i} has a text that is not its token ids "
                    "decoded (what the reward read is not what would be trained)")
    return None


def reward_error(group: ScoredGroup, cfg: RewardConfig) -> str | None:
    """Why a score is not what the run's reward settings give its sample (`misscored: ...`; None if none is): its
    reward worker runs with another overlong buffer or penalty, the soft punishment switched otherwise, or the other
    answer rule (`services.rewards.score_error`). Trained, the policy would learn another reward than the run's."""
    max_tokens = group.rollout.task.sampling.max_tokens
    for i, (sample, score) in enumerate(zip(group.rollout.samples, group.scores)):
        if error := score_error(score, sample, max_tokens, cfg):
            return (f"misscored: task {group.rollout.task.task_id} sample {i} {error}: a reward worker runs with "
                    f"other reward settings than the learner's (worker {group.reward_worker_id or 'unnamed'})")
    return None


def quarantine_reason(suspect: dict | None) -> str | None:
    """The dead letter's reason for a group that updates failed with QUARANTINE_AFTER times (None below that)."""
    if suspect is None or suspect["failures"] < QUARANTINE_AFTER:
        return None
    return (f"quarantined: {suspect['failures']} updates failed with this group in their batch "
            f"(the last: {suspect['reason']})")


class WorkingSet:
    """A task's whole life in the learner: issued and pushed, its scored group read, checked and held, taken into
    a batch by its BatchAssembler (dynamic sampling), trained, checkpointed and settled; or lost, dropped or
    dead-lettered. The service speaks to it in verbs (`issue`, `next_batch`, `finish`, `evaluating`, `resume`,
    `checkpoint_state`, `release`) and reads `status()`."""

    def __init__(self, streams: Streams, learner_cfg: LearnerConfig, policy: PolicyVersion, reward_cfg: RewardConfig):
        self.streams = streams
        self.reward_cfg = reward_cfg  # what every score must say (`reward_error`)
        self.assembler = BatchAssembler.from_settings(learner_cfg, policy=policy)
        self.on_refill_limit = learner_cfg.batch.on_refill_limit
        self.version = lambda: policy.current  # learner/policy.py owns the number
        self.prompts = streams.stream("prompts", PromptTask)
        self.scored = streams.stream("scored", ScoredGroup)
        self.held = streams.stream(HELD, ScoredGroup)
        self.issued_key = streams.key(ISSUED)
        self.entry_ids_key = entry_ids_key(self.issued_key)  # task id -> its prompts entry id (Stream.produce)
        self.suspects_key = streams.key(SUSPECTS)
        self.suspects: set[str] = set()  # held groups an update failed with (fewer than QUARANTINE_AFTER times)
        # The model's embedding rows, from the model's config (0 refuses every token: `limit_vocabulary` first).
        self.vocab_size = 0
        # The tokenizer's decoding of sampled ids (`services.models.safe_decode`): what a sample's text must be
        # (`text_error`); None where no tokenizer is loaded (the learner's `load` sets it).
        self.decode: Callable[[list[int]], str] | None = None
        self.cursor_key = streams.key(DATA_CURSOR)
        # task id -> the data cursors before and after its problem was drawn (train tasks not pushed yet)
        self._cursors: dict[str, tuple[dict, dict]] = {}
        self.redis = streams.redis
        self.consumer = consumer_name("learner")
        self.outbox: deque[PromptTask] = deque()
        self.eval_round: EvalRound | None = None  # while `evaluating`
        self.consumed_since_checkpoint: set[str] = set()
        self.last_released: set[str] = set()  # what the last checkpoint's release deleted (`check_redis_restart`)
        self.drops: dict[str, list[str]] = {kind: [] for kind in DROP_KINDS}
        self.generator_clocks = GeneratorClocks()  # where the generators' time went (from the groups read)
        batch = learner_cfg.batch
        self.deadlines = Deadlines(batch.task_deadline_factor, batch.task_deadline_min_s,
                                   ceiling_s=batch.task_deadline_max_s)
        self._dead_cursor = streams.last_dead_letter_id()
        self._dead_scanned_at = 0.0
        self._repaired_at = 0.0
        self._memory_warned_at = float("-inf")
        self._redis_run_id: str | None = None

    # -- the service's verbs -----------------------------------------------------------------------------------
    def limit_vocabulary(self, size: int) -> None:
        """The model's embedding rows: a group with a token id at or past them is refused (before any is read)."""
        self.vocab_size = size

    def issue(self, tasks: list[PromptTask], version: int, cursors: list[tuple[dict, dict]] | None = None) -> None:
        """Training tasks for the policy `version`: counted in flight by the assembler, then queued for pushing;
        `cursors`: each task's data cursors before and after its problem was drawn (`push`)."""
        self.assembler.issued([t.task_id for t in tasks], version)
        self.push(tasks, cursors=cursors)

    def next_batch(self, version: int) -> Batch | Push:
        """The batch of this step when it is in hand (or the refill limit says to stop waiting), else the tasks to
        push now (possibly none) before reading on."""
        status = self.assembler.status(version)
        if status == "train":
            return self.assembler.take_batch(version)
        if status == "limit":
            return self.assembler.take_at_limit(version, self.on_refill_limit)
        return self.assembler.plan(version)

    def plan_ahead(self, version: int) -> Push:
        """The next step's tasks pushed while this one trains (none when max_staleness = 0)."""
        return self.assembler.plan(version, ahead=True)

    def finish(self, batch: Batch, version: int) -> list[int]:
        """A step took `batch` at policy `version`: its groups (and those aged out at the take) are consumed, released
        from `held` at the next checkpoint. Returns each trained group's lag behind `version`."""
        self.consumed(batch.task_ids)
        self.consumed(task_id_of(g) for g in batch.stale_at_take)
        return [self.assembler.lag(g, version) for g in batch.groups]

    @property
    def train_in_flight(self) -> bool:
        return bool(self.assembler.in_flight)

    @contextlib.contextmanager
    def evaluating(self, round_: EvalRound, tasks: list[PromptTask]):
        """Push the evaluation's tasks and route their groups to `round_` until the block ends; then forget those
        never pushed."""
        self.eval_round = round_
        self.push(tasks)
        try:
            yield round_
        finally:
            self.eval_round = None
            self.unqueue({t.task_id for t in tasks})

    def resume(self, step: int, state: dict) -> None:
        """From a checkpoint of `step` (its `checkpoint_state`): the batch warm-up goes on where it was, a late
        duplicate of a group it trained stays out, and `held` is re-admitted but for what it consumed."""
        self.assembler.start_at(step + 1)
        self.assembler.load_state(state["assembler"], trained=state["consumed"])
        self.restore(skip=set(state["consumed"]), counted=set(state["carried"]))

    def checkpoint_state(self) -> dict:
        return {
            "assembler": self.assembler.state(),  # the informative-ratio estimate
            "consumed": sorted(self.consumed_since_checkpoint),
            "carried": self.assembler.carried_ids,
        }

    def status(self) -> dict:
        return {
            "in_hand": len(self.assembler.ready),
            "in_flight": len(self.assembler.in_flight),
            "informative_ratio": self.assembler.ratio.value,
            "refills": self.assembler.refills,
            "evaluating": self.eval_round is not None,
        }

    # -- pushing -----------------------------------------------------------------------------------------------
    def push(self, tasks: list[PromptTask], cursors: list[tuple[dict, dict]] | None = None) -> None:
        """Queue tasks; `cursors`, the training data's position before and after each task's problem. The position
        after the last task pushed is kept in Redis: a resumed learner continues after the last problem it issued,
        whose groups survive the crash, not after the checkpoint's cursor (which would draw those problems a second
        time). A checkpoint takes the position before the first one still queued (`data_cursor`)."""
        self.outbox.extend(tasks)
        self._cursors.update(zip((t.task_id for t in tasks), cursors or ()))

    def data_cursor(self, drawn: dict) -> dict:
        """The data cursor a checkpoint keeps: `drawn` (after every problem drawn), or before the first train task
        still queued (a full prompts stream): a resume loses the queue, so it draws those problems again."""
        queued = next((self._cursors[t.task_id] for t in self.outbox if t.task_id in self._cursors), None)
        return queued[0] if queued is not None else drawn

    def unqueue(self, task_ids: set[str]) -> None:
        """Forget queued tasks that were never pushed (an evaluation that ended)."""
        self.outbox = deque(t for t in self.outbox if t.task_id not in task_ids)
        for task_id in task_ids:
            self._cursors.pop(task_id, None)

    def issued_data_cursor(self) -> dict | None:
        """The data cursor after the last training task pushed in this run (None if none was, or Redis lost it)."""
        raw = self.redis.get(self.cursor_key)
        return json.loads(raw) if raw else None

    def forget_run(self) -> None:
        """Starting over (`checkpoints.resume: false`): nothing of the run before trains in this one. Its held groups,
        its issued tasks (a group of one still in the pipeline is then refused as unknown), its suspects and data
        cursor go, and so do the entries still waiting in its streams (generators would sample them for nothing);
        its dead letters stay."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.delete(self.cursor_key, self.issued_key, entry_ids_key(self.issued_key), self.suspects_key, self.held.key)
        for name in STAGE_STREAMS:
            pipe.xtrim(self.streams.key(name), maxlen=0)
        pipe.execute()

    def flush_outbox(self) -> None:
        """Produce queued tasks while the prompts stream has room (never block on back-pressure: keep reading)."""
        room = self.prompts.room() if self.outbox else 0
        pushed_cursor = None
        try:
            while self.outbox and room > 0:
                task = self.outbox.popleft()
                try:  # recorded as issued (ground truth included), atomically; generators get no ground truth
                    self.prompts.produce(task.for_generators(), register=(self.issued_key, task.task_id, task))
                except redis.ResponseError as err:
                    if " ID" not in str(err):
                        raise
                    self.outbox.appendleft(task)  # a client set the stream's last id in the future: repair, go on
                    self.streams.repair_future_ids(["prompts"])
                    return
                self.deadlines.pushed(task.task_id, time.monotonic())
                room -= 1
                if (cursors := self._cursors.pop(task.task_id, None)) is not None:
                    pushed_cursor = cursors[1]
        finally:
            if pushed_cursor is not None:  # a crash before this line draws these problems again: rare, harmless
                self.redis.set(self.cursor_key, json.dumps(pushed_cursor))

    def issued_task(self, task_id: str) -> PromptTask | None:
        raw = self.redis.hget(self.issued_key, task_id)
        return from_wire(PromptTask, raw) if raw else None

    def settle(self, task_ids) -> None:
        """Forget issued tasks whose groups are settled (dropped, evaluated, lost, or trained and checkpointed)."""
        task_ids = list(task_ids)
        pipe = self.redis.pipeline(transaction=False)
        for i in range(0, len(task_ids), 500):
            pipe.hdel(self.issued_key, *task_ids[i : i + 500])
            pipe.hdel(self.entry_ids_key, *task_ids[i : i + 500])
        pipe.execute()

    # -- reading -----------------------------------------------------------------------------------------------
    def pump(self) -> None:
        """Flush the outbox, read scored groups (blocking up to block_ms), look for dead prompts."""
        self.flush_outbox()
        for delivery in self.scored.consume(self.consumer, count=CONSUME_BATCH):
            self.handle(delivery)
        if time.monotonic() - self._dead_scanned_at >= DEAD_SCAN_SECONDS:
            self.redis_memory()
            self.scan_dead_letters()
            self.expire_overdue()
        if time.monotonic() - self._repaired_at >= REPAIR_SCAN_SECONDS:
            self._repaired_at = time.monotonic()
            self.streams.repair_future_ids(WORKER_WRITTEN_STREAMS)
            self.streams.delete_orphans(STAGE_STREAMS)
            self.streams.sweep_groups(STAGE_STREAMS)
            self.weigh_keys()

    def handle(self, delivery: Delivery[ScoredGroup]) -> None:
        group = delivery.message
        task_id = task_id_of(group)
        if task_id not in self.assembler.seen:  # a duplicate of a settled group is dropped below, not checked
            reason = (provenance_error(group, self.issued_task(task_id), self.vocab_size, self.streams.rollout_refusal)
                      or text_error(group, self.decode) or reward_error(group, self.reward_cfg))
        else:  # but one its reward worker rewrote is that worker's forgery, in the dead letters for all to see
            reason = self.streams.rollout_refusal(group)
        if reason is not None:
            self.scored.reject(delivery, reason)
            return
        self.deadlines.returned(task_id, time.monotonic())  # after the checks: a forged group must not stop the clock
        metrics.learner_progressed()
        self.generator_clocks.observe(group)
        if group.rollout.task.split == "eval":
            if self.eval_round is None or not self.eval_round.add(group):
                log.debug("ignoring eval group %s (not part of a running evaluation)", task_id)
            self.scored.ack(delivery)
            self.settle([task_id])
            return
        verdict = self.assembler.admit(group, self.version())
        if verdict == "informative":
            if not self.scored.forward(delivery, self.held, group, idempotent=True):
                self.assembler.retract(group)  # reclaimed meanwhile: it comes back and is admitted then
                self.deadlines.pushed(task_id, time.monotonic())  # and is given up if it never does
            return
        self.scored.ack(delivery)
        if verdict != "duplicate":
            self.settle([task_id])
        self.drops[verdict].append(task_id)
        if verdict == "uninformative":
            metrics.LEARNER_UNINFORMATIVE.inc()
        elif verdict == "stale":
            metrics.LEARNER_STALE.inc()

    def take_drops(self) -> dict[str, list[str]]:
        """The task ids dropped since the last call, by kind (for the ledger)."""
        drops, self.drops = self.drops, {kind: [] for kind in DROP_KINDS}
        return drops

    # -- losses ------------------------------------------------------------------------------------------------
    def check_redis_restart(self) -> None:
        """After a Redis restart, prompts pushed after the last write its AOF kept (a machine crash loses up to
        a second with appendfsync everysec) will never come back: stop waiting for them. A task and its record
        in `issued` are written atomically, so a task missing from `issued` was never pushed as far as Redis
        knows."""
        run_id = self.streams.server_run_id()
        previous, self._redis_run_id = self._redis_run_id, run_id
        if previous is None or previous == run_id:
            return
        # The last release may have been lost with the AOF's last second (a host crash): its groups would stay in
        # `held`, listed by no later checkpoint, and a later resume would train them again.
        self._delete_consumed(self.last_released)
        waiting = list(self.assembler.in_flight)
        if self.eval_round is not None:
            waiting += [t for t in self.eval_round.expected if t not in self.eval_round.received]
        queued = {task.task_id for task in self.outbox}  # not pushed yet: not in `issued` either
        waiting = [task_id for task_id in waiting if task_id not in queued]
        known = self.redis.hmget(self.issued_key, waiting) if waiting else []
        lost = self.lose([task_id for task_id, raw in zip(waiting, known) if raw is None])
        log.warning("Redis restarted (run id %s); %d tasks in flight were lost with it", run_id[:8], sum(lost))

    def scan_dead_letters(self) -> None:
        """Tasks that died in the pipeline (poison, too many deliveries, malformed) will never be scored: stop
        waiting. Which task a letter retires is read from Redis, not from the letter (`Streams.settle_dead_letter`):
        a worker can retire only an entry it held and parked, and letters for forged, altered or oversize entries
        retire none (the genuine group of the task they name may still come); letters no service signed are
        skipped (anyone who can write to Redis could add one)."""
        self._dead_scanned_at = time.monotonic()
        self.check_redis_restart()
        self._dead_cursor, letters = self.streams.dead_letters_after(self._dead_cursor, count=LETTERS_PER_SCAN)
        lost = [task_id for _, fields in letters
                if (task_id := self.streams.settle_dead_letter(fields))]
        gone, eval_gone = self.lose(lost)
        if gone or eval_gone:
            log.warning("%d train and %d eval tasks died in the pipeline (see the dead stream)", gone, eval_gone)

    def settle_parked_letters(self) -> None:
        """After a (re)start: settle the workers' letters that no learner has (written while none ran, or just before
        the last one ended; the scan reads on from the newest letter at start). A parked entry waits in its
        stream's consumer group for the learner to settle its letter: the letters naming one still parked are read
        back from the oldest such entry's time, and only those settled (the others were, by the last learner)."""
        parked = {(name, entry_id) for name, model in (("prompts", PromptTask), ("rollouts", RolloutGroup))
                  for entry_id in self.streams.stream(name, model).parked()}
        if not parked:
            return
        end = id_order(self._dead_cursor)
        # A letter follows its entry, but a worker may date an entry up to FUTURE_ID_TOLERANCE_MS ahead (an XADD id)
        oldest = min(id_order(entry_id)[0] for _, entry_id in parked)
        cursor = f"{max(oldest - FUTURE_ID_TOLERANCE_MS - 1, 0)}-0"
        lost, settled = [], 0
        while id_order(cursor) < end:
            after, letters = self.streams.dead_letters_after(cursor, count=LETTERS_PER_SCAN)
            if after == cursor:
                break
            cursor = after
            for entry_id, fields in letters:
                if id_order(entry_id) > end:
                    break  # the scan's own from here
                named = (fields.get(b"stream", b"").decode(errors="replace"),
                         fields.get(b"entry_id", b"").decode(errors="replace"))
                if named in parked:
                    parked.discard(named)  # settled once: a second letter for it would find it gone
                    settled += 1
                    if task_id := self.streams.settle_dead_letter(fields):
                        lost.append(task_id)
        gone, eval_gone = self.lose(lost)
        log.info("%d dead letters no learner had settled: %d train and %d eval tasks given up", settled, gone,
                 eval_gone)

    def expire_overdue(self) -> None:
        """Tasks past their deadline (learner/deadlines.py) are not waited for any more: their entry may have been
        deleted or trimmed, or a worker holds them and never answers. Counted lost (the step refills, an evaluation
        or a drain goes on) and forgotten in `issued`: a group that still comes is refused as unknown. Not those no
        generator has read yet: they wait on."""
        overdue = self.deadlines.overdue(time.monotonic(), queued=self.unread)
        gone, eval_gone = self.lose(overdue)
        metrics.LEARNER_TASKS_EXPIRED.inc(len(overdue))  # a previous process's tasks too (no step awaits them)
        if overdue:
            log.warning("%d tasks passed their deadline (%.3g s after the push, or after this process started for "
                        "a previous one's): forgotten, %d of this step's and %d of the evaluation's counted lost",
                        len(overdue), self.deadlines.limit_s(), gone, eval_gone)

    def unread(self, task_ids: list[str]) -> set[str]:
        """Of `task_ids`, those whose `prompts` entry no generator has read yet: waiting, not lost."""
        entries = {}
        for i in range(0, len(task_ids), 500):
            chunk = task_ids[i : i + 500]
            found = self.redis.hmget(self.entry_ids_key, chunk)
            entries |= {raw.decode(): task_id for task_id, raw in zip(chunk, found) if raw}
        waiting = {entries[entry_id] for entry_id in self.streams.unread("prompts", entries)}
        if waiting:
            log.warning("%d tasks past their deadline are still unread in prompts (no generator has taken them: too "
                        "few generators, or none up yet): they wait on", len(waiting))
        return waiting

    def lose(self, task_ids: list[str]) -> tuple[int, int]:
        """Stop waiting for tasks whose groups will never come: forgotten in `issued` and by the deadlines, counted
        lost in the step and in a running evaluation. Returns how many of each were still awaited."""
        if not task_ids:
            return 0, 0
        self.settle(task_ids)
        self.deadlines.forget(task_ids)
        gone = self.assembler.lost(task_ids)
        return gone, self.eval_round.mark_lost(task_ids) if self.eval_round is not None else 0

    # -- held: the durable working set -------------------------------------------------------------------------
    def redis_memory(self) -> tuple[int, int]:
        """Redis' used memory and maxmemory (0: no limit), bytes, also set on /metrics (the alerts watch them)."""
        used, maxmemory = self.streams.memory()
        metrics.REDIS_USED_MEMORY.set(used)
        metrics.REDIS_MAXMEMORY.set(maxmemory)
        return used, maxmemory

    def weigh_keys(self) -> dict[str, int]:
        """What fills Redis: the bytes of each of the run's streams and hashes, on /metrics; past MEMORY_WARN_SHARE
        of maxmemory (writes are refused at it) the log names the largest, with their sizes, once a minute, so
        that the process that fills it can be found (a stream's producer, `held` waiting for a checkpoint...)."""
        # (`weights:members`: the generators' broadcast memberships, which any generator may write)
        sizes = self.streams.key_memory([*RUN_STREAMS, ISSUED, entry_ids_key(ISSUED), "weights:members"])
        for name, size in sizes.items():
            metrics.REDIS_KEY_MEMORY.labels(name).set(size)
        used, maxmemory = self.redis_memory()
        now = time.monotonic()
        if maxmemory and used >= MEMORY_WARN_SHARE * maxmemory and now - self._memory_warned_at >= MEMORY_WARN_EVERY_S:
            self._memory_warned_at = now
            largest = sorted(sizes.items(), key=lambda item: -item[1])[:3]
            log.warning("Redis uses %.0f%% of its maxmemory (%d MB); the largest keys of this run: %s",
                        100 * used / maxmemory, maxmemory // 2**20,
                        ", ".join(f"{name} {size / 2**20:.1f} MB" for name, size in largest))
        if maxmemory and used >= MEMORY_TRIM_SHARE * maxmemory:
            self.streams.trim_overfull()
        return sizes

    def consumed(self, task_ids) -> None:
        """Groups trained (or aged out) by a step: released from `held` at the next checkpoint."""
        self.consumed_since_checkpoint.update(task_ids)

    def release(self) -> int:
        """A checkpoint now lists the consumed groups: delete them from `held` and `issued`."""
        consumed, self.consumed_since_checkpoint = self.consumed_since_checkpoint, set()
        self.last_released = consumed
        return self._delete_consumed(consumed)

    def _delete_consumed(self, consumed: set[str]) -> int:
        if not consumed:
            return 0
        doomed = [eid for eid, fields in self.held.entries() if task_id_in_payload(HELD, fields.get(FIELD)) in consumed]
        self.held.delete(doomed)
        self.settle(consumed)
        return len(doomed)

    def restore(self, skip: set[str], counted: set[str]) -> None:
        """After a (re)start: re-admit `held` (minus what the checkpoint consumed), then take over the scored
        groups a previous learner process was given and never settled. Every task a previous process issued gets
        a deadline from now: its group is still welcome until then, and past it the task is forgotten in `issued`
        (and `issued:entries`) instead of staying there for good when its group never comes."""
        now = time.monotonic()
        for task_id, _ in self.redis.hscan_iter(self.issued_key, count=1000):
            self.deadlines.pushed(task_id.decode(), now)
        outcome, in_hand = self.readmit_held(skip, counted)
        self.deadlines.forget(sorted(in_hand))  # their groups are here: nothing more to wait for
        self.settle_parked_letters()
        claimed = self.claim_pending()
        if any(outcome.values()) or claimed:
            log.info(
                "working set: %d groups re-admitted, %d already consumed, %d dropped, %d garbled, %d refused "
                "(malformed or quarantined); %d pending claimed",
                outcome["kept"], outcome["skipped"], outcome["dropped"], outcome["garbled"], outcome["refused"],
                claimed,
            )

    def readmit_held(self, skip: set[str], counted: set[str]) -> tuple[dict[str, int], set[str]]:
        """Re-admit the working set after a restart: skip (and delete) what the checkpoint consumed; groups in
        `counted` were already counted in the checkpointed statistics (carried), the others are counted again.
        A group the trainer cannot use (`shape_error`), or that was in the batch of QUARANTINE_AFTER updates that
        raised, is dead-lettered with the reason: a group that crashes every update is not re-admitted at every
        restart. Returns the outcome's counts and the tasks whose group `held` holds."""
        outcome = {"kept": 0, "skipped": 0, "dropped": 0, "garbled": 0, "refused": 0}
        in_hand: set[str] = set()
        doomed = []
        version = self.version()
        suspects = {task_id.decode(): json.loads(raw) for task_id, raw in self.redis.hgetall(self.suspects_key).items()}
        kept = set()
        for entry_id, fields in self.held.entries():
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
            in_hand.add(task_id)
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
            refused = shape_error(group, self.vocab_size) or quarantine_reason(suspects.get(task_id))
            if refused:
                self.held.dead(entry_id, payload, refused[:2000])
                outcome["refused"] += 1
                continue
            verdict = self.assembler.admit(group, version, fresh=task_id not in counted, observe=False)
            if verdict == "informative":
                outcome["kept"] += 1
                kept.add(task_id)
            else:
                if verdict == "duplicate":  # another entry of the task is the one kept: delete this one alone
                    doomed.append(entry_id)
                else:  # held until the next checkpoint lists it: a kill before then drops it again, in the ledger
                    self.consumed([task_id])
                outcome["dropped"] += 1
                self.drops[verdict].append(task_id)
        self.held.delete(doomed)
        self.suspects = kept & suspects.keys()
        if settled := suspects.keys() - self.suspects:  # quarantined, or no longer held
            self.redis.hdel(self.suspects_key, *settled)
        return outcome, in_hand

    # -- quarantine --------------------------------------------------------------------------------------------
    def suspect(self, task_ids: list[str], reason: str) -> None:
        """An update raised with these groups in its batch: count it against each, in Redis (the process ends
        next). A group counted QUARANTINE_AFTER times is dead-lettered when the restarted learner reads `held`."""
        known = self.redis.hmget(self.suspects_key, task_ids) if task_ids else []
        counts = {task_id: json.dumps({"failures": (json.loads(raw)["failures"] if raw else 0) + 1, "reason": reason})
                  for task_id, raw in zip(task_ids, known)}
        if counts:
            self.redis.hset(self.suspects_key, mapping=counts)

    def trained(self, task_ids: list[str]) -> None:
        """An update with these groups went through: an earlier failure with them was not theirs."""
        cleared = self.suspects.intersection(task_ids)
        if cleared:
            self.redis.hdel(self.suspects_key, *cleared)
            self.suspects -= cleared

    def claim_pending(self) -> int:
        """Take over every scored group a previous learner process was given and never settled (there is one
        learner, so whoever holds them is dead) and handle them now instead of after the visibility timeout."""
        # At most CONSUME_BATCH entries are ever pending (each read is settled before the next): one call takes all.
        claimed = self.scored.take_over(self.consumer, count=10 * CONSUME_BATCH)
        for delivery in self.scored.recover(self.consumer, count=max(claimed, 1)):
            self.handle(delivery)
        return claimed
