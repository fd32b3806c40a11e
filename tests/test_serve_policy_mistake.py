"""`specctl serve --config` given a policy file says to use `--policy`; a real
server config with a typo still gets the error naming its field."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from policies.presets import PRESET_DIR, list_presets
from specctl.serve_config import policy_file_mistake


ROOT = Path(__file__).resolve().parents[1]


def serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specctl.cli", "serve", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_serve_with_a_policy_preset_as_config_says_use_policy() -> None:
    preset = "policies/presets/goodput.yaml"  # as the issue typed it, from the repository root
    result = serve("--config", preset)
    assert result.returncode == 2 and result.stdout == ""
    assert "Traceback" not in result.stderr
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("specctl serve")]
    assert line.startswith(f"specctl serve: {preset} is a policy file (policy: goodput), not a server config")
    assert f"use `specctl serve --policy {preset}` instead" in line
    assert "Extra inputs are not permitted" not in line


def test_a_preset_with_a_typo_is_still_a_policy_file(tmp_path: Path) -> None:
    preset = tmp_path / "mine.yaml"
    preset.write_text("policy: goodput\nmax_dpeth: 4\nprobe_fraction: 0.1\n")
    result = serve("--config", str(preset))
    assert result.returncode == 2
    assert f"{preset} is a policy file (policy: goodput)" in result.stderr
    assert f"--policy {preset}" in result.stderr


@pytest.mark.parametrize("name", list_presets())
def test_every_shipped_preset_is_recognised(name: str) -> None:
    message = policy_file_mistake(PRESET_DIR / f"{name}.yaml")
    assert message is not None and "--policy" in message


@pytest.mark.parametrize("text, error", [
    # A server config with a misspelt key beside its policy: not a policy file.
    ("policy: goodput\nlisen: 127.0.0.1:0\n", "lisen='127.0.0.1:0': Extra inputs are not permitted"),
    # Policy fields mixed into a server config: still the server config's own error.
    ("listen: 127.0.0.1:0\npolicy: goodput\nprobe_fraction: 0.1\n", "probe_fraction=0.1: Extra inputs"),
    ("policy: nosuchpolicy\nmax_depth: 3\n", "max_depth=3: Extra inputs are not permitted"),
])
def test_a_server_config_typo_keeps_the_field_error(tmp_path: Path, text: str, error: str) -> None:
    config = tmp_path / "controller.yaml"
    config.write_text(text)
    assert policy_file_mistake(config) is None
    result = serve("--config", str(config))
    assert result.returncode == 2
    assert error in result.stderr and "--policy" not in result.stderr
