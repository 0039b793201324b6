"""Each service of a local run on its own CPUs, with as many compute threads as CPUs (cli/cores.py)."""

from __future__ import annotations

import pytest

from cli import cores
from cli.launcher import service_children
from services.config import CpusConfig, load_settings
from services.keys import ROLES


@pytest.mark.parametrize("n, generators, reward_workers", [(2, 1, 1), (2, 2, 1), (8, 1, 1), (8, 3, 2), (64, 4, 2)])
def test_the_automatic_plan_never_oversubscribes(n, generators, reward_workers):
    plan = cores.plan(CpusConfig(), generators, reward_workers, cpus=tuple(range(n)))
    assert len(plan.generators) == generators and len(plan.reward) == reward_workers
    learner = set(plan.learner.cpus)
    generator_cpus = [set(p.cpus) for p in plan.generators]
    assert not learner & set().union(*generator_cpus)  # the learner and the generators never share a CPU
    if generators <= n // 2:
        assert all(not a & b for i, a in enumerate(generator_cpus) for b in generator_cpus[i + 1:])
    for placement in (plan.learner, *plan.generators, *plan.reward):
        assert placement.threads == len(placement.cpus)  # one compute thread per CPU
    if generators > len(set().union(*generator_cpus)):  # 2 generators on 2 CPUs: they must share, and it says so
        assert plan.oversubscribed() == sorted(set().union(*generator_cpus))
        return
    assert plan.compute_threads() <= n and plan.oversubscribed() == []
    if n >= 3:  # the reward pool has CPUs of its own too: every thread of every service fits
        reward = set().union(*(set(p.cpus) for p in plan.reward))
        assert not reward & (learner | set().union(*generator_cpus))
        assert plan.compute_threads() + sum(p.threads for p in plan.reward) <= n
    else:  # 2 CPUs: the reward pool (mostly asleep) yields to the generator whose CPU it shares
        assert all(p.nice > 0 and set(p.cpus) <= set().union(*generator_cpus) for p in plan.reward)


def test_the_defaults_for_2_8_and_64_cpus():
    describe = lambda n: cores.plan(CpusConfig(), 1, 1, cpus=tuple(range(n))).describe()  # noqa: E731
    assert describe(2) == {"learner": "0", "generator-0": "1", "reward-0": "1"}
    assert describe(8) == {"learner": "0,1,2", "generator-0": "3,4,5,6", "reward-0": "7"}
    plan64 = cores.plan(CpusConfig(), 1, 1, cpus=tuple(range(64)))
    assert (plan64.learner.threads, plan64.generators[0].threads, plan64.reward[0].threads) == (30, 30, 4)
    assert describe(1) == {"learner": "0", "generator-0": "0", "reward-0": "0"}


def test_explicit_cpu_lists_win():
    config = CpusConfig(learner="0-3", generators="4-7", reward="8")
    plan = cores.plan(config, 2, 1, cpus=tuple(range(16)))
    assert plan.describe() == {"learner": "0,1,2,3", "generator-0": "4,5", "generator-1": "6,7", "reward-0": "8"}
    assert cores.parse_cpu_list("0-2, 5,5") == (0, 1, 2, 5)
    with pytest.raises(ValueError):
        cores.parse_cpu_list(",")


def test_the_automatic_services_take_the_cpus_none_lists():
    """cpus.learner=4-7 on 8 CPUs put the automatic generator on 3-6 and the reward worker on 7, over the learner's,
    while 0-2 sat idle: the plan promises that none oversubscribes."""
    def used(plan):
        return [cpu for placed in (plan.learner, *plan.generators, *plan.reward) for cpu in placed.cpus]

    for config, generators in [(CpusConfig(learner="4-7"), 1), (CpusConfig(generators="0-3"), 2),
                               (CpusConfig(reward="7"), 1), (CpusConfig(learner="0-3", generators="4-5"), 1)]:
        plan = cores.plan(config, generators, 1, cpus=tuple(range(8)))
        assert sorted(used(plan)) == list(range(8)), (config, plan.describe())  # each CPU once: none idle
    assert cores.plan(CpusConfig(learner="4-7"), 1, 1, cpus=tuple(range(8))).learner.cpus == (4, 5, 6, 7)
    from services.config import ConfigError

    with pytest.raises(ConfigError, match=r"cpus.generators and cpus.reward \(auto\) would have none"):
        cores.plan(CpusConfig(learner="0-1"), 1, 1, cpus=(0, 1))


@pytest.mark.parametrize("field, cpu_list, error", [
    ("generators", "4-7", r"cpus.generators lists CPUs \[4, 5, 6, 7\] this machine does not give the run \(it may "
                          r"use 0,1\)"),
    ("learner", "3-1", r"cpus.learner: the range '3-1' in the CPU list '3-1' runs backwards"),
])
def test_a_cpu_list_the_machine_cannot_honour_is_a_config_error_before_anything_starts(field, cpu_list, error):
    """Not a child's bare `Exception occurred in preexec_fn` once Redis and the learner are up."""
    from services.config import ConfigError

    with pytest.raises(ConfigError, match=error):
        cores.plan(CpusConfig(**{field: cpu_list}), 1, 1, cpus=(0, 1))


def test_the_launcher_hands_each_service_its_cpus_and_threads(tmp_path):
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path))
    plan = cores.plan(settings.cpus, 2, 1, cpus=(0, 1, 2, 3, 4, 5, 6, 7))
    children = service_children(settings, tmp_path / "c.yaml", dict.fromkeys(ROLES, "redis://127.0.0.1:1"), 2, 1, 8000,
                                learner_procs=2, cpus=plan)
    by_name = {child.name: child for child in children}
    assert by_name["learner"].placement.cpus == (0, 1, 2) and by_name["learner"].env["OMP_NUM_THREADS"] == "3"
    assert by_name["generator-0"].env["VLLM_CPU_OMP_THREADS_BIND"] == "3,4"
    assert by_name["generator-1"].env["VLLM_CPU_OMP_THREADS_BIND"] == "5,6"
    assert by_name["reward-0"].env["DAPO_REWARD__WORKERS"] == "1" and by_name["reward-0"].placement.cpus == (7,)
    # torchrun kills its ranks (each in a session of its own) before the launcher kills torchrun's group
    assert int(by_name["learner"].env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < by_name["learner"].stop_seconds


def _tree(root, files: dict[str, str]):
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


@pytest.mark.parametrize(("files", "proc", "quota"), [
    # cgroup v2, the container's own namespace: its limit at the mount's root
    ({"cgroup.controllers": "cpu", "cpu.max": "400000 100000\n"}, "0::/\n", 4.0),
    ({"cgroup.controllers": "cpu", "cpu.max": "max 100000\n"}, "0::/\n", None),
    # a parent's limit binds its child's (a pod's limit over its container's unlimited one)
    ({"cgroup.controllers": "cpu", "kubepods/cpu.max": "150000 100000\n", "kubepods/c1/cpu.max": "max 100000\n"},
     "0::/kubepods/c1\n", 1.5),
    # cgroup v1 (the cpu controller's own mount); -1 is no limit
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "4:cpu:/\n0::/\n", 2.0),
    ({"cpu,cpuacct/docker/x/cpu.cfs_quota_us": "50000\n", "cpu,cpuacct/docker/x/cpu.cfs_period_us": "100000\n",
      "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
     "3:cpu,cpuacct:/docker/x\n", 0.5),
    # the path seen from inside a container without its own cgroup namespace does not exist at the mount: the
    # mount's own limit (the container's) is read
    ({"cgroup.controllers": "cpu", "cpu.max": "300000 100000\n"}, "0::/docker/abc\n", 3.0),
    ({}, "0::/\n", None),
])
def test_cpu_quota_from_cgroups(tmp_path, files, proc, quota):
    from services.cpus import cpu_quota

    assert cpu_quota(_tree(tmp_path, files), proc) == quota


def test_a_cgroup_v1_cpu_controller_mounted_through_a_link_is_read(tmp_path):
    """Docker and systemd hosts mount v1's `cpu` as a link to `cpu,cpuacct`: the walk up to the mount still runs."""
    from services.cpus import cpu_quota

    root = _tree(tmp_path, {"cpu,cpuacct/slice/cpu.cfs_quota_us": "200000\n",
                            "cpu,cpuacct/slice/cpu.cfs_period_us": "100000\n",
                            "cpu,cpuacct/slice/c1/cpu.cfs_quota_us": "-1\n",
                            "cpu,cpuacct/slice/c1/cpu.cfs_period_us": "100000\n"})
    (root / "cpu").symlink_to(root / "cpu,cpuacct")
    assert cpu_quota(root, "4:cpu,cpuacct:/slice/c1\n") == 2.0


def test_a_cpu_quota_sizes_the_threads_and_pins_nothing(tmp_path, monkeypatch):
    """`docker run --cpus 2` on a 16-core host: the plan is the 2 CPUs' plan in threads, on any of the 16 (pinned to
    the first two, every such container of the host would share CPUs 0 and 1)."""
    import os

    from services.cpus import usable_cpu_count

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    root = _tree(tmp_path, {"cgroup.controllers": "cpu", "cpu.max": "150000 100000\n"})
    assert usable_cpu_count(root, "0::/\n") == 2
    assert usable_cpu_count(tmp_path / "none", "0::/\n") == 16
    monkeypatch.setattr(cores, "cpu_quota", lambda: 1.5)
    quota_plan = cores.plan(CpusConfig(), 1, 1)
    assert quota_plan.describe() == {"learner": "any 1", "generator-0": "any 1", "reward-0": "any 1"}
    assert quota_plan.learner.cpus == tuple(range(16)) and quota_plan.oversubscribed() == []
    assert cores.generator_env(quota_plan.generators[0]) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                             "OMP_NUM_THREADS": "1"}
    assert quota_plan.reward[0].nice == cores.REWARD_NICE  # sharing the generators' share, behind them
    listed = cores.plan(CpusConfig(learner="0-3", generators="4-7", reward="8"), 1, 1)  # the user's CPUs: pinned
    assert listed.learner.cpus == (0, 1, 2, 3) and listed.learner.pinned
