"""TLS, the option docs/deploy.md describes: a service serves HTTPS from http_tls_certfile/http_tls_keyfile and a
client trusts it through the CA file only; Redis clients speak TLS from a rediss:// URL naming the CA."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from services.config import Settings
from services.http import BackgroundServer, client_verify, create_app, free_port, server_options
from services.redis_local import client_for

TOKEN = "t0k3n-for-the-tls-test-0123456789abcdef"


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a certificate it signed for 127.0.0.1 (openssl): (ca.crt, tls.crt, tls.key), as a Secret holds them."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed")
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "tls.key", "tls.csr", "tls.crt"))
    run = lambda *args: subprocess.run([openssl, *args], check=True, capture_output=True)  # noqa: E731
    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "1",
        "-subj", "/CN=dapo-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=learner")
    extensions = folder / "san.cnf"
    extensions.write_text("subjectAltName=IP:127.0.0.1,DNS:learner\n")
    run("x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert, "-days", "1",
        "-extfile", extensions)
    return ca, cert, key


def test_a_service_serves_https_that_clients_trust_through_the_ca_file(tmp_path):
    ca, cert, key = make_certificates(tmp_path)
    settings = Settings(token=TOKEN, http_tls_certfile=str(cert), http_tls_keyfile=str(key), http_tls_ca=str(ca))
    server = BackgroundServer(create_app("test", token=TOKEN), "127.0.0.1", free_port(), **server_options(settings))
    server.start(wait_s=30)
    try:
        assert server.url.startswith("https://")
        assert httpx.get(f"{server.url}/healthz", verify=client_verify(settings)).status_code == 200
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{server.url}/healthz")  # the system's CAs do not know it
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https", "http", 1) + "/healthz")  # no plain HTTP beside it
    finally:
        server.stop()


def test_a_connection_that_never_finishes_its_tls_handshake_is_closed_at_the_head_deadline(tmp_path):
    """The guards of services.http see a connection once its handshake is done, and asyncio waits 60 s for that:
    a client opening connections that never say a word held a socket each that long."""
    ca, cert, key = make_certificates(tmp_path)
    settings = Settings(token=TOKEN, http_tls_certfile=str(cert), http_tls_keyfile=str(key), http_tls_ca=str(ca),
                        http_head_timeout_s=1)
    server = BackgroundServer(create_app("test", token=TOKEN), "127.0.0.1", free_port(), **server_options(settings))
    server.start(wait_s=30)
    try:
        with socket.create_connection((server.host, server.port), timeout=20) as silent:
            opened = time.monotonic()
            assert silent.recv(1) == b""  # closed by the server, not by this timeout
            assert time.monotonic() - opened < 10
        assert httpx.get(f"{server.url}/healthz", verify=client_verify(settings)).status_code == 200
    finally:
        server.stop()


def test_plain_http_without_a_certificate():
    assert server_options(Settings())["ssl_certfile"] is None


def test_a_rediss_url_gives_a_tls_client_that_checks_the_ca():
    client = client_for("rediss://:pw@redis:6379/0?ssl_ca_certs=/etc/dapo-tls/ca.crt")
    pool = client.connection_pool
    assert pool.connection_class.__name__ == "SSLConnection"
    assert pool.connection_kwargs["ssl_ca_certs"] == "/etc/dapo-tls/ca.crt"
    assert pool.connection_kwargs.get("ssl_cert_reqs", "required") == "required"
