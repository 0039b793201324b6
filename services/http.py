"""The HTTP shell every service uses: health, readiness, metrics, bearer token, body limit, JSON errors.

The bearer token is checked by `BearerGate`, a pure ASGI middleware in front of everything else, on the request's
headers alone: a request without the token is answered 401 (403 with a wrong one) before a byte of its body is
read or parsed. Every path needs it except the probes and the scrape (`OPEN_PATHS`: `/healthz`, `/readyz`, and
`/metrics`, which Prometheus scrapes without credentials; it carries counters, no secret), and `/docs` and
`/openapi.json`, which exist only when asked for (`http_docs`). Read-only endpoints such as the learner's
`/v1/status` and a generator's `/v1/weights/version` take the token too: they describe the run to whoever asks.
The probes are async and `/readyz` runs its check on threads of its own (a limiter apart from the shared one), so
neither waits for the worker threads that synchronous handlers hold. uvicorn answers 503 above
`http_max_connections` connections, and a connection that has not sent a whole request head within
`http_head_timeout_s`, or whose request body stops that long, is closed, as is one beyond
`http_max_connections_per_client` from one address (`guarded_protocol`), so neither idle half-open connections nor
one client can keep the probes out.
With `http_tls_certfile` (and its key) every service serves HTTPS (`server_options`), its TLS handshakes held to
the same deadline (`Server`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import ipaddress
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Callable

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from services import metrics as _metrics  # noqa: F401  (registers every dapo_* metric)
from services.config import DEFAULT_TOKEN, ConfigError, Settings, digest_of_token

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})  # no token: probes and the Prometheus scrape
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/openapi.json"})  # served (open) only with http_docs


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (`localhost`, 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


MIN_TOKEN_CHARS = 24  # and MIN_TOKEN_DISTINCT different characters: a random token has them, a word does not
MIN_TOKEN_DISTINCT = 8


def check_token(token: str, host: str, variable: str = "DAPO_TOKEN") -> None:
    """Refuse to serve on a reachable address with the presets' placeholder token (anyone could change state) or a
    weak one that a client on the network can guess (the token guards the weights and every endpoint that changes
    state; the wire's signatures use the role keys of services/keys.py, not the token)."""
    if is_loopback(host):
        return
    if token == DEFAULT_TOKEN:
        raise ConfigError(
            f"refusing to listen on {host} with the default token {DEFAULT_TOKEN!r}: set {variable} "
            "(or bind to 127.0.0.1)"
        )
    if len(token) < MIN_TOKEN_CHARS or len(set(token)) < MIN_TOKEN_DISTINCT:
        raise ConfigError(
            f"refusing to listen on {host} with a weak token ({len(token)} characters, {len(set(token))} different; "
            f"at least {MIN_TOKEN_CHARS} and {MIN_TOKEN_DISTINCT}): set {variable} to e.g. $(openssl rand -hex 32) "
            "(or bind to 127.0.0.1)"
        )


def check_tokens(settings: Settings, host: str) -> None:
    """`check_token` on every token a service admits: the operator's (given as its sha256 alone, only the
    placeholder's digest can be refused) and the weights token."""
    if settings.token_sha256 is None:
        check_token(settings.token.get_secret_value(), host)
    elif not is_loopback(host) and hmac.compare_digest(settings.token_sha256.get_secret_value(),
                                                        digest_of_token(DEFAULT_TOKEN)):
        raise ConfigError(f"refusing to listen on {host} with the default token {DEFAULT_TOKEN!r} (its sha256 in "
                          "DAPO_TOKEN_SHA256)")
    if settings.weights_token is not None:
        check_token(settings.weights_token.get_secret_value(), host, "DAPO_WEIGHTS_TOKEN")


@dataclass(frozen=True)
class Caller:
    """A token a service accepts, known by its sha256 (the service need not hold the token itself), and the path
    prefix it opens to GET requests; `opens` None: every path and method (the operator)."""

    digest: bytes
    opens: str | None = None

    @classmethod
    def of(cls, token: str, opens: str | None = None) -> "Caller":
        return cls(bytes.fromhex(digest_of_token(token)), opens)


WEIGHTS_PATHS = "/v1/weights/"  # what `weights_token` opens on the learner


def callers(settings: Settings, weights_readers: bool = False) -> tuple[Caller, ...]:
    """Whom a service admits: the operator (by `token_sha256` where the service was given only that, else by
    `token`) and, on the learner (`weights_readers`), the holders of `weights_token`, to the weights only."""
    operator = (Caller(bytes.fromhex(settings.token_sha256.get_secret_value())) if settings.token_sha256
                else Caller.of(settings.token.get_secret_value()))
    if weights_readers and settings.weights_token is not None:
        return operator, Caller.of(settings.weights_token.get_secret_value(), WEIGHTS_PATHS)
    return (operator,)


def token_refusal(authorization: bytes | None, admitted: str | tuple[Caller, ...], method: str = "GET",
                  path: str = "/") -> tuple[int, str] | None:
    """Why an `Authorization` header value does not admit `method path`: (401, reason) without a bearer token,
    (403, reason) with a token no caller holds or one that does not open the path; None when it does (the token
    given as is, or the `Caller`s; constant-time comparisons of sha256 digests)."""
    scheme, _, credentials = (authorization or b"").partition(b" ")
    if scheme.lower() != b"bearer" or not credentials.strip():
        return 401, "missing bearer token"
    callers_ = (Caller.of(admitted),) if isinstance(admitted, str) else admitted
    digest = hashlib.sha256(credentials.strip()).digest()
    matches = [caller for caller in callers_ if hmac.compare_digest(digest, caller.digest)]
    if not matches:
        return 403, "wrong bearer token"
    if any(c.opens is None or (method in ("GET", "HEAD") and path.startswith(c.opens)) for c in matches):
        return None
    return 403, f"this token opens only GET {matches[0].opens}..."


class BearerGate:
    """ASGI middleware: every HTTP request to a path outside `open_paths` needs a token the service admits
    (`callers`), checked on the headers before the application (or anything that reads the body) sees the
    request."""

    def __init__(self, app: ASGIApp, token: str | tuple[Caller, ...], open_paths: frozenset[str]):
        self.app, self.token, self.open_paths = app, token, open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            refusal = token_refusal(authorization, self.token, scope["method"], scope["path"])
            if refusal is not None:
                status, reason = refusal
                headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
                await JSONResponse({"error": reason}, status_code=status, headers=headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(
    name: str,
    *,
    token: str | tuple[Caller, ...],
    ready: Callable[[], tuple[bool, str]] = lambda: (True, "ready"),
    max_body_bytes: int = 64 * 1024 * 1024,
    docs: bool = False,
) -> FastAPI:
    """A FastAPI app with /healthz, /readyz and /metrics, JSON error bodies, a request body limit, and a bearer
    token required on every other path (`BearerGate`: the token, or the `callers` it admits); `/docs` and
    `/openapi.json` only with `docs`.

    `ready()` returns (is_ready, reason); /readyz answers 503 with the reason until it is ready.
    """
    app = FastAPI(title=f"dapo {name}", version="1", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    # /readyz runs the service's check on threads of its own: never behind handlers holding the shared ones.
    probe_threads = anyio.CapacityLimiter(2)

    @app.middleware("http")
    async def limit_body(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None:
            if not (length.isascii() and length.isdigit()):
                return JSONResponse({"error": "invalid Content-Length"}, status_code=400)
            if int(length) > max_body_bytes:
                return JSONResponse(
                    {"error": f"request body of {length} bytes exceeds the limit of {max_body_bytes}"},
                    status_code=413,
                )
        elif request.method in ("POST", "PUT", "PATCH"):
            # Chunked upload: read it here, bounded, so a handler never sees an unbounded body.
            body = bytearray()  # appended in place: `bytes +=` would copy the whole body at every chunk
            async for chunk in request.stream():
                body += chunk
                if len(body) > max_body_bytes:
                    return JSONResponse(
                        {"error": f"request body exceeds the limit of {max_body_bytes} bytes"}, status_code=413
                    )
            request._body = bytes(body)
        return await call_next(request)

    @app.exception_handler(StarletteHTTPException)  # FastAPI's HTTPException subclasses it
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        problems = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type", "")} for e in exc.errors()
        ]
        return JSONResponse({"error": "invalid request", "details": problems}, status_code=422)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)

    @app.get("/healthz", tags=["ops"])
    async def healthz() -> dict:
        return {"status": "ok", "service": name}

    @app.get("/readyz", tags=["ops"])
    async def readyz():
        ok, reason = await anyio.to_thread.run_sync(ready, limiter=probe_threads)
        return JSONResponse({"ready": ok, "reason": reason}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["ops"])
    def metrics() -> Response:
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # Added last, so it is the outermost of the app's middleware: before the body limit reads a chunked body.
    app.add_middleware(BearerGate, token=token, open_paths=OPEN_PATHS | (DOCS_PATHS if docs else frozenset()))
    return app


_handed_out: set[int] = set()  # free_port's answers so far in this process


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago, and not handed out before by this process:
    the kernel may offer one again once its socket is closed (two services of one `dapo run` on one port, about one
    launch in 2,000)."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _handed_out:
            if len(_handed_out) >= 10_000:  # a long-lived caller: the oldest answers are long in use or gone
                _handed_out.clear()
            _handed_out.add(port)
            return port


def server_options(settings: Settings) -> dict:
    """uvicorn's options from the settings: the connection limits, the deadline on request heads, and the
    certificate and key for HTTPS."""
    return dict(limit_concurrency=settings.http_max_connections, ssl_certfile=settings.http_tls_certfile,
                ssl_keyfile=settings.http_tls_keyfile,
                http=guarded_protocol(settings.http_head_timeout_s, settings.http_max_connections_per_client))


def guarded_protocol(head_timeout_s: float, per_client: int | None = None) -> type:
    """uvicorn's h11 protocol with two guards against slow or greedy clients (slowloris):

    - a deadline on every request's head: a connection that has not sent a whole head within `head_timeout_s` of
      opening, or of its last response, is closed. uvicorn starts no timer before a head is whole (its keep-alive
      timer stops at the first byte), so half-sent requests would hold the `http_max_connections` slots for ever
      and every request, the probes included, would be answered 503. The same deadline runs while a request's body
      is coming, again from each of its bytes: a body that stops (a chunked POST to /healthz that never sends a
      chunk, a client cut off mid-upload) held its connection for ever, the body limit bounding its size, not its
      time;
    - `per_client`: the connections one client address may hold open at once; a new one beyond is closed at once,
      so no single address can take every slot within a deadline either."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    open_by_address: dict[str, int] = {}  # one server's protocols share it (one event loop: no lock)

    class Guarded(H11Protocol):
        head_timeout = head_timeout_s
        _head_deadline = None
        _address = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._address = peer[0] if isinstance(peer, tuple) and peer else None
            if self._address is not None:
                open_by_address[self._address] = open_by_address.get(self._address, 0) + 1
                if per_client and open_by_address[self._address] > per_client:
                    log.warning("closing a connection from %s: it holds %d already (http_max_connections_per_client)",
                                self._address, per_client)
                    self.transport.close()
                    return
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                if self._head_deadline is not None:
                    self._head_deadline.cancel()  # a whole head: the request runs under the handlers' own bounds,
                    self._head_deadline = None
                if self._sending_body():  # but for its body, which must keep coming
                    self._arm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self._head_deadline is None:
                self._arm()  # the next request's head, on this kept-alive connection

        def connection_lost(self, exc) -> None:
            if self._head_deadline is not None:
                self._head_deadline.cancel()
            if self._address is not None:
                open_by_address[self._address] -= 1
                if not open_by_address[self._address]:
                    del open_by_address[self._address]
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._head_deadline = self.loop.call_later(head_timeout_s, self._too_slow)

        def _sending_body(self) -> bool:
            import h11

            return self.conn.their_state is h11.SEND_BODY

        def _too_slow(self) -> None:
            self._head_deadline = None
            if self.cycle is None or self.cycle.response_complete:
                log.info("closing a connection from %s: no whole request head within %.0fs", self.client,
                         head_timeout_s)
                self.transport.close()
            elif self._sending_body():
                log.info("closing a connection from %s: its request body stopped for %.0fs", self.client,
                         head_timeout_s)
                self.transport.close()

    return Guarded


class Server(uvicorn.Server):
    """uvicorn's server, its TLS handshakes held to the head deadline of its `guarded_protocol`: the protocol sees a
    connection only once its handshake is done, and asyncio waits 60 s for one, so a client that opened connections
    and never finished a handshake held a socket each that long, uncounted by the per-client and connection
    limits. `on_exit`: called as soon as a signal asks it to stop (uvicorn's own handler holds the process's
    signals while it serves, and gives them back only after the requests in flight have ended)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None] | None = None):
        super().__init__(config)
        self.on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        if self.on_exit is not None:
            self.on_exit()
        super().handle_exit(sig, frame)

    def run(self, sockets=None) -> None:
        make_loop = self.config.get_loop_factory() or asyncio.new_event_loop
        handshake_timeout = getattr(self.config.http, "head_timeout", None)

        def bounded_loop() -> asyncio.AbstractEventLoop:
            loop = make_loop()
            if self.config.is_ssl and handshake_timeout is not None:
                loop.create_server = functools.partial(loop.create_server, ssl_handshake_timeout=handshake_timeout)
            return loop

        with asyncio.Runner(loop_factory=bounded_loop) as runner:
            runner.run(self.serve(sockets=sockets))


def client_verify(settings: Settings) -> ssl.SSLContext | bool:
    """What an HTTP client checks a service's certificate against: the CA file http_tls_ca, else the system's CAs."""
    return ssl.create_default_context(cafile=settings.http_tls_ca) if settings.http_tls_ca else True


class BackgroundServer:
    """uvicorn serving `app` from a daemon thread, so the service's own loop keeps the main thread.

    uvicorn does not install signal handlers outside the main thread: the service owns SIGTERM/SIGINT.
    """

    def __init__(self, app: FastAPI, host: str, port: int, name: str = "http", *, limit_concurrency: int, **config):
        self.host, self.port = host, port
        self.scheme = "https" if config.get("ssl_certfile") else "http"
        self.server = Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                            limit_concurrency=limit_concurrency, **config))
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.host}:{self.port}"

    def start(self, wait_s: float = 0.0) -> "BackgroundServer":
        """Start serving; with `wait_s`, block until the socket listens (RuntimeError after that long)."""
        self.thread.start()
        deadline = time.monotonic() + wait_s
        while wait_s and not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"HTTP server on {self.host}:{self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=timeout)
