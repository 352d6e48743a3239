"""Fixtures of the chaos tests: the redis-server of the service tests (AOF on, killable)."""

from tests.services.conftest import redis_server

__all__ = ["redis_server"]
