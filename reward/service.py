"""`dapo reward`: one process running the stream worker and the HTTP API over one verifier pool."""

from __future__ import annotations

import logging
import signal
import threading
import time

import uvicorn

from reward.app import create_reward_app
from reward.sandbox import VerifierPool
from reward.scoring import Scorer
from reward.worker import RewardWorker
from services.config import Settings
from services.http import Server, server_options
from services.keys import load_signer
from services.redis_local import connect, wait_for_redis
from services.startup import scrub_secret_environment
from services.streams import Streams

log = logging.getLogger(__name__)

STOP_REQUESTS_S = 5  # the HTTP requests in flight at a stop get this long (Kubernetes' grace for the pod: 30 s)


def main(settings: Settings) -> int:
    """`dapo reward`: Redis is checked before the verifier processes start; until the HTTP server runs a signal
    stops it at once (`services.startup`), then it stops the worker and the pool in order."""
    load_signer(settings, "reward")  # its key first: a missing one fails before anything starts
    scrub_secret_environment()  # the settings hold them now; the verifier processes inherit none
    wait_for_redis(settings)
    cfg = settings.reward
    pool = VerifierPool.from_config(cfg)
    log.info("reward: starting %d verifier processes (answer rule %s)", cfg.workers, cfg.answer_rule)
    try:
        return serve(settings, pool.start())
    finally:
        pool.close()


def serve(settings: Settings, pool: VerifierPool) -> int:
    """The stream worker in a thread and the HTTP API in this one, until SIGTERM or SIGINT."""
    cfg = settings.reward
    if pool.broken:
        log.error("reward: %s", pool.broken)
        return 1
    scorer = Scorer(pool, cfg)
    worker = RewardWorker(settings, scorer, Streams(connect(settings), settings, signs_as=("reward",)))
    ended: list[BaseException] = []  # what ended the stream worker (its key retired, say): the process's end too

    def work() -> None:
        try:
            worker.run()
        except BaseException as err:
            ended.append(err)
            server.should_exit = True

    thread = threading.Thread(target=work, name="reward-worker", daemon=True)

    def ready() -> tuple[bool, str]:
        if pool.broken:
            return False, pool.broken
        if not thread.is_alive():
            return False, "stream worker stopped"
        stale = time.monotonic() - worker.last_poll
        if worker.last_poll == 0.0 or stale > max(30.0, 4 * settings.streams.block_ms / 1000):
            return False, "stream worker has not reached Redis recently"
        return True, f"{pool.ready_workers()}/{pool.size} verifier processes, {worker.groups_done} groups scored"

    app = create_reward_app(settings, scorer, ready=ready)
    # The worker stops claiming groups at the signal, not once uvicorn has drained the requests in flight (a
    # /v1/score of many items): the groups it claimed meanwhile were killed with the pod, and waited out the
    # visibility timeout. Requests in flight are cancelled after STOP_REQUESTS_S (a batch already in the verifier
    # pool still ends first).
    server = Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level="warning",
                                   timeout_graceful_shutdown=STOP_REQUESTS_S, **server_options(settings)),
                    on_exit=worker.stop)
    thread.start()

    # uvicorn handles SIGTERM/SIGINT while it serves, then re-raises the signal to the handler that was there
    # before; with the default handler that would kill us before the worker and the pool are stopped.
    def on_signal(signum, frame) -> None:
        log.info("reward: signal %d, stopping", signum)
        worker.stop()
        server.should_exit = True

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    log.info("reward service on %s:%d (%d verifier processes)", cfg.host, cfg.port, cfg.workers)
    try:
        if not worker.stopping:
            server.run()  # returns on SIGTERM / SIGINT
    finally:
        worker.stop()
        thread.join(timeout=settings.streams.block_ms / 1000 + cfg.timeout_s + 5)
    if ended:
        raise ended[0]
    return 0
