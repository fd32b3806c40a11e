"""A real ``redis-server`` for tests: Debian's binary (``make redis``), on a free
loopback port, in a temporary folder, without persistence unless asked.

:class:`RedisServer` starts it, kills it with SIGKILL and restarts it on the
same port (what a crashed Redis looks like to its clients), and stops it.
The ``redis_server`` fixture in ``tests/conftest.py`` yields a started one.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest


def redis_server_binary() -> str:
    """The ``redis-server`` on PATH; fails the test (not skips it) when missing."""
    path = shutil.which("redis-server")
    if path is None:
        pytest.fail("redis-server is not installed: `make test` installs Debian's redis-server "
                    "(apt-get install --no-install-recommends redis-server); install it and rerun")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process owned by a test.

    Parameters
    ----------
    folder : Path
        Working folder (its log, and its append-only file when ``persist``).
    persist : bool
        ``appendonly yes`` with ``appendfsync always``: a SIGKILL loses
        nothing acknowledged. Off (the default), a restart starts empty.
    port : int or None
        A fixed port; default a free one.
    """

    def __init__(self, folder: Path, persist: bool = False, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.persist = persist
        self.port = port or _free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = self.folder / "redis.log"
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start on ``self.port`` and wait until it answers PING."""
        args = [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--save", "", "--daemonize", "no", "--logfile", str(self.log_path),
                "--appendonly", "yes" if self.persist else "no"]
        if self.persist:
            args += ["--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, cwd=self.folder)
        self.starts += 1
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}: "
                                   f"{self._log_tail()}")
            if self._answers():
                return self
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not answer within {timeout_s} s: {self._log_tail()}")

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text(errors="replace").splitlines()[-5:])
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL, as a crash: no shutdown, no save; wait until the port is closed."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.proc = None

    def restart(self) -> "RedisServer":
        """Kill (if running) and start again on the same port."""
        self.kill()
        return self.start()

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None
