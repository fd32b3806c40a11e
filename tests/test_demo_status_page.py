"""`specctl demo` (what `make demo` runs) serves the controller's status page
while the fleet runs and prints its URL; the URL answers in a browser's stead."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.test_demo import TINY

URL = re.compile(r"status page: (http://127\.0\.0\.1:(\d+)/)")


def get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read()


def test_demo_serves_the_status_page_and_prints_its_url(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(TINY)
    proc = subprocess.Popen([sys.executable, "-m", "specctl.cli", "demo", "--duration", "6", "--scenario", str(scenario),
                             "--out", str(tmp_path / "out")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if URL.search(line):
                found.set()
        found.set()  # the demo ended: whatever it printed is all there is

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        found.wait(60)
        match = next((m for line in lines if (m := URL.search(line))), None)
        assert match, "no status page URL printed:\n" + "".join(lines)
        url = match.group(1)
        assert int(match.group(2)) > 0  # port 0 asked for, the real port printed
        status, content_type, body = get(url)
        assert status == 200 and content_type.startswith("text/html")
        assert b"specctl status" in body
        # The page is the demo's controller: its simulated worker shows up once it has said Hello.
        deadline = time.monotonic() + 20
        while True:
            status, content_type, body = get(url + "status.json")
            assert status == 200 and content_type == "application/json"
            if [w["worker_id"] for w in json.loads(body)["workers"]] == ["h100-eagle"]:
                break
            assert time.monotonic() < deadline, body[:2000]
            time.sleep(0.2)
        assert proc.wait(60) == 0, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        reader.join(10)
    assert (tmp_path / "out" / "demo.json").is_file()


def test_demo_refuses_a_bad_status_listen(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "specctl.cli", "demo", "--status-listen", "localhost",
                             "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and result.stdout == ""
    assert "--status-listen='localhost': expected HOST:PORT" in result.stderr


def test_demo_with_its_status_port_taken_says_so(tmp_path: Path) -> None:
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(TINY)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run([sys.executable, "-m", "specctl.cli", "demo", "--duration", "2", "--scenario",
                                 str(scenario), "--status-listen", listen, "--out", str(tmp_path / "out")],
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    (line,) = [text for text in result.stderr.splitlines() if text.startswith("specctl demo")]
    assert line.startswith(f"specctl demo: cannot serve the status page on {listen}:")
