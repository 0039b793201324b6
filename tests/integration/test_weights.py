"""The weight-sync protocol against a real HTTP server (uvicorn) and a real Redis: publish, announce, pull or read
the shared folder."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from servers import ServerThread, free_port
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME

import services.weights as weights_module
from services.config import ConfigError, WeightsConfig, load_settings
from services.http import create_app
from services.keys import ROLES
from services.messages import WeightsAnnouncement
from services.redis_local import connect
from services.streams import Streams
from services.weights import (
    AnnouncementWatcher,
    WeightPublisher,
    WeightsError,
    check_schema,
    check_shared,
    latest_announcement,
    model_schema,
    pull_weights,
    read_schema,
    shareable_state_dict,
    tied_aliases,
    weights_router,
)
from services.weights_layout import (
    PULLING_PREFIX,
    WRITING_PREFIX,
    held_versions,
    remove_unfinished,
    shard_plan,
    write_hold,
    write_version,
)

TOKEN = "s3cret"


def big_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """Tensors of 0.6, 0.6 and 1.2 MB and a small norm: with weights.shard_mb = 1, four shards."""
    gen = torch.Generator().manual_seed(seed)
    state = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(150, 1024, generator=gen) for i in range(3)}
    state["model.layers.2.mlp.up_proj.weight"] = torch.randn(300, 1024, generator=gen)  # 1.2 MB: alone
    state["model.norm.weight"] = torch.ones(8)
    return state


def tiny_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A state dict with a tied embedding / lm_head pair, like a tied HF causal LM."""
    gen = torch.Generator().manual_seed(seed)
    embed = torch.randn(32, 8, generator=gen)
    return {
        "model.embed_tokens.weight": embed,
        "model.layers.0.mlp.up_proj.weight": torch.randn(16, 8, generator=gen),
        "model.norm.weight": torch.ones(8),
        "lm_head.weight": embed,  # tied: the same storage under a second name
    }


@pytest.fixture
def learner(settings):
    """A learner-like HTTP app serving the publisher's weights."""
    client = connect(settings)
    app = create_app("learner", token=TOKEN)
    with ServerThread(app) as server:
        publisher = WeightPublisher(settings, client, server.url)
        app.include_router(weights_router(publisher))
        yield publisher, server, client


def test_shareable_state_dict_drops_tied_alias_and_clones_partial_views():
    fused = torch.arange(12.0).reshape(4, 3)
    state = {"a": fused[:2], "b": fused[2:], **tiny_state_dict()}
    out = shareable_state_dict(state)
    assert "lm_head.weight" not in out and "model.embed_tokens.weight" in out
    assert torch.equal(out["a"], fused[:2]) and torch.equal(out["b"], fused[2:])
    save_file(out, "/dev/null")  # safetensors accepts it (it refuses shared storage)


def test_publish_pull_round_trip_with_announcement(learner, settings, short_tmp):
    publisher, server, client = learner
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(f"dapo:{settings.redis.run}:weights")
    time.sleep(0.05)
    state = tiny_state_dict(seed=1)
    announced = publisher.publish(state, version=3)
    assert announced.url == f"{server.url}/v1/weights/3" and announced.version == 3
    assert [f.name for f in announced.files] == ["model-00001-of-00001.safetensors", SAFE_WEIGHTS_INDEX_NAME]

    # announced both ways: the latest key and the channel
    assert latest_announcement(client, Streams(client, settings, signs_as=ROLES), publisher.keyring) == announced
    message = None
    for _ in range(50):
        message = pubsub.get_message(timeout=0.1)
        if message:
            break
    assert WeightsAnnouncement.model_validate_json(message["data"]) == announced

    folder = pull_weights(announced, TOKEN, f"{short_tmp}/pulled")
    assert folder.name == "v3"
    got = load_file(folder / "model-00001-of-00001.safetensors")
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name])
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".pull")]  # no temp leftovers


def test_endpoints_require_token_and_404_unknown(learner):
    import httpx

    publisher, server, _ = learner
    publisher.publish(tiny_state_dict(), version=0)
    shard = "model-00001-of-00001.safetensors"
    assert httpx.get(f"{server.url}/v1/weights/latest").status_code == 401
    assert httpx.get(f"{server.url}/v1/weights/0/{shard}", headers={"Authorization": "Bearer nope"}).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    latest = httpx.get(f"{server.url}/v1/weights/latest", headers=auth)
    assert latest.status_code == 200 and latest.json()["version"] == 0
    assert httpx.get(f"{server.url}/v1/weights/0", headers=auth).json() == latest.json()
    (entry,) = [f for f in latest.json()["files"] if f["name"] == shard]
    body = httpx.get(f"{server.url}/v1/weights/0/{shard}", headers=auth)
    assert body.status_code == 200 and body.headers["x-weights-sha256"] == entry["sha256"]
    assert len(body.content) == entry["size"]
    missing = httpx.get(f"{server.url}/v1/weights/7", headers=auth)
    assert missing.status_code == 404 and "unknown" in missing.json()["error"]
    for name in ("announcement.json", "..%2Fv0%2Fannouncement.json", "other.safetensors"):  # only announced files
        assert httpx.get(f"{server.url}/v1/weights/0/{name}", headers=auth).status_code == 404
    for version in ("9" * 300, "-1", str(2**63)):  # no version a policy can have: refused before it names a folder
        for path in (version, f"{version}/{shard}"):
            refused = httpx.get(f"{server.url}/v1/weights/{path}", headers=auth)
            assert refused.status_code == 422, (path[:20], refused.status_code)


def test_pull_refuses_bad_token_and_bad_checksum_without_leftovers(learner, short_tmp):
    publisher, _, _ = learner
    announced = publisher.publish(tiny_state_dict(), version=1)
    dest = f"{short_tmp}/pulled"
    with pytest.raises(WeightsError, match="refused the token") as err:
        pull_weights(announced, "wrong", dest)
    assert err.value.reason == "unauthorized"
    shard = announced.files[0]
    forged = announced.model_copy(update={"files": [shard.model_copy(update={"sha256": "0" * 64}), announced.files[1]]})
    with pytest.raises(WeightsError, match="does not match") as err:
        pull_weights(forged, TOKEN, dest)
    assert err.value.reason == "checksum"
    shorter = announced.model_copy(update={"files": [shard.model_copy(update={"size": shard.size - 1}),
                                                     announced.files[1]]})
    with pytest.raises(WeightsError) as err:
        pull_weights(shorter, TOKEN, dest)
    assert err.value.reason == "checksum"
    with pytest.raises(WeightsError) as err:
        pull_weights(announced.model_copy(update={"url": announced.url[:-1] + "9"}), TOKEN, dest)
    assert err.value.reason == "not_found"
    with pytest.raises(WeightsError) as err:
        pull_weights(announced.model_copy(update={"url": f"http://127.0.0.1:{free_port()}/x"}), TOKEN, dest)
    assert err.value.reason == "unreachable"
    stopping = threading.Event()
    stopping.set()  # a generator told to stop: its download ends at the next chunk, not after the whole version
    with pytest.raises(WeightsError) as err:
        pull_weights(announced, TOKEN, dest, cancel=stopping)
    assert err.value.reason == "cancelled"
    assert list(Path(dest).iterdir()) == []


def test_publisher_keeps_last_versions_and_serves_only_those(learner, settings):
    publisher, _, _ = learner
    keep = settings.weights.keep_versions
    for version in range(keep + 2):
        publisher.publish(tiny_state_dict(seed=version), version=version)
    (publisher.dir / "v\u00b2").mkdir()  # a stray folder (generators may write in a shared one): no version
    assert publisher.versions() == list(range(2, keep + 2))
    assert publisher.latest().version == keep + 1
    assert publisher.open_file(0, "model-00001-of-00001.safetensors") is None
    folder = publisher.dir / f"v{keep + 1}"
    assert sorted(p.name for p in folder.iterdir()) == [
        "announcement.json", "model-00001-of-00001.safetensors", SAFE_WEIGHTS_INDEX_NAME
    ]
    meta = json.loads(folder.joinpath("announcement.json").read_text())
    assert meta["size"] == sum(folder.joinpath(f["name"]).stat().st_size for f in meta["files"])
    assert not [p for p in publisher.dir.iterdir() if p.name.startswith(".")]  # no temporary folders left


def test_a_version_is_announced_before_the_one_it_replaces_is_pruned(learner, settings, monkeypatch):
    """Pruned first, `latest` named a deleted version until the SET (a late generator got a 404), and for good if
    the learner died in between."""
    publisher, _, _ = learner
    keep = settings.weights.keep_versions
    for version in range(keep):
        publisher.publish(tiny_state_dict(seed=version), version=version)
    announced = []
    monkeypatch.setattr(publisher.redis, "set", lambda key, value: announced.append(
        (json.loads(value)["version"], publisher.versions())))
    publisher.publish(tiny_state_dict(seed=keep), version=keep)
    assert announced == [(keep, list(range(keep + 1)))]  # every version still on disk when the newest is announced
    assert publisher.versions() == list(range(1, keep + 1))


def test_holds_and_requests_on_every_old_version_keep_at_most_keep_versions_more(shared_settings):
    """Holds are any generator's word (requests any weights token's): one holding every version must not keep them
    all on disk. The newest `keep_versions` of what is held stay; the older go."""
    publisher = WeightPublisher(shared_settings, connect(shared_settings), "http://learner.invalid:8000")
    keep = shared_settings.weights.keep_versions
    total = 3 * keep + 2
    for version in range(total):
        write_hold(publisher.dir, f"greedy-{version}", {version})  # one hold file per version: each within its cap
        publisher.served(version - 1)  # and a request for the version before, as a pull would
        publisher.publish(tiny_state_dict(seed=version), version=version)
    newest = list(range(total - keep, total))
    assert publisher.versions() == [*range(total - 2 * keep, total - keep), *newest]


def test_a_version_being_pulled_over_http_outlives_keep_versions_until_its_hold_lapses(learner, settings, monkeypatch):
    """A pull opens its next file when one ends: a version whose files are being downloaded is not pruned under it,
    however many versions are published meanwhile, nor for SERVING_HOLD_S after; then it goes."""
    publisher, _, _ = learner
    keep = settings.weights.keep_versions
    publisher.publish(tiny_state_dict(seed=1), version=1)
    _, handle = publisher.open_file(1, "model-00001-of-00001.safetensors")
    handle.close()
    for version in range(2, keep + 4):
        publisher.publish(tiny_state_dict(seed=version), version=version)
    assert publisher.versions() == [1, *range(4, keep + 4)]  # opened a moment ago
    monkeypatch.setattr(weights_module, "SERVING_HOLD_S", 0.0)
    with publisher.downloading(1):  # a long download: held however long it takes
        publisher.publish(tiny_state_dict(seed=9), version=keep + 4)
        assert publisher.versions() == [1, *range(5, keep + 5)]
    publisher.publish(tiny_state_dict(seed=10), version=keep + 5)
    assert publisher.versions() == list(range(6, keep + 6))


def test_a_stopping_generator_ends_its_check_of_a_shared_version_at_the_next_chunk(learner):
    """Hashing a 32B version where it lies (61 GiB over NFS) takes minutes and took no stop: a generator told to stop
    went on reading past its pod's grace (its pull thread is joined at exit) and was killed."""
    publisher, _, _ = learner
    announced = publisher.publish(tiny_state_dict(seed=3), version=1)
    stop = threading.Event()
    stop.set()
    with pytest.raises(WeightsError, match="stopped") as err:
        check_shared(announced, publisher.dir, cancel=stop)
    assert err.value.reason == "cancelled"
    assert check_shared(announced, publisher.dir, cancel=threading.Event()) == publisher.dir / "v1"


def test_a_republished_version_is_never_missing_and_other_bytes_replace_it_whole(learner, short_tmp):
    """A resume republishes its checkpoint's version: the same bytes keep their files (a download or an engine
    reading them goes on) and get the new announcement; other bytes under that version replace it whole."""
    publisher, _, _ = learner
    first = publisher.publish(tiny_state_dict(seed=1), version=1)
    shard = publisher.dir / "v1" / "model-00001-of-00001.safetensors"
    inode = shard.stat().st_ino
    publisher.base_url = "http://127.0.0.1:1/moved"
    again = publisher.publish(tiny_state_dict(seed=1), version=1)
    assert again.sha256 == first.sha256 and shard.stat().st_ino == inode
    assert publisher.announcement(1).url == "http://127.0.0.1:1/moved/v1/weights/1"
    other = publisher.publish(tiny_state_dict(seed=2), version=1)
    assert other.sha256 != first.sha256 and publisher.announcement(1).sha256 == other.sha256
    assert check_shared(other, publisher.dir) == publisher.dir / "v1"
    assert not [p for p in publisher.dir.iterdir() if p.name.startswith(".")]


def test_a_version_the_server_cannot_read_is_a_5xx_not_a_404(learner):
    """A garbled announcement (or a disk error) is this server's fault: generators must not take it for a prune."""
    import httpx

    publisher, server, _ = learner
    publisher.publish(tiny_state_dict(), version=2)
    (publisher.dir / "v2" / "announcement.json").write_text("{not json")
    auth = {"Authorization": f"Bearer {TOKEN}"}
    answer = httpx.get(f"{server.url}/v1/weights/2", headers=auth)
    assert answer.status_code == 500 and "ValidationError" in answer.json()["error"]
    assert httpx.get(f"{server.url}/v1/weights/5", headers=auth).status_code == 404


def test_a_download_does_not_wait_for_a_version_being_written(learner, monkeypatch):
    # A generator still pulling v1 while the learner writes v2 (minutes for a 32B model) is served at once.
    publisher, _, _ = learner
    publisher.publish(tiny_state_dict(seed=1), version=1)
    writing, finish = threading.Event(), threading.Event()

    def slow_write(*args, **kwargs):
        writing.set()
        finish.wait(30)
        return write_version(*args, **kwargs)

    monkeypatch.setattr(weights_module, "write_version", slow_write)
    publishing = threading.Thread(target=publisher.publish, args=(tiny_state_dict(seed=2), 2))
    publishing.start()
    try:
        assert writing.wait(10)
        opened: list = []
        reader = threading.Thread(
            target=lambda: opened.append(publisher.open_file(1, "model-00001-of-00001.safetensors")))
        reader.start()
        reader.join(10)
        assert opened and opened[0] is not None, "the download waited for the version being written"
        opened[0][1].close()
    finally:
        finish.set()
        publishing.join(30)
    assert publisher.latest().version == 2


def test_versions_a_killed_process_left_half_written_are_removed_by_the_next_one(learner, settings, short_tmp):
    """A learner SIGKILLed while writing a version, or a generator while pulling one, leaves its temporary folder:
    the next process in that folder removes it (a whole version is renamed into place, so none is touched)."""
    publisher, server, client = learner
    publisher.publish(tiny_state_dict(), version=1)
    half = publisher.dir / f"{WRITING_PREFIX}2-x1y2"
    half.mkdir()
    (half / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 100)
    restarted = WeightPublisher(settings, client, server.url)
    assert not half.exists() and restarted.versions() == [1]
    pulls = Path(short_tmp) / "pulled"
    pull_weights(publisher.latest(), TOKEN, pulls)
    (pulls / f"{PULLING_PREFIX}2-a1b2").mkdir()
    assert remove_unfinished(pulls, PULLING_PREFIX) == 1
    assert sorted(p.name for p in pulls.iterdir()) == ["v1"]


def test_schema_check_names_and_shapes(short_tmp):
    model = Path(short_tmp) / "model"
    model.mkdir()
    save_file(shareable_state_dict(tiny_state_dict()), str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    expected = model_schema(model)
    assert expected["model.norm.weight"] == ("F32", (8,))
    optional = tied_aliases(model)
    check_schema(expected, expected, optional)
    with_alias = dict(expected, **{"lm_head.weight": ("F32", (32, 8))})
    check_schema(with_alias, expected, optional)  # a tied alias is tolerated (vLLM skips it)
    bf16 = {k: ("BF16", shape) for k, (_, shape) in expected.items()}
    check_schema(bf16, expected, optional)  # dtype is cast on load
    wrong_shape = dict(expected, **{"model.norm.weight": ("F32", (9,))})
    with pytest.raises(WeightsError, match=r"model.norm.weight \[9\] != \[8\]"):
        check_schema(wrong_shape, expected, optional)
    missing = {k: v for k, v in expected.items() if k != "model.norm.weight"}
    with pytest.raises(WeightsError, match="missing 1 tensors"):
        check_schema(missing, expected, optional)
    # a tied checkpoint that stores the alias too (merged or converted ones do): the learner publishes it once
    stored_alias = dict(expected, **{"lm_head.weight": ("F32", (32, 8))})
    check_schema(expected, stored_alias, optional)
    # a snapshot with an index and a consolidated file of other names (Mistral's): the index's files only
    save_file({"layers.0.attention.wq.weight": torch.zeros(2)}, str(model / "consolidated.safetensors"))
    (model / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {name: "model.safetensors" for name in expected}}))
    assert model_schema(model) == expected
    (model / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(WeightsError, match="not a valid index"):
        model_schema(model)
    with pytest.raises(WeightsError, match="unknown tensors"):
        check_schema(dict(expected, extra=("F32", (1,))), expected, optional)
    garbage = model / "bad.safetensors"
    garbage.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(WeightsError) as err:
        read_schema(garbage)
    assert err.value.reason == "format"


def test_watcher_sees_pubsub_and_latest_key(learner, settings):
    publisher, _, client = learner
    publisher.publish(tiny_state_dict(), version=0)  # before the watcher starts: found via the key
    watcher = AnnouncementWatcher(client, Streams(client, settings, signs_as=ROLES), publisher.keyring,
                                  poll_s=30).start()
    try:
        assert watcher.newest.version == 0
        assert watcher.wait_newer(0, timeout=0.1) is None
        time.sleep(0.2)  # subscribed
        publisher.publish(tiny_state_dict(seed=2), version=1)
        got = watcher.wait_newer(0, timeout=5)
        assert got is not None and got.version == 1  # via pub/sub (the key poll is 30 s away)
    finally:
        watcher.stop()


def test_shards_follow_the_hf_layout_and_a_bad_shard_is_refused(learner, settings, short_tmp):
    publisher, _, _ = learner
    publisher.shard_bytes = 1024 * 1024  # weights.shard_mb = 1: several shards
    state = big_state_dict(seed=4)
    assert shard_plan(state, publisher.shard_bytes) == [
        ["model.layers.0.mlp.up_proj.weight"], ["model.layers.1.mlp.up_proj.weight"],
        ["model.layers.2.mlp.up_proj.weight"], ["model.norm.weight"],  # a tensor above the limit goes alone
    ]
    announced = publisher.publish(state, version=5)
    names = [f.name for f in announced.files]
    assert names == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)] + [SAFE_WEIGHTS_INDEX_NAME]
    folder = pull_weights(announced, TOKEN, f"{short_tmp}/pulled", concurrency=3)
    index = json.loads((folder / SAFE_WEIGHTS_INDEX_NAME).read_text())
    assert index["weight_map"]["model.norm.weight"] == "model-00004-of-00004.safetensors"
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state.values())
    assert model_schema(folder) == {k: ("F32", tuple(v.shape)) for k, v in state.items()}
    for name, tensor in {k: v for n in names[:4] for k, v in load_file(folder / n).items()}.items():
        assert torch.equal(tensor, state[name])

    # One flipped byte in the learner's second shard: the pull is refused, nothing lands, v5 stays intact.
    shard = publisher.dir / "v5" / names[1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=names[1]) as err:
        pull_weights(announced, TOKEN, f"{short_tmp}/other", concurrency=2)
    assert err.value.reason == "checksum" and list(Path(f"{short_tmp}/other").iterdir()) == []
    with pytest.raises(WeightsError, match=names[1]) as err:
        check_shared(announced, publisher.dir)
    assert err.value.reason == "checksum"


@pytest.fixture
def shared_settings(settings, short_tmp):
    settings = settings.model_copy(deep=True)
    settings.weights = WeightsConfig(transport="shared-fs", shared_dir=f"{short_tmp}/shared", shard_mb=1)
    return settings


def test_a_shared_folder_holds_one_runs_versions(shared_settings, short_tmp):
    """Versions are numbered per run: a second run in the same shared_dir removed the first's half-written version,
    took its numbers and pruned its versions. It is refused, before anything in the folder is touched."""
    first = WeightPublisher(shared_settings, connect(shared_settings), "http://learner.invalid:8000")
    first.publish(tiny_state_dict(seed=1), version=1)
    (first.dir / f"{WRITING_PREFIX}2-x1y2").mkdir()  # the first run's next version, half written
    other = shared_settings.model_copy(deep=True)
    other.redis.run = "another-run"
    with pytest.raises(ConfigError, match=f"holds the weight versions of run '{shared_settings.redis.run}'"):
        WeightPublisher(other, connect(other), "http://learner.invalid:8000")
    assert (first.dir / f"{WRITING_PREFIX}2-x1y2").is_dir() and first.versions() == [1]
    again = WeightPublisher(shared_settings, connect(shared_settings), "http://learner.invalid:8000")  # a restart
    assert again.versions() == [1]


def test_shared_fs_generators_read_the_learners_folder_and_holds_stop_the_prune(shared_settings, short_tmp):
    from generator.sync import WeightSync

    client = connect(shared_settings)
    publisher = WeightPublisher(shared_settings, client, "http://learner.invalid:8000")
    assert publisher.dir == Path(shared_settings.weights.shared_dir)
    model = Path(short_tmp) / "model"
    model.mkdir()
    save_file(big_state_dict(), str(model / "model.safetensors"))
    sync = WeightSync(shared_settings, model, client, "gen-a")
    published = [publisher.publish(big_state_dict(seed=v), version=v) for v in range(2)]
    folder, _ = sync.prepare(sync.latest())  # no HTTP: the learner's URL does not even resolve
    assert folder == publisher.dir / "v1" and not list(sync.dir.iterdir())  # nothing copied
    sync.prune(keep={folder})  # serving v1
    assert held_versions(publisher.dir, 60) == {1}
    keep = shared_settings.weights.keep_versions
    for version in range(2, keep + 4):
        publisher.publish(big_state_dict(seed=version), version=version)
    assert publisher.versions() == [1, *range(keep + 1, keep + 4)]  # v1 is served: kept beyond keep_versions
    # A version pruned meanwhile (or never written here) is refused as not_found; the old one keeps serving.
    with pytest.raises(WeightsError) as err:
        sync.prepare(published[0])
    assert err.value.reason == "not_found"
    sync.prune(keep={publisher.dir / f"v{keep + 3}"})  # moved on: v1 is released and goes at the next publish
    publisher.publish(big_state_dict(), version=keep + 4)
    assert 1 not in publisher.versions()
    write_hold(publisher.dir, "dead-generator", {keep + 1})
    stale = publisher.dir / "holds" / "dead-generator.json"
    os.utime(stale, (time.time() - 2 * shared_settings.weights.hold_s,) * 2)
    assert held_versions(publisher.dir, shared_settings.weights.hold_s) == {keep + 3}  # a lapsed hold counts no more


def test_shared_fs_needs_a_folder():
    with pytest.raises(ValueError, match="shared_dir"):
        load_settings("tiny-cpu", weights={"transport": "shared-fs"})


def test_a_failed_file_stops_the_files_not_started_yet():
    from services.weights import _each

    started = []

    def fetch(name):
        started.append(name)
        if name == "first":
            raise WeightsError("checksum", "first: bad")
        time.sleep(0.5)  # the one that may already have started when "first" failed
        return name

    with pytest.raises(WeightsError, match="first"):
        _each(1, fetch, ["first", "second", "third"])
    assert "third" not in started
    assert _each(2, str.upper, ["a", "b", "c"]) == ["A", "B", "C"]


def test_a_failure_of_any_file_is_raised_at_once_and_stops_the_downloads_running():
    """Not in file order: a bad second shard must not wait for the first to download whole, nor let it go on."""
    from services.weights import _each

    failed, stopped = threading.Event(), []

    def fetch(name):
        if name == "bad":
            time.sleep(0.1)
            raise WeightsError("checksum", "bad: sha256")
        stopped.append(failed.wait(timeout=10))  # a download checks this between chunks
        return name

    began = time.monotonic()
    with pytest.raises(WeightsError, match="bad"):
        _each(2, fetch, ["slow", "bad", "next"], failed)
    assert time.monotonic() - began < 5 and stopped and all(stopped)  # ("next" may start as "bad" fails)


def test_a_version_published_again_with_other_bytes_replaces_its_announcement(learner, settings):
    """A resume that writes its version again in another dtype replaces the files: the stale announcement's pull
    would fail on every file's sha256, every 30 s, until a newer version."""
    publisher, _, client = learner
    watcher = AnnouncementWatcher(client, Streams(client, settings, signs_as=ROLES), publisher.keyring, poll_s=30)
    first = publisher.publish(tiny_state_dict(), version=3)
    watcher.offer(first)
    again = publisher.publish(tiny_state_dict(seed=2), version=3)
    assert again.sha256 != first.sha256
    watcher.offer(again)
    assert watcher.newest == again
    watcher.offer(first)  # a late copy of the old one
    assert watcher.newest == again
