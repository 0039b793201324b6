"""The weight-sync protocol: the learner publishes versions as sha256-checked safetensors shards, generators
pull them over HTTP or read them in a shared folder.

Learner side (`WeightPublisher`, `weights_router`):
    publish(state_dict, version) writes `v{version}/` in the Hugging Face sharded layout (services/weights_layout.py:
    shards of at most `weights.shard_mb`, the index, every file's sha256) under `{run_dir}/weights` (transport
    http) or `weights.shared_dir` (transport shared-fs), keeps the last `weights.keep_versions` versions (and those
    a generator holds, shared-fs, or pulled within SERVING_HOLD_S, HTTP), then SETs `dapo:{run}:weights:latest` to
    the announcement (JSON) and PUBLISHes it on the channel `dapo:{run}:weights`. The router serves
    `GET /v1/weights/latest` and `GET /v1/weights/{v}` (announcements) and `GET /v1/weights/{v}/{file}` (the bytes),
    all behind the shared bearer token. A version the server cannot read (a disk error, a garbled file) is a 500
    with the error's type, not a 404: generators must not take a fault of the server for a pruned version.

Announcements are signed by the learner's key (`services.messages.sign_announcement`; the scheme: services/keys.py)
under the run's channel name (another run's announcement does not verify); `parse_announcement` refuses an
unsigned one, or one signed by any other key (a worker's, a retired one), so a process that can write to Redis
but holds no learner key cannot point generators (and their bearer token) at its own URL. Generators also pull only
from the configured learner URL (generator/sync.py).

Generator side (`latest_announcement`, `AnnouncementWatcher`, `pull_weights`, `check_shared`, `check_schema`):
    learn of versions from pub/sub plus the latest key (late joiners, missed messages). HTTP: download the files
    `weights.pull_concurrency` at a time into a temporary folder, hashing on the way, refuse any mismatch, then
    rename the folder into place. shared-fs: hash the files where they are (no copy). Before handing the folder
    to the engine, `check_schema` compares tensor names and shapes with the model's own checkpoint, read from the
    safetensors headers only (no tensor is loaded).

Weights travel as safetensors, never pickle. Tied weights: safetensors refuses two names for one storage, so
an alias of an already written tensor is skipped (the first name in state_dict order is kept: for HF models the
input embedding, and `lm_head.weight` is dropped, exactly what `save_pretrained` writes and what vLLM's loader
expects for `tie_word_embeddings` models, whose `load_weights` ignores `lm_head.weight`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import logging
import os
import shutil
import ssl
import struct
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, BinaryIO, Callable, Iterator

import httpx
import torch
from fastapi import APIRouter, HTTPException
from fastapi import Path as PathParameter
from fastapi.responses import StreamingResponse

from services.broadcast import parse_round
from services.config import ConfigError
from services.files import numbered, open_regular, read_regular, write_atomic
from services.keys import Keyring, load_keyring, load_signer
from services.messages import WeightsAnnouncement, WeightsBroadcast, WeightsFile, read_announcement
from services.redis_local import retrying
from services.streams import run_prefix
from services.weights_layout import (
    ANNOUNCEMENT_FILE,
    ANNOUNCEMENT_MAX_BYTES,
    CHUNK,
    PULLING_PREFIX,
    WRITING_PREFIX,
    Written,
    begin_version,
    check_file,
    check_index,
    finish_version,
    held_versions,
    remove_unfinished,
    shard_files,
    write_version,
)

log = logging.getLogger(__name__)
# HTTP's hold: a version stays on disk while one of its files is being downloaded, and this long after a generator
# last asked for it or a download of it ended (a pull opens its next file as one ends, so it is never cut short)
SERVING_HOLD_S = 60.0
PULL_CONNECT_TIMEOUT_S = 10.0  # a pull's connection: a learner that does not answer it is unreachable after this


class WeightsError(RuntimeError):
    """A weight sync that was refused. `reason` is a short label (metrics), the message says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


# -- pure helpers -------------------------------------------------------------------------------------------
def unique_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF name -> each parameter and buffer once, detached: a tied alias (lm_head.weight of tied-embedding models,
    the same object as the embedding) is dropped, as save_pretrained does. The same order on every rank."""
    unique: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            unique[name] = tensor.detach()
    return unique


def checkpoint_names(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` (some or all of `unique_tensors(model)`) under the checkpoint's names, which vLLM loads:
    transformers 5 holds an MoE layer's experts fused in memory (`mlp.experts.gate_up_proj`) and reverts that on
    save. Each in-memory tensor reverts on its own, so a rank may revert the part it writes
    (`learner.publish.owned_weights`)."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4: the checkpoint's layout in memory
        return tensors
    return {name: value.contiguous() for name, value in revert_weight_conversion(model, tensors).items()}


def shareable_state_dict(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached, contiguous CPU tensors that safetensors accepts.

    An exact alias (same storage, offset, shape and strides as a tensor already kept) is dropped: tied weights.
    A tensor that only overlaps another one (a view of a fused parameter) is cloned, so both names survive.
    """
    kept: dict[str, torch.Tensor] = {}
    seen: dict[tuple, str] = {}
    storages: set[int] = set()
    for name, tensor in state_dict.items():
        tensor = tensor.detach()
        storage = tensor.untyped_storage().data_ptr()
        identity = (storage, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if identity in seen:
            log.debug("skipping %s: tied to %s", name, seen[identity])
            continue
        seen[identity] = name
        shared = storage in storages
        storages.add(storage)
        if tensor.device.type != "cpu":
            tensor = tensor.to("cpu")  # a fresh copy: shares nothing
        elif shared:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        kept[name] = tensor.contiguous()
    return kept


def read_schema(path: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype, shape)} from a safetensors header, without reading any tensor.

    Raises WeightsError("format") if the file is not a well-formed safetensors file.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (header_len,) = struct.unpack("<Q", handle.read(8))
            if header_len > min(size - 8, 100 * 1024 * 1024):
                raise ValueError(f"header length {header_len} exceeds the file")
            header = json.loads(handle.read(header_len))
        schema, end = {}, 0
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, stop = info["data_offsets"]
            end = max(end, stop)
            schema[name] = (str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        if 8 + header_len + end != size:
            raise ValueError(f"data ends at {8 + header_len + end} but the file has {size} bytes")
    except (OSError, ValueError, KeyError, TypeError, struct.error) as err:
        raise WeightsError("format", f"{path.name} is not a valid safetensors file: {err}") from err
    return schema


def model_schema(model_dir: str | os.PathLike) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The checkpoint schema of a model folder: the files its `model.safetensors.index.json` maps, as vLLM and
    transformers read it (a hub snapshot may also hold a `consolidated.safetensors` of other names), else all its
    *.safetensors files."""
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise WeightsError("format", f"{index} is not a valid index: {err}") from err
        files = [Path(model_dir) / name for name in names]
    else:
        files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise WeightsError("format", f"no *.safetensors in {model_dir}")
    schema: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        schema.update(read_schema(file))
    return schema


def tied_aliases(model_dir: str | os.PathLike) -> set[str]:
    """Names a tied-embedding checkpoint may carry in addition to the model's own (vLLM skips them)."""
    config_path = Path(model_dir) / "config.json"
    if not config_path.is_file():
        return set()
    config = json.loads(config_path.read_text())
    text_config = config.get("text_config", config)
    return {"lm_head.weight"} if text_config.get("tie_word_embeddings", config.get("tie_word_embeddings")) else set()


def check_schema(
    candidate: dict[str, tuple[str, tuple[int, ...]]],
    expected: dict[str, tuple[str, tuple[int, ...]]],
    optional: set[str] = frozenset(),
) -> None:
    """Refuse weights whose tensor names or shapes differ from the model's (dtype may differ: it is cast).

    A missing tensor would leave an old one in place (a silently mixed policy); an unknown or misshapen one
    would crash the engine mid-reload. Both raise WeightsError("shape") with the first few differences.
    """
    problems = []
    missing = sorted(set(expected) - set(candidate) - set(optional))  # a tied alias the checkpoint stores too
    unknown = sorted(set(candidate) - set(expected) - set(optional))
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
    if unknown:
        problems.append(f"{len(unknown)} unknown tensors (e.g. {', '.join(unknown[:3])})")
    misshapen = [
        f"{name} {list(candidate[name][1])} != {list(shape)}"
        for name, (_, shape) in expected.items()
        if name in candidate and candidate[name][1] != shape
    ]
    if misshapen:
        problems.append(f"{len(misshapen)} shape mismatches (e.g. {'; '.join(misshapen[:3])})")
    if problems:
        raise WeightsError("shape", "weights do not fit the model: " + ", ".join(problems))


def channel(streams_or_prefix) -> str:
    """The pub/sub channel `dapo:{run}:weights`."""
    return _prefix(streams_or_prefix) + "weights"


def latest_key(streams_or_prefix) -> str:
    return _prefix(streams_or_prefix) + "weights:latest"


def _prefix(streams_or_prefix) -> str:
    prefix = streams_or_prefix if isinstance(streams_or_prefix, str) else streams_or_prefix.prefix
    return prefix if prefix.endswith(":") else prefix + ":"


def _version_of(folder: Path) -> int | None:
    return numbered(folder.name, "v")


# -- learner side -------------------------------------------------------------------------------------------
SHARED_DIR_RUN_FILE = "run"  # in weights.shared_dir: the run whose versions it holds


def claim_shared_dir(folder: Path, run: str) -> None:
    """Mark `folder` (weights.shared_dir) as `run`'s, or refuse it if another run's versions are there: versions
    are numbered per run, so a second run in it removed the first's half-written version, took its numbers and
    pruned its versions (both runs stalled)."""
    marker = folder / SHARED_DIR_RUN_FILE
    try:
        owner = read_regular(marker, 4096).decode(errors="replace").strip()
    except FileNotFoundError:
        write_atomic(marker, run + "\n")
        return
    if owner != run:
        raise ConfigError(f"weights.shared_dir {folder} holds the weight versions of run {owner!r} (its file "
                          f"{SHARED_DIR_RUN_FILE}), not of {run!r}: give each run its own folder, or delete the "
                          "folder's contents once that run is over")


class WeightPublisher:
    """Writes weight versions (services/weights_layout.py) and announces them on Redis."""

    def __init__(self, settings, redis_client, base_url: str):
        cfg = settings.weights
        self.dir = Path(cfg.shared_dir) if cfg.transport == "shared-fs" else Path(settings.run_dir) / "weights"
        self.dir.mkdir(parents=True, exist_ok=True)
        if cfg.transport == "shared-fs":
            claim_shared_dir(self.dir, settings.redis.run)  # before anything in it is removed
        if removed := remove_unfinished(self.dir, WRITING_PREFIX):
            log.warning("removed %d versions a killed learner left half written in %s", removed, self.dir)
        self.keep = max(1, int(settings.weights.keep_versions))
        self.hold_s = cfg.hold_s
        self.shard_bytes = int(cfg.shard_mb * 1024 * 1024)
        self.redis = retrying(redis_client)
        self.prefix = run_prefix(settings)
        self.keyring = load_keyring(settings)
        self.signer = load_signer(settings, "learner", self.keyring)
        self.base_url = base_url.rstrip("/")
        self._lock = threading.Lock()
        self._served: dict[int, float] = {}  # version -> when a generator last asked for it or a download ended
        self._downloading: dict[int, int] = {}  # version -> its files being downloaded now

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> WeightsAnnouncement:
        """Write, hash, prune, then announce (SET latest + PUBLISH). Returns the announcement."""
        # Written into a temporary folder renamed at the end: downloads of older versions go on meanwhile (a 32B
        # version takes minutes to write); only the prune must not remove a folder a download is opening.
        return self._announce(write_version(self.dir, version, shareable_state_dict(state_dict), self.shard_bytes,
                                            self._url(version), self.signer, channel(self.prefix)))

    def begin(self, version: int) -> Path:
        """The temporary folder `version`'s shards are written into (by this process, or by every learner rank:
        learner/publish.py), then completed by `finish`."""
        return begin_version(self.dir, version)

    def finish(self, version: int, tmp: Path, writers: list[Written]) -> WeightsAnnouncement:
        """The index and the signed announcement of what `writers` wrote into `tmp`, the folder renamed into place,
        old versions pruned, then the announcement (SET latest + PUBLISH). Returns it."""
        return self._announce(finish_version(self.dir, tmp, version, writers, self._url(version), self.signer,
                                             channel(self.prefix)))

    def _url(self, version: int) -> str:
        return f"{self.base_url}/v1/weights/{version}"

    def _announce(self, announcement: WeightsAnnouncement) -> WeightsAnnouncement:
        """A version now on disk: announce it (SET latest + PUBLISH), then prune the old ones (pruned first, `latest`
        named a deleted version until the SET, for good if the learner died in between)."""
        version = announcement.version
        payload = announcement.model_dump_json()
        self.redis.set(latest_key(self.prefix), payload)
        self.redis.publish(channel(self.prefix), payload)
        with self._lock:
            self._prune(keep_also=version)
        log.info(
            "published weights v%d (%.1f MB in %d files, sha256 %s)",
            version, announcement.size / 1e6, len(announcement.files), announcement.sha256[:12],
        )
        return announcement

    def versions(self) -> list[int]:
        """Published versions on disk, oldest first."""
        found = [
            v for p in self.dir.iterdir()
            if p.is_dir() and (v := _version_of(p)) is not None and (p / ANNOUNCEMENT_FILE).is_file()
        ]
        return sorted(found)

    def announcement(self, version: int) -> WeightsAnnouncement | None:
        """None for a version that is not on disk (never published, or pruned). Anything else that keeps it from
        being read (a disk error, no file descriptor left, a garbled file, something other than a regular file of
        bounded size: generators may write in a shared folder) raises: a fault of this server, not a version that
        is gone. Nothing here waits on a FIFO or follows a symlink (`open_regular`)."""
        path = self.dir / f"v{version}" / ANNOUNCEMENT_FILE
        try:
            return WeightsAnnouncement.model_validate_json(read_regular(path, ANNOUNCEMENT_MAX_BYTES))
        except FileNotFoundError:
            return None

    def latest(self) -> WeightsAnnouncement | None:
        versions = self.versions()
        return self.announcement(versions[-1]) if versions else None

    def served(self, version: int) -> WeightsAnnouncement | None:
        """The announcement of a version a generator asks for, which then stays on disk for SERVING_HOLD_S
        more (HTTP's hold: the files of a pull not opened yet must not be pruned under it; see open_file)."""
        with self._lock:
            announcement = self.announcement(version)
            if announcement is not None:
                self._served[version] = time.monotonic()
            return announcement

    def open_file(self, version: int, name: str) -> tuple[WeightsFile, BinaryIO] | None:
        """An announced file of a version and an open handle on it (an open handle survives a concurrent prune).
        The version is held SERVING_HOLD_S, and while the download runs (`downloading`): its other files may be
        still to come."""
        with self._lock:
            announcement = self.announcement(version)
            entry = next((f for f in announcement.files if f.name == name), None) if announcement else None
            if entry is None:
                return None
            try:
                handle = open_regular(self.dir / f"v{version}" / name, entry.size)
            except FileNotFoundError:
                return None
            self._served[version] = time.monotonic()
            return entry, handle

    @contextlib.contextmanager
    def downloading(self, version: int) -> Iterator[None]:
        """Hold `version` while a file of it is sent, and SERVING_HOLD_S after (done, failed or cut off)."""
        with self._lock:
            self._downloading[version] = self._downloading.get(version, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._downloading.pop(version) - 1
                if left:
                    self._downloading[version] = left
                self._served[version] = time.monotonic()

    def _serving(self) -> set[int]:
        """Versions being downloaded, or asked for or downloaded within the last SERVING_HOLD_S seconds."""
        now = time.monotonic()
        self._served = {v: t for v, t in self._served.items() if now - t <= SERVING_HOLD_S}
        return set(self._served) | set(self._downloading)

    def _prune(self, keep_also: int) -> None:
        """Keep the newest `keep_versions`, `keep_also` and what generators hold (shared-fs) or are pulling
        (HTTP), of those at most `keep_versions` more, the newest: holds and requests are any generator's word (or
        any holder of the weights token's), and asking for every old version must not fill the disk. Drop the
        rest."""
        versions = sorted(v for p in self.dir.iterdir() if p.is_dir() and (v := _version_of(p)) is not None)
        newest = set(versions[-self.keep:]) | {keep_also}
        if (held := held_versions(self.dir, self.hold_s)) is None:
            return  # a hold that could not be read may name any of them: the next publish prunes
        asked = sorted((held | self._serving()) & set(versions) - newest)
        keep = newest | set(asked[-self.keep:])
        if len(asked) > self.keep:
            log.warning("weights: %d older versions held or being pulled, more than weights.keep_versions (%d): "
                        "the oldest pruned", len(asked), self.keep)
        for version in versions:
            if version not in keep:
                shutil.rmtree(self.dir / f"v{version}", ignore_errors=True)


# A version in a request: 422 beyond what a policy version can be, before it names a folder (ENAMETOOLONG: a 500).
RequestedVersion = Annotated[int, PathParameter(ge=0, le=2**63 - 1)]


def weights_router(publisher: WeightPublisher) -> APIRouter:
    """`GET /v1/weights/latest` and `GET /v1/weights/{version}` (behind the app's bearer token, services/http.py)."""
    router = APIRouter(prefix="/v1/weights", tags=["weights"])

    @router.get("/latest", response_model=WeightsAnnouncement)
    def latest() -> WeightsAnnouncement:
        announcement = publisher.latest()
        if announcement is None:
            raise HTTPException(404, "no weights published yet")
        return announcement

    @router.get("/{version}", response_model=WeightsAnnouncement)
    def manifest(version: RequestedVersion) -> WeightsAnnouncement:
        announcement = publisher.served(version)
        if announcement is None:
            raise HTTPException(404, f"weights version {version} is unknown or was pruned")
        return announcement

    @router.get("/{version}/{name}")
    def download(version: RequestedVersion, name: str):
        opened = publisher.open_file(version, name)
        if opened is None:
            raise HTTPException(404, f"weights version {version} has no file {name!r} (unknown or pruned)")
        entry, handle = opened

        def chunks() -> Iterator[bytes]:
            with handle, publisher.downloading(version):
                while chunk := handle.read(CHUNK):
                    yield chunk

        headers = {
            "Content-Length": str(entry.size),
            "X-Weights-Sha256": entry.sha256,
            "X-Weights-Version": str(version),
            "Content-Disposition": f'attachment; filename="{entry.name}"',
        }
        return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)

    return router


# -- generator side -----------------------------------------------------------------------------------------
def parse_announcement(raw: bytes | str, keyring: Keyring, streams_or_prefix) -> WeightsAnnouncement | None:
    """An announcement read from Redis, or None (logged) if it is malformed or not signed by a learner key of the
    keyring for this run."""
    return read_announcement(WeightsAnnouncement, raw, keyring, channel(streams_or_prefix), "weights announcement")


def latest_announcement(redis_client, streams_or_prefix, keyring: Keyring) -> WeightsAnnouncement | None:
    """The announcement in `dapo:{run}:weights:latest`; None if nothing was published, or it is garbled or forged."""
    raw = retrying(redis_client).get(latest_key(streams_or_prefix))
    return parse_announcement(raw, keyring, streams_or_prefix) if raw else None


def pull_weights(
    announcement: WeightsAnnouncement,
    token: str,
    dest_dir: str | os.PathLike,
    timeout: float = 60.0,
    concurrency: int = 4,
    cancel: threading.Event | None = None,
    verify: ssl.SSLContext | bool = True,
) -> Path:
    """Download the announced files into `dest_dir/v{version}/`, `concurrency` at a time; return that folder.
    `verify`: what an HTTPS learner's certificate is checked against (services.http.client_verify).

    The bytes stream into a temporary folder and are hashed on the way; the folder is renamed into place only
    if every file's sha256 and size match the announcement, the index names exactly the announced shards and
    every shard is well-formed safetensors. Raises WeightsError with reason unauthorized (401/403), not_found
    (404), http (other status), unreachable (connection), checksum (sha256/size mismatch), format, or cancelled
    (`cancel` was set: the caller is stopping, and a version downloads for minutes); nothing is left behind.
    """
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PULLING_PREFIX}{announcement.version}-", dir=dest_dir))
    started = time.perf_counter()
    try:
        # `timeout` between bytes; a learner that does not answer the connection at all is unreachable sooner
        limits = httpx.Timeout(timeout, connect=min(timeout, PULL_CONNECT_TIMEOUT_S))
        with httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=limits, verify=verify) as client:
            failed = threading.Event()  # the downloads still running stop at another file's failure
            _each(concurrency, lambda f: _download(client, announcement, f, tmp, (cancel, failed)),
                  announcement.files, failed)
        _check_layout(tmp, announcement)
        final = dest_dir / f"v{announcement.version}"
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info(
        "pulled weights v%d (%.1f MB, %d files) in %.2fs",
        announcement.version, announcement.size / 1e6, len(announcement.files), time.perf_counter() - started,
    )
    return final


def check_shared(announcement: WeightsAnnouncement, shared_dir: str | os.PathLike, concurrency: int = 4,
                 cancel: threading.Event | None = None) -> Path:
    """The version's folder in the shared directory, once every file matches the announcement (no copy).

    The files are hashed where they are: a shared file system may serve a stale or damaged file, and a bad
    file would kill the engine mid-reload; reading them also warms the page cache the engine then loads from.
    WeightsError not_found (pruned, or the learner writes elsewhere), checksum, format, or cancelled (`cancel`
    was set: the caller is stopping, and the reading ends at its next chunk).
    """
    folder = Path(shared_dir) / f"v{announcement.version}"
    if not folder.is_dir():
        raise WeightsError("not_found",
                           f"weights v{announcement.version} not in {shared_dir} (pruned, or another folder)")
    problems = [p for p in _each(concurrency, lambda f: check_file(folder / f.name, f, cancel), announcement.files)
                if p]
    if cancel is not None and cancel.is_set():
        raise WeightsError("cancelled", f"check of weights v{announcement.version} in {folder} stopped")
    if problems:
        reason = "not_found" if all(p.endswith("missing") for p in problems) else "checksum"
        raise WeightsError(reason, f"weights v{announcement.version} in {folder}: " + "; ".join(problems[:3]))
    _check_layout(folder, announcement)
    return folder


def _each(concurrency: int, function: Callable, items: list, failed: threading.Event | None = None) -> list:
    """function(item) for every item, `concurrency` at a time; at the first failure, whichever item it is, the
    rest is not started, `failed` is set (for those running to stop early) and that failure is raised."""
    with ThreadPoolExecutor(concurrency, thread_name_prefix="weights") as pool:
        futures = [pool.submit(function, item) for item in items]
        try:
            done, _ = concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_EXCEPTION)
            first = next((future for future in futures if future in done and future.exception() is not None), None)
            if first is not None:
                raise first.exception()
            return [future.result() for future in futures]
        except BaseException:
            if failed is not None:
                failed.set()
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _download(
    client: httpx.Client, announcement: WeightsAnnouncement, entry: WeightsFile, folder: Path,
    stops: tuple[threading.Event | None, ...]
) -> None:
    url = f"{announcement.url}/{entry.name}"
    digest, size = hashlib.sha256(), 0
    try:
        with client.stream("GET", url) as response:
            if response.status_code in (401, 403):
                raise WeightsError("unauthorized",
                                   f"weights server refused the token ({response.status_code}) for {url}")
            if response.status_code == 404:
                raise WeightsError("not_found", f"weights v{announcement.version} not found at {url}")
            if response.status_code != 200:
                raise WeightsError("http", f"GET {url} answered {response.status_code}")
            with open(folder / entry.name, "wb") as out:
                for chunk in response.iter_raw(CHUNK):
                    if any(stop is not None and stop.is_set() for stop in stops):
                        raise WeightsError("cancelled", f"download of weights v{announcement.version} stopped")
                    size += len(chunk)
                    if size > entry.size:
                        raise WeightsError("checksum", f"{url}: more than the announced {entry.size} bytes")
                    digest.update(chunk)
                    out.write(chunk)
    except httpx.HTTPError as err:
        raise WeightsError("unreachable", f"GET {url} failed: {type(err).__name__}: {err}") from err
    if size != entry.size or digest.hexdigest() != entry.sha256:
        raise WeightsError(
            "checksum",
            f"weights v{announcement.version} {entry.name}: sha256 {digest.hexdigest()[:16]}... ({size} bytes) does "
            f"not match the announced {entry.sha256[:16]}... ({entry.size} bytes)",
        )


def _check_layout(folder: Path, announcement: WeightsAnnouncement) -> None:
    """Index and shard headers well-formed before anyone loads them (WeightsError format)."""
    problem = check_index(folder, announcement)
    if problem:
        raise WeightsError("format", f"weights v{announcement.version}: {problem}")
    for entry in shard_files(announcement):
        read_schema(folder / entry.name)


class AnnouncementWatcher:
    """Tracks the newest announced version: pub/sub for promptness, the latest key at start and every poll_s.

    A background thread keeps `newest` up to date; `wait_newer(version, timeout)` blocks until something newer
    than `version` is known. Pub/sub messages can be lost (reconnects), the key poll makes that harmless. The
    channel also carries broadcast rounds (transport collective, services/broadcast.py): the newest is `round`
    (a lost one costs that round, the files bring its version).
    """

    def __init__(self, redis_client, streams_or_prefix, keyring: Keyring, poll_s: float = 5.0):
        self.redis = retrying(redis_client)
        self.prefix = _prefix(streams_or_prefix)
        self.keyring = keyring
        self.poll_s = poll_s
        self.newest: WeightsAnnouncement | None = None
        self.round: WeightsBroadcast | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "AnnouncementWatcher":
        self.offer(latest_announcement(self.redis, self.prefix, self.keyring))
        self._thread = threading.Thread(target=self._run, name="weights-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def offer(self, announcement: WeightsAnnouncement | None) -> None:
        if announcement is None:
            return
        with self._changed:
            newest = self.newest
            # A version published again with other bytes (a resume that writes its version in another dtype or
            # layout) replaces the files: its new announcement must replace the old one, or a pull keeps failing.
            if (newest is None or announcement.version > newest.version
                    or (announcement.version == newest.version and announcement.sha256 != newest.sha256
                        and announcement.published_at > newest.published_at)):
                self.newest = announcement
                self._changed.notify_all()

    def _take(self, raw: bytes | str) -> None:
        if b'"kind":"broadcast"' not in (raw if isinstance(raw, bytes) else raw.encode()):
            self.offer(parse_announcement(raw, self.keyring, self.prefix))
        elif (offered := parse_round(raw, self.keyring, channel(self.prefix))) is not None:
            if self.round is None or offered.version > self.round.version:
                self.round = offered

    def wait_newer(self, version: int, timeout: float) -> WeightsAnnouncement | None:
        with self._changed:
            self._changed.wait_for(lambda: self.newest is not None and self.newest.version > version, timeout)
            return self.newest if self.newest is not None and self.newest.version > version else None

    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_s
        pubsub = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(channel(self.prefix))
                    self.offer(latest_announcement(self.redis, self.prefix, self.keyring))  # anything missed while away
                message = pubsub.get_message(timeout=min(1.0, self.poll_s))
                if message and message.get("type") == "message":
                    self._take(message["data"])
                if time.monotonic() >= next_poll:
                    next_poll = time.monotonic() + self.poll_s
                    self.offer(latest_announcement(self.redis, self.prefix, self.keyring))
            except Exception as err:  # Redis restart or network: resubscribe after a pause
                log.warning("weights watcher: %s; resubscribing", err)
                if pubsub is not None:
                    try:
                        pubsub.close()
                    except Exception:
                        pass
                pubsub = None
                self._stop.wait(1.0)
        if pubsub is not None:
            pubsub.close()
