"""The broadcast rounds of transport collective (services/broadcast.py) between real processes over gloo, without
vLLM (tests/integration/test_generator.py streams into the real engine): the bytes arrive whole at every rank of
the chain while the learner sends them once, and faults cost at most one `weights.broadcast_timeout_s`: a member
that never joins, one killed mid-stream, the first link of the chain killed."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import threading
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from services import broadcast as broadcast_module
from services.broadcast import (
    MEMBER_TTL_S,
    Broadcaster,
    commit_refusal,
    join,
    layout,
    pack,
    register_member,
    relay,
    store_client,
    unpack,
)
from services.config import WeightsConfig
from services.keys import Signer, load_keyring, load_signer
from services.messages import BroadcastCommit, WeightsBroadcast, sign_announcement
from services.redis_local import connect
from services.streams import run_prefix
from services.weights import channel

TIMEOUT_S = 3.0


def state(seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(300, 64, generator=generator).to(torch.bfloat16),
        "layer.0.weight": torch.randn(64, 64, generator=generator),
        "layer.0.bias": torch.randn(7, generator=generator).to(torch.float16),  # 14 bytes: the next one is padded
        "norm.weight": torch.randn(64, generator=generator),
        "head.weight": torch.randn(64, 300, generator=generator),
    }


def test_layout_packs_and_unpacks_every_dtype_exactly_and_cuts_at_the_bucket_size():
    tensors = state()
    slots, sizes = layout(tensors, bucket_bytes=40_000)
    assert [[slot.name for slot in bucket] for bucket in slots] == [
        ["embed.weight"], ["layer.0.weight", "layer.0.bias", "norm.weight"], ["head.weight"]]  # a big one alone
    assert all(slot.offset % 16 == 0 for bucket in slots for slot in bucket)
    for bucket, size in zip(slots, sizes):
        for name, tensor in unpack(pack(tensors, bucket, size), bucket):
            assert tensor.dtype == tensors[name].dtype and torch.equal(tensor, tensors[name])
    with pytest.raises(ValueError, match="int64"):
        layout({"step": torch.zeros(2, dtype=torch.int64)}, 1024)


def fingerprint(tensor: torch.Tensor) -> tuple[str, list[int], str]:
    data = tensor.contiguous().view(torch.uint8).numpy()
    return str(tensor.dtype), list(tensor.shape), hashlib.sha256(data).hexdigest()


def receiver(member: str, inbox, port: int, die_after: int | None, out) -> None:
    """One rank of the chain, as an engine's worker runs it, started (its imports done) before the round: its
    announcement comes through `inbox`. `die_after`: exit at once after that bucket."""
    out.put(("ready", member, None))
    announcement = WeightsBroadcast.model_validate_json(inbox.get())
    rank = announcement.ranks[member]
    try:
        pg = join(store_client("127.0.0.1", port, TIMEOUT_S), announcement.group, rank, announcement.world_size,
                  "gloo", TIMEOUT_S, TIMEOUT_S)

        def maybe_die(index, bucket):
            if index == die_after:
                os._exit(0)

        buckets, commit = relay(pg, rank, announcement.world_size, announcement.bucket_bytes, TIMEOUT_S,
                                on_bucket=maybe_die)
        named = {name: fingerprint(tensor) for slots, bucket in zip(announcement.buckets, buckets)
                 for name, tensor in unpack(bucket, slots)}  # not the tensors: shared memory dies with the sender
        out.put((rank, named, commit.decode()))
    except Exception as err:
        out.put((rank, None, f"{type(err).__name__}: {err}"))
    out.close()
    out.join_thread()  # flushed before the hard exit
    os._exit(0)  # gloo's threads torn down by the interpreter may abort the process (tests/integration/test_ranks)


@pytest.fixture
def rounds(settings):
    settings.weights = WeightsConfig(transport="collective", broadcast_port=0, bucket_mb=0.02,
                                     broadcast_timeout_s=TIMEOUT_S, broadcast_join_timeout_s=TIMEOUT_S)
    client = connect(settings)
    keyring = load_keyring(settings)
    prefix = run_prefix(settings)
    broadcaster = Broadcaster(settings, client, load_signer(settings, "learner", keyring), prefix, channel(prefix))
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel(prefix))
    context = mp.get_context("spawn")
    out = context.Queue()
    started = []

    def run(members: dict[str, int | None], version: int = 1, tensors=None):
        """Register `members` (id -> the bucket after which it dies, or None), broadcast, start their ranks as the
        round names them; (round result, announcement, {rank: (tensors, commit or error)}, seconds)."""
        inboxes = {}
        for member, die_after in members.items():
            register_member(client, prefix, member, workers=1)
            if not member.startswith("absent"):
                inboxes[member] = context.Queue()
                started.append(context.Process(target=receiver,
                                               args=(member, inboxes[member], broadcaster.port, die_after, out)))
                started[-1].start()
        for _ in inboxes:
            assert out.get(timeout=120)[0] == "ready"
        result = {}
        began = time.monotonic()
        sending = threading.Thread(target=lambda: result.update(
            round=broadcaster.broadcast(tensors or state(), version)))
        sending.start()
        message = None
        while message is None:
            message = pubsub.get_message(timeout=5)
        announcement = WeightsBroadcast.model_validate_json(message["data"])
        for inbox in inboxes.values():
            inbox.put(message["data"].decode())
        sending.join(timeout=60)
        seconds = time.monotonic() - began
        received = {}
        for process in started:
            process.join(timeout=60)
        while True:
            try:
                rank, named, commit = out.get(timeout=1)
            except queue.Empty:
                break
            received[rank] = (named, commit)
        started.clear()
        return result["round"], announcement, received, seconds

    yield dict(run=run, broadcaster=broadcaster, keyring=keyring, prefix=prefix, client=client)
    pubsub.close()
    for process in started:
        process.kill()


def test_every_rank_of_the_chain_gets_the_version_whole_and_the_learner_sends_it_once(rounds):
    tensors = state(1)
    sent, announcement, received, _ = rounds["run"]({"gen-a": None, "gen-b": None, "gen-c": None}, tensors=tensors)
    assert sent.error is None and sent.failed == [] and sent.members == ["gen-a", "gen-b", "gen-c"]
    assert announcement.ranks == {"gen-a": 1, "gen-b": 2, "gen-c": 3} and announcement.world_size == 4
    total = sum(announcement.bucket_bytes)
    assert total <= sent.bytes_sent < total + 4096  # one copy and the commit, not one per member
    assert sorted(received) == [1, 2, 3]
    for named, commit in received.values():
        assert named is not None, commit
        assert named == {name: fingerprint(tensor) for name, tensor in tensors.items()}
        digests = {0: BroadcastCommit.model_validate_json(commit).digests[0]}
        assert commit_refusal(announcement, commit, digests, rounds["keyring"], channel(rounds["prefix"])) is None


def test_a_commit_not_signed_by_the_learner_is_refused(rounds):
    sent, announcement, received, _ = rounds["run"]({"gen-a": None})
    (_, commit), = received.values()
    forged = sign_announcement(BroadcastCommit.model_validate_json(commit), Signer("learner",
                               Ed25519PrivateKey.generate()), "dapo:test:weights:broadcast")
    refusal = commit_refusal(announcement, forged.model_dump_json(), {}, rounds["keyring"], channel(rounds["prefix"]))
    assert refusal is not None and refusal.startswith("forged")


def test_a_member_that_never_joins_costs_one_timeout_and_sits_out_the_next_rounds(rounds, monkeypatch):
    sent, announcement, received, seconds = rounds["run"]({"gen-a": None, "absent-b": None})
    assert sent.error is not None and sent.failed == ["absent-b"]
    assert seconds < TIMEOUT_S * 3  # the join's wait, then the learner goes on
    # gen-a's round failed with it (gloo connects everyone): it takes the files
    assert received[announcement.ranks["gen-a"]][0] is None
    again, announcement, received, _ = rounds["run"]({"gen-a": None}, version=2)
    assert again.error is None and announcement.ranks == {"gen-a": 1} and received[1][0] is not None
    # a new process under the failed member's id (a restart) is not held to its predecessor's failure
    monkeypatch.setattr(broadcast_module, "PROCESS_STARTED", broadcast_module.PROCESS_STARTED + 1.0)
    register_member(rounds["client"], rounds["prefix"], "absent-b", workers=1)
    assert "absent-b" in rounds["broadcaster"].members()


def test_a_member_killed_mid_stream_costs_only_those_after_it(rounds):
    sent, _, received, seconds = rounds["run"]({"gen-a": None, "gen-b": 1, "gen-c": None})
    assert sent.error is None  # the learner's link (to gen-a) held
    assert seconds < TIMEOUT_S * 3
    assert received[1][0] is not None  # before the break: whole
    assert received[3][0] is None  # after it: refused by its own timeout, takes the files


def test_the_first_link_killed_fails_the_round_within_the_timeout(rounds):
    sent, _, received, seconds = rounds["run"]({"gen-a": 0, "gen-b": None})
    assert sent.error is not None and seconds < TIMEOUT_S * 3
    assert received[2][0] is None


def test_stale_and_garbled_memberships_are_dropped(rounds):
    client, key = rounds["client"], f"{rounds['prefix'].rstrip(':')}:weights:members"
    client.hset(key, "old", '{"workers": 1, "at": %f}' % (time.time() - MEMBER_TTL_S - 1))
    client.hset(key, "garbled", "not json")
    client.hset(key, "greedy", '{"workers": 100000, "at": %f}' % time.time())
    register_member(client, rounds["prefix"], "fresh", workers=2)
    assert rounds["broadcaster"].members() == {"fresh": 2}
    assert set(client.hkeys(key)) == {b"fresh"}
