"""The shared weights folder's holds (services/weights_layout.py): every generator can write there, so the learner
reads a hold only as a small regular file, and a hold pins a bounded number of versions."""

from __future__ import annotations

import json
import os
import threading

from services.weights_layout import HOLD_MAX_BYTES, HOLD_MAX_VERSIONS, HOLDS_DIR, held_versions, write_hold


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
