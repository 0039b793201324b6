"""Redis URLs written to files others may read carry no password."""

from __future__ import annotations

from services.config import without_password


def test_service_map_urls_carry_no_password():
    assert without_password("unix://:s3cret@/run/redis/redis.sock") == "unix:///run/redis/redis.sock"
    assert without_password("redis://user:s3cret@redis:6379/0") == "redis://redis:6379/0"
    assert without_password("redis://redis:6379/0") == "redis://redis:6379/0"

