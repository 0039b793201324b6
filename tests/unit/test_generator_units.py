"""Generator pieces without an engine: decoding, budgets, status codes, and weight preparation over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from servers import ServerThread
from tiny_qwen import VOCAB_ROWS, build_model_folder, build_tokenizer, random_qwen2

from generator.engine import (
    default_max_model_len,
    map_finish_reason,
    response_budget,
    safe_decode,
    stop_token_ids,
)
from generator.service import sync_status_code
from generator.sync import WeightSync
from generator.worker import _Rates, entry_time
from services.config import load_settings
from services.http import create_app
from services.redis_local import connect
from services.weights import WeightPublisher, WeightsError, weights_router


def test_safe_decode_never_crashes_on_unknown_ids():
    tokenizer = build_tokenizer()
    size = len(tokenizer)
    assert size < VOCAB_ROWS  # the model can emit ids the tokenizer does not know
    ids = tokenizer.encode("12+3=15")
    assert safe_decode(tokenizer, ids) == "12+3=15"
    assert safe_decode(tokenizer, ids + [size, VOCAB_ROWS - 1, -3, 10**9]) == "12+3=15"
    assert safe_decode(tokenizer, [1]) == ""  # EOS is special: not in the text
    assert safe_decode(tokenizer, []) == ""


def test_finish_reasons_and_budgets():
    assert [map_finish_reason(r) for r in ("stop", "length", "abort", None, "error")] == [
        "stop", "length", "abort", "abort", "abort"
    ]
    assert response_budget(prompt_len=10, requested=64, max_model_len=256) == 64
    assert response_budget(prompt_len=250, requested=64, max_model_len=256) == 6
    assert response_budget(prompt_len=300, requested=64, max_model_len=256) == 0


def test_max_model_len_default_is_prompt_room_plus_longest_response():
    settings = load_settings("tiny-cpu", generator={"max_model_len": None, "max_prompt_tokens": 100})
    assert default_max_model_len(settings) == 100 + max(settings.sampling.max_tokens, settings.eval_sampling.max_tokens)
    assert default_max_model_len(load_settings("tiny-cpu", generator={"max_model_len": 256})) == 256


def test_stop_ids_from_tokenizer_and_generation_config(short_tmp):
    folder = build_model_folder(Path(short_tmp) / "m", seed=0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert stop_token_ids(folder, build_tokenizer()) == [1, 7]


def test_rates_and_entry_time():
    rates = _Rates(window=10.0)
    rates.add(100, now=0.0)
    tokens_per_s, tasks_per_s = rates.add(300, now=4.0)
    assert tokens_per_s == pytest.approx(100.0) and tasks_per_s == pytest.approx(0.5)
    tokens_per_s, _ = rates.add(50, now=20.0)  # the old events left the window
    assert tokens_per_s == pytest.approx(50.0)
    assert entry_time("1700000000123-4") == pytest.approx(1700000000.123)


def test_sync_status_codes():
    assert sync_status_code(None) == 200
    assert sync_status_code("none") == 404
    assert {sync_status_code(r) for r in ("unauthorized", "unreachable", "http", "not_found")} == {502}
    assert {sync_status_code(r) for r in ("checksum", "shape", "format", "reload")} == {422}


@pytest.fixture
def learner_with_model(settings, short_tmp):
    """A model folder, and a learner-like app publishing weight versions over real HTTP and Redis."""
    model_dir = build_model_folder(Path(short_tmp) / "model", seed=0)
    client = connect(settings)
    app = create_app("learner", token=settings.token)
    with ServerThread(app) as server:
        publisher = WeightPublisher(settings, client, server.url)
        app.include_router(weights_router(publisher, app.state.require_token))
        yield model_dir, publisher, client


def test_prepare_accepts_fitting_weights_and_refuses_the_rest(learner_with_model, settings):
    model_dir, publisher, client = learner_with_model
    sync = WeightSync(settings, model_dir, client, "gen-test")

    state = random_qwen2(seed=1).state_dict()
    good = publisher.publish(state, version=1)
    folder, seconds = sync.prepare(good)
    assert folder == sync.dir / "v1" and seconds >= 0
    loaded = load_file(folder / "model-00001-of-00001.safetensors")
    assert "lm_head.weight" not in loaded  # the tied alias was not written
    assert torch.equal(loaded["model.norm.weight"], state["model.norm.weight"])

    wrong_shape = dict(state)
    wrong_shape["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64)
    with pytest.raises(WeightsError, match=r"up_proj.weight \[128, 64\] != \[256, 64\]") as err:
        sync.prepare(publisher.publish(wrong_shape, version=2))
    assert err.value.reason == "shape"
    assert not (sync.dir / "v2").exists()  # refused weights are not kept

    missing = {k: v for k, v in state.items() if "layers.1." not in k}
    with pytest.raises(WeightsError, match="missing") as err:
        sync.prepare(publisher.publish(missing, version=3))

    sync.token = "not-the-token"
    with pytest.raises(WeightsError) as err:
        sync.prepare(good)
    assert err.value.reason == "unauthorized"

    sync.prune(keep={folder})
    assert sorted(p.name for p in sync.dir.iterdir()) == ["v1"]
