"""The policy version: the one number that names the learner's weights, owned by one object.

Version v is the policy after v train steps of this lineage, published as weights/vN and announced to the
generators; every group carries the version that sampled it, and staleness (the paper's async bound) is measured
against it. `PolicyVersion` is the only keeper: the trainer never counts versions, the batch assembler reads
staleness from it, the service advances it after each update and saves it in the checkpoint.

Jumps. Versions stay monotonic across a resume: if generators were told of a version newer than the restored
checkpoint (a lineage the crash discarded), the restored policy is republished as the next version after it,
so that every generator loads it (they ignore older announcements). A jump (from, to) records that version `to`
holds the weights of `from`: a group sampled by `from` or an ancestor is `to - from` versions fresher than the raw
difference says, while a group from inside the jump (the discarded lineage) keeps its raw age.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PolicyVersion:
    current: int = 0
    jumps: list[tuple[int, int]] = field(default_factory=list)  # (from, to): `from` republished as `to`

    def advance(self) -> int:
        """One update made: the new weights are the next version."""
        self.current += 1
        return self.current

    def republish_as(self, version: int) -> None:
        """The current weights are published as `version` (> current) from now on (a resume; see the module)."""
        if version <= self.current:
            raise ValueError(f"a republished version must be newer: v{self.current} -> v{version}")
        self.jumps.append((self.current, version))
        self.current = version

    def lag(self, sampled_by: int, at: int | None = None) -> int:
        """How many versions a group sampled by `sampled_by` is behind version `at` (default: the current one);
        negative if it is ahead."""
        at = self.current if at is None else at
        lag = at - sampled_by
        for start, end in self.jumps:
            if sampled_by <= start and end <= at:
                lag -= end - start
        return lag

    def state(self) -> dict:
        return {"current": self.current, "jumps": [list(jump) for jump in self.jumps]}

    @classmethod
    def from_state(cls, state: dict) -> "PolicyVersion":
        return cls(int(state["current"]), [(int(a), int(b)) for a, b in state.get("jumps", [])])

    def restore(self, state: dict) -> None:
        restored = self.from_state(state)
        self.current, self.jumps = restored.current, restored.jumps
