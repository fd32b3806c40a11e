"""A real ``redis-server`` for tests: Debian's binary (``make redis``), on a free
loopback port, in a temporary folder, without persistence unless asked.

It is the fleet benchmark's :class:`bench.fleet.RedisServer`: it starts one,
kills it with SIGKILL and restarts it on the same port (what a crashed Redis
looks like to its clients), and stops it. A missing binary is an error, not a
skip. The ``redis_server`` fixture in ``tests/conftest.py`` yields a started one.
"""

from bench.fleet import RedisServer

__all__ = ["RedisServer"]
