"""Policy reloads that reach every replica: a versioned current policy and a pub/sub nudge.

A replica that reloads its policy file (SIGHUP, a changed file, the
ReloadPolicy call) and accepts it publishes the file's text:
:data:`PUBLISH_LUA` raises the fleet's policy version (Redis's clock in ms,
above the stored one, so it keeps rising across a Redis that lost its
data), stores text and
version under ``policy:current`` and publishes ``{"version", "origin"}`` on
the ``policy`` channel, in one atomic step. Every other replica's
:class:`PolicyBus` thread hears it, reads ``policy:current`` and applies it
through the same validation as a local reload
(:func:`policies.presets.load_preset_text`, which :func:`policies.presets.load_preset`
and so :class:`controller.reload.PolicySource` use): a text that does not
validate there is refused and counted (``policy_reload_failures``), and the
policy in force stays.

Pub/sub delivers only to connected subscribers. So the message carries no
text: the receiver reads the current one, and after every (re)subscription
it reads it too. A replica that was cut off, or started after the reload,
catches up with the newest version; versions at or below the one applied
are ignored, so a replay or a duplicate changes nothing.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

import redis

from controller.fleet.store import FleetStore
from policies.presets import PresetError, load_preset_text

log = logging.getLogger("specctl.fleet")

PUBLISH_LUA = r"""
-- KEYS[1] the current policy hash; ARGV: 1 text, 2 source, 3 origin, 4 channel
-- The version is Redis's clock in ms, at least one above the stored one: it keeps rising when
-- Redis restarts without its data (a counter would start again at 1, below what replicas applied).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local v = math.max(tonumber(redis.call('HGET', KEYS[1], 'version') or '0') + 1, now)
redis.call('HSET', KEYS[1], 'version', string.format('%d', v), 'text', ARGV[1], 'source', ARGV[2],
           'origin', ARGV[3])
redis.call('PUBLISH', ARGV[4], cjson.encode({version = string.format('%d', v), origin = ARGV[3]}))
return v
"""


def apply_policy_text(controller: Any, text: str, source: str) -> bool:
    """Validate ``text`` as a local reload would and put it in force; False
    (counted in ``controller.policy_reload_failures``, old policy kept) if it
    does not validate.

    Parameters
    ----------
    controller : controller.core.Controller
        Anything with ``policy``, ``set_policy`` and ``policy_reload_failures``.
    text : str
        The preset's YAML.
    source : str
        Names it in errors and logs (the publishing replica and its file).
    """
    try:
        policy = load_preset_text(text, source=source)
    except PresetError as err:
        controller.policy_reload_failures += 1
        log.error("fleet policy from %s refused, keeping %s in force: %s", source, controller.policy.name, err)
        return False
    controller.set_policy(policy)
    log.info("fleet policy applied from %s: %s", source, policy.name)
    return True


class PolicyBus:
    """Publishes this replica's reloads and applies the others'.

    Parameters
    ----------
    store : FleetStore
    apply : callable
        ``apply(text, version, source)`` for each newer policy from another
        replica, called on the bus thread (route it to the controller's loop,
        e.g. ``loop.call_soon_threadsafe``, and call :func:`apply_policy_text` there).
    adopt_current : bool
        Apply the fleet's current policy when first subscribed (a replica
        started after a reload follows it), not only later reloads.
    """

    def __init__(self, store: FleetStore, apply: Callable[[str, int, str], None], *,
                 adopt_current: bool = True) -> None:
        self.store = store
        self.apply = apply
        self.origin = store.incarnation
        self.current_key = store.key("policy", "current")
        self.channel = store.key("policy", "channel")
        self.counts: Counter = Counter()
        self.applied_version = 0 if adopt_current else -1  # -1: the first catch-up only records the version
        self._publish = store.script(PUBLISH_LUA)
        self._unpublished: tuple[str, str] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="specctl-policy-bus")
        self._client = redis.Redis.from_url(store.url, socket_timeout=1.0 + store.op_timeout_s,
                                            socket_connect_timeout=store.connect_timeout_s)
        self.subscribed = threading.Event()

    # ----------------------------------------------------------- publishing
    def publish(self, text: str, source: str) -> Future:
        """Publish an accepted local reload (never blocks: the future gives the fleet version, or raises
        :class:`~controller.fleet.store.StoreUnavailable`; then :meth:`flush` sends it later)."""
        with self._lock:
            self._unpublished = (text, source)  # only the newest matters: it supersedes any unsent one
        return self.store.submit("policy_publish", self._send_unpublished)

    def flush(self) -> int | None:
        """Send a reload whose publication failed (a store thread, e.g. with the directory heartbeat);
        the fleet version, or None if nothing waited. Raises :class:`~controller.fleet.store.StoreUnavailable`."""
        with self._lock:
            if self._unpublished is None:
                return None
        return self.store.call("policy_publish", self._send_unpublished)

    def _send_unpublished(self, client: redis.Redis) -> int | None:
        with self._lock:
            item = self._unpublished
        if item is None:
            return None
        text, source = item
        version = int(self._publish(keys=[self.current_key], args=[text, f"{self.store.replica_id}:{source}",
                                                                   self.origin, self.channel], client=client))
        with self._lock:
            if self._unpublished is item:
                self._unpublished = None
            # Our own policy is in force already: the echo and later catch-ups must not re-apply it.
            self.applied_version = max(self.applied_version, version)
            self.counts["published"] += 1
        return version

    # ---------------------------------------------------------- subscribing
    def start(self) -> "PolicyBus":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
        self._client.close()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            try:
                pubsub.subscribe(self.channel)
                self.subscribed.set()
                self.counts["subscribed"] += 1
                self._catch_up()  # whatever was published while not subscribed
                backoff = 0.1
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=0.5)
                    if message is not None and message.get("type") == "message":
                        self._on_message(message["data"])
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as err:
                if self.subscribed.is_set():
                    log.warning("policy bus lost the fleet store: %s", err)
                self.subscribed.clear()
                self.counts["errors"] += 1
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                try:
                    pubsub.close()
                except Exception:  # noqa: BLE001 - closing a broken connection may fail too
                    pass

    def _on_message(self, data: bytes) -> None:
        try:
            note = json.loads(data)
            version, origin = int(note["version"]), str(note["origin"])
        except (ValueError, KeyError, TypeError):
            self.counts["unreadable"] += 1
            return
        with self._lock:
            if version <= self.applied_version or origin == self.origin:
                self.counts["ignored"] += 1
                return
        self._catch_up()

    def _catch_up(self) -> None:
        """Read the current policy and hand it to ``apply`` if newer than the one applied."""
        raw = self._client.hgetall(self.current_key)
        version = int(raw.get(b"version", b"0")) if raw else 0
        with self._lock:
            if self.applied_version < 0:  # not adopting: what is current now is the baseline
                self.applied_version = version
                return
            if version <= self.applied_version:
                return
            self.applied_version = version
            if raw.get(b"origin", b"").decode() == self.origin:
                return
        self.counts["applied"] += 1
        self.apply(raw.get(b"text", b"").decode(), version, raw.get(b"source", b"").decode())
