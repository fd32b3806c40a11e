"""Alert sinks against real endpoints: JSON log lines, webhooks POSTed to a
local HTTP server (successes, HTTP errors, timeouts, a closed port), and a
command run with the alert on stdin and in its environment."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from controller.drift.alerts import Action
from controller.alerts.sinks import CommandSink, LogSink, WebhookSink
from tests.support import free_port
from tests.test_store import make_alert


class Hook:
    """A local HTTP endpoint: records every POST; answers with the next planned status (200 after)."""

    def __init__(self, statuses: list[int] | None = None, delay_s: float = 0.0) -> None:
        self.bodies: list[dict] = []
        self.headers: list[dict] = []
        self.statuses = list(statuses or [])
        self.delay_s = delay_s
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.bodies.append(json.loads(body))
                hook.headers.append(dict(self.headers))
                time.sleep(hook.delay_s)
                self.send_response(hook.statuses.pop(0) if hook.statuses else 200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def hook():
    h = Hook()
    yield h
    h.close()


def test_every_event_is_one_json_log_line(caplog: pytest.LogCaptureFixture) -> None:
    sink = LogSink()
    with caplog.at_level(logging.INFO, logger="specctl.alerts"):
        sink.emit("opened", make_alert().to_dict())
        sink.emit("acknowledged", make_alert(acked_at=5.0, acked_by="ops").to_dict())
    records = [r for r in caplog.records if r.name == "specctl.alerts"]
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
    lines = [json.loads(r.getMessage()) for r in records]
    assert [line["event"] for line in lines] == ["opened", "acknowledged"]
    assert lines[0]["alert"]["id"] == "drift-000001" and lines[0]["alert"]["action"] == "RETRAIN_HEADS"
    assert lines[0]["alert"]["extra"]["threshold"] == 12.5 and lines[1]["alert"]["acked_by"] == "ops"


async def test_webhook_posts_the_alert_json_and_honours_its_event_filter(hook: Hook) -> None:
    sink = WebhookSink([hook.url], timeout_s=5.0, events=["opened", "resolved"])
    sink.emit("opened", make_alert().to_dict())
    sink.emit("acknowledged", make_alert().to_dict())  # not subscribed
    sink.emit("resolved", make_alert(resolution="matches baseline again").to_dict())
    await sink.close(timeout=10.0)
    assert [b["event"] for b in hook.bodies] == ["opened", "resolved"]
    assert hook.bodies[0]["alert"] == {**make_alert().to_dict(), "extra": {"threshold": 12.5, "tested": 3}}
    assert hook.headers[0]["Content-Type"] == "application/json"
    assert sink.stats() == {"sent": 2}


async def test_webhook_failures_are_retried_counted_and_never_block(caplog: pytest.LogCaptureFixture) -> None:
    flaky = Hook(statuses=[500])  # fails once, then accepts
    broken = Hook(statuses=[503, 503, 503])
    slow = Hook(delay_s=2.0)
    closed_port = f"http://127.0.0.1:{free_port()}/alerts"
    try:
        sink = WebhookSink([flaky.url, broken.url, slow.url, closed_port], timeout_s=0.3, retries=1,
                           backoff_s=0.01)
        with caplog.at_level(logging.ERROR, logger="specctl.sinks"):
            sink.emit("opened", make_alert().to_dict())  # returns at once: delivery is on the sink's thread
            await sink.close(timeout=30.0)
        assert sink.stats() == {"sent": 1, "failed": 3}
        assert len(flaky.bodies) == 2 and len(broken.bodies) == 2  # one retry each
        errors = "\n".join(r.getMessage() for r in caplog.records)
        assert f"webhook {broken.url}: alert drift-000001 not delivered after 2 attempt(s): HTTP 503" in errors
        assert f"webhook {slow.url}" in errors and "timed out" in errors
        assert f"webhook {closed_port}" in errors and "Connection refused" in errors
    finally:
        for h in (flaky, broken, slow):
            h.close()


async def test_webhook_queue_is_bounded(hook: Hook) -> None:
    hook.delay_s = 0.2
    sink = WebhookSink([hook.url], max_pending=2)
    for i in range(6):
        sink.emit("opened", make_alert(f"drift-{i:06d}").to_dict())
    await sink.close(timeout=10.0)
    assert sink.stats()["dropped"] >= 3 and sink.stats()["sent"] + sink.stats()["dropped"] == 6


RECORDER = """
import json, os, sys
event = json.load(sys.stdin)
env = {k: v for k, v in os.environ.items() if k.startswith("SPECCTL_ALERT_")}
with open(sys.argv[1], "a") as f:
    f.write(json.dumps({"stdin": event, "env": env}) + "\\n")
print("retraining job queued")
"""


async def test_command_gets_the_alert_on_stdin_and_in_its_environment(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    script, out = tmp_path / "retrain.py", tmp_path / "runs.jsonl"
    script.write_text(RECORDER)
    sink = CommandSink([sys.executable, str(script), str(out)], timeout_s=30.0, actions=["RETRAIN_HEADS"])
    with caplog.at_level(logging.INFO, logger="specctl.sinks"):
        sink.emit("opened", make_alert().to_dict())
        sink.emit("resolved", make_alert().to_dict())  # only "opened" runs it by default
        sink.emit("opened", make_alert("drift-000002", action=Action.INVESTIGATE).to_dict())  # action filtered
        await sink.close(timeout=30.0)
    runs = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(runs) == 1
    assert runs[0]["stdin"]["event"] == "opened" and runs[0]["stdin"]["alert"]["id"] == "drift-000001"
    env = runs[0]["env"]
    assert env["SPECCTL_ALERT_ID"] == "drift-000001" and env["SPECCTL_ALERT_ACTION"] == "RETRAIN_HEADS"
    assert env["SPECCTL_ALERT_DRAFTER_VERSION"] == "v1" and env["SPECCTL_ALERT_EVENT"] == "opened"
    assert env["SPECCTL_ALERT_STRATUM"] == "ctx[0,1024)"
    assert sink.stats() == {"started": 1, "succeeded": 1}
    assert any("retraining job queued" in r.getMessage() for r in caplog.records)


async def test_command_failures_and_overruns_are_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    failing = CommandSink([sys.executable, "-c", "import sys; print('no GPU free'); sys.exit(3)"])
    hanging = CommandSink([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=0.5)
    missing = CommandSink([str(tmp_path / "no-such-command")])
    with caplog.at_level(logging.ERROR, logger="specctl.sinks"):
        for sink in (failing, hanging, missing):
            sink.emit("opened", make_alert().to_dict())
        for sink in (failing, hanging, missing):
            await sink.close(timeout=30.0)
    assert failing.stats() == {"started": 1, "failed": 1}
    assert hanging.stats() == {"started": 1, "timed_out": 1}
    assert missing.stats() == {"failed": 1}
    errors = "\n".join(r.getMessage() for r in caplog.records)
    assert "exited 3: no GPU free" in errors and "killed after 0.5 s" in errors and "could not start" in errors
    with pytest.raises(ValueError, match="argv"):
        CommandSink([])
