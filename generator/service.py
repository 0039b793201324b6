"""`dapo generator`: the rollout worker on a vLLM engine, with its HTTP app.

Endpoints (besides /healthz, /readyz, /metrics from services.http):
    POST /v1/weights/sync     pull and load the latest announced version now (bearer token); answers once the
                              new version serves, or with the reason it was refused (old version still serving)
    GET  /v1/weights/version  the version served, its sha256, the newest announced, in-flight tasks

Threads: the engine and the rollout loop own the main thread (vLLM is driven from one thread; signals land
there); uvicorn serves HTTP from a second thread and talks to the loop only through thread-safe calls.
"""

from __future__ import annotations

import concurrent.futures
import logging
import signal
import threading
import time
from typing import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from services.config import Settings
from services.http import BackgroundServer, callers, create_app, server_options
from services.keys import load_signer
from services.messages import PromptTask
from services.models import model_dir
from services.redis_local import connect, wait_for_redis
from services.startup import raise_stopped
from services.streams import Streams, consumer_name

log = logging.getLogger(__name__)

UPSTREAM_REASONS = {"unauthorized", "http", "unreachable", "not_found"}  # the learner's side refused or failed
OWN_REASONS = {"reload", "error"}  # this generator failed (its engine, its disk) on weights that checked out


def sync_status_code(reason: str | None) -> int:
    """HTTP status for a sync outcome: 200 done, 404 nothing announced, 502 learner side, 500 this generator
    failed, 503 it is stopping, 422 the weights were refused (checksum, shape, format, untrusted URL)."""
    if reason is None:
        return 200
    if reason == "none":
        return 404
    if reason in ("stopped", "cancelled"):
        return 503
    if reason in OWN_REASONS:
        return 500
    return 502 if reason in UPSTREAM_REASONS else 422


def build_app(settings: Settings, get_worker: Callable[[], "object | None"]) -> FastAPI:
    """The generator's HTTP app; `get_worker()` is None while the engine starts."""

    def ready() -> tuple[bool, str]:
        worker = get_worker()
        return worker.readiness() if worker is not None else (False, "starting the engine")

    app = create_app("generator", token=callers(settings), ready=ready,
                     max_body_bytes=int(settings.max_body_mb * 2**20), docs=settings.http_docs)

    @app.post("/v1/weights/sync", tags=["weights"])
    def sync_now():
        worker = get_worker()
        if worker is None:
            return JSONResponse({"error": "engine still starting"}, status_code=503)
        future = worker.request_sync()
        try:
            outcome = future.result(timeout=settings.generator.pull_timeout_s + 300)
        except concurrent.futures.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            return JSONResponse({"status": "in progress", "version": worker.version}, status_code=202)
        body = {
            "version": outcome.version,
            "previous": outcome.previous,
            "changed": outcome.changed,
            "seconds": round(outcome.seconds, 4),
        }
        if outcome.error:
            body.update(error=outcome.error, reason=outcome.reason)
        return JSONResponse(body, status_code=sync_status_code(outcome.reason))

    @app.get("/v1/weights/version", tags=["weights"])
    def version() -> dict:
        worker = get_worker()
        if worker is None:
            return {"version": None, "status": "starting the engine"}
        return worker.describe()

    return app


def generator_id(settings: Settings) -> str:
    return settings.generator.id or consumer_name("generator")


def hand_back_previous(client, settings: Settings, name: str) -> int:
    """Tasks a dead generator of this name held: handed back now, before this one's engine starts (a minute or
    more), so a live generator serves them at once instead of after the visibility timeout. The launcher and a
    pod keep the name across restarts; a delivery is counted either way (reclaimed here, or recovered later)."""
    handed = Streams(client, settings, signs_as=("generator",)).stream("prompts", PromptTask).release_all(name)
    if handed:
        log.info("handed back %d tasks a previous %s held (to whichever generator is up first)", handed, name)
    return handed


def engine_start_hung(seconds: float) -> None:
    from generator.worker import exit_stalled  # (imported with the engine: loaded by now)

    log.critical("the engine has not started in %.0fs (generator.stall_timeout_s): exiting, for a fresh start", seconds)
    exit_stalled(seconds)


def main(settings: Settings) -> int:
    """`dapo generator`. Until the engine is up a signal stops it at once (`services.startup`); then the first one
    lets in-flight tasks finish (generator.shutdown_grace_s), a second one stops at once."""
    load_signer(settings, "generator")  # its key first: a missing one fails before anything starts
    folder = model_dir(settings)  # the dependencies first: fail in a second, not after loading vLLM
    wait_for_redis(settings)
    name = generator_id(settings)
    client = connect(settings)
    hand_back_previous(client, settings, name)  # before importing vLLM and starting its engine: minutes when loaded

    from generator.engine import VllmEngine
    from generator.sync import WeightSync
    from generator.worker import RolloutWorker

    holder: dict = {"worker": None}
    stopping = threading.Event()

    def on_signal(signum, frame):
        worker = holder["worker"]
        if worker is None:
            raise_stopped(signum, frame)
        log.info("signal %s: %s", signum, "stopping" if not stopping.is_set() else "stopping now")
        worker.stop(hard=stopping.is_set())
        stopping.set()

    app = build_app(settings, lambda: holder["worker"])
    http = BackgroundServer(app, settings.generator.host, settings.generator.port,
                            **server_options(settings)).start(wait_s=30)  # port taken: fail now

    engine = None
    try:
        sync = WeightSync(settings, folder, client, name)
        # An engine whose start hangs (NCCL among its workers, a stuck read of the model) held its GPUs for ever:
        # the stall bound covers its start too (it holds no task yet: nothing to hand back)
        starting = threading.Timer(settings.generator.stall_timeout_s, engine_start_hung,
                                   (settings.generator.stall_timeout_s,))
        starting.daemon = True
        starting.start()
        try:
            engine = VllmEngine(folder, settings)
        finally:
            starting.cancel()
        worker = RolloutWorker(settings, engine, Streams(client, settings, signs_as=("generator",)), sync, name)
        holder["worker"] = worker
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        log.info(
            "generator %s: engine up in %.1fs, HTTP on port %d", name, engine.start_seconds, settings.generator.port
        )
        worker.run()
    finally:
        http.stop()
        if engine is not None:
            engine.shutdown()
    return 0


def wait_ready(url: str, timeout: float) -> bool:
    """Poll a service's /readyz until it answers 200 (tests, launcher)."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False
