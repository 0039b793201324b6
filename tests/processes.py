"""Test helper: the child processes of a process, as the OS lists them."""

from __future__ import annotations

import subprocess


def children_of(pid: int) -> set[int]:
    """The children of `pid`, zombies included (a child nobody waits for stays one)."""
    listed = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(p) for p in listed.split()}
