"""The shared weights folder (services/weights_layout.py): every generator can write there, so the learner reads a
hold, an announcement, an index or a shard only as a regular file of bounded size, never waits on a FIFO, never
follows a symlink, and a hold pins a bounded number of versions."""

from __future__ import annotations

import json
import os
import stat
import threading

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services.files import NotRegularFile
from services.keys import Signer
from services.weights_layout import (
    ANNOUNCEMENT_FILE,
    HOLD_MAX_BYTES,
    HOLD_MAX_VERSIONS,
    HOLDS_DIR,
    INDEX_FILE,
    check_file,
    check_index,
    held_versions,
    shard_files,
    write_hold,
    write_version,
)


def test_a_fifo_a_symlink_or_a_large_file_in_the_holds_folder_is_skipped_without_blocking(tmp_path, caplog):
    write_hold(tmp_path, "gen-a", {3})
    holds = tmp_path / HOLDS_DIR
    os.mkfifo(holds / "fifo.json")  # an open() without O_NONBLOCK would wait for a writer forever
    secret = tmp_path / "elsewhere.json"
    secret.write_text("[7]")
    (holds / "link.json").symlink_to(secret)
    (holds / "big.json").write_text(json.dumps([8] + [0] * HOLD_MAX_BYTES))
    (holds / "garbled.json").write_text('{"not": "a list"}')
    result: list = []
    reader = threading.Thread(target=lambda: result.append(held_versions(tmp_path, 60)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert result == [{3}]  # only gen-a's hold, and at once
    assert "fifo.json is not a hold" in caplog.text and "link.json is a symlink" in caplog.text
    assert "big.json is not a hold" in caplog.text


def test_a_hold_pins_at_most_its_newest_few_versions(tmp_path):
    write_hold(tmp_path, "greedy", set(range(100)))
    assert held_versions(tmp_path, 60) == set(range(100 - HOLD_MAX_VERSIONS, 100))


def test_a_hold_that_cannot_be_read_prunes_nothing_and_a_failed_write_leaves_no_part(tmp_path, monkeypatch):
    """Out of file descriptors or an I/O error: what that hold pins is unknown, so no version may go (one a
    generator serves would). A hold whose write failed (a disk full) leaves no part of itself behind."""
    import errno

    from services import files, weights_layout

    write_hold(tmp_path, "gen-a", {3})
    write_hold(tmp_path, "gen-b", {4})
    real = weights_layout.open_regular

    refusal = OSError(errno.EMFILE, "Too many open files")

    def flaky(path, *args):
        if path.name == "gen-b.json":
            raise refusal
        return real(path, *args)

    monkeypatch.setattr(weights_layout, "open_regular", flaky)
    assert held_versions(tmp_path, 60) is None
    refusal = OSError(errno.EACCES, "Permission denied")  # a file any generator may make unreadable: for good
    assert held_versions(tmp_path, 60) == {3}
    monkeypatch.setattr(weights_layout, "open_regular", real)
    monkeypatch.setattr(files.os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with pytest.raises(OSError):
        write_hold(tmp_path, "gen-c", {5})
    assert sorted(p.name for p in (tmp_path / HOLDS_DIR).iterdir()) == ["gen-a.json", "gen-b.json"]


def within(seconds: float, call):
    """call() in a thread: its result, or a failure if it blocks (a FIFO opened without O_NONBLOCK waits forever)."""
    result: list = []

    def run():
        try:
            result.append(call())
        except Exception as err:  # noqa: BLE001 - handed to the test
            result.append(err)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout=seconds)
    assert result, f"{call} blocked"
    return result[0]


@pytest.mark.parametrize("trick", ["fifo", "symlink", "socket", "larger"])
def test_a_version_file_a_generator_replaced_is_refused_unread_and_nothing_blocks(tmp_path, trick):
    from services.weights import WeightPublisher

    signer = Signer("learner", Ed25519PrivateKey.generate())
    tensors = {f"layer{i}.weight": torch.full((64, 64), float(i)) for i in range(4)}
    announcement = write_version(tmp_path, 1, tensors, 32 * 1024, "http://unused", signer, "dapo:t:weights")
    folder = tmp_path / "v1"
    shard = shard_files(announcement)[0]
    elsewhere = tmp_path / "elsewhere"
    for name in (shard.name, INDEX_FILE, ANNOUNCEMENT_FILE):
        elsewhere.write_bytes((folder / name).read_bytes())
        (folder / name).unlink()
        if trick == "fifo":
            os.mkfifo(folder / name)
        elif trick == "symlink":
            (folder / name).symlink_to(elsewhere)  # the very bytes, but not the file the learner wrote
        elif trick == "socket":  # open() of a unix socket fails (ENXIO): refused as not a regular file
            os.mknod(folder / name, stat.S_IFSOCK | 0o600)
        else:
            (folder / name).write_bytes(elsewhere.read_bytes() + b" " * (64 << 20))
    assert within(10, lambda: check_file(folder / shard.name, shard)).startswith(shard.name)
    assert within(10, lambda: check_index(folder, announcement)).startswith(INDEX_FILE)
    publisher = WeightPublisher.__new__(WeightPublisher)  # only its folder: no Redis, no settings
    publisher.dir = tmp_path
    assert isinstance(within(10, lambda: publisher.announcement(1)), (NotRegularFile, OSError))
    # A republish of the same version (a resume) finds no intact copy and writes it again, whole.
    again = within(30, lambda: write_version(tmp_path, 1, tensors, 32 * 1024, "http://unused", signer,
                                             "dapo:t:weights"))
    assert again.sha256 == announcement.sha256
    assert not any(check_file(folder / f.name, f) for f in again.files)
