"""A controller on its own event loop thread, for in-process use by
benchmarks, demos and tests whose own code is synchronous (engine threads)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

from controller.config import ServerConfig
from controller.server import RunningServer, start_server


def in_process_config(policy: str, interval_s: float = 0.5, **overrides) -> ServerConfig:
    """A loopback controller config for demos and benchmarks: a free port,
    plans recomputed every ``interval_s``, the drift store in memory."""
    return ServerConfig.model_validate({
        "listen": "127.0.0.1:0", "policy": policy,
        "plan": {"recompute_interval_s": interval_s, "min_push_interval_s": interval_s},
        "store": {"path": ""}, **overrides})


class BackgroundController:
    """``start_server(config)`` on a daemon thread's event loop.

    Parameters
    ----------
    config : ServerConfig
        ``listen`` may name port 0: ``address`` gives the port it got.
    clock : callable, optional
        The controller's clock, seconds since the epoch (default ``time.time``):
        evidence decay, idle expiry and plan pacing run on it.
    """

    def __init__(self, config: ServerConfig, clock: Callable[[], float] = time.time) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="specctl-controller")
        self._thread.start()
        self.running: RunningServer = self.call(start_server(config, clock=clock), timeout=60)
        self.address = self.running.address

    def call(self, coro, timeout: float = 30.0):
        """Run ``coro`` on the controller's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        try:
            self.call(self.running.stop(0), timeout=30)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)
