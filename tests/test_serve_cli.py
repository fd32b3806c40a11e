"""`specctl serve` as a real process: config file, SIGHUP reload, refusal of a
bad policy file, GetStatus over the network."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from policies.presets import PRESET_DIR
from controller.client import fetch_status
from specctl.status import render_status
from tests.support import free_port

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGHUP"), reason="needs SIGHUP")


def wait_status(target: str, predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fetch_status(target, timeout=2.0)
            if predicate(last):
                return last
        except grpc.RpcError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"status never matched; last: {last}")


def test_serve_reloads_on_sighup_and_refuses_bad_files(tmp_path: Path) -> None:
    policy = tmp_path / "policy.yaml"
    shutil.copy(PRESET_DIR / "goodput.yaml", policy)
    port = free_port()
    config = tmp_path / "controller.yaml"
    # Polling is slowed to an hour so only SIGHUP can trigger the reloads.
    config.write_text(f"listen: 127.0.0.1:{port}\npolicy: {policy}\npolicy_poll_interval_s: 3600\n")
    proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    target = f"127.0.0.1:{port}"
    try:
        status = wait_status(target, lambda s: s.policy == "goodput")
        assert status.policy_reloads == 0

        policy.write_text("policy: static\ndepth: 99\n")  # out of range
        proc.send_signal(signal.SIGHUP)
        status = wait_status(target, lambda s: s.policy_reload_failures == 1)
        assert status.policy == "goodput"

        policy.write_text("policy: static\ndepth: 2\n")
        proc.send_signal(signal.SIGHUP)
        status = wait_status(target, lambda s: s.policy == "static")
        assert status.policy_reloads == 1 and status.policy_reload_failures == 1
        assert len(render_status(status)) == 3  # what `specctl status` prints
    finally:
        proc.terminate()
        output = proc.communicate(timeout=10)[0]
    assert "listening" in output
    assert "policy file refused" in output and "depth" in output


def test_serve_refuses_a_bad_config_naming_the_field(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text("listen: 127.0.0.1:0\nplan: {hysteresis: 3}\n")
    result = subprocess.run([sys.executable, "-m", "specctl.cli", "serve", "--config", str(config)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "plan.hysteresis=3" in result.stderr
