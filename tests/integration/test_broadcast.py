"""The broadcast rounds of transport collective (services/broadcast.py) between real processes over gloo, without
vLLM (tests/integration/test_generator.py streams into the real engine): the bytes arrive whole at every rank of
the chain while the learner sends them once, and faults cost at most one `weights.broadcast_timeout_s`: a member
that never joins, one killed mid-stream, the first link of the chain killed."""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import multiprocessing as mp
import os
import queue
import random
import socket
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from torch.distributed import PrefixStore

from services import broadcast as broadcast_module
from services.broadcast import (
    HOST,
    MEMBER_TTL_S,
    NEWCOMERS_PER_ROUND,
    Broadcaster,
    Handoff,
    commit_refusal,
    join,
    layout,
    map_sealed,
    pack,
    receive,
    register_member,
    relay,
    sealed_bucket,
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
    """One rank of the chain, or a nearby receiver, as an engine's worker runs it, started (its imports done)
    before the round: its announcement comes through `inbox`. `die_after`: exit at once after that bucket. Puts
    (its rank, or its name when nearby; {tensor name: fingerprint} or None; the commit or the error). A member
    named *-hung: joins, then takes nothing (alive: a stopped process, a frozen host); *-posing: says it joined
    and builds no group."""
    out.put(("ready", member, None))
    announcement = WeightsBroadcast.model_validate_json(inbox.get())
    if member in announcement.nearby:
        take_nearby(announcement, member, die_after, out)
        return
    rank = announcement.ranks[member]
    if member.endswith("posing"):
        PrefixStore(f"dapo-broadcast/{announcement.group}", store_client("127.0.0.1", port, TIMEOUT_S)).set(
            f"joined/{rank}", "1")
        time.sleep(TIMEOUT_S * 2)
        os._exit(0)
    try:
        pg = join(store_client("127.0.0.1", port, TIMEOUT_S), announcement.group, rank, announcement.world_size,
                  "gloo", TIMEOUT_S, TIMEOUT_S)
        if member.endswith("hung"):
            time.sleep(TIMEOUT_S * 3)
            raise TimeoutError("hung")

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


def take_nearby(announcement: WeightsBroadcast, member: str, die_after: int | None, out) -> None:
    if die_after is not None:  # a worker killed with the round half taken: hello, one bucket, gone
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect("\0" + announcement.handoff)
        conn.sendall(json.dumps({"token": announcement.handoff_token, "member": member, "worker": 0}).encode())
        socket.recv_fds(conn, 8, 1)
        os._exit(0)
    try:
        receipt = receive(announcement, "127.0.0.1", member)
        named = {name: fingerprint(tensor) for slots, bucket in zip(announcement.buckets, receipt.buckets)
                 for name, tensor in unpack(bucket, slots)}
        out.put((member, named, receipt.commit))
    except Exception as err:
        out.put((member, None, f"{type(err).__name__}: {err}"))
    out.close()
    out.join_thread()
    os._exit(0)


@pytest.fixture
def rounds(settings):
    settings.weights = WeightsConfig(transport="collective", broadcast_port=0, bucket_mb=0.02,
                                     broadcast_timeout_s=TIMEOUT_S, broadcast_join_timeout_s=TIMEOUT_S)
    client = connect(settings)
    keyring = load_keyring(settings)
    prefix = run_prefix(settings)
    broadcaster = Broadcaster(settings, client, load_signer(settings, "learner", keyring), prefix, channel(prefix))
    broadcaster.shuffler = SimpleNamespace(shuffle=lambda items: None)  # the chain in sorted order: tests name ranks
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel(prefix))
    context = mp.get_context("spawn")
    out = context.Queue()
    started = []

    def run(members: dict[str, int | None], version: int = 1, tensors=None, nearby: tuple[str, ...] = ()):
        """Register `members` (id -> the bucket after which it dies, or None; those in `nearby` on this host, the
        others as if on another), broadcast, start their receivers as the round names them; (round result,
        announcement, {rank or nearby member: (tensors, commit or error)}, seconds)."""
        inboxes = {}
        for member, die_after in members.items():
            register_member(client, prefix, member, workers=1, host=HOST if member in nearby else "another-host")
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
        message, deadline = None, time.monotonic() + 120
        while message is None and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=5)
            if message is None and not sending.is_alive():
                break  # it ended without announcing a round
        assert message is not None, "no round announced (the broadcast thread ended or hung before it)"
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
    assert sorted(announcement.ranks.values()) == [1, 2, 3] and announcement.world_size == 4
    assert sent.members == sorted(announcement.ranks)
    total = sum(announcement.bucket_bytes)
    assert total <= sent.bytes_sent < total + 4096  # one copy and the commit, not one per member
    again, _, _, _ = rounds["run"]({"gen-a": None, "gen-b": None, "gen-c": None}, version=2)
    assert again.error is None  # the round before's keys go once this one is over: only this one's are left
    assert {key.split("/")[1] for key in rounds["broadcaster"].store.list_keys()} == {rounds["broadcaster"].last_group}
    assert sorted(received) == [1, 2, 3]
    for named, commit in received.values():
        assert named is not None, commit
        assert named == {name: fingerprint(tensor) for name, tensor in tensors.items()}
        digests = {0: BroadcastCommit.model_validate_json(commit).digests[0]}
        assert commit_refusal(announcement, commit, digests, rounds["keyring"], channel(rounds["prefix"])) is None


def test_the_chain_takes_a_new_order_every_round(rounds, monkeypatch):
    """In a sorted chain a member whose id sorts first relayed every round to all the others: one that joins and
    then withholds buckets (it is never blamed: it joined) cost everyone after it every version."""
    broadcaster = rounds["broadcaster"]
    broadcaster.shuffler = random.Random(0)  # as made (the fixture keeps the chain sorted for the other tests)
    orders = set()
    monkeypatch.setattr(broadcast_module, "join", lambda *args, **kwargs: (_ for _ in ()).throw(OSError("no chain")))
    for member in ("gen-a", "gen-b", "gen-c"):
        register_member(rounds["client"], rounds["prefix"], member, workers=1, host="another-host")
    pubsub = rounds["client"].pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(channel(rounds["prefix"]))
    for version in range(1, 13):
        broadcaster.broadcast(state(), version)
        message = next(filter(None, (pubsub.get_message(timeout=1) for _ in range(10))))
        ranks = WeightsBroadcast.model_validate_json(message["data"]).ranks
        orders.add(tuple(sorted(ranks, key=ranks.get)))
        broadcaster.paused.clear()  # (the round failed without a chain: everyone again)
        broadcaster.newcomers_from = float("-inf")
    pubsub.close()
    assert len(orders) > 1


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
    # a new process under the failed member's id (a restart) is not held to its predecessor's failure: a newcomer,
    # it is taken once the newcomers' pause after a newcomer's failure is over
    monkeypatch.setattr(broadcast_module, "PROCESS_STARTED", broadcast_module.PROCESS_STARTED + 1.0)
    register_member(rounds["client"], rounds["prefix"], "absent-b", workers=1)
    assert "absent-b" not in rounds["broadcaster"].members()
    rounds["broadcaster"].newcomers_from = time.monotonic()
    assert "absent-b" in rounds["broadcaster"].members()


def test_a_member_that_joins_and_builds_no_group_sits_out_the_next_rounds(rounds):
    """It came (its key is in the store), so it is not absent, yet the round broke: the round's newcomers are
    the suspects, and the member that took rounds before keeps its place."""
    first, _, _, _ = rounds["run"]({"gen-a": None})
    assert first.error is None
    sent, _, _, _ = rounds["run"]({"gen-a": None, "gen-b-posing": None}, version=2)
    assert sent.error is not None and sent.failed == ["gen-b-posing"]
    again, announcement, received, _ = rounds["run"]({"gen-a": None, "gen-b-posing": None}, version=3)
    assert again.error is None and announcement.ranks == {"gen-a": 1} and received[1][0] is not None


def test_a_generator_that_registers_new_ids_that_never_join_costs_one_timeout_per_pause(rounds):
    """Any generator may write any membership: new ids (or process starts) every heartbeat, never joining, fail
    one round; then newcomers wait MEMBER_PAUSE_S while the members that joined keep their rounds."""
    sent, _, _, _ = rounds["run"]({"gen-a": None, "absent-1": None})
    assert sent.failed == ["absent-1"]
    for version, fake in ((2, "absent-2"), (3, "absent-3")):
        again, announcement, received, seconds = rounds["run"]({"gen-a": None, fake: None}, version=version)
        assert again.error is None and announcement.ranks == {"gen-a": 1} and received[1][0] is not None
        assert seconds < TIMEOUT_S  # no join timeout
    broadcaster = rounds["broadcaster"]
    broadcaster.newcomers_from = time.monotonic()  # the pause is over: newcomers again, NEWCOMERS_PER_ROUND at most
    for i in range(NEWCOMERS_PER_ROUND + 4):
        register_member(rounds["client"], rounds["prefix"], f"new-{i:02d}", workers=1)
    taken = broadcaster.members()
    assert "gen-a" in taken and len(taken) == 1 + NEWCOMERS_PER_ROUND
    client, key = rounds["client"], f"{rounds['prefix'].rstrip(':')}:weights:members"
    client.hset(key, "nan", '{"workers": 1, "at": %f, "since": NaN}' % time.time())  # never matched by a pause
    assert "nan" not in broadcaster.members() and b"nan" not in client.hkeys(key)


def test_a_member_killed_mid_stream_costs_only_those_after_it(rounds):
    sent, _, received, seconds = rounds["run"]({"gen-a": None, "gen-b": 1, "gen-c": None})
    assert sent.error is None  # the learner's link (to gen-a) held
    assert seconds < TIMEOUT_S * 3
    assert received[1][0] is not None  # before the break: whole
    assert received[3][0] is None  # after it: refused by its own timeout, takes the files


def test_a_member_that_hangs_costs_only_those_after_it(rounds):
    """Alive but taking nothing: its predecessor keeps receiving (its hand-ons wait to the end, under one
    timeout), so the learner's round and the members before it are whole; those after it take the files."""
    rounds["broadcaster"].bucket_bytes = 4 << 20  # 8 buckets: more than the sockets' buffers hold
    tensors = {f"t{i}": torch.randn(1024, 1024) for i in range(8)}
    sent, announcement, received, _ = rounds["run"]({"gen-a": None, "gen-b-hung": None, "gen-c": None}, tensors=tensors)
    assert sent.error is None and sent.failed == []
    assert received[announcement.ranks["gen-a"]][0] == {name: fingerprint(t) for name, t in tensors.items()}
    assert received[announcement.ranks["gen-c"]][0] is None


def test_a_ranks_first_wait_allows_one_timeout_per_hop_before_it():
    """Bucket 0 is handed on hop by hop down the chain: rank k waits one timeout and the bucket's transfer over the
    k - 1 hops before the previous rank, at the slowest link allowed; later buckets one timeout."""
    waits = []

    class Group:
        def recv(self, tensors, source, tag):
            if tag == 3:  # the commit's length
                tensors[0].fill_(2)
            return SimpleNamespace(wait=waits.append)

        def send(self, tensors, destination, tag):
            return SimpleNamespace(wait=lambda timeout: None)

    relay(Group(), rank=4, world_size=6, sizes=[int(broadcast_module.HOP_FLOOR_BPS // 10), 8, 8], timeout_s=2.0)
    assert [w.total_seconds() for w in waits[:3]] == pytest.approx([2.3, 2.0, 2.0])


def test_a_round_over_nccl_fails_the_round_not_the_process(monkeypatch):
    """NCCL's default on a timeout or a dead peer ends the process (the learner, or an engine's workers): a
    round's group is made with CleanUpOnly, and the process's own setting is left as it was."""
    made = []

    class Group:
        Options = type("Options", (), {})

        def __init__(self, store, rank, world_size, options):
            made.append((os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), options._timeout.total_seconds()))

    monkeypatch.setattr(broadcast_module.dist, "ProcessGroupNCCL", Group, raising=False)  # (a CPU build has none)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    store = broadcast_module.dist.HashStore()
    join(store, "v1-x", 0, 1, "nccl", 5.0, 1.0)
    assert made == [("2", 5.0)] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_the_first_link_killed_fails_the_round_within_the_timeout(rounds):
    sent, _, received, seconds = rounds["run"]({"gen-a": 0, "gen-b": None})
    assert sent.error is not None and seconds < TIMEOUT_S * 3
    assert received[2][0] is None


def test_stale_and_garbled_memberships_are_dropped(rounds):
    client, key = rounds["client"], f"{rounds['prefix'].rstrip(':')}:weights:members"
    client.hset(key, "old", '{"workers": 1, "at": %f, "since": 1}' % (time.time() - MEMBER_TTL_S - 1))
    client.hset(key, "garbled", "not json")
    client.hset(key, "greedy", '{"workers": 100000, "at": %f}' % time.time())
    client.hset(key, b"\xff\xfe", '{"workers": 1, "at": %f, "since": 1}' % time.time())  # an id that is no text
    register_member(client, rounds["prefix"], "fresh", workers=2)
    broadcaster = rounds["broadcaster"]
    assert broadcaster.members() == {"fresh": 2}
    assert set(client.hkeys(key)) == {b"fresh", b"old"}  # old: not renewed as far as this learner saw, yet
    broadcaster.renewals[b"old"] = (*broadcaster.renewals[b"old"][:2], time.monotonic() - MEMBER_TTL_S - 1)
    register_member(client, rounds["prefix"], "fresh", workers=2)
    assert broadcaster.members() == {"fresh": 2} and set(client.hkeys(key)) == {b"fresh"}


def test_membership_freshness_goes_by_the_learners_clock_not_the_generators(rounds, monkeypatch):
    """A generator whose clock is minutes behind the learner's was never a member; one minutes ahead stayed one
    that long after it died. Renewed is what the learner sees change."""
    client, broadcaster = rounds["client"], rounds["broadcaster"]
    behind = time.time() - 600
    monkeypatch.setattr(broadcast_module.time, "time", lambda: behind)
    register_member(client, rounds["prefix"], "slow-clock", workers=1)
    monkeypatch.undo()
    assert "slow-clock" not in broadcaster.members()  # first seen, dated ten minutes ago
    behind += 20  # its next heartbeat, twenty seconds later by its clock
    monkeypatch.setattr(broadcast_module.time, "time", lambda: behind)
    register_member(client, rounds["prefix"], "slow-clock", workers=1)
    monkeypatch.undo()
    assert "slow-clock" in broadcaster.members()  # renewed as the learner saw
    ahead = time.time() + 600
    monkeypatch.setattr(broadcast_module.time, "time", lambda: ahead)
    register_member(client, rounds["prefix"], "fast-clock", workers=1)  # and then it died
    monkeypatch.undo()
    assert "fast-clock" not in broadcaster.members()  # dated in the future: not taken on its word
    (at, _, first) = broadcaster.renewals[b"fast-clock"]
    broadcaster.renewals[b"fast-clock"] = (at, -math.inf, first - MEMBER_TTL_S - 1)
    broadcaster.members()
    assert b"fast-clock" not in client.hkeys(f"{rounds['prefix'].rstrip(':')}:weights:members")


def test_a_member_loading_a_version_from_the_files_sits_rounds_out_without_a_pause(rounds):
    """A generator pulling a version from the files (a late joiner's first, or after a missed round) skips rounds
    until it has loaded it: listed as usual, its next round failed on it, and it (a newcomer: every newcomer) sat
    out MEMBER_PAUSE_S. It says `busy`, and is in the first round after it says otherwise, with no failure."""
    broadcaster, client, prefix = rounds["broadcaster"], rounds["client"], rounds["prefix"]
    register_member(client, prefix, "gen-a", workers=1)
    register_member(client, prefix, "loading", workers=1, busy=True)
    assert broadcaster.members() == {"gen-a": 1}
    assert ("loading", broadcast_module.PROCESS_STARTED) not in broadcaster.paused
    register_member(client, prefix, "loading", workers=1)
    assert broadcaster.members() == {"gen-a": 1, "loading": 1}


# -- nearby receivers: sealed memory from the learner's host --------------------------------------------------
def test_nearby_receivers_take_sealed_buckets_whole_without_the_chain_or_digests(rounds):
    tensors = state(2)
    nearby = ("gen-a", "gen-b", "gen-c")
    sent, announcement, received, _ = rounds["run"](dict.fromkeys(nearby), tensors=tensors, nearby=nearby)
    assert sent.error is None and sent.failed == []
    assert announcement.nearby == list(nearby) and announcement.ranks == {} and announcement.world_size == 1
    assert sent.bytes_sent == sum(announcement.bucket_bytes)  # packed once for all of them
    assert sorted(received) == list(nearby)
    for named, commit in received.values():
        assert named == {name: fingerprint(tensor) for name, tensor in tensors.items()}, commit
        assert BroadcastCommit.model_validate_json(commit).digests == []  # sealed: nothing to hash
        assert commit_refusal(announcement, commit, {}, rounds["keyring"], channel(rounds["prefix"])) is None


def test_a_round_with_nearby_and_chained_members_gives_each_the_same_bytes(rounds):
    tensors = state(3)
    sent, announcement, received, _ = rounds["run"]({"gen-far": None, "gen-near": None}, tensors=tensors,
                                                    nearby=("gen-near",))
    assert sent.error is None and sent.failed == []
    assert announcement.ranks == {"gen-far": 1} and announcement.nearby == ["gen-near"]
    assert sorted(received, key=str) == [1, "gen-near"]
    for named, commit in received.values():
        assert named == {name: fingerprint(tensor) for name, tensor in tensors.items()}, commit
        assert len(BroadcastCommit.model_validate_json(commit).digests) == len(announcement.bucket_bytes)


def test_a_chain_that_fails_costs_the_nearby_members_nothing(rounds):
    tensors = state(4)
    sent, announcement, received, seconds = rounds["run"]({"absent-far": None, "gen-near": None}, tensors=tensors,
                                                          nearby=("gen-near",))
    assert sent.error is not None and sent.failed == ["absent-far"] and seconds < TIMEOUT_S * 3
    named, commit = received["gen-near"]
    assert named == {name: fingerprint(tensor) for name, tensor in tensors.items()}, commit
    assert len(BroadcastCommit.model_validate_json(commit).digests) == len(announcement.bucket_bytes)
    assert commit_refusal(announcement, commit, {}, rounds["keyring"], channel(rounds["prefix"])) is None


def test_nearby_members_absent_or_killed_mid_round_cost_one_timeout_and_only_themselves(rounds):
    nearby = ("gen-a", "absent-b", "gen-c")
    sent, announcement, received, seconds = rounds["run"]({"gen-a": None, "absent-b": None, "gen-c": 0},
                                                          nearby=nearby)
    assert sent.error is None and sent.failed == ["absent-b", "gen-c"] and seconds < TIMEOUT_S * 3
    assert received["gen-a"][0] is not None
    again, announcement, _, _ = rounds["run"]({"gen-a": None}, version=2, nearby=nearby)
    assert again.failed == [] and announcement.nearby == ["gen-a"]  # the two that failed sit out


def one_bucket_handoff() -> tuple[Handoff, WeightsBroadcast]:
    """The learner's side of a round with one bucket (32 bytes of 7) for one nearby worker, gen-n, and its round."""
    name = f"dapo-weights-test-{os.getpid()}-{time.monotonic_ns()}"
    handoff = Handoff(name, "the-token", {"gen-n": 1}, 1, TIMEOUT_S, TIMEOUT_S)
    handoff.add(sealed_bucket(32, lambda out: out.fill_(7)))
    announcement = WeightsBroadcast(version=1, group="v1-test", port=1, backend="gloo", world_size=1, ranks={},
                                    nearby=["gen-n"], handoff=name, handoff_token="the-token",
                                    learner_pid=os.getpid(), buckets=[[]], bucket_bytes=[32], verify="full",
                                    timeout_s=TIMEOUT_S, join_timeout_s=TIMEOUT_S)
    return handoff, announcement


def test_the_handoff_serves_only_the_rounds_receivers_and_they_take_it_only_from_the_learner():
    handoff, announcement = one_bucket_handoff()
    name = announcement.handoff

    def ask(token: str, member: str) -> list[int]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(TIMEOUT_S)
            conn.connect("\0" + name)
            conn.sendall(json.dumps({"token": token, "member": member, "worker": 0}).encode())
            return socket.recv_fds(conn, 8, 1)[1]

    try:
        assert ask("a-guess", "gen-n") == [] and ask("the-token", "gen-x") == []  # closed unserved
        if os.getuid() == 0:  # another user with the right token: refused by its credentials
            child = os.fork()
            if child == 0:
                os.setuid(65534)
                try:
                    os._exit(len(ask("the-token", "gen-n")))
                except OSError:  # closed at once: refused before its hello was read
                    os._exit(0)
            assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
        with pytest.raises(ConnectionError, match="not the learner's"):  # a socket someone else serves
            broadcast_module.take_handoff(announcement.model_copy(update={"learner_pid": os.getpid() + 1}),
                                          "gen-n", 0)
        taken = {}
        thread = threading.Thread(target=lambda: taken.update(r=broadcast_module.take_handoff(announcement,
                                                                                                "gen-n", 0)))
        thread.start()
        large = os.urandom(3 << 20)  # a commit of ~45,000 digests: more than one message on any socket holds
        assert handoff.finish(large) == []
        thread.join(TIMEOUT_S)
        (bucket,), commit = taken["r"]
        assert commit == large and torch.equal(bucket, torch.full((32,), 7, dtype=torch.uint8))
    finally:
        handoff.close()


def test_a_sealed_bucket_cannot_be_changed_and_an_unsealed_one_is_refused():
    fd = sealed_bucket(64, lambda out: out.fill_(3))
    try:
        with pytest.raises(PermissionError):
            os.write(fd, b"x")
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 64)  # a writable shared mapping
        mine, theirs = map_sealed(fd, 64), map_sealed(fd, 64)
        assert torch.equal(mine, torch.full((64,), 3, dtype=torch.uint8))
        mine.fill_(9)  # a receiver that writes into its bucket writes into a private copy of the page
        assert torch.equal(theirs, torch.full((64,), 3, dtype=torch.uint8))
        assert torch.equal(map_sealed(fd, 64), torch.full((64,), 3, dtype=torch.uint8))
        with pytest.raises(ValueError, match="64 bytes where the round says 65"):
            map_sealed(fd, 65)
    finally:
        os.close(fd)
    unsealed = os.memfd_create("test", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 64)
    with pytest.raises(ValueError, match="unsealed"):
        map_sealed(unsealed, 64)
    os.close(unsealed)


def test_a_receiver_out_of_file_descriptors_says_so():
    handoff, announcement = one_bucket_handoff()
    child = os.fork()
    if child == 0:  # every fd but one taken: the socket gets it, the bucket's fd finds none
        code = 1
        try:
            import resource

            resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
            while True:
                try:
                    os.dup(0)
                except OSError:
                    break
            os.close(63)
            broadcast_module.take_handoff(announcement, "gen-n", 0)
        except ConnectionError as err:
            code = 0 if "open-file limit" in str(err) else 2
        finally:
            os._exit(code)
    try:
        assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    finally:
        handoff.close()


def test_a_commit_length_beyond_any_commit_from_the_previous_rank_is_refused_before_it_is_allocated():
    """The chain's previous rank is any generator: its word for the commit's length must not size an allocation."""

    class PreviousRank:  # a process group whose rank - 1 sends one bucket, then a commit of 2^40 bytes
        def recv(self, tensors, source, tag):
            tensors[0].fill_(1 << 40 if tag == 1 else 7)
            return SimpleNamespace(wait=lambda timeout: None)

    with pytest.raises(ConnectionError, match="a commit of 1099511627776 bytes"):
        relay(PreviousRank(), rank=1, world_size=2, sizes=[4], timeout_s=1.0)
