"""The weight-sync protocol against a real HTTP server (uvicorn) and a real Redis: publish, announce, pull."""

from __future__ import annotations

import json
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from servers import ServerThread, free_port
from services.http import create_app
from services.messages import WeightsAnnouncement
from services.redis_local import connect
from services.streams import Streams
from services.weights import (
    AnnouncementWatcher,
    WeightPublisher,
    WeightsError,
    check_schema,
    latest_announcement,
    model_schema,
    pull_weights,
    read_schema,
    shareable_state_dict,
    tied_aliases,
    weights_router,
)

TOKEN = "s3cret"


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
        app.include_router(weights_router(publisher, app.state.require_token))
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

    # announced both ways: the latest key and the channel
    assert latest_announcement(client, Streams(client, settings), publisher.key) == announced
    message = None
    for _ in range(50):
        message = pubsub.get_message(timeout=0.1)
        if message:
            break
    assert WeightsAnnouncement.model_validate_json(message["data"]) == announced

    folder = pull_weights(announced, TOKEN, f"{short_tmp}/pulled")
    assert folder.name == "v3"
    got = load_file(folder / "model.safetensors")
    assert set(got) == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"}
    for name, tensor in got.items():
        assert torch.equal(tensor, state[name])
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".pull")]  # no temp leftovers


def test_endpoints_require_token_and_404_unknown(learner):
    import httpx

    publisher, server, _ = learner
    publisher.publish(tiny_state_dict(), version=0)
    assert httpx.get(f"{server.url}/v1/weights/latest").status_code == 401
    assert httpx.get(f"{server.url}/v1/weights/0", headers={"Authorization": "Bearer nope"}).status_code == 403
    auth = {"Authorization": f"Bearer {TOKEN}"}
    latest = httpx.get(f"{server.url}/v1/weights/latest", headers=auth)
    assert latest.status_code == 200 and latest.json()["version"] == 0
    body = httpx.get(f"{server.url}/v1/weights/0", headers=auth)
    assert body.status_code == 200 and body.headers["x-weights-sha256"] == latest.json()["sha256"]
    assert len(body.content) == latest.json()["size"]
    missing = httpx.get(f"{server.url}/v1/weights/7", headers=auth)
    assert missing.status_code == 404 and "unknown" in missing.json()["error"]


def test_pull_refuses_bad_token_and_bad_checksum_without_leftovers(learner, short_tmp):
    publisher, _, _ = learner
    announced = publisher.publish(tiny_state_dict(), version=1)
    dest = f"{short_tmp}/pulled"
    with pytest.raises(WeightsError, match="refused the token") as err:
        pull_weights(announced, "wrong", dest)
    assert err.value.reason == "unauthorized"
    forged = announced.model_copy(update={"sha256": "0" * 64})
    with pytest.raises(WeightsError, match="does not match") as err:
        pull_weights(forged, TOKEN, dest)
    assert err.value.reason == "checksum"
    shorter = announced.model_copy(update={"size": announced.size - 1})
    with pytest.raises(WeightsError) as err:
        pull_weights(shorter, TOKEN, dest)
    assert err.value.reason == "checksum"
    with pytest.raises(WeightsError) as err:
        pull_weights(announced.model_copy(update={"url": announced.url[:-1] + "9"}), TOKEN, dest)
    assert err.value.reason == "not_found"
    with pytest.raises(WeightsError) as err:
        pull_weights(announced.model_copy(update={"url": f"http://127.0.0.1:{free_port()}/x"}), TOKEN, dest)
    assert err.value.reason == "unreachable"
    from pathlib import Path

    assert list(Path(dest).iterdir()) == []


def test_publisher_keeps_last_versions_and_serves_only_those(learner, settings):
    publisher, _, _ = learner
    keep = settings.learner.keep_versions
    for version in range(keep + 2):
        publisher.publish(tiny_state_dict(seed=version), version=version)
    assert publisher.versions() == list(range(2, keep + 2))
    assert publisher.latest().version == keep + 1
    assert publisher.open_version(0) is None
    folder = publisher.dir / f"v{keep + 1}"
    assert sorted(p.name for p in folder.iterdir()) == ["announcement.json", "model.safetensors"]
    meta = json.loads(folder.joinpath("announcement.json").read_text())
    assert meta["size"] == folder.joinpath("model.safetensors").stat().st_size


def test_schema_check_names_and_shapes(short_tmp):
    from pathlib import Path

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
    watcher = AnnouncementWatcher(client, Streams(client, settings), publisher.key, poll_s=30).start()
    try:
        assert watcher.newest.version == 0
        assert watcher.wait_newer(0, timeout=0.1) is None
        time.sleep(0.2)  # subscribed
        publisher.publish(tiny_state_dict(seed=2), version=1)
        got = watcher.wait_newer(0, timeout=5)
        assert got is not None and got.version == 1  # via pub/sub (the key poll is 30 s away)
    finally:
        watcher.stop()
