"""Files written so that a crash leaves the old content or the new, never a partial file (standard library only:
every layer imports this, a config error or a key file included, without torch)."""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO


def numbered(name: str, prefix: str) -> int | None:
    """N of a folder named `{prefix}N` (`v12`, `step-40`), else None: ASCII digits only (`"²".isdigit()` is true,
    and int() refuses it; the folders may hold anything a generator or an operator put there)."""
    digits = name.removeprefix(prefix)
    return int(digits) if name.startswith(prefix) and digits.isascii() and digits.isdigit() else None


def write_atomic(path: Path, data: str | bytes, mode: int = 0o666) -> None:
    """Replace `path` with `data` so that readers see the old content or the new, never a partial file.

    `mode` (less the umask) applies from the file's creation: 0o600 for anything holding a secret, so that it is
    never readable by others, not even for a moment."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)  # a leftover of a crash keeps its old mode: start afresh
    try:
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as handle:
            handle.write(data.encode() if isinstance(data, str) else data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:  # (a disk full: the part written would stay, under a name no later write reuses)
        tmp.unlink(missing_ok=True)
        raise


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


class NotRegularFile(OSError):
    """A path that should be a plain file of bounded size is something else (a FIFO, a device, a symlink's target is
    not followed) or is larger: reading it could block for ever or exhaust memory."""


def open_regular(path: Path, max_bytes: int) -> BinaryIO:
    """Open `path` for reading only if it is a regular file (not a symlink, FIFO or device: O_NOFOLLOW, and
    O_NONBLOCK so that opening a FIFO never waits for a writer) of at most `max_bytes`. For files another process
    can write in a shared folder. Raises NotRegularFile, or OSError (ELOOP for a symlink, FileNotFoundError)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        if err.errno in (errno.ENXIO, errno.ENODEV, errno.EOPNOTSUPP):  # a socket, a device without a driver
            raise NotRegularFile(err.errno, "not a regular file", str(path)) from None
        raise
    handle = os.fdopen(descriptor, "rb")
    info = os.fstat(descriptor)
    if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
        handle.close()
        kind = "a regular file" if stat.S_ISREG(info.st_mode) else "not a regular file"
        raise NotRegularFile(errno.EINVAL, f"{kind} of {info.st_size} bytes (at most {max_bytes} read)", str(path))
    fcntl.fcntl(descriptor, fcntl.F_SETFL, fcntl.fcntl(descriptor, fcntl.F_GETFL) & ~os.O_NONBLOCK)  # reads block
    return handle


def read_regular(path: Path, max_bytes: int) -> bytes:
    """The bytes of `path`, read as `open_regular` allows (a file that grows meanwhile is read to `max_bytes`)."""
    with open_regular(path, max_bytes) as handle:
        return handle.read(max_bytes)
