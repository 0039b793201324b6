"""Each service of a local run on its own CPUs: the plan, the environment that applies it, the CPU it used.

Measured on 2 cores: the learner's torch threads and the vLLM CPU worker's OpenMP threads on the same cores made
an asynchronous step 1.33x slower than a synchronous one (train 14.0 s instead of 4.95 s). So every service gets
a CPU set (its affinity) and as many compute threads as CPUs: the learner's torch threads (shared by its ranks),
vLLM's OpenMP threads bound with VLLM_CPU_OMP_THREADS_BIND, the reward pool's processes.

The automatic plan, from the n CPUs the launcher may use (its affinity; under a lower CPU quota, `docker run --cpus
4`, the plan of ceil(quota) CPUs in threads, on any of them):
  n = 1   everything on that CPU (nothing to split);
  n = 2   learner on the first, generators on the second; the reward pool (one process: a verification takes
          milliseconds, most of its time it sleeps) shares the generators' CPU at a lower priority;
  n >= 3  the reward pool gets n // 16 CPUs, or one per reward worker up to n // 4 (at least 1), and the rest is
          halved between the learner and the generators (the learner's half rounded down): 8 CPUs, 1 reward
          worker -> learner 3, generators 4, reward 1; 64 -> learner 30, generators 30, reward 4.
Generators deal their CPUs in equal contiguous slices. More generators than their CPUs cannot be placed without
sharing: the plan says which CPUs are oversubscribed and the launcher warns.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from services.config import ConfigError, CpusConfig
from services.cpus import affinity_cpus, cpu_quota

REWARD_NICE = 10  # when the reward pool shares the generators' CPUs, they come first


@dataclass(frozen=True)
class Placement:
    """One service process's CPUs and its compute threads."""

    cpus: tuple[int, ...]
    threads: int
    nice: int = 0
    pinned: bool = True  # False under a CPU quota: any of `cpus`, `threads` of them at a time

    @property
    def cpu_list(self) -> str:
        return ",".join(str(c) for c in self.cpus) if self.pinned else f"any {self.threads}"


@dataclass(frozen=True)
class CpuPlan:
    learner: Placement
    generators: tuple[Placement, ...]
    reward: tuple[Placement, ...]

    def compute_threads(self) -> int:
        """Threads that compute all the time when the run is busy: the learner's and the generators'."""
        return self.learner.threads + sum(p.threads for p in self.generators)

    def oversubscribed(self) -> list[int]:
        """CPUs given to more than one compute thread (more generators than CPUs, or explicit lists that overlap)."""
        counts: dict[int, int] = {}
        for placement in (p for p in (self.learner, *self.generators) if p.pinned):
            for cpu in placement.cpus:
                counts[cpu] = counts.get(cpu, 0) + 1
        return sorted(cpu for cpu, count in counts.items() if count > 1)

    def unpinned(self, cpus: tuple[int, ...]) -> "CpuPlan":
        """This plan's threads on any of `cpus` (no CPU of its own): a quota's plan."""
        def free(p: Placement) -> Placement:
            return dataclasses.replace(p, cpus=cpus, pinned=False)

        return CpuPlan(free(self.learner), tuple(map(free, self.generators)), tuple(map(free, self.reward)))

    def describe(self) -> dict:
        return {"learner": self.learner.cpu_list,
                **{f"generator-{i}": p.cpu_list for i, p in enumerate(self.generators)},
                **{f"reward-{i}": p.cpu_list for i, p in enumerate(self.reward)}}


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """`0-3,8` -> (0, 1, 2, 3, 8)."""
    cpus: list[int] = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        if int(high or low) < int(low):
            raise ValueError(f"the range {part!r} in the CPU list {text!r} runs backwards")
        cpus.extend(range(int(low), int(high or low) + 1))
    if not cpus:
        raise ValueError(f"empty CPU list {text!r}")
    return tuple(sorted(set(cpus)))


def slices(cpus: tuple[int, ...], count: int) -> list[tuple[int, ...]]:
    """`count` near-equal contiguous slices of `cpus` (shared round robin when there are fewer CPUs)."""
    if count <= len(cpus):
        return [cpus[k * len(cpus) // count:(k + 1) * len(cpus) // count] for k in range(count)]
    return [(cpus[k % len(cpus)],) for k in range(count)]


def auto_split(cpus: tuple[int, ...], reward_workers: int = 1) -> tuple:
    """(learner, generators, reward, reward shares the generators' CPUs) for the automatic plan."""
    n = len(cpus)
    if n == 1:
        return cpus, cpus, cpus, True
    if n == 2:
        return cpus[:1], cpus[1:], cpus[1:], True
    reward = max(1, n // 16, min(reward_workers, n // 4))  # a CPU per reward worker while that leaves 3/4
    learner = (n - reward) // 2
    return cpus[:learner], cpus[learner:n - reward], cpus[n - reward:], False


def plan(config: CpusConfig, generators: int, reward_workers: int, cpus: tuple[int, ...] | None = None,
         quota: float | None = None) -> CpuPlan:
    """The services' CPUs and threads on `cpus` (this process's affinity by default). Under a CPU quota lower than
    them (`docker run --cpus 4` on 16 cores; by default this process's, from its cgroups: services/cpus.py) the plan
    is the quota's, ceil(quota) CPUs, in threads only: pinned to the first CPUs, every container of a host would
    share the same few; a quota limits time, any CPU may serve it."""
    if cpus is None:  # this process's, and its quota (given CPUs come with the quota given, if any)
        cpus, quota = affinity_cpus(), cpu_quota() if quota is None else quota
    automatic = config.learner == config.generators == config.reward == "auto"  # (listed CPUs are the user's)
    if automatic and quota is not None and math.ceil(quota) < len(cpus):
        return _split(config, generators, reward_workers, tuple(range(max(1, math.ceil(quota))))).unpinned(cpus)
    return _split(config, generators, reward_workers, cpus)


def _split(config: CpusConfig, generators: int, reward_workers: int, cpus: tuple[int, ...]) -> CpuPlan:
    """The listed services on their CPUs, the automatic ones split over the CPUs that none lists."""
    listed = {field: _listed(config, field, cpus) for field in ("learner", "generators", "reward")
              if getattr(config, field) != "auto"}
    automatic = [field for field in ("learner", "generators", "reward") if field not in listed]
    taken = {cpu for chosen in listed.values() for cpu in chosen}
    rest = tuple(cpu for cpu in cpus if cpu not in taken)
    if not rest and automatic:
        raise ConfigError(f"the listed CPUs ({', '.join(f'cpus.{f}' for f in listed)}) are all of this machine's: "
                          f"{' and '.join(f'cpus.{f}' for f in automatic)} (auto) would have none of their own (list "
                          "them too)")
    learner, generator_cpus, reward_cpus, shared = auto_split(rest or cpus, reward_workers)
    if len(automatic) == 1:  # all the rest is its
        learner, generator_cpus, reward_cpus, shared = rest, rest, rest, False
    elif len(automatic) == 2 and not shared:  # the listed one's share of the rest goes to its neighbour
        if "learner" in listed:
            generator_cpus = learner + generator_cpus
        elif "generators" in listed:
            learner = learner + generator_cpus
        else:
            generator_cpus = generator_cpus + reward_cpus
    learner = listed.get("learner", learner)
    generator_cpus = listed.get("generators", generator_cpus)
    if "reward" in listed:
        reward_cpus, shared = listed["reward"], False
    gen = tuple(Placement(s, len(s)) for s in slices(generator_cpus, max(generators, 1)))[:generators]
    reward = tuple(Placement(s, len(s), REWARD_NICE if shared else 0)
                   for s in slices(reward_cpus, max(reward_workers, 1)))[:reward_workers]
    return CpuPlan(Placement(learner, len(learner)), gen, reward)


def _listed(config: CpusConfig, field: str, cpus: tuple[int, ...]) -> tuple[int, ...]:
    """The CPUs `cpus.{field}` lists, all of them among `cpus` (this process may run on); ConfigError otherwise,
    before any process starts (a child pinned to a CPU it may not use fails in its preexec, naming none)."""
    try:
        listed = parse_cpu_list(getattr(config, field))
    except ValueError as err:
        raise ConfigError(f"cpus.{field}: {err}") from None
    if outside := sorted(set(listed) - set(cpus)):
        raise ConfigError(f"cpus.{field} lists CPUs {outside} this machine does not give the run (it may use "
                          f"{','.join(map(str, cpus))})")
    return listed


def learner_env(placement: Placement) -> dict[str, str]:
    """The learner's CPU budget: its ranks share it (learner/trainer.py `_set_cpu_threads`)."""
    return {"OMP_NUM_THREADS": str(placement.threads)}


def generator_env(placement: Placement) -> dict[str, str]:
    """vLLM's CPU worker binds one OpenMP thread per listed CPU."""
    return {"VLLM_CPU_OMP_THREADS_BIND": placement.cpu_list if placement.pinned else "nobind",
            "OMP_NUM_THREADS": str(placement.threads)}


def reward_env(placement: Placement) -> dict[str, str]:
    return {"DAPO_REWARD__WORKERS": str(placement.threads), "OMP_NUM_THREADS": "1"}


def _process_table() -> tuple[dict[int, int], dict[int, int], dict[int, int]]:
    """pid -> parent pid, process group and CPU ticks (user + system, and of reaped children), from /proc."""
    parent, group, ticks = {}, {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        pid = int(entry.name)
        parent[pid], group[pid] = int(fields[1]), int(fields[2])  # ppid, pgrp
        ticks[pid] = sum(int(value) for value in fields[11:15])  # utime, stime, cutime, cstime
    return parent, group, ticks


def descendant_groups(root: int) -> set[int]:
    """The process groups of `root`'s live descendants, not its own: torchrun starts each learner rank in a session
    of its own, which a kill of torchrun's group misses (and once torchrun is gone, they are nobody's children)."""
    parent, group, _ = _process_table()
    return {group[pid] for pid in parent if pid != root and _root_above(pid, parent, {root}) == root} - \
        {group.get(root)}


def _root_above(pid: int, parent: dict[int, int], roots: set[int]) -> int | None:
    """The first of `roots` up the tree from `pid` (itself included), None if there is none."""
    seen = set()
    while pid not in roots and pid in parent and pid not in seen:
        seen.add(pid)
        pid = parent[pid]
    return pid if pid in roots else None


def cpu_seconds_by_root(roots: Iterable[int]) -> dict[int, float]:
    """CPU seconds (user + system, and of reaped children) used so far by the live processes under each root pid,
    from one pass over /proc: its process group (a vLLM engine core left by a killed generator), and its
    descendants wherever they lead (torchrun starts each learner rank in a session of its own)."""
    roots = set(roots)
    tick = os.sysconf("SC_CLK_TCK")
    parent, group, ticks = _process_table()
    totals = dict.fromkeys(roots, 0)
    for pid, used in ticks.items():
        root = _root_above(pid, parent, roots)
        root = root if root is not None else group[pid] if group[pid] in roots else None
        if root is not None:
            totals[root] += used
    return {root: used / tick for root, used in totals.items()}
