"""Held-out evaluation through the generators: avg@n accuracy of one policy version (pure bookkeeping).

Eval tasks (split "eval", the eval_sampling parameters) travel the same prompts -> rollouts -> scored path as
training tasks and are scored by the same reward workers; the learner routes their scored groups here, never to
the optimizer. Accuracy is the paper's avg@n: the share of correct responses over n samples per problem,
averaged over the problems (every problem has n samples, so it equals correct / samples).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from services.messages import ScoredGroup

EXAMPLE_GROUPS = 4


@dataclass
class EvalRound:
    """One evaluation: the task ids it waits for and what came back."""

    step: int
    version: int
    expected: set[str]
    started_at: float = 0.0
    received: set[str] = field(default_factory=set)
    lost: set[str] = field(default_factory=set)
    correct: int = 0
    samples: int = 0
    solved: int = 0  # problems with at least one correct sample (pass@n)
    policy_versions: set[int] = field(default_factory=set)
    examples: list[ScoredGroup] = field(default_factory=list)  # the first few groups, for the trackers' table

    def add(self, group: ScoredGroup) -> bool:
        """Count a scored eval group of this round; False for anything else (another round, a duplicate)."""
        task_id = group.rollout.task.task_id
        if task_id not in self.expected or task_id in self.received or task_id in self.lost:
            return False
        self.received.add(task_id)
        correct = sum(1 for s in group.scores if s.correct)
        self.correct += correct
        self.samples += len(group.scores)
        self.solved += correct > 0
        self.policy_versions.add(group.rollout.policy_version)
        if len(self.examples) < EXAMPLE_GROUPS:
            self.examples.append(group)
        return True

    def mark_lost(self, task_ids: Iterable[str]) -> int:
        """Tasks that died in the pipeline (dead letters): stop waiting for them."""
        gone = {t for t in task_ids if t in self.expected and t not in self.received} - self.lost
        self.lost |= gone
        return len(gone)

    @property
    def done(self) -> bool:
        return len(self.received) + len(self.lost) >= len(self.expected)

    @property
    def accuracy(self) -> float | None:
        """avg@n: correct responses over all responses."""
        return self.correct / self.samples if self.samples else None

    @property
    def pass_at_n(self) -> float | None:
        return self.solved / len(self.received) if self.received else None

    def summary(self) -> dict:
        return {
            "eval_accuracy": self.accuracy,
            "eval_pass_at_n": self.pass_at_n,
            "eval_problems": len(self.received),
            "eval_samples": self.samples,
            "eval_lost": len(self.lost),
            "eval_version": self.version,
        }
