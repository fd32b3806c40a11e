"""The Redis connection every fleet module shares: timeouts, health, backoff, Lua helpers.

Rule of the fleet package: no Redis call runs on the controller's event
loop or on an ingest path. A module prepares what it needs on the loop (a
few array copies), hands the round trip to :meth:`FleetStore.submit` or
:meth:`FleetStore.run` (a small thread pool), and applies the answer on
the loop. Every call has a socket timeout of ``op_timeout_s``; a call that
fails is counted per operation and raises :class:`StoreUnavailable`, which
callers count and swallow. After a connection failure the store backs off
(0.1 s doubling to 2 s): calls in that window fail at once without touching
the network, so a dead Redis costs the fleet modules nothing but a counter
and never queues work behind connect timeouts.

Keys share one prefix, ``specctl:{<fleet>}:``: the braces are a Redis
Cluster hash tag, so every key of a fleet lands in one slot and one Lua
script may touch several of them.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

log = logging.getLogger("specctl.fleet")
T = TypeVar("T")

# Redis answered but refused (script error, OOM, wrong type): the server is up, the call failed.
_REFUSED = (redis.exceptions.ResponseError, redis.exceptions.DataError)
# No answer: the server is down, unreachable, loading or too slow.
_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)

# Doubles packed little-endian in Redis strings (struct is in Redis's Lua).
# unpack() of many values at once is limited by Lua's C stack: 64 per call.
LUA_DOUBLES = r"""
local function unpack_doubles(s, n)
  local out = {}
  if not s then
    for i = 1, n do out[i] = 0 end
    return out
  end
  local pos, i = 1, 0
  while i < n do
    local m = math.min(n - i, 64)
    local vals = {struct.unpack('<' .. string.rep('d', m), s, pos)}
    for j = 1, m do out[i + j] = vals[j] end
    pos = vals[m + 1]
    i = i + m
  end
  return out
end
local function pack_doubles(t, n)
  local parts = {}
  local i = 0
  while i < n do
    local m = math.min(n - i, 64)
    parts[#parts + 1] = struct.pack('<' .. string.rep('d', m), unpack(t, i + 1, i + m))
    i = i + m
  end
  return table.concat(parts)
end
"""


class StoreUnavailable(RuntimeError):
    """A store call that did not complete: Redis down, slow, refusing, or the store backing off.

    Attributes
    ----------
    op : str
        The operation's name (as counted in :meth:`FleetStore.health`).
    """

    def __init__(self, op: str, message: str) -> None:
        super().__init__(f"{op}: {message}")
        self.op = op


def default_replica_id() -> str:
    """Host name and process id: unique on a host, readable in the directory."""
    return f"{socket.gethostname()[:48]}-{os.getpid()}"


class FleetStore:
    """One Redis client, a thread pool for its calls, and the counters that say how it goes.

    Parameters
    ----------
    url : str
        ``redis://host:port/db`` (``rediss://`` for TLS, ``unix://`` for a socket).
    fleet : str
        Namespace: replicas with the same fleet name share state.
    replica_id : str
        This replica's name (directory, leases, alert origin); default
        :func:`default_replica_id`.
    op_timeout_s, connect_timeout_s : float
        Socket timeouts of a call and of a new connection.
    max_workers : int
        Threads running Redis calls; each module keeps at most one call in
        flight, so a few suffice.
    backoff_s : tuple of float
        First and longest pause after a connection failure.
    clock : callable
        Monotonic clock for backoff and health ages.

    Examples
    --------
    >>> store = FleetStore("redis://127.0.0.1:1/0", fleet="doc", replica_id="r1", connect_timeout_s=0.05)
    >>> store.key("acc", "eagle", "v1:rc", "0")
    'specctl:{doc}:acc:eagle:v1%3Arc:0'
    >>> store.ping()
    False
    >>> store.health()["failures"]
    {'ping': 1}
    >>> store.close()
    """

    def __init__(self, url: str, *, fleet: str = "default", replica_id: str = "", op_timeout_s: float = 0.5,
                 connect_timeout_s: float = 0.5, max_workers: int = 4, backoff_s: tuple[float, float] = (0.1, 2.0),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.url = url
        self.fleet = fleet
        self.replica_id = replica_id or default_replica_id()
        # A per-process token: names this incarnation where a restarted replica
        # with the same name must not be taken for its predecessor (leases, sequences).
        self.incarnation = f"{self.replica_id}/{secrets.token_hex(4)}"
        self.prefix = f"specctl:{{{fleet}}}:"
        self.op_timeout_s = op_timeout_s
        self.connect_timeout_s = connect_timeout_s
        # One immediate retry on a connection error only: after a restart of Redis the
        # pool's first connection is stale and the retry gets a fresh one. Timeouts are
        # never retried (the call may have run: callers decide, most are idempotent).
        self.client = redis.Redis.from_url(
            url, socket_timeout=op_timeout_s, socket_connect_timeout=connect_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)),
            health_check_interval=0, client_name=f"specctl:{self.replica_id}"[:60])
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="specctl-fleet")
        self._clock = clock
        self._lock = threading.Lock()
        self._backoff_min, self._backoff_max = backoff_s
        self._backoff = backoff_s[0]
        self._retry_at = float("-inf")
        self.calls: Counter = Counter()  # completed calls per operation
        self.failures: Counter = Counter()  # calls that raised StoreUnavailable, per operation (backoff skips too)
        self.up: bool | None = None  # None until the first call
        self.outages = 0  # up -> down transitions
        self.last_error = ""
        self.last_ok_at = float("nan")
        self.down_since = float("nan")
        self._closed = False

    # ------------------------------------------------------------------ keys
    def key(self, *parts: str) -> str:
        """The fleet's key for ``parts`` (each percent-escaped, so a ``:`` in a drafter version cannot collide)."""
        return self.prefix + ":".join(quote(str(p), safe="") for p in parts)

    def script(self, lua: str):
        """A registered Lua script (EVALSHA, reloaded by redis-py after NOSCRIPT, e.g. a restarted server)."""
        return self.client.register_script(lua)

    # ----------------------------------------------------------------- calls
    def call(self, op: str, fn: Callable[[redis.Redis], T]) -> T:
        """Run ``fn(client)`` on this thread (an I/O thread, never the event loop).

        Raises
        ------
        StoreUnavailable
            Redis did not answer, answered with an error, or the store is
            backing off after a failure; counted under ``op``.
        """
        now = self._clock()
        with self._lock:
            if self._closed:
                raise StoreUnavailable(op, "store closed")
            if now < self._retry_at:
                self.failures[op] += 1
                raise StoreUnavailable(op, f"backing off after {self.last_error}")
        try:
            result = fn(self.client)
        except _REFUSED as err:
            with self._lock:
                self.failures[op] += 1
                self.last_error = f"{op}: {type(err).__name__}: {err}"
            raise StoreUnavailable(op, f"refused: {err}") from err
        except _DOWN as err:
            self._down(op, err)
            raise StoreUnavailable(op, f"{type(err).__name__}: {err}") from err
        with self._lock:
            self.calls[op] += 1
            if self.up is False:
                log.info("fleet store %s is back after %.1f s", self.url, self._clock() - self.down_since)
            self.up = True
            self.last_ok_at = self._clock()
            self._backoff = self._backoff_min
            self._retry_at = float("-inf")
        return result

    def _down(self, op: str, err: BaseException) -> None:
        with self._lock:
            self.failures[op] += 1
            self.last_error = f"{op}: {type(err).__name__}: {err}"
            now = self._clock()
            if self.up is not False:
                self.outages += 1
                self.down_since = now
                log.warning("fleet store %s unreachable (%s); replicas serve from local state", self.url,
                            self.last_error)
            self.up = False
            self._retry_at = now + self._backoff
            self._backoff = min(self._backoff * 2, self._backoff_max)

    def submit(self, op: str, fn: Callable[[redis.Redis], T]) -> Future:
        """:meth:`call` on the store's threads; the future raises :class:`StoreUnavailable`."""
        try:
            return self._executor.submit(self.call, op, fn)
        except RuntimeError as err:  # the executor was shut down
            future: Future = Future()
            future.set_exception(StoreUnavailable(op, f"store closed ({err})"))
            return future

    async def run(self, op: str, fn: Callable[[redis.Redis], T], timeout_s: float | None = None) -> T:
        """Await :meth:`call` on the store's threads, at most ``timeout_s`` (default: a few op timeouts).

        The loop only awaits; a call that outlives the timeout finishes on
        its thread and its answer is dropped (every fleet write is
        idempotent or carries its own sequence, so that is safe).
        """
        limit = timeout_s if timeout_s is not None else 4 * self.op_timeout_s + self.connect_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(self.submit(op, fn)), limit)
        except asyncio.TimeoutError:
            with self._lock:
                self.failures[op] += 1
                self.last_error = f"{op}: no answer within {limit:.2f} s"
            raise StoreUnavailable(op, f"no answer within {limit:.2f} s") from None

    async def offload(self, fn: Callable[[], T], timeout_s: float | None = None) -> T:
        """Await ``fn()`` on the store's threads, for a function that makes its
        own store calls (counted there); a timeout raises :class:`StoreUnavailable`."""
        limit = timeout_s if timeout_s is not None else 4 * self.op_timeout_s + self.connect_timeout_s
        try:
            future = self._executor.submit(fn)
        except RuntimeError as err:
            raise StoreUnavailable("offload", f"store closed ({err})") from None
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), limit)
        except asyncio.TimeoutError:
            with self._lock:
                self.failures["offload"] += 1
            raise StoreUnavailable("offload", f"no answer within {limit:.2f} s") from None

    def ping(self) -> bool:
        """True if Redis answers now (runs here: an I/O thread or a test)."""
        try:
            return bool(self.call("ping", lambda r: r.ping()))
        except StoreUnavailable:
            return False

    # ---------------------------------------------------------------- status
    def health(self) -> dict[str, Any]:
        """Counters for GetStatus and /metrics."""
        with self._lock:
            now = self._clock()
            return {
                "url": _redact(self.url), "fleet": self.fleet, "replica_id": self.replica_id,
                "up": self.up, "outages": self.outages, "last_error": self.last_error,
                "down_for_s": (now - self.down_since) if self.up is False else 0.0,
                "since_ok_s": now - self.last_ok_at if self.last_ok_at == self.last_ok_at else None,
                "calls": dict(self.calls), "failures": dict(self.failures),
            }

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def _redact(url: str) -> str:
    """The URL without its password (it goes into status output and logs)."""
    scheme, sep, rest = url.partition("://")
    if "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}" if ":" in creds else f"{scheme}{sep}{user}@{host}"


async def run_every(interval_s: float, step: Callable[[], Awaitable[Any]], name: str) -> None:
    """Call ``await step()`` every ``interval_s`` until cancelled. A store
    fault is already counted where it happened; anything else is logged
    and the loop goes on (a fleet module must not stop serving)."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await step()
        except StoreUnavailable:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - one bad round must not end the loop
            log.exception("fleet %s round failed", name)
