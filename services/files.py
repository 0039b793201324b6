"""Files written so that a crash leaves the old content or the new, never a partial file (standard library only:
every layer imports this, a config error or a key file included, without torch)."""

from __future__ import annotations

import errno
import os
from pathlib import Path


def write_atomic(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Replace `path` with `data` so that readers see the old content or the new, never a partial file.

    `mode` (less the umask) applies from the file's creation: 0o600 for anything holding a secret, so that it is
    never readable by others, not even for a moment."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a crash keeps its old mode: start afresh
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as handle:
        handle.write(data.encode() if isinstance(data, str) else data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def fsync_dir(path: Path) -> None:
    """Make the folder's entries (files created or renamed in it) durable: a file's own fsync does not. A file
    system that cannot fsync a folder (some network and FUSE mounts answer EINVAL) is left to its own guarantees."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under `root`, then every folder, deepest first: all of it survives a power loss once
    this returns (before a rename publishes the tree)."""
    folders = [root]
    for path in root.rglob("*"):
        if path.is_dir():
            folders.append(path)
        elif path.is_file():
            with open(path, "rb") as handle:
                os.fsync(handle.fileno())
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        fsync_dir(folder)
