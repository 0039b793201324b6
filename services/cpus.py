"""The compute a process may use: its affinity, cut to its CPU quota.

A container's CPU limit (`docker run --cpus 4`, a Kubernetes `limits.cpu`, a systemd `CPUQuota=`) is a CFS quota,
not an affinity: the process still sees every core of the host, and a plan that gave each service as many
threads as it sees would have 16 threads share 4 CPUs' worth of time, throttled every period. The quota is read
from the cgroup the process is in (v2 `cpu.max`, v1 `cpu.cfs_quota_us` over `cpu.cfs_period_us`), and from each
of its ancestors, since a parent's limit binds its children too.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _cgroup_paths(proc_cgroup: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 cpu controller path) from /proc/self/cgroup's lines `0::/a/b` and `4:cpu,cpuacct:/a/b`."""
    unified = cpu = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            unified = path
        elif "cpu" in controllers.split(","):
            cpu = path
    return unified, cpu


def _limits(folder: Path, path: str, read) -> list[float]:
    """The quota of `folder/path` and of every folder above it up to `folder` (the cgroup's mount)."""
    found = []
    folder = folder.resolve()  # v1's `cpu` is often a link to `cpu,cpuacct`
    current = (folder / path.lstrip("/")).resolve()
    while True:
        limit = read(current)
        if limit is not None:
            found.append(limit)
        if current == folder or folder not in current.parents:
            return found
        current = current.parent


def _read_v2(folder: Path) -> float | None:
    try:
        quota, _, period = (folder / "cpu.max").read_text().partition(" ")
        return None if quota.strip() == "max" else int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def _read_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def cpu_quota(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> float | None:
    """CPUs' worth of time per period this process may use by its cgroups' quotas; None where none is set."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    unified, cpu = _cgroup_paths(proc_cgroup)
    limits = []
    if unified is not None:
        for mount in (root, root / "unified"):  # the pure v2 layout, or the hybrid one's v2 mount
            if (mount / "cgroup.controllers").exists():
                limits += _limits(mount, unified, _read_v2)
    if cpu is not None:
        for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
            if mount.is_dir():
                limits += _limits(mount, cpu, _read_v1)
                break
    return min(limits) if limits else None


def affinity_cpus() -> tuple[int, ...]:
    """The CPUs this process may run on."""
    return (tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity")
            else tuple(range(os.cpu_count() or 1)))


def usable_cpu_count(root: Path = CGROUP_ROOT, proc_cgroup: str | None = None) -> int:
    """CPUs' worth of compute this process has: its affinity's, or ceil(quota) where a CPU quota is lower."""
    cpus = len(affinity_cpus())
    quota = cpu_quota(root, proc_cgroup)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))
