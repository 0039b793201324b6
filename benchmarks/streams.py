"""Rollout groups per second through the reliable stream layer vs raw redis-py on the same bytes.

A realistic group: 16 responses x 1,024 token ids with their logprobs and ~3 KB of text each. Both paths
talk to the same embedded redis-server over loopback TCP, side by side in one run:

  raw:      XADD(bytes) ; XREADGROUP ; XACK                          (the floor: Redis + network)
  service:  Stream.produce(model) ; Stream.consume ; Stream.ack       (encode, back-pressure check,
                                                                       delivery counts, decode, owned ack)

Usage: python benchmarks/streams.py [--groups 300]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time

import redis

from services.config import load_settings
from services.keys import ROLES, create_keys, keys_dir
from services.messages import PromptTask, RolloutGroup, Sample, from_wire, to_wire
from services.redis_local import EmbeddedRedis, client_for
from services.streams import Streams


def realistic_group(seed: int = 0, samples: int = 16, tokens: int = 1024) -> RolloutGroup:
    rng = random.Random(seed)
    task = PromptTask(prompt_id="p0", prompt="Solve ... " * 40, prompt_token_ids=list(range(400)), ground_truth="42")
    return RolloutGroup(
        task=task,
        policy_version=3,
        generator_id="gen-0",
        samples=[
            Sample(
                token_ids=[rng.randrange(152_000) for _ in range(tokens)],
                logprobs=[-rng.random() * 5 for _ in range(tokens)],
                text="".join(rng.choice("abcdefgh 0123456789\n") for _ in range(3 * tokens)),
                finish_reason="stop",
            )
            for _ in range(samples)
        ],
    )


def bench_raw(client: redis.Redis, payload: bytes, n: int) -> float:
    key, group = "bench:raw", "g"
    client.delete(key)
    client.xgroup_create(key, group, id="0", mkstream=True)
    start = time.perf_counter()
    for _ in range(n):
        client.xadd(key, {b"data": payload})
        reply = client.xreadgroup(group, "c", {key: ">"}, count=1)
        entry_id, fields = reply[0][1][0]
        assert len(fields[b"data"]) == len(payload)
        client.xack(key, group, entry_id)
    return n / (time.perf_counter() - start)


def bench_service(streams: Streams, group: RolloutGroup, n: int) -> float:
    stream = streams.stream("rollouts", RolloutGroup)
    start = time.perf_counter()
    for _ in range(n):
        stream.produce(group)
        (delivery,) = stream.consume("c", count=1, block_ms=0)
        assert len(delivery.message.samples) == len(group.samples)
        stream.ack(delivery)
    return n / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--groups", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    group = realistic_group()
    payload = to_wire(group)
    json_bytes = len(group.model_dump_json())
    t0 = time.perf_counter()
    for _ in range(50):
        to_wire(group)
    encode_ms = (time.perf_counter() - t0) / 50 * 1e3
    t0 = time.perf_counter()
    for _ in range(50):
        from_wire(RolloutGroup, payload)
    decode_ms = (time.perf_counter() - t0) / 50 * 1e3

    with tempfile.TemporaryDirectory(prefix="dapo-bench-") as tmp:
        port = random.randrange(20000, 40000)
        server = EmbeddedRedis(tmp, aof=False, port=port).start()
        try:
            url = f"redis://:{server.password}@127.0.0.1:{port}/0"
            client = client_for(url)
            settings = load_settings("tiny-cpu", run_dir=tmp, redis={"url": url, "run": "bench"})
            create_keys(keys_dir(settings))  # this process writes as every role
            streams = Streams(client, settings, signs_as=ROLES)
            raw, service = [], []
            for _ in range(args.rounds):  # interleaved rounds, so drift hits both paths alike
                raw.append(bench_raw(client, payload, args.groups))
                service.append(bench_service(streams, group, args.groups))
        finally:
            server.stop()

    raw_rate, service_rate = statistics.median(raw), statistics.median(service)
    print(f"group: 16 x 1024 tokens; wire {len(payload) / 1e3:.0f} KB (JSON {json_bytes / 1e3:.0f} KB, "
          f"{json_bytes / len(payload):.2f}x larger)")
    print(f"encode {encode_ms:.2f} ms/group, decode+validate {decode_ms:.2f} ms/group")
    print(f"raw redis-py     : {raw_rate:8.0f} groups/s  ({1e3 / raw_rate:.2f} ms/group)")
    print(f"reliable streams : {service_rate:8.0f} groups/s  ({1e3 / service_rate:.2f} ms/group)")
    print(f"ratio service/raw: {service_rate / raw_rate:.2f}")
    overhead = 1e3 / service_rate - 1e3 / raw_rate
    print(f"overhead {overhead:.2f} ms/group, of which encode+decode {encode_ms + decode_ms:.2f} ms; "
          f"rest = extra round trips (XLEN, XAUTOCLAIM, XPENDING, Lua ack)")


if __name__ == "__main__":
    main()
