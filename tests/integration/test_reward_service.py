"""`dapo reward` as a real process: it serves /v1/score, scores the rollouts stream, and stops on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import redis

from benchmarks.faults import children_of
from services.keys import ROLES
from services.messages import PromptTask, RolloutGroup, Sample, SamplingParams, ScoredGroup, to_wire
from services.streams import ISSUED, Streams


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dapo_reward_process(settings, short_tmp):
    port = free_port()
    env = {
        **os.environ,
        "DAPO_REDIS__URL": settings.redis.url.get_secret_value(),
        "DAPO_TOKEN": settings.token.get_secret_value(),
        "DAPO_REDIS__RUN": settings.redis.run,
        "DAPO_REWARD__PORT": str(port),
        "DAPO_REWARD__HOST": "127.0.0.1",
        "DAPO_REWARD__WORKERS": "1",
        "DAPO_RUN_DIR": os.path.join(short_tmp, "run"),
        "DAPO_WORKER_ID": "reward-proc",
        "HF_TOKEN": "hf_not_for_verifiers",  # credentials of other programs in the operator's shell
        "DATABASE_URL": "postgres://user:hunter2@db/x",
    }
    log_path = os.path.join(short_tmp, "reward.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "cli", "reward", "--config", "tiny-cpu"],
                                env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, open(log_path).read()
            assert time.monotonic() < deadline, "reward service never became ready:\n" + open(log_path).read()
            time.sleep(0.2)

        scores = httpx.post(f"{base}/v1/score", json=[{"response": "Answer: 1,000", "ground_truth": "1000"}],
                            headers={"Authorization": f"Bearer {settings.token.get_secret_value()}"}).json()
        assert scores[0]["correct"] and scores[0]["rule"] == "answer_line"

        streams = Streams(redis.Redis.from_url(settings.redis.url.get_secret_value()), settings, signs_as=ROLES)
        task = PromptTask(task_id="svc", prompt_id="p", prompt="q", ground_truth="42", sampling=SamplingParams(n=1))
        streams.redis.hset(streams.key(ISSUED), task.task_id, to_wire(task))  # as the learner issues it
        sample = Sample(token_ids=[1, 2], logprobs=[-0.1, -0.2], text="\\boxed{42}", finish_reason="stop")
        streams.stream("rollouts", RolloutGroup).produce(
            RolloutGroup(task=task.for_generators(), policy_version=0, generator_id="g", samples=[sample]))
        scored = []
        deadline = time.monotonic() + 30
        while not scored and time.monotonic() < deadline:
            scored = streams.stream("scored", ScoredGroup).consume("learner-test", count=1, block_ms=500)
        assert scored and scored[0].message.scores[0].correct
        assert scored[0].message.reward_worker_id == "reward-proc"
        # The verifier processes, which parse what generators wrote, inherit none of the service's secrets.
        verifiers = children_of(proc.pid)
        assert verifiers
        for pid in verifiers:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                names = {entry.split(b"=", 1)[0].decode() for entry in environ.read().split(b"\0") if entry}
            assert not names & {"DAPO_REDIS__URL", "DAPO_TOKEN", "DAPO_KEYS__PRIVATE_KEY", "DAPO_REDIS__PASSWORD",
                                "HF_TOKEN", "DATABASE_URL"}
            assert "DAPO_REDIS__RUN" in names  # what is not a secret stays
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, open(log_path).read()
