"""One weight version on disk: the Hugging Face sharded layout, written atomically and checked file by file.

A version folder `v{version}/` holds `model-0000k-of-0000N.safetensors` (at most `weights.shard_mb` each, whole
tensors), `model.safetensors.index.json` (`weight_map`: tensor -> shard, what vLLM's and transformers' loaders
read) and `announcement.json` (every file's sha256 and size). The learner writes it into a hidden temporary
folder and renames that into place, so a reader (an HTTP download or a generator on a shared file system) sees
a whole version or none. Both transports publish through `write_version` and check through `check_file`.

Holds (shared-fs): generators load straight from the learner's folder, so the learner must not prune a version
a generator still loads or serves (a restarted engine reloads the version it served). Each generator keeps
`holds/{generator}.json` (the versions it holds) beside the versions, and rewrites it on every load; the learner
keeps held versions beyond `weights.keep_versions` until the hold lapses (`weights.hold_s`, a dead generator's).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save

from services.files import NotRegularFile, fsync_dir, open_regular, read_regular, write_atomic
from services.keys import Signer
from services.messages import WeightsAnnouncement, WeightsFile, sign_announcement

INDEX_FILE = "model.safetensors.index.json"
ANNOUNCEMENT_FILE = "announcement.json"
WRITING_PREFIX = ".v"  # `.v{version}-*`: a version the learner is writing (renamed to v{version} once whole)
PULLING_PREFIX = ".pull-v"  # `.pull-v{version}-*`: a version a generator is downloading (the same)
HOLDS_DIR = "holds"
HOLD_MAX_BYTES = 4096  # a hold is a short JSON list: a larger file is not read
# Files of a version read back from a folder generators may write to: an announcement lists a few dozen files, an
# index one line per tensor (about 100 kB at 32B); anything larger is not what the learner wrote.
ANNOUNCEMENT_MAX_BYTES = 1 << 20
INDEX_MAX_BYTES = 16 << 20
HOLD_MAX_VERSIONS = 4  # a generator holds what it serves and what it loads: more pin disk for nothing
CHUNK = 4 << 20
log = logging.getLogger(__name__)


def shard_plan(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Tensor names per shard, in order; a shard closes before it would exceed max_bytes (a bigger tensor is alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def shard_name(index: int, count: int, prefix: str = "model") -> str:
    return f"{prefix}-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclass
class Written:
    """The shards one writer put in a version's temporary folder: what the index and the announcement list."""

    files: list[WeightsFile] = field(default_factory=list)
    weight_map: dict[str, str] = field(default_factory=dict)  # tensor name -> its shard
    total: int = 0  # tensor bytes

    def to_wire(self) -> dict:
        return {"files": [f.model_dump() for f in self.files], "weight_map": self.weight_map, "total": self.total}

    @classmethod
    def from_wire(cls, data: dict) -> "Written":
        return cls([WeightsFile.model_validate(f) for f in data["files"]], dict(data["weight_map"]), data["total"])


def begin_version(root: Path, version: int) -> Path:
    """A temporary folder in `root` for `version`'s files, renamed into place whole by `finish_version`."""
    return Path(tempfile.mkdtemp(prefix=f"{WRITING_PREFIX}{version}-", dir=root))


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], shard_bytes: int, prefix: str = "model") -> Written:
    """Write `tensors` into `folder` as safetensors shards of at most `shard_bytes` (a bigger tensor is alone), named
    `{prefix}-NNNNN-of-NNNNN`. Each shard is serialized in memory, hashed from those bytes (no read back), written
    and fsynced."""
    plan = shard_plan(tensors, shard_bytes) if tensors else []
    written = Written()
    for index, names in enumerate(plan):
        name = shard_name(index, len(plan), prefix)
        # One metadata key: safetensors writes its metadata map in hash order, so a second key would give the same
        # tensors other bytes now and then (and a republished version another digest).
        data = save({n: tensors[n] for n in names}, metadata={"format": "pt"})
        written.files.append(WeightsFile(name=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data)))
        write_atomic(folder / name, data)
        del data
        written.weight_map.update(dict.fromkeys(names, name))
        written.total += sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    return written


def write_version(
    root: Path, version: int, tensors: dict[str, torch.Tensor], shard_bytes: int, url: str, signer: Signer,
    context: str,
) -> WeightsAnnouncement:
    """Write `root/v{version}/` (shards, index, announcement signed by `signer` under `context`, the run's weights
    channel) atomically; returns the announcement."""
    tmp = begin_version(root, version)
    try:
        written = write_shards(tmp, tensors, shard_bytes)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return finish_version(root, tmp, version, [written], url, signer, context)


def finish_version(root: Path, tmp: Path, version: int, writers: list[Written], url: str, signer: Signer,
                   context: str) -> WeightsAnnouncement:
    """Complete the version whose shards `writers` (one, or each learner rank in turn) wrote into `tmp`: the index,
    the signed announcement, then the rename to `root/v{version}` (or, when that folder already holds the same
    bytes, only its announcement replaced). `tmp` is removed on failure."""
    try:
        files = [f for written in writers for f in written.files]
        weight_map = {name: shard for written in writers for name, shard in written.weight_map.items()}
        total = sum(written.total for written in writers)
        index_bytes = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1).encode()
        write_atomic(tmp / INDEX_FILE, index_bytes)
        files.append(WeightsFile(name=INDEX_FILE, sha256=hashlib.sha256(index_bytes).hexdigest(),
                                 size=len(index_bytes)))
        announcement = sign_announcement(WeightsAnnouncement(
            version=version, sha256=files_digest(files), size=sum(f.size for f in files), url=url, files=files
        ), signer, context)
        write_atomic(tmp / ANNOUNCEMENT_FILE, announcement.model_dump_json().encode())
        fsync_dir(tmp)
        final = root / f"v{version}"
        if _same_files(final, announcement):
            # Republished on a resume from the same checkpoint: the same bytes. Only the announcement is replaced
            # (its URL may differ), so a generator downloading or loading this version never finds it gone.
            write_atomic(final / ANNOUNCEMENT_FILE, announcement.model_dump_json().encode())
            fsync_dir(final)
            shutil.rmtree(tmp)
        else:
            aside = root / f"{WRITING_PREFIX}{version}-replaced"
            shutil.rmtree(aside, ignore_errors=True)
            if final.exists():  # other bytes under the same version (a crash after it was written): moved aside
                os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return announcement


def _same_files(folder: Path, announcement: WeightsAnnouncement) -> bool:
    """Whether `folder` already holds the announced files, intact (read back and hashed: a damaged copy is
    rewritten, not kept)."""
    try:
        existing = WeightsAnnouncement.model_validate_json(read_regular(folder / ANNOUNCEMENT_FILE,
                                                                       ANNOUNCEMENT_MAX_BYTES))
        return existing.sha256 == announcement.sha256 and not any(
            check_file(folder / f.name, f) for f in announcement.files)
    except (OSError, ValueError):  # anything unreadable there is rewritten
        return False


def files_digest(files: list[WeightsFile]) -> str:
    """The version's identity: sha256 over every file's name, size and sha256."""
    return hashlib.sha256("".join(f"{f.name}\t{f.size}\t{f.sha256}\n" for f in files).encode()).hexdigest()


def check_file(path: Path, expected: WeightsFile, stop: threading.Event | None = None) -> str | None:
    """None if `path` is a regular file with the expected size and sha256, else what differs (hashing streams the
    file; a FIFO, a symlink or a larger file is refused unread: `open_regular`). `stop` set: the hashing ends at
    its next chunk (a version's files take minutes to read at 32B), and says so."""
    try:
        with open_regular(path, expected.size) as handle:
            size = os.fstat(handle.fileno()).st_size
            if size != expected.size:
                return f"{expected.name}: {size} bytes, announced {expected.size}"
            digest = hashlib.sha256()
            left = expected.size + 1  # a file that grows meanwhile is not hashed without end
            while left > 0 and (chunk := handle.read(min(CHUNK, left))):
                if stop is not None and stop.is_set():
                    return f"{expected.name}: not read to its end (stopping)"
                digest.update(chunk)
                left -= len(chunk)
    except FileNotFoundError:
        return f"{expected.name}: missing"
    except NotRegularFile as err:
        return f"{expected.name}: {err.strerror}"
    except OSError as err:
        if err.errno != errno.ELOOP:
            raise
        return f"{expected.name}: a symlink, not the file written"
    if digest.hexdigest() != expected.sha256:
        return (f"{expected.name}: sha256 {digest.hexdigest()[:16]}... does not match the announced "
                f"{expected.sha256[:16]}...")
    return None


def shard_files(announcement: WeightsAnnouncement) -> list[WeightsFile]:
    return [f for f in announcement.files if f.name.endswith(".safetensors")]


def check_index(folder: Path, announcement: WeightsAnnouncement) -> str | None:
    """None if the index maps tensors to exactly the announced shards (vLLM loads only what it lists)."""
    try:
        weight_map = json.loads(read_regular(folder / INDEX_FILE, INDEX_MAX_BYTES))["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{INDEX_FILE}: unreadable ({err})"
    if set(weight_map.values()) != {f.name for f in shard_files(announcement)}:
        return f"{INDEX_FILE} names other shards than the announcement"
    return None


# -- holds (shared-fs) ---------------------------------------------------------------------------------------
def remove_unfinished(root: Path, prefix: str) -> int:
    """Delete the `prefix*` folders in `root`: versions a killed process was writing or pulling (a whole one is
    renamed into place). For the folder's only writer, before it writes; returns how many it removed."""
    unfinished = [path for path in root.iterdir() if path.is_dir() and path.name.startswith(prefix)]
    for path in unfinished:
        shutil.rmtree(path, ignore_errors=True)
    return len(unfinished)


def write_hold(root: Path, holder: str, versions: set[int]) -> None:
    """Replace `holder`'s hold with `versions` (atomic: the learner may read it at any time)."""
    holds = root / HOLDS_DIR
    holds.mkdir(exist_ok=True)
    write_atomic(holds / f"{holder}.json", json.dumps(sorted(versions)).encode())


def held_versions(root: Path, hold_s: float) -> set[int] | None:
    """Versions some generator held within the last `hold_s` seconds: at most HOLD_MAX_VERSIONS (its newest) of
    each hold. The folder is writable by every generator, so the learner reads a hold only as a regular file of at
    most HOLD_MAX_BYTES, never through a symlink, and opens it without blocking (a FIFO put there would otherwise
    stop publishing); anything else is skipped, with one line naming it (a file it may not read too: any generator
    could make one). None: a hold could not be read for a while (out of file descriptors, an I/O error): what it
    holds is unknown, so nothing may be pruned this time."""
    held: set[int] = set()
    now = time.time()
    for path in (root / HOLDS_DIR).glob("*.json") if (root / HOLDS_DIR).is_dir() else ():
        try:
            versions = _read_hold(path, now, hold_s)
        except FileNotFoundError:
            continue  # its generator left meanwhile
        except OSError as err:
            if err.errno == errno.ELOOP:
                log.warning("weights: %s is a symlink, not a hold: ignored", path)
                continue
            if err.errno in (errno.EACCES, errno.EPERM):  # a file a generator made unreadable: as good as none
                log.warning("weights: the hold %s cannot be read (%s): ignored", path, err)
                continue
            log.warning("weights: the hold %s cannot be read (%s): no version is pruned this time", path, err)
            return None
        except (ValueError, TypeError):
            continue  # garbled
        held.update(sorted(versions)[-HOLD_MAX_VERSIONS:])
    return held


def _read_hold(path: Path, now: float, hold_s: float) -> set[int]:
    try:
        handle = open_regular(path, HOLD_MAX_BYTES)
    except NotRegularFile:
        log.warning("weights: %s is not a hold (a regular file of at most %d bytes): ignored", path, HOLD_MAX_BYTES)
        return set()
    with handle:
        if now - os.fstat(handle.fileno()).st_mtime > hold_s:
            return set()
        versions = json.loads(handle.read(HOLD_MAX_BYTES + 1))
    if not isinstance(versions, list) or not all(isinstance(v, int) and v >= 0 for v in versions):
        raise ValueError(f"{path}: a hold is a list of version numbers")
    return set(versions)
