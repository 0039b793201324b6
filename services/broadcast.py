"""Weights streamed into the generators' running engines over a process group of their own (transport collective).

One round per version, the same code on CPU (gloo) and GPU (NCCL), built from PyTorch's standalone c10d pieces
(a `TCPStore`, a `PrefixStore` per round, `ProcessGroupGloo` / `ProcessGroupNCCL`) outside any default world:

  members   A generator that serves the current version asks to be in the next rounds: it writes its engine's
            worker count to the hash `dapo:{run}:weights:members` every heartbeat (`register_member`). One
            that is loading a version from the files says so (`busy`: it would not join) and sits rounds out
            meanwhile, without the pause of a member that failed one.
  round     After an update the learner picks the fresh members, gives each engine's workers consecutive ranks
            (the learner is rank 0), cuts the served-dtype state dict into buckets of `weights.bucket_mb`
            (`layout`), and publishes a signed `WeightsBroadcast` on the weights channel. Every worker of every
            engine joins the round's group at the learner's store (`join`), inside vLLM's worker process
            (generator/vllm_worker.py), so a tensor-parallel engine's workers each take the whole stream and load
            their own slice through vLLM's `reload_weights`.
  stream    A chain: rank 0 sends bucket k to rank 1, which forwards it to rank 2 while it takes bucket k + 1
            (`relay`). The learner sends each version once, whatever the number of engines; each engine has a
            bucket one bucket-time after the one before it. NCCL's own broadcast pipelines the same way; gloo's is a
            tree whose root sends log2(N) copies, hence the chain. A rank whose successor fails or hangs keeps
            receiving.
  nearby    A generator whose engine runs on the learner's host (same kernel, network, pid and user namespaces:
            `dapo run`) is not in the chain: the learner packs each bucket once into a memfd, seals it against any
            write, and hands the fd to each of its workers over the round's abstract unix socket (`Handoff`,
            `take_handoff`), which map it: no copy. Over TCP every hop would copy each byte into the kernel
            and out again on the same cores (NCCL takes shared memory within a node for the same reason; gloo has
            only TCP). Sealed bytes from the learner's pid cannot have changed: nothing to hash.
  commit    After the buckets the learner streams a signed `BroadcastCommit`: the sha256 of every bucket, hashed
            while the bucket was on the wire. Receivers stage the buckets without touching the engine and hash all
            of them (`weights.verify` full), a random eighth (sampled) or none (off; the round and commit are still
            signed, but a process on the path could alter bytes); the generator checks the commit's signature and
            the digests before the engine loads the staged tensors between two batches (generator/worker.py).
  faults    Every wait is bounded by `weights.broadcast_timeout_s`. A member that does not join fails the round for
            everyone (gloo connects a full mesh): the learner leaves it out of rounds for MEMBER_PAUSE_S, and this
            version reaches the others through the files, which the learner writes after every round as before (the
            way in for a generator that starts late, restarts or misses a round).
  newcomers Memberships are a generator's word, and any generator may write any id (`weights:members`): one that
            registered a new id (or a new process start) every heartbeat and never joined would fail every round.
            So a member process not yet seen joining a round is a newcomer: at most NEWCOMERS_PER_ROUND a round,
            and once a newcomer failed to join, none for MEMBER_PAUSE_S (those that joined keep their places). Such
            an insider costs one join timeout per MEMBER_PAUSE_S; a genuine generator started meanwhile takes the
            files until then.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import logging
import math
import mmap
import os
import random
import secrets
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from services.messages import (
    BroadcastCommit,
    TensorSlot,
    WeightsBroadcast,
    announcement_refusal,
    read_announcement,
    sign_announcement,
)

log = logging.getLogger(__name__)

ALIGN = 16  # bytes: every tensor starts at an offset its dtype can be viewed at
MEMBER_TTL_S = 60.0  # a membership not renewed this long is dropped (generators renew every heartbeat)
MEMBER_PAUSE_S = 300.0  # a member process that failed a round sits out this long (a restarted one need not)
NEWCOMERS_PER_ROUND = 16  # member processes never seen joining a round, taken into one round at most
SAMPLED_SHARE = 8  # verify sampled: one bucket in this many, at random, at least one
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def members_key(prefix: str) -> str:
    return prefix.rstrip(":") + ":weights:members"


def streamed_key(prefix: str) -> str:
    """The newest version a round began to stream: members may hold it before, or without, its announcement."""
    return prefix.rstrip(":") + ":weights:streamed"


def newest_streamed(redis_client, prefix: str) -> int | None:
    raw = redis_client.get(streamed_key(prefix))
    return int(raw) if raw is not None else None


def round_context(channel: str) -> str:
    """What rounds and commits are signed under: the run's weights channel, apart from file announcements."""
    return channel + ":broadcast"


# -- the pure part: buckets -----------------------------------------------------------------------------------
def layout(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> tuple[list[list[TensorSlot]], list[int]]:
    """Tensors in state-dict order cut into buckets of at most `bucket_bytes` (a larger tensor gets its own)."""
    buckets: list[list[TensorSlot]] = [[]]
    sizes = [0]
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets[-1] and sizes[-1] + nbytes > bucket_bytes:
            buckets.append([])
            sizes.append(0)
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {dtype} is not streamed (float32, float16 and bfloat16 are)")
        buckets[-1].append(TensorSlot(name=name, dtype=dtype, shape=list(tensor.shape), offset=sizes[-1]))
        sizes[-1] += -(-nbytes // ALIGN) * ALIGN
    return buckets, sizes


def pack(tensors: dict[str, torch.Tensor], slots: list[TensorSlot], size: int, device="cpu",
         out: torch.Tensor | None = None) -> torch.Tensor:
    """One bucket's bytes (uint8), in `out` if given (zeroed, `size` bytes)."""
    buffer = torch.zeros(size, dtype=torch.uint8, device=device) if out is None else out
    for slot in slots:
        flat = tensors[slot.name].detach().contiguous().view(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + flat.numel()].copy_(flat)
    return buffer


def unpack(buffer: torch.Tensor, slots: list[TensorSlot]) -> list[tuple[str, torch.Tensor]]:
    """The named tensors of a bucket, as views of its bytes (no copy)."""
    named = []
    for slot in slots:
        dtype = _DTYPES[slot.dtype]
        count = 1
        for dim in slot.shape:
            count *= dim
        nbytes = count * torch.tensor([], dtype=dtype).element_size()
        named.append((slot.name, buffer[slot.offset : slot.offset + nbytes].view(dtype).view(slot.shape)))
    return named


def digest(buffer: torch.Tensor) -> str:
    return hashlib.sha256(buffer.cpu().numpy().data).hexdigest()  # hashlib releases the GIL on large buffers


# -- the group ------------------------------------------------------------------------------------------------
def join(store: dist.Store, group: str, rank: int, world_size: int, backend: str, timeout_s: float,
         join_timeout_s: float):
    """This process's handle on the round's process group, once every rank came (DistStoreError after
    `join_timeout_s`); `timeout_s` bounds each operation after (the group's own timeout, which would also bound the
    rendezvous: hence the wait for every rank first)."""
    timeout = timedelta(seconds=timeout_s)
    round_store = dist.PrefixStore(f"dapo-broadcast/{group}", store)
    round_store.set(f"joined/{rank}", "1")  # who came, for the learner's account of a failed round
    round_store.wait([f"joined/{r}" for r in range(world_size)], timedelta(seconds=join_timeout_s))
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A round's failure is the round's, not the process's: NCCL's default on a timeout or a dead peer tears the
        # whole process down (the learner, or every engine's workers), where the files would bring the version.
        # CleanUpOnly aborts the round's communicators and raises in the wait. Read when the group is made.
        with _NCCL_ENV_LOCK:
            before = os.environ.get(NCCL_ERROR_HANDLING)
            os.environ[NCCL_ERROR_HANDLING] = NCCL_CLEAN_UP_ONLY
            try:
                return dist.ProcessGroupNCCL(round_store, rank, world_size, options)
            finally:
                if before is None:
                    os.environ.pop(NCCL_ERROR_HANDLING, None)
                else:
                    os.environ[NCCL_ERROR_HANDLING] = before
    return dist.ProcessGroupGloo(round_store, rank, world_size, timeout)


NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
NCCL_CLEAN_UP_ONLY = "2"  # (3, SkipCleanUp, torch's default, and 1, TearDown, end the process)
_NCCL_ENV_LOCK = threading.Lock()


def store_client(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)


_COMMIT_MAX = 64 << 20  # bytes: a commit holds a digest per bucket (about 70 bytes each)
HOP_FLOOR_BPS = 100e6  # bytes/s: the slowest link a bucket is allowed to cross the chain at (most are 10x faster)


def relay(pg, rank: int, world_size: int, sizes: list[int], timeout_s: float, device="cpu",
          on_bucket=None) -> tuple[list[torch.Tensor], bytes]:
    """A receiving rank's part of the chain: take each bucket from rank - 1, hand it on to rank + 1 while taking
    the next, then the commit. Returns the buckets and the commit's bytes. A successor that fails or hangs only
    stops the forwarding: each hand-on is posted at once (every bucket stays in memory until the round ends
    anyway) and waited for at the end, so this rank never stops receiving, and it and those before it still get
    the version. Each wait is bounded by `timeout_s`; the first also allows bucket 0's transfer at HOP_FLOOR_BPS
    over each of the `rank - 1` hops before the previous rank (a hung rank up the chain holds this one no longer)."""
    timeout = timedelta(seconds=timeout_s)
    forward = rank + 1 < world_size
    buckets: list[torch.Tensor] = []
    sends = []

    def hand_on(tensor: torch.Tensor, tag: int) -> None:
        nonlocal forward
        if not forward:
            return
        try:
            sends.append(pg.send([tensor], rank + 1, tag))
        except Exception as err:
            log.warning("broadcast: rank %d cannot hand on to rank %d (%s); receiving on", rank, rank + 1, err)
            forward = False

    for tag, size in enumerate(sizes):
        bucket = torch.empty(size, dtype=torch.uint8, device=device)
        hops = timedelta(seconds=(rank - 1) * size / HOP_FLOOR_BPS) if tag == 0 else timedelta(0)
        pg.recv([bucket], rank - 1, tag).wait(timeout + hops)
        hand_on(bucket, tag)
        buckets.append(bucket)
        if on_bucket is not None:
            on_bucket(tag, bucket)
    length = torch.empty(1, dtype=torch.int64, device=device)
    pg.recv([length], rank - 1, len(sizes)).wait(timeout)
    if not 0 < int(length.item()) <= _COMMIT_MAX:  # the previous rank's word (any generator): bound what it costs
        raise ConnectionError(f"a commit of {int(length.item())} bytes (at most {_COMMIT_MAX})")
    hand_on(length, len(sizes))
    commit = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    pg.recv([commit], rank - 1, len(sizes) + 1).wait(timeout)
    hand_on(commit, len(sizes) + 1)
    deadline = time.monotonic() + timeout_s  # one for them all: a successor that hangs costs one timeout
    for send in sends if forward else []:
        try:
            send.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))
        except Exception as err:
            log.warning("broadcast: rank %d could not hand everything on to rank %d: %s", rank, rank + 1, err)
            break
    return buckets, commit.cpu().numpy().tobytes()


# -- nearby receivers: sealed memory instead of the chain ---------------------------------------------------------
# On the learner's host every hop of the chain would copy each byte into the kernel and out again, on the same cores
# (NCCL takes shared memory or P2P within a node for the same reason; gloo has only TCP). A receiver there is
# handed each bucket as a memfd instead: the learner packs the bucket into it once and seals it (F_SEAL_WRITE: no
# process can change its bytes after), and every receiver maps it: sealed bytes are as good as a copy of its own,
# so there is none (one copy of the version in memory for every engine on the host, until they have loaded it).
# The fd comes over the round's abstract unix socket, from the learner's pid (the signed round names it;
# SO_PEERCRED shows it), so a sealed bucket needs no digest: nothing on the way can alter it. The learner serves
# only its own user with the round's token (which only readers of the weights channel have).
SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
_CREDENTIALS = struct.Struct("3i")  # SO_PEERCRED: pid, uid, gid
_COMMIT_PIECE = 1 << 15  # bytes per message: well under any socket's send buffer, whatever the commit's size


def host_identity() -> str:
    """The same for two processes that can pass fds over an abstract unix socket and check each other's pid and
    uid: the same kernel (boot id), network, pid and user namespaces, and uid (the learner serves only its own)
    ("" where that cannot be read)."""
    try:
        boot = open("/proc/sys/kernel/random/boot_id").read().strip()
        namespaces = [str(os.stat(f"/proc/self/ns/{ns}").st_ino) for ns in ("net", "pid", "user")]
        return "/".join([boot, *namespaces, str(os.getuid())])
    except OSError:
        return ""


HOST = host_identity()


def _peer(conn: socket.socket) -> tuple[int, int]:
    pid, uid, _ = _CREDENTIALS.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
    return pid, uid


def sealed_bucket(size: int, fill) -> int:
    """A memfd of `size` bytes that `fill(uint8 tensor)` wrote, sealed against any change: its fd."""
    fd = os.memfd_create("dapo-weights-bucket", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        if size:
            with mmap.mmap(fd, size) as view:
                target = torch.frombuffer(view, dtype=torch.uint8)
                fill(target)
                del target  # the mapping must be gone before F_SEAL_WRITE
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_sealed(fd: int, size: int) -> torch.Tensor:
    """A sealed bucket as this process's own tensor, without a copy: a private mapping of the memfd (its pages
    shared with every other receiver until one writes; a write stays private), every page mapped now so that
    the engine's load does not fault them in. ValueError if the fd is not sealed or not `size` bytes."""
    if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
        raise ValueError("a bucket came unsealed: its bytes could still change")
    if os.fstat(fd).st_size != size:
        raise ValueError(f"a bucket of {os.fstat(fd).st_size} bytes where the round says {size}")
    if not size:
        return torch.empty(0, dtype=torch.uint8)
    bucket = torch.frombuffer(mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE),
                              dtype=torch.uint8)  # holds the mapping for as long as the tensor lives
    bucket[:: mmap.PAGESIZE].sum()  # a read per page: mapped now, in the receiving thread, not at load
    return bucket


def take_handoff(announcement: WeightsBroadcast, member: str, worker: int) -> tuple[list[torch.Tensor], bytes]:
    """A nearby receiving worker's round: every bucket from the learner's socket, mapped from its sealed memfd as
    it comes, then the commit. ConnectionError when the socket is not the learner's or the round ends early."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as conn:
        conn.settimeout(announcement.join_timeout_s)
        conn.connect("\0" + announcement.handoff)
        if (pid := _peer(conn)[0]) != announcement.learner_pid:
            raise ConnectionError(f"the round's socket is served by pid {pid}, not the learner's "
                                  f"({announcement.learner_pid})")
        conn.sendall(json.dumps({"token": announcement.handoff_token, "member": member, "worker": worker}).encode())
        buckets = []
        for index, size in enumerate(announcement.bucket_bytes):
            # the first bucket may wait for the chain's join, when there is a chain
            conn.settimeout(announcement.timeout_s + (announcement.join_timeout_s if index == 0 else 0))
            message, fds, flags, _ = socket.recv_fds(conn, 8, 1)
            try:
                if flags & socket.MSG_CTRUNC:  # the kernel dropped the fd: this process is out of them
                    raise ConnectionError(f"bucket {index}'s fd did not fit: this process is at its open-file limit")
                if message != struct.pack("!Q", index) or len(fds) != 1:
                    raise ConnectionError(f"the learner ended the round before bucket {index}")
                buckets.append(map_sealed(fds[0], size))
            finally:
                for fd in fds:
                    os.close(fd)
        commit = _take_commit(conn)
        conn.sendall(b"ok")  # the learner counts this worker as served
    return buckets, commit


def _take_commit(conn: socket.socket) -> bytes:
    """The commit, as `Handoff` sends it: its length, then pieces (one message could not hold a large one)."""
    header = conn.recv(8)
    if len(header) != 8:
        raise ConnectionError("the learner ended the round before its commit")
    (length,) = struct.unpack("!Q", header)
    if length > _COMMIT_MAX:
        raise ConnectionError(f"a commit of {length} bytes (at most {_COMMIT_MAX})")
    pieces, taken = [], 0
    while taken < length:
        if not (piece := conn.recv(_COMMIT_PIECE)):
            raise ConnectionError("the learner ended the round inside its commit")
        pieces.append(piece)
        taken += len(piece)
    return b"".join(pieces)


class Handoff:
    """The learner's side of a round's nearby receivers: a thread accepts their connections on the round's abstract
    socket (own user, the round's token, an expected worker, once each) and hands each every bucket as soon as it
    is sealed, then the commit. `finish` says who was not served."""

    def __init__(self, name: str, token: str, expected: dict[str, int], buckets: int, timeout_s: float,
                 join_timeout_s: float):
        self.name, self.token, self.buckets, self.timeout_s = name, token, buckets, timeout_s
        self.expected = {(member, worker) for member, workers in expected.items() for worker in range(workers)}
        self.fds: list[int] = []
        self.commit: bytes | None = None
        self.closed = False
        self.claimed: set[tuple[str, int]] = set()  # a receiver that showed the token is being served
        self.ended: set[tuple[str, int]] = set()  # ... and its service ended, served or not
        self.served: set[tuple[str, int]] = set()
        self.changed = threading.Condition()
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.server.bind("\0" + name)  # OSError if taken: the round's name is new, so someone squats it
        self.server.listen(64)
        self.server.settimeout(0.2)
        self.join_deadline = time.monotonic() + join_timeout_s
        threading.Thread(target=self._accept, name="weights-handoff", daemon=True).start()

    def _accept(self) -> None:
        # A bounded number of connections: whoever else connects costs a thread until its hello times out.
        budget = 4 * len(self.expected) + 8
        while not self.closed and time.monotonic() < self.join_deadline and len(self.claimed) < len(self.expected) \
                and budget > 0:
            try:
                conn, _ = self.server.accept()
            except TimeoutError:
                continue
            except OSError:  # out of fds, say: not a reason to spin
                time.sleep(0.05)
                continue
            if _peer(conn)[1] != os.getuid():  # any user can see the name: others cost no budget and no thread
                conn.close()
                continue
            budget -= 1
            threading.Thread(target=self._serve, args=(conn,), name="weights-handoff-to", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        who = None
        with conn:
            try:
                conn.settimeout(max(self.join_deadline - time.monotonic(), 0.1))
                hello = json.loads(conn.recv(1024) or b"null")
                if not hmac.compare_digest(str(hello["token"]), self.token):
                    raise PermissionError("not the round's token")
                with self.changed:
                    if (hello["member"], hello["worker"]) not in self.expected - self.claimed:
                        raise PermissionError(f"{hello['member']!r} worker {hello['worker']!r} is not a receiver of "
                                              "this round, or came twice")
                    who = (hello["member"], hello["worker"])
                    self.claimed.add(who)
                conn.settimeout(self.timeout_s)
                if self._hand_over(conn) and conn.recv(8) == b"ok":
                    with self.changed:
                        self.served.add(who)
            except (OSError, ValueError, KeyError, TypeError, PermissionError, RecursionError) as err:
                log.warning("broadcast: a nearby receiver was not served: %s", err)
            finally:
                if who is not None:
                    with self.changed:
                        self.ended.add(who)
                        self.changed.notify_all()

    def _hand_over(self, conn: socket.socket) -> bool:
        """Every bucket's fd as it is sealed, then the commit; False if the round ended first."""
        for index in range(self.buckets):
            with self.changed:  # a copy of the fd taken under the lock (`close` closes them under it) ...
                wait = self.timeout_s + max(self.join_deadline - time.monotonic(), 0) if index == 0 else self.timeout_s
                self.changed.wait_for(lambda: self.closed or len(self.fds) > index, wait)
                if self.closed or len(self.fds) <= index:
                    return False
                fd = os.dup(self.fds[index])
            try:  # ... and sent outside it: a receiver slow to read holds up no one else
                socket.send_fds(conn, [struct.pack("!Q", index)], [fd])
            finally:
                os.close(fd)
        with self.changed:
            self.changed.wait_for(lambda: self.closed or self.commit is not None, self.timeout_s)
            if self.closed or self.commit is None:
                return False
        conn.sendall(struct.pack("!Q", len(self.commit)))
        for start in range(0, len(self.commit), _COMMIT_PIECE):
            conn.sendall(self.commit[start:start + _COMMIT_PIECE])
        return True

    def add(self, fd: int) -> None:
        with self.changed:
            self.fds.append(fd)
            self.changed.notify_all()

    def finish(self, commit: bytes) -> list[str]:
        """Hand every receiver the commit, then wait until each took it, or the join window passed and every one
        that came was served or failed (at most the join timeout and one `timeout_s`); the members not served."""
        deadline = max(self.join_deadline, time.monotonic()) + self.timeout_s
        with self.changed:
            self.commit = commit
            self.changed.notify_all()
            while not (self.served >= self.expected
                       or (time.monotonic() >= self.join_deadline and self.ended >= self.claimed)):
                if time.monotonic() >= deadline:
                    break
                self.changed.wait(0.05)
        return sorted({member for member, _ in self.expected - self.served})

    def close(self) -> None:
        with self.changed:
            self.closed = True
            for fd in self.fds:
                os.close(fd)
            self.fds = []
            self.changed.notify_all()
        self.server.close()


@dataclass
class Receipt:
    """What a receiving worker staged: the buckets, the digests it computed (by bucket index), the commit."""

    buckets: list[torch.Tensor]
    digests: dict[int, str]
    commit: str
    seconds: float


def receive(announcement: WeightsBroadcast, host: str, member: str, worker: int = 0, device="cpu") -> Receipt:
    """A receiving worker's whole round (`worker` of generator `member`'s engine): nearby, the sealed buckets;
    else join the chain, relay, and hash what `verify` asks for (random buckets for sampled)."""
    started = time.perf_counter()
    if member in announcement.nearby:
        buckets, commit = take_handoff(announcement, member, worker)
        return Receipt(buckets, {}, commit.decode(), time.perf_counter() - started)
    rank = announcement.ranks[member] + worker
    count = len(announcement.bucket_bytes)
    if announcement.verify == "full":
        hashed = set(range(count))
    elif announcement.verify == "sampled":
        hashed = set(random.SystemRandom().sample(range(count), max(1, count // SAMPLED_SHARE)))
    else:
        hashed = set()
    digests: dict[int, str] = {}
    store = store_client(host, announcement.port, announcement.join_timeout_s)
    pg = join(store, announcement.group, rank, announcement.world_size, announcement.backend, announcement.timeout_s,
              announcement.join_timeout_s)

    def check(index: int, bucket: torch.Tensor) -> None:
        if index in hashed:
            digests[index] = digest(bucket)

    buckets, commit = relay(pg, rank, announcement.world_size, announcement.bucket_bytes, announcement.timeout_s,
                            device, on_bucket=check)
    return Receipt(buckets, digests, commit.decode(), time.perf_counter() - started)


def commit_refusal(announcement: WeightsBroadcast, commit_json: str, digests: dict[int, str], keyring,
                   channel: str) -> str | None:
    """Why a receiver must not serve what it staged (None: it may): the commit is not the learner's for this
    round, or a bucket it hashed differs from the committed digest."""
    try:
        commit = BroadcastCommit.model_validate_json(commit_json)
    except ValueError as err:
        return f"malformed commit: {err}"
    if refusal := announcement_refusal(commit, keyring, round_context(channel)):
        return refusal
    if (commit.version, commit.group) != (announcement.version, announcement.group):
        return f"the commit is for v{commit.version} round {commit.group}, not this round"
    if announcement.verify != "off" and announcement.ranks and len(commit.digests) != len(announcement.bucket_bytes):
        return f"the commit has {len(commit.digests)} digests for {len(announcement.bucket_bytes)} buckets"
    if bad := [i for i, hexdigest in digests.items() if commit.digests[i] != hexdigest]:
        return f"digest mismatch in bucket(s) {bad[:5]}: bytes changed on the way"
    return None


# -- the learner's side ---------------------------------------------------------------------------------------
@dataclass
class RoundResult:
    version: int
    members: list[str]
    nearby: list[str] = field(default_factory=list)  # those that took sealed memory, not the chain
    failed: list[str] = field(default_factory=list)
    seconds: float = 0.0
    bytes_sent: int = 0
    error: str | None = None

    def figures(self) -> dict[str, float]:
        """For the learner's step record; a failed round counts at least one failed member."""
        failed = max(len(self.failed), 1 if self.error else 0)
        return {"broadcast_seconds": self.seconds, "broadcast_members": len(self.members),
                "broadcast_nearby": len(self.nearby), "broadcast_failed": failed, "broadcast_bytes": self.bytes_sent}


class Broadcaster:
    """Rank 0 of every round: hosts the rendezvous store, picks the members, streams the buckets, signs."""

    def __init__(self, settings, redis_client, signer, prefix: str, channel: str, backend: str | None = None):
        cfg = settings.weights
        self.redis = redis_client
        self.signer = signer
        self.channel = channel
        self.members_key = members_key(prefix)
        self.streamed_key = streamed_key(prefix)
        self.timeout_s = cfg.broadcast_timeout_s
        self.join_timeout_s = cfg.broadcast_join_timeout_s
        self.bucket_bytes = int(cfg.bucket_mb * 1024 * 1024)
        self.verify = cfg.verify
        self.take_nearby = cfg.broadcast_nearby
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = "cuda" if self.backend == "nccl" else "cpu"
        self.store = dist.TCPStore("0.0.0.0", cfg.broadcast_port, is_master=True, wait_for_workers=False,
                                   timeout=timedelta(seconds=self.join_timeout_s), use_libuv=True)
        self.port = self.store.port
        self.since: dict[str, float] = {}  # member -> its process's start, as the last `members` read it
        self.nearby: set[str] = set()  # members on this host (gloo): sealed memory, not the chain
        self.paused: dict[tuple[str, float], float] = {}  # (member, its process's start) -> when it may again
        self.joined: set[tuple[str, float]] = set()  # member processes seen joining a round: no newcomers
        self.newcomers: set[str] = set()  # this round's
        self.newcomers_from = float("-inf")  # monotonic time from which newcomers are taken again
        self.shuffler = random.Random()  # its own: rounds run beside training, whose seeded `random` they must not move
        self.last_group: str | None = None  # the round before, whose keys the store still holds
        # member id -> (its record's `at`, when this learner saw it renewed, when it first saw it): freshness by this
        # learner's clock, not by a comparison of two hosts' (`members`)
        self.renewals: dict[bytes | str, tuple[float, float, float]] = {}

    def members(self) -> dict[str, int]:
        """Fresh members not sitting out, newcomers within their bounds (module docstring): generator id -> its
        engine's workers. Drops stale ones. Fresh: renewed within MEMBER_TTL_S as this learner saw its record
        change (a generator's clock minutes off the learner's would be never a member, or one long after it died);
        a record first seen counts as renewed when it says, if that is within MEMBER_TTL_S of now."""
        now, clock = time.time(), time.monotonic()
        fresh, stale = {}, []
        self.since, self.nearby, self.newcomers = {}, set(), set()
        self.paused = {process: until for process, until in self.paused.items() if until > clock}
        listed = list((self.redis.hgetall(self.members_key) or {}).items())
        renewals: dict[bytes | str, tuple[float, float, float]] = {}
        self.shuffler.shuffle(listed)  # which newcomers a round takes: ids chosen to sort first keep no one out
        seen = set()
        for raw_id, raw in listed:
            try:  # any generator's word: an id that is no text is as stale as a record that is no record
                member = raw_id.decode() if isinstance(raw_id, bytes) else raw_id
                record = json.loads(raw)
                workers, at, since = int(record["workers"]), float(record["at"]), float(record["since"])
            except (ValueError, KeyError, TypeError, OverflowError):  # (UnicodeDecodeError is a ValueError)
                stale.append(raw_id)
                continue
            if not (math.isfinite(at) and math.isfinite(since)) or not 1 <= workers <= 64:
                stale.append(raw_id)
                continue
            known = self.renewals.get(raw_id)
            if known is None:
                known = (at, clock - max(0.0, now - at) if abs(now - at) <= MEMBER_TTL_S else -math.inf, clock)
            elif known[0] != at:
                known = (at, clock, known[2])
            renewals[raw_id] = known
            if clock - known[1] > MEMBER_TTL_S:  # not renewed lately: left out, dropped once seen that long
                if clock - max(known[1], known[2]) > MEMBER_TTL_S:
                    stale.append(raw_id)
                continue
            seen.add((member, since))
            if record.get("busy") is True or (member, since) in self.paused:
                continue
            if (member, since) not in self.joined:
                if clock < self.newcomers_from or len(self.newcomers) >= NEWCOMERS_PER_ROUND:
                    continue
                self.newcomers.add(member)
            fresh[member] = workers
            self.since[member] = since
            if self.take_nearby and self.backend == "gloo" and HOST and record.get("host") == HOST:
                self.nearby.add(member)
        self.renewals = {member: known for member, known in renewals.items() if member not in stale}
        if stale:
            self.redis.hdel(self.members_key, *stale)
        self.joined &= seen  # member processes no longer listed: gone
        return fresh

    def broadcast(self, tensors: dict[str, torch.Tensor], version: int) -> RoundResult | None:
        """Stream `tensors` (served dtype) to the members as `version`; None when there are none."""
        members = self.members()
        if not members:
            return None
        started = time.perf_counter()
        nearby = sorted(self.nearby & set(members))
        slots, sizes = layout(tensors, self.bucket_bytes)
        group = f"v{version}-{secrets.token_hex(6)}"
        token, handoff = secrets.token_hex(16), None
        try:
            handoff = Handoff(f"dapo-weights-{group}", token, {m: members[m] for m in nearby}, len(sizes),
                              self.timeout_s, self.join_timeout_s) if nearby else None
        except OSError as err:
            log.warning("broadcast: no nearby socket for v%d (%s): every member takes the chain", version, err)
            nearby = []
        ranks, world_size = {}, 1
        chain = sorted(members.items())
        self.shuffler.shuffle(chain)  # a new order each round: an id chosen to sort first is not every round's relay
        for member, workers in chain:
            if member not in nearby:
                ranks[member] = world_size
                world_size += workers
        announcement = sign_announcement(
            WeightsBroadcast(version=version, group=group, port=self.port, backend=self.backend,
                             world_size=world_size, ranks=ranks, buckets=slots, bucket_bytes=sizes,
                             nearby=nearby, handoff=handoff.name if handoff else "", handoff_token=token,
                             learner_pid=os.getpid(), verify=self.verify, timeout_s=self.timeout_s,
                             join_timeout_s=self.join_timeout_s),
            self.signer, round_context(self.channel),
        )
        result = RoundResult(version, sorted(members), nearby)
        # Recorded before any member can take it: a learner killed before the files and the announcement restarts
        # its versions after this one (generators ignore a round no newer than what they serve).
        self.redis.set(self.streamed_key, version)
        pg, chain_error = None, None
        try:
            self.redis.publish(self.channel, announcement.model_dump_json())
            if ranks:
                try:
                    pg = join(self.store, group, 0, world_size, self.backend, self.timeout_s, self.join_timeout_s)
                except Exception as err:  # the chain's fault: the nearby receivers are not in it
                    chain_error = err
            result.bytes_sent, commit, chain_error = self._stream(pg, handoff, tensors, announcement, chain_error)
            result.failed = handoff.finish(commit) if handoff else []
            if chain_error is not None:
                raise chain_error
        except Exception as err:
            result.error = f"{type(err).__name__}: {err}"
            absent = self._absent(group, ranks, members)
            if chain_error is not None and not absent:
                # Every worker came, yet the chain broke before rank 1 took the version: one that joined and then
                # did not build the group or take the stream (a worker that crashed, an address its peers cannot
                # reach, a member that only says it joined). Which cannot be told: the round's newcomers, else
                # every chained member, take the files for a while, rather than fail every round for all.
                absent = sorted(set(ranks) & self.newcomers) or sorted(ranks)
            result.failed = sorted({*result.failed, *absent})
            log.warning("broadcast of v%d failed (%s); %s get it through the files", version, result.error,
                        ", ".join(result.failed) or "those after the break")
        finally:
            if handoff is not None:
                handoff.close()
            self._forget_round(self.last_group)
            self.last_group = group
        for member in result.failed:
            self.paused[(member, self.since[member])] = time.monotonic() + MEMBER_PAUSE_S
        self.joined |= {(member, self.since[member]) for member in members if member not in result.failed}
        if self.newcomers & set(result.failed):
            self.newcomers_from = time.monotonic() + MEMBER_PAUSE_S
        result.seconds = time.perf_counter() - started
        return result

    def _commit(self, announcement: WeightsBroadcast, digests: list[str]) -> bytes:
        return sign_announcement(
            BroadcastCommit(version=announcement.version, group=announcement.group, digests=digests),
            self.signer, round_context(self.channel),
        ).model_dump_json().encode()

    def _stream(self, pg, handoff: Handoff | None, tensors: dict[str, torch.Tensor], announcement: WeightsBroadcast,
                chain_error: Exception | None) -> tuple[int, bytes, Exception | None]:
        """Every bucket packed once: sealed for the nearby receivers, sent down the chain (and hashed for the commit
        while on the wire) for the others. A chain that fails (`chain_error`, or a send) stops only the chain: the
        nearby receivers still get every bucket and a commit with every digest. The bytes sent, the signed commit
        and the chain's error."""
        timeout = timedelta(seconds=self.timeout_s)
        hashing = self.verify != "off" and bool(announcement.ranks)
        digests, sends, sent = [], [], 0

        def sealed(out: torch.Tensor, slots, size) -> None:
            pack(tensors, slots, size, out=out)
            if hashing:
                digests.append(digest(out))

        for tag, (slots, size) in enumerate(zip(announcement.buckets, announcement.bucket_bytes)):
            if pg is None or chain_error is not None:  # no chain (or no longer): packed straight into sealed memory
                if handoff is None:
                    break
                handoff.add(sealed_bucket(size, lambda out: sealed(out, slots, size)))
                sent += size
                continue
            bucket = pack(tensors, slots, size, self.device)
            try:
                sends.append(pg.send([bucket], 1, tag))
                while len(sends) > 2:
                    sends.pop(0).wait(timeout)
            except Exception as err:
                chain_error = err
            if handoff is not None:
                handoff.add(sealed_bucket(size, lambda out: out.copy_(bucket)))
            if hashing:
                digests.append(digest(bucket))  # while the bucket is on the wire
            sent += size
        commit = self._commit(announcement, digests)
        if pg is None or chain_error is not None:
            return sent, commit, chain_error
        try:
            payload = torch.frombuffer(bytearray(commit), dtype=torch.uint8).to(self.device)
            tag = len(announcement.bucket_bytes)
            sends.append(pg.send([torch.tensor([len(commit)], dtype=torch.int64, device=self.device)], 1, tag))
            sends.append(pg.send([payload], 1, tag + 1))
            for send in sends:
                send.wait(timeout)
        except Exception as err:
            chain_error = err
        return sent + len(commit), commit, chain_error

    def _forget_round(self, group: str | None) -> None:
        """A round's keys in the store (who joined, the group's rendezvous), once the next round is over: by then no
        rank far down the chain is still reading them; kept, they would stay as long as the learner, a few hundred
        bytes a rank each round."""
        if group is None:
            return
        prefix = f"dapo-broadcast/{group}/"
        try:
            for key in self.store.list_keys():
                if key.startswith(prefix):
                    self.store.delete_key(key)
        except Exception as err:  # a store that cannot list: the keys stay, nothing else is wrong
            log.warning("broadcast: the keys of round %s stay in the store (%s)", group, err)

    def _absent(self, group: str, ranks: dict[str, int], members: dict[str, int]) -> list[str]:
        """Members with a worker that never joined the round's group."""
        round_store = dist.PrefixStore(f"dapo-broadcast/{group}", self.store)
        return [member for member, first in ranks.items()
                if not round_store.check([f"joined/{rank}" for rank in range(first, first + members[member])])]


PROCESS_STARTED = time.time()  # tells a restarted generator from the one that failed a round under its id


def register_member(redis_client, prefix: str, generator_id: str, workers: int, host: str = HOST,
                    busy: bool = False) -> None:
    """Ask to be in the next rounds (renewed every heartbeat; MEMBER_TTL_S unrenewed and the learner drops it).
    `host`: where its engine's workers run (`host_identity`), for the learner to tell nearby ones; `busy`: loading a
    version from the files (it would not join: left out of rounds until it says otherwise, not paused)."""
    record = {"workers": workers, "at": time.time(), "since": PROCESS_STARTED, "host": host, "busy": busy}
    redis_client.hset(members_key(prefix), generator_id, json.dumps(record))


def leave(redis_client, prefix: str, generator_id: str) -> None:
    redis_client.hdel(members_key(prefix), generator_id)


def parse_round(raw: bytes | str, keyring, channel: str) -> WeightsBroadcast | None:
    """A round read from the weights channel, or None (logged) if it is malformed or not the learner's."""
    return read_announcement(WeightsBroadcast, raw, keyring, round_context(channel), "broadcast round")
