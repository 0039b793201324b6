"""Test helper: a scored group as a reward worker forwards one, carrying its rollout's generator signature."""

from __future__ import annotations

from services.messages import RolloutGroup, ScoredGroup, to_wire
from services.streams import Streams


def vouched(streams: Streams, group: ScoredGroup) -> ScoredGroup:
    """`group` with `rollout_signature` set as its generator would have signed the rollout (`streams` must hold the
    generator role's key): what `Streams.rollout_refusal` accepts."""
    payload = to_wire(group.rollout.as_generated())
    return group.model_copy(update={"rollout_signature": streams.stream("rollouts", RolloutGroup).signature(payload)})
