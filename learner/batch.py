"""Batch assembly with dynamic sampling (DAPO §3.2, the constraint of Eq. 11) as a pure state machine.

No Redis, no HTTP: the learner service tells it which prompts it pushed and which scored groups arrived, asks
it how many prompts to push, and takes batches from it. Everything here is decided from those calls alone.

Vocabulary (k = max_staleness, B = prompts_per_step, B_t = the target of rollout step t)
  ready      informative groups in hand, carried surplus included, oldest policy first.
  in flight  train prompts pushed and not scored yet.
  ratio r    running estimate of the share of pushed prompts that come back usable (informative, fresh),
             from decayed counts with a weak prior of 1/2 (the first push of a run is 2 B); without dynamic
             sampling every fresh group is usable: a prior of 1, and B prompts a step.
  supply     ready + r * in_flight: the informative groups expected without pushing anything more.

Rules
  warm-up    B_t = ceil(B t / W) over the first W = batch_warmup_steps steps, then B (W = 0: B from step 1,
             the paper): the first updates come after a fraction of a full step's generation.
  sizing     a push covers the expected deficit B - supply, times the over-sampling factor
             clamp(m / r, oversample_min, oversample_max): sized from the observed ratio, not a fixed multiple
             (m = 1 without dynamic sampling: nothing is filtered out to hedge against).
             The margin m (oversample_margin, 1 = push the expected need) buys fewer refill rounds: a push sized
             at exactly the expected need falls short about every other step (the informative count of a push
             scatters around its mean), and each refill waits a whole generation.
  refills    after a step's first push, push again only once the shortfall is certain: even if every prompt in
             flight came back informative, the step would still miss B (ready + in_flight < B). Each such push
             is one refill round. After max_refills rounds nothing more is pushed; once the last prompt in flight
             is back the step is at its limit: the service trains on what is in hand or stops (on_refill_limit).
  staleness  a group whose policy is more than k versions behind the learner is dropped, on arrival and again
             when the batch is taken (carried groups age). A group from a version ahead of the learner is dropped
             the same way. Version jumps made at a resume are discounted (learner/policy.py).
  pacing     what is pushed now is sampled with the current version V or later, and each version consumes B
             groups, so the supply must not exceed what versions V..V+k can train on: (k + 1) * B while the step
             at V is being collected, k * B when pushing ahead of training step V (its batch already taken);
             under the warm-up, the sum of the targets of those k + 1 (or k) steps.
             With k = 0 nothing is pushed ahead, and a step trains once every prompt in flight is back: the
             synchronous on-policy loop (push, wait for all, train, publish). A factor above 1 / r (the margin,
             or a configured oversample_min) widens the bound by the same factor (the margin asked for is pushed).
             Pacing instead of drop-and-requeue: requeued prompts with long answers would go stale again and
             again and never be trained.
  carry-over surplus informative groups stay in `ready` for the next step (oldest policy first, so they are
             trained before they age out).
  dedupe     a task id is admitted once (delivery is at least once).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Iterable, Literal

from learner.dapo import FilterMetric, LinearWarmup, filter_values, is_informative
from learner.policy import PolicyVersion
from services.messages import ScoredGroup

Admission = Literal["informative", "uninformative", "stale", "duplicate"]
Status = Literal["train", "wait", "limit"]


def _ceil(x: float) -> int:
    """Ceiling that ignores floating-point dust (2.0000000001 -> 2): counts of prompts from estimates."""
    return math.ceil(x - 1e-6)


def warmed_up_target(prompts_per_step: int, warmup_steps: int, step: int) -> int:
    """B_t, the informative groups rollout step `step` (from 1) trains on: ceil(B t / W) for t < W, then B."""
    return max(1, _ceil(prompts_per_step * LinearWarmup(warmup_steps)(step - 1)))


class RefillLimitReached(RuntimeError):
    """learner.batch.on_refill_limit = stop, and a step could not gather B informative groups."""


def group_rewards(group: ScoredGroup) -> list[float]:
    return [score.reward for score in group.scores]


def task_id_of(group: ScoredGroup) -> str:
    return group.rollout.task.task_id


class InformativeRatio:
    """Running estimate of P(a pushed prompt yields a usable group): counts that decay with `memory` groups.

    A prior of `prior` with weight `prior_weight` groups keeps the estimate away from 0 (no division by zero,
    no runaway sizing before evidence) and is forgotten as real observations accumulate.
    """

    def __init__(self, memory: float = 256.0, prior: float = 0.5, prior_weight: float = 2.0):
        if memory < 1 or not 0.0 < prior <= 1.0 or prior_weight <= 0:
            raise ValueError("memory >= 1, 0 < prior <= 1 and prior_weight > 0 required")
        self.decay = 1.0 - 1.0 / memory
        self.prior, self.prior_weight = prior, prior_weight
        self.usable = 0.0
        self.seen = 0.0

    def observe(self, usable: bool) -> None:
        self.usable = self.usable * self.decay + (1.0 if usable else 0.0)
        self.seen = self.seen * self.decay + 1.0

    def withdraw(self, usable: bool) -> None:
        """Take back one recent observation (its group will be observed again when it is delivered again)."""
        self.usable = max(self.usable - (1.0 if usable else 0.0), 0.0)
        self.seen = max(self.seen - 1.0, 0.0)

    @property
    def value(self) -> float:
        return (self.usable + self.prior * self.prior_weight) / (self.seen + self.prior_weight)

    def oversample(self, low: float, high: float, margin: float = 1.0) -> float:
        """The over-sampling factor margin / r, bounded to [low, high]."""
        return min(max(margin / self.value, low), high)

    def state(self) -> dict:
        return {"usable": self.usable, "seen": self.seen}

    def load_state(self, state: dict) -> None:
        self.usable, self.seen = float(state["usable"]), float(state["seen"])


class RecentIds:
    """A set of the most recent `capacity` ids (duplicates arrive close together: redeliveries)."""

    def __init__(self, capacity: int):
        self.capacity = max(1, capacity)
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, task_id: str) -> None:
        self._ids[task_id] = None
        self._ids.move_to_end(task_id)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def discard(self, task_id: str) -> None:
        self._ids.pop(task_id, None)

    def __contains__(self, task_id: str) -> bool:
        return task_id in self._ids

    def __len__(self) -> int:
        return len(self._ids)


@dataclass
class StepStats:
    """What happened to the train groups that arrived during one step (before filtering)."""

    scored: int = 0  # non-duplicate train groups that arrived
    informative: int = 0
    uninformative: int = 0
    stale_dropped: int = 0
    duplicates: int = 0
    lost: int = 0  # prompts that died in the pipeline (dead letters)
    reward_sum: float = 0.0  # over every sample of every scored group: the unfiltered reward
    correct: int = 0
    samples: int = 0

    def count_scored(self, group: ScoredGroup, sign: int = 1) -> None:
        """Count a scored group's arrival (sign -1: take it back)."""
        rewards = group_rewards(group)
        self.scored += sign
        self.reward_sum += sign * sum(rewards)
        self.samples += sign * len(rewards)
        self.correct += sign * sum(1 for s in group.scores if s.correct)

    @property
    def reward_all(self) -> float | None:
        return self.reward_sum / self.samples if self.samples else None

    @property
    def accuracy_all(self) -> float | None:
        return self.correct / self.samples if self.samples else None

    @property
    def informative_share(self) -> float | None:
        return self.informative / self.scored if self.scored else None


@dataclass
class Batch:
    """The groups one training step uses, and how they were gathered."""

    groups: list[ScoredGroup]
    target: int
    refills: int
    refill_limit_hit: bool
    stats: StepStats
    informative_ratio: float  # the running estimate when the batch was taken
    stale_at_take: list[ScoredGroup] = field(default_factory=list)  # carried groups that aged out

    @property
    def task_ids(self) -> list[str]:
        return [task_id_of(g) for g in self.groups]

    @property
    def short_by(self) -> int:
        return max(0, self.target - len(self.groups))


@dataclass(frozen=True)
class Push:
    count: int
    refill: bool  # a refill round (as opposed to the step's first allocation)


class BatchAssembler:
    """Decides what to push, what to keep, what to drop, and when a batch is ready."""

    def __init__(
        self,
        target: int,
        *,
        warmup_steps: int = 0,
        max_staleness: int = 0,
        dynamic_sampling: bool = True,
        max_refills: int = 10,
        oversample_min: float = 1.0,
        oversample_max: float = 16.0,
        oversample_margin: float = 1.0,
        filter_metric: FilterMetric = "acc",
        ratio: InformativeRatio | None = None,
        dedupe_capacity: int | None = None,
        policy: PolicyVersion | None = None,
    ):
        if target < 1:
            raise ValueError("prompts_per_step must be >= 1")
        if max_staleness < 0 or max_refills < 0 or warmup_steps < 0:
            raise ValueError("max_staleness, max_refills and warmup_steps must be >= 0")
        if not 0 < oversample_min <= oversample_max:
            raise ValueError("need 0 < oversample_min <= oversample_max")
        if oversample_margin < 1:
            raise ValueError("oversample_margin must be >= 1 (1 = push the expected need)")
        self.prompts_per_step, self.warmup_steps = target, warmup_steps
        self.step = 1  # the rollout step being collected (learner.step + 1), for the batch warm-up
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.max_refills = max_refills
        self.oversample_min, self.oversample_max = oversample_min, oversample_max
        self.oversample_margin = oversample_margin
        self.filter_metric = filter_metric
        # Without dynamic sampling every group is usable: the estimate starts at 1 and drops only with stale groups.
        prior = 0.5 if dynamic_sampling else 1.0
        self.ratio = ratio or InformativeRatio(memory=max(64.0, 4.0 * target), prior=prior)
        self.seen = RecentIds(dedupe_capacity or max(10_000, int(8 * target * oversample_max)))
        self.ready: list[tuple[int, int, ScoredGroup]] = []  # (policy version, arrival, group)
        self.in_flight: dict[str, int] = {}  # task id -> learner version when pushed
        self.policy = policy or PolicyVersion()  # owned by the service; read here for staleness (its jumps)
        self._arrivals = 0
        self._first_push_done = False
        self.refills = 0
        self.stats = StepStats()

    # -- what to push ---------------------------------------------------------------------------------------
    @classmethod
    def from_settings(cls, learner_cfg, **kwargs) -> "BatchAssembler":
        return cls(
            learner_cfg.batch.prompts_per_step,
            warmup_steps=learner_cfg.batch.warmup_steps,
            max_staleness=learner_cfg.batch.max_staleness,
            dynamic_sampling=learner_cfg.batch.dynamic_sampling,
            filter_metric=learner_cfg.batch.filter_metric,
            max_refills=learner_cfg.batch.max_refills,
            oversample_min=learner_cfg.batch.oversample_min,
            oversample_max=learner_cfg.batch.oversample_max,
            oversample_margin=learner_cfg.batch.oversample_margin,
            **kwargs,
        )

    def target_at(self, step: int) -> int:
        """B_t of rollout step `step` under this assembler's warm-up."""
        return warmed_up_target(self.prompts_per_step, self.warmup_steps, step)

    @property
    def target(self) -> int:
        """B_t of the step being collected."""
        return self.target_at(self.step)

    def start_at(self, step: int) -> None:
        """The next batch taken is rollout step `step` (a resume picks up the warm-up where it was)."""
        self.step = step

    def lag(self, group: ScoredGroup, version: int) -> int:
        """Versions the group's policy is behind `version` (negative: ahead), across resume jumps."""
        return self.policy.lag(group.rollout.policy_version, version)

    def too_stale(self, group: ScoredGroup, version: int) -> bool:
        lag = self.lag(group, version)
        return lag > self.max_staleness or lag < 0

    def in_hand(self, train_version: int) -> int:
        """Groups in hand that will still be within the staleness bound when trained at `train_version`."""
        return sum(1 for _, _, g in self.ready if not self.too_stale(g, train_version))

    def supply(self, train_version: int) -> float:
        return self.in_hand(train_version) + self.ratio.value * len(self.in_flight)

    def oversample_factor(self) -> float:
        """margin / r, bounded; without dynamic sampling no margin (nothing is filtered out: 1 / r, 1 until groups
        go stale), so the GRPO baseline pushes its B prompts a step, not more."""
        margin = self.oversample_margin if self.dynamic_sampling else 1.0
        return self.ratio.oversample(self.oversample_min, self.oversample_max, margin)

    def supply_cap(self, ahead: bool) -> float:
        """Pacing: the most informative groups versions V..V+k can train on (k * B when pushing ahead).

        Scaled by the hedge the margin (or a configured oversample_min) adds on top of 1 / r, so that the margin
        the user asked for is pushed, not clipped away by the bound it was meant to protect.
        """
        hedge = max(1.0, self.oversample_factor() * self.ratio.value)
        steps = range(self.step, self.step + self.max_staleness + (0 if ahead else 1))
        return sum(self.target_at(t) for t in steps) * hedge

    def admission_room(self, version: int, ahead: bool = False) -> int:
        """How many prompts can be pushed at learner version `version` within the staleness bound (expected)."""
        train_version = version + 1 if ahead else version
        return max(0, _ceil((self.supply_cap(ahead) - self.supply(train_version)) / self.ratio.value))

    def shortfall_certain(self, version: int) -> bool:
        """Even if every prompt in flight came back informative, the step at `version` would miss B."""
        return self.in_hand(version) + len(self.in_flight) < self.target

    def plan(self, version: int, ahead: bool = False) -> Push:
        """How many train prompts to push now, the learner being at `version`.

        `ahead=True`: the batch of the step training at `version` is already taken and this is the next step's
        first allocation, pushed before training so generation overlaps it (only when max_staleness > 0).
        """
        if ahead and self.max_staleness == 0:
            return Push(0, refill=False)  # synchronous: the next step's prompts wait for the new weights
        refill = self._first_push_done
        if refill:
            if not self.shortfall_certain(version) or self.refills >= self.max_refills:
                return Push(0, refill=True)
        deficit = self.target - self.supply(version + 1 if ahead else version)
        count = 0
        if deficit > 0:
            count = min(_ceil(deficit * self.oversample_factor()), self.admission_room(version, ahead))
        self._first_push_done = True
        if refill and count > 0:
            self.refills += 1
        return Push(count, refill=refill and count > 0)

    def issued(self, task_ids: Iterable[str], version: int) -> None:
        """Train prompts were pushed (pushed at learner version `version`)."""
        for task_id in task_ids:
            self.in_flight[task_id] = version

    def lost(self, task_ids: Iterable[str]) -> int:
        """Prompts that will never come back (dead letters); returns how many were in flight."""
        gone = 0
        for task_id in task_ids:
            if self.in_flight.pop(task_id, None) is not None:
                gone += 1
        self.stats.lost += gone
        return gone

    def forget_in_flight(self) -> None:
        """Forget every prompt in flight (after a restart their groups still arrive, as unexpected ones)."""
        self.in_flight.clear()

    # -- what arrives ---------------------------------------------------------------------------------------
    def is_usable(self, group: ScoredGroup) -> bool:
        if not self.dynamic_sampling:
            return True
        correct = [score.correct for score in group.scores]
        return is_informative(filter_values(correct, group_rewards(group), self.filter_metric))

    def admit(self, group: ScoredGroup, version: int, *, fresh: bool = True, observe: bool = True) -> Admission:
        """Classify an arriving train group; informative ones join `ready`.

        `fresh=False` re-admits a group already counted before (the working set read back after a restart):
        it is not counted in the step's statistics again. `observe=False` keeps it from the ratio estimate: the
        working set holds only groups that were informative when they arrived, a biased sample of what a push
        yields (and after a restart those of a discarded lineage come back stale), so only groups arriving from
        the stream estimate the ratio.
        """
        task_id = task_id_of(group)
        if task_id in self.seen:
            self.stats.duplicates += 1
            return "duplicate"
        self.seen.add(task_id)
        self.in_flight.pop(task_id, None)
        stale = self.too_stale(group, version)
        usable = self.is_usable(group)
        if fresh:
            self.stats.count_scored(group)
        if fresh and observe:
            self.ratio.observe(usable and not stale)
        if stale:
            if fresh:
                self.stats.stale_dropped += 1
            return "stale"
        if not usable:
            if fresh:
                self.stats.uninformative += 1
            return "uninformative"
        if fresh:
            self.stats.informative += 1
        self._arrivals += 1
        self.ready.append((group.rollout.policy_version, self._arrivals, group))
        return "informative"

    def retract(self, group: ScoredGroup) -> None:
        """Undo the fresh admission of an informative group the service could not take over: it will be delivered
        again, so it is in flight once more (a synchronous step waits for it) and counted when it comes back."""
        task_id = task_id_of(group)
        self.ready = [entry for entry in self.ready if task_id_of(entry[2]) != task_id]
        self.seen.discard(task_id)
        self.in_flight[task_id] = group.rollout.policy_version  # (about when it was pushed: only counted)
        self.stats.count_scored(group, -1)
        self.stats.informative -= 1
        self.ratio.withdraw(usable=True)  # nor observed twice

    # -- when to train --------------------------------------------------------------------------------------
    def status(self, version: int) -> Status:
        """train: B groups usable at `version` are in hand; limit: the refill limit is reached; else wait.

        Synchronous mode (max_staleness = 0) also waits for every prompt in flight, as the paper's loop does
        (generate, filter, train): what comes back after the update is off-policy and would be thrown away, and
        the next step starts from a clean slate. With k > 0 the stragglers are simply the next step's groups.
        """
        if self.in_hand(version) >= self.target and (self.max_staleness > 0 or not self.in_flight):
            return "train"
        if (
            self._first_push_done
            and self.refills >= self.max_refills
            and self.shortfall_certain(version)
            and not self.in_flight
        ):
            return "limit"
        return "wait"

    def drop_stale(self, version: int) -> list[ScoredGroup]:
        """Remove carried groups that aged past the staleness bound."""
        kept, dropped = [], []
        for entry in self.ready:
            (dropped if self.too_stale(entry[2], version) else kept).append(entry)
        self.ready = kept
        self.stats.stale_dropped += len(dropped)
        return [g for _, _, g in dropped]

    def take_batch(self, version: int, *, partial: bool = False) -> Batch:
        """Take B groups (oldest policy first, then in the order their prompts were pushed) and start the next
        step; the rest are carried. Not in order of arrival: the last to arrive are the longest to generate, and
        a surplus cut by arrival would drop long responses at every step (the paper's loop keeps data order).

        `partial=True` takes whatever is in hand (the refill limit with on_refill_limit = train).
        """
        stale = self.drop_stale(version)
        if len(self.ready) < self.target and not partial:
            raise RuntimeError(f"take_batch: {len(self.ready)} groups in hand, {self.target} needed")
        self.ready.sort(key=lambda entry: (entry[0], entry[2].rollout.task.created_at, entry[1]))
        taken, self.ready = self.ready[: self.target], self.ready[self.target :]
        batch = Batch(
            groups=[g for _, _, g in taken],
            target=self.target,
            refills=self.refills,
            refill_limit_hit=len(taken) < self.target,
            stats=self.stats,
            informative_ratio=self.ratio.value,
            stale_at_take=stale,
        )
        self.stats = StepStats()
        self.refills = 0
        self._first_push_done = False
        self.step += 1
        return batch

    def take_at_limit(self, version: int, on_refill_limit: Literal["train", "stop"]) -> Batch:
        """The refill limit is reached: a short batch (train), or RefillLimitReached with the numbers (stop)."""
        if on_refill_limit == "stop":
            self.drop_stale(version)
            stats = self.stats
            raise RefillLimitReached(
                f"only {len(self.ready)} of {self.target} informative groups after {self.refills} refill rounds "
                f"(learner.batch.max_refills={self.max_refills}): {stats.informative} informative of {stats.scored} "
                f"groups scored this step, running ratio {self.ratio.value:.3f}. Raise learner.batch.max_refills or "
                "set learner.batch.on_refill_limit=train to train on what is in hand."
            )
        return self.take_batch(version, partial=True)

    @property
    def carried_ids(self) -> list[str]:
        return [task_id_of(g) for _, _, g in self.ready]

    # -- checkpoint ---------------------------------------------------------------------------------------
    def state(self) -> dict:
        return {"ratio": self.ratio.state()}

    def load_state(self, state: dict, trained: Iterable[str] = ()) -> None:
        """The checkpoint's estimate; `trained`, the task ids it consumed: a late duplicate of one stays out."""
        self.ratio.load_state(state["ratio"])
        for task_id in trained:
            self.seen.add(task_id)
