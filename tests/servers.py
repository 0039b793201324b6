"""Test helpers: a real uvicorn server on a free local port, in a thread."""

from __future__ import annotations

from services.config import Settings
from services.http import BackgroundServer, free_port

__all__ = ["ServerThread", "free_port"]


class ServerThread(BackgroundServer):
    """`with ServerThread(app) as server:` serves `app` on 127.0.0.1 at `server.url` until the block ends."""

    def __init__(self, app, limit_concurrency: int = Settings.model_fields["http_max_connections"].default, **config):
        super().__init__(app, "127.0.0.1", free_port(), limit_concurrency=limit_concurrency, **config)

    def __enter__(self) -> "ServerThread":
        return self.start(wait_s=10)

    def __exit__(self, *exc) -> None:
        self.stop()
