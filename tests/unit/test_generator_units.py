"""Generator pieces without an engine: decoding, task checks, bisection, status codes, and weight preparation
over real HTTP."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from servers import ServerThread
from tiny_qwen import VOCAB_ROWS, build_model_folder, build_tokenizer, random_qwen2

from generator.engine import InvalidTask, check_task, default_max_num_seqs, map_finish_reason, stop_token_ids
from generator.service import sync_status_code
from generator.sync import WeightSync, pulls_from
from generator.worker import _Rates, entry_time, halves, heartbeat_interval
from services.broadcast import MEMBER_TTL_S
from services.config import default_max_model_len, load_settings
from services.http import create_app
from services.keys import load_signer
from services.messages import PromptTask, SamplingParams, sign_announcement
from services.models import safe_decode
from services.redis_local import connect
from services.weights import (
    WeightPublisher,
    WeightsError,
    channel,
    latest_announcement,
    latest_key,
    parse_announcement,
    weights_router,
)


def test_safe_decode_never_crashes_on_unknown_ids():
    tokenizer = build_tokenizer()
    size = len(tokenizer)
    assert size < VOCAB_ROWS  # the model can emit ids the tokenizer does not know
    ids = tokenizer.encode("12+3=15")
    assert safe_decode(tokenizer, ids) == "12+3=15"
    assert safe_decode(tokenizer, ids + [size, VOCAB_ROWS - 1, -3, 10**9]) == "12+3=15"
    assert safe_decode(tokenizer, [1]) == ""  # EOS is special: not in the text
    assert safe_decode(tokenizer, []) == ""


def test_finish_reasons():
    assert [map_finish_reason(r) for r in ("stop", "length", "abort", None, "error")] == [
        "stop", "length", "abort", "abort", "abort"
    ]


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one token per character."""
    return [ord(c) for c in text]


def checked(prompt: str = "12+3=", ids: list[int] | None = None, **sampling) -> list[int]:
    params = SamplingParams.model_construct(**{**SamplingParams().model_dump(), "max_tokens": 64, **sampling})
    task = PromptTask.model_construct(**{**PromptTask(prompt_id="p", prompt="", ground_truth="0").model_dump(),
                                         "prompt": prompt, "prompt_token_ids": ids, "sampling": params})
    return check_task(task, encode, vocab_size=1000, max_model_len=256)


def test_check_task_passes_servable_tasks():
    assert checked() == encode("12+3=")
    assert checked(ids=[0, 5, 999]) == [0, 5, 999]  # the task's own ids win over its text
    assert checked(ids=[7] * 192) == [7] * 192  # exactly fills max_model_len with max_tokens 64
    assert checked(temperature=1.0, top_p=1.0, n=1024, seed=2**63 - 1) == encode("12+3=")
    assert checked(temperature=0.0, n=1) == checked(temperature=2.0) == checked(temperature=0.01)


@pytest.mark.parametrize(("kwargs", "reason"), [
    (dict(ids=[5, 10**9]), "token id 1000000000 at position 1 is outside the vocabulary [0, 1000)"),
    (dict(ids=[1000]), "token id 1000 at position 0 is outside the vocabulary [0, 1000)"),
    (dict(ids=[-1]), "token id -1 at position 0"),
    (dict(ids=[7] * 193), "prompt of 193 tokens + max_tokens 64 exceeds max_model_len 256"),
    (dict(prompt="x" * 300), "prompt of 300 tokens + max_tokens 64 exceeds max_model_len 256"),
    (dict(prompt="x" * 8 * 2**20), "prompt text of 8388608 bytes cannot fit 192 tokens"),
    (dict(prompt=""), "empty prompt"),
    (dict(ids=[], prompt=""), "empty prompt"),
    (dict(max_tokens=256), "max_tokens 256 is outside [1, max_model_len 256)"),
    (dict(max_tokens=0), "max_tokens 0 is outside"),
    (dict(temperature=float("inf")), "temperature inf is outside [0, 2.0]"),
    (dict(temperature=2.5), "temperature 2.5 is outside [0, 2.0]"),  # vLLM refuses it: the task, not the engine
    (dict(temperature=0.001), "temperature 0.001 is below 0.01 and not 0"),  # vLLM would sample at 0.01
    (dict(temperature=0.0, n=4), "n = 4 greedy samples"),
    (dict(temperature=float("nan")), "temperature nan"),
    (dict(temperature=-0.5), "temperature -0.5"),
    (dict(top_p=0.0), "top_p 0.0 is outside (0, 1]"),
    (dict(top_p=1.5), "top_p 1.5"),
    (dict(n=0), "n = 0"),
    (dict(seed=2**64), "seed 18446744073709551616 is outside [0, 2**63 - 1]"),
    (dict(seed=-1), "seed -1"),
])
def test_check_task_refuses_with_the_exact_reason(kwargs, reason):
    with pytest.raises(InvalidTask) as refused:
        checked(**kwargs)
    assert reason in str(refused.value)


def test_halves_bisect_down_to_one():
    assert halves([1, 2, 3, 4, 5]) == [[1, 2, 3], [4, 5]]
    assert halves([1, 2]) == [[1], [2]]
    assert halves([1]) == [[1]]
    assert halves([]) == []


def test_max_model_len_default_is_prompt_room_plus_longest_response():
    settings = load_settings("tiny-cpu", generator={"max_model_len": None, "max_prompt_tokens": 100})
    assert default_max_model_len(settings) == 100 + max(settings.sampling.max_tokens, settings.eval_sampling.max_tokens)
    assert default_max_model_len(load_settings("tiny-cpu", generator={"max_model_len": 256})) == 256


def test_stop_ids_from_tokenizer_and_generation_config(short_tmp):
    folder = build_model_folder(Path(short_tmp) / "m", seed=0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7]}))
    assert stop_token_ids(folder, build_tokenizer()) == [1, 7]


def test_rates_and_entry_time():
    """What was written in the last 10 s, over the 10 s: a group every 15 s of 80,000 tokens is not 80,000 tokens/s
    (the time since the window's first event, floored at 1 s, made it so), and an idle generator decays to 0."""
    rates = _Rates(window=10.0)
    rates.add(100, now=0.0)
    rates.add(300, now=4.0)
    assert rates.rates(now=4.0) == pytest.approx((40.0, 0.2))
    rates.add(80_000, now=15.0)  # the old events left the window
    assert rates.rates(now=15.0) == pytest.approx((8_000.0, 0.1))
    assert rates.rates(now=30.0) == (0.0, 0.0)
    assert entry_time("1700000000123-4") == pytest.approx(1700000000.123)


def test_a_heartbeat_renews_claims_and_memberships_before_either_lapses():
    """Every visibility_timeout_s / 3 alone let a membership of broadcast rounds (dropped after MEMBER_TTL_S)
    lapse between two beats when the visibility timeout is longer than three times it."""
    for visibility in (0.3, 30.0, 300.0, 3600.0):
        settings = load_settings("tiny-cpu", streams={"visibility_timeout_s": visibility})
        assert 3 * heartbeat_interval(settings) <= min(visibility, MEMBER_TTL_S)


def test_sync_status_codes():
    assert sync_status_code(None) == 200
    assert sync_status_code("none") == 404
    assert {sync_status_code(r) for r in ("unauthorized", "unreachable", "http", "not_found")} == {502}
    assert {sync_status_code(r) for r in ("checksum", "shape", "format", "untrusted_url")} == {422}
    assert {sync_status_code(r) for r in ("reload", "error")} == {500}  # the generator failed, not the weights
    assert {sync_status_code(r) for r in ("stopped", "cancelled")} == {503}


@pytest.fixture
def learner_with_model(settings, short_tmp):
    """A model folder, and a learner-like app publishing weight versions over real HTTP and Redis."""
    model_dir = build_model_folder(Path(short_tmp) / "model", seed=0)
    client = connect(settings)
    app = create_app("learner", token=settings.token.get_secret_value())
    with ServerThread(app) as server:
        settings.learner.public_url = server.url
        publisher = WeightPublisher(settings, client, server.url)
        app.include_router(weights_router(publisher))
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


def test_announcements_with_a_bad_signature_or_an_unconfigured_url_are_refused(learner_with_model, settings):
    model_dir, publisher, client = learner_with_model
    sync = WeightSync(settings, model_dir, client, "gen-test")
    good = publisher.publish(random_qwen2(seed=1).state_dict(), version=1)
    assert good.signature and sync.latest() == good

    # even signed: the token goes to the configured learner only
    elsewhere = sign_announcement(good.model_copy(update={"url": "http://collector.example:9/v1/weights/1"}),
                                  publisher.signer, channel(publisher.prefix))
    with pytest.raises(WeightsError, match="not under the configured learner URL") as err:
        sync.prepare(elsewhere)
    assert err.value.reason == "untrusted_url"

    for forged in (
        good.model_copy(update={"signature": ""}),                                      # unsigned
        good.model_copy(update={"version": 9}),                                         # tampered after signing
        # a generator's key (the role's own, trusted for rollouts): never the learner's word
        sign_announcement(good.model_copy(update={"version": 9}), load_signer(settings, "generator"),
                          channel(publisher.prefix)),
        # another run with the same keys: its announcements never pin this run's generators
        sign_announcement(good.model_copy(update={"version": 9}), publisher.signer, "dapo:another-run:weights"),
    ):
        client.set(latest_key(publisher.prefix), forged.model_dump_json())
        assert sync.latest() is None
        assert latest_announcement(client, publisher.prefix, publisher.keyring) is None
        assert parse_announcement(forged.model_dump_json(), publisher.keyring, publisher.prefix) is None


def test_pulls_from_only_the_configured_learner():
    base = "http://learner:8000"
    assert pulls_from("http://learner:8000/v1/weights/3", base)
    assert pulls_from("http://learner:8000/v1/weights/3", base + "/")
    assert pulls_from("https://h/dapo/v1/weights/3", "https://h/dapo")
    assert not pulls_from("http://learner:8001/v1/weights/3", base)
    assert not pulls_from("https://learner:8000/v1/weights/3", base)
    assert not pulls_from("http://learner:8000@evil/v1/weights/3", base)
    assert not pulls_from("http://learner:8000/other/3", base)
    assert not pulls_from("http://learner:8000/v1/weights/../../x", base)
    assert not pulls_from("https://h/v1/weights/3", "https://h/dapo")


def test_max_num_seqs_default_holds_every_sample_of_a_full_batch():
    settings = load_settings("tiny-cpu", generator={"tasks_per_batch": 8}, eval_sampling={"n": 32})
    assert default_max_num_seqs(settings) == 8 * 32
    assert default_max_num_seqs(load_settings("tiny-cpu", generator={"max_num_seqs": 100})) == 100
