"""Redis URLs written to files others may read carry no password."""

from __future__ import annotations

from services.config import without_password


def test_service_map_urls_carry_no_password():
    assert without_password("unix://:s3cret@/run/redis/redis.sock") == "unix:///run/redis/redis.sock"
    assert without_password("redis://user:s3cret@redis:6379/0") == "redis://redis:6379/0"
    assert without_password("redis://redis:6379/0") == "redis://redis:6379/0"



def test_free_port_hands_out_no_port_twice(monkeypatch):
    """The kernel may offer a port again once its socket is closed: two services of one launch got the same one in
    about one launch in 2,000 (the second failed to bind at every restart, then was given up)."""
    import socket

    from services import http

    offered = iter([40001, 40002, 40001, 40003])

    class Socket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, address):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(http, "_handed_out", set())
    monkeypatch.setattr(socket, "socket", Socket)
    assert [http.free_port() for _ in range(3)] == [40001, 40002, 40003]
