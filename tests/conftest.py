"""Suite-wide fixtures."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

import controller.config


@pytest.fixture(scope="session", autouse=True)
def _session_drift_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Controllers started without a ``store.path`` (module fixtures included) keep their drift state in
    this run's temporary folder, not in a file every run and every engineer would share and restore from."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(controller.config, "DEFAULT_STORE_PATH",
                      str(tmp_path_factory.mktemp("state") / "specctl-state.sqlite3"))
        yield


@pytest.fixture(autouse=True)
def _own_drift_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's own controllers: a store of the test's own."""
    monkeypatch.setattr(controller.config, "DEFAULT_STORE_PATH", str(tmp_path / "specctl-state.sqlite3"))


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator["RedisServer"]:
    """A started ``redis-server`` of this test's own (free loopback port, no persistence), stopped after it.
    ``redis_server.kill()`` / ``.restart()`` crash it and bring it back on the same port."""
    from tests.redis_support import RedisServer

    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()
