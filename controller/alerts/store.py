"""The controller's durable state: drift baselines, alert history, acknowledgements.

One SQLite file (stdlib ``sqlite3``, WAL mode) holds

* ``baselines`` — the drift monitor's state per drafter version (its
  ``to_dict`` entry: every stratum's baseline histogram), replaced on each
  save; a version the monitor no longer tracks (superseded, evicted) is
  deleted with it, so a restart brings back exactly the versions in force;
* ``alerts`` — every alert's latest state (open, resolved, acknowledged),
  one row per alert id;
* ``alert_events`` — every event (opened, resolved, acknowledged) in order,
  with the alert as it was then;
* ``meta`` — the monitor's settings at the last save and its next alert id.

The path ``""`` keeps everything in memory (gone at exit). A single thread
owns the connection: callers on the event loop only enqueue, and reads are
queued behind the writes before them, so a read sees every write made
before it was asked. Writes are committed in batches as they drain.
"""

from __future__ import annotations

import json
import logging
import queue
import sqlite3
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

log = logging.getLogger("specctl.store")

SCHEMA_VERSION = 1
_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS baselines (
    drafter_kind TEXT NOT NULL, drafter_version TEXT NOT NULL, saved_at REAL NOT NULL, data TEXT NOT NULL,
    PRIMARY KEY (drafter_kind, drafter_version));
CREATE TABLE IF NOT EXISTS alerts (
    id TEXT PRIMARY KEY, drafter_kind TEXT NOT NULL, drafter_version TEXT NOT NULL, stratum TEXT NOT NULL,
    action TEXT NOT NULL, severity TEXT NOT NULL, status TEXT NOT NULL, opened_at REAL NOT NULL,
    resolved_at REAL, acked_at REAL, acked_by TEXT NOT NULL DEFAULT '', data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS alerts_by_status ON alerts (status, opened_at);
CREATE TABLE IF NOT EXISTS alert_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, alert_id TEXT NOT NULL, event TEXT NOT NULL, at REAL NOT NULL,
    data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS alert_events_by_alert ON alert_events (alert_id, seq);
"""


def _dumps(data: Any) -> str:
    """JSON of monitor output, numpy scalars included."""
    return json.dumps(data, default=lambda o: o.item() if hasattr(o, "item") else str(o))


class StoreError(RuntimeError):
    """The store cannot be opened or used; the message names the path."""


class StateStore:
    """SQLite persistence owned by one background thread.

    Parameters
    ----------
    path : str
        Database file (created with its folder if missing); ``""`` = in memory.
    busy_timeout_s : float
        How long a write waits for another process holding the file.

    Raises
    ------
    StoreError
        The file cannot be opened, is not a SQLite database, or was written
        by a newer schema.
    """

    def __init__(self, path: str, busy_timeout_s: float = 5.0) -> None:
        self.path = path
        self._ops: queue.Queue = queue.Queue()
        self._closed = False
        self.write_errors = 0
        opened: Future = Future()
        self._thread = threading.Thread(target=self._run, args=(opened, busy_timeout_s), name="specctl-store",
                                        daemon=True)
        self._thread.start()
        try:
            opened.result()
        except (sqlite3.Error, OSError) as err:
            self._thread.join()
            where = path or ":memory:"
            raise StoreError(f"store.path={where!r}: cannot open the state database: {err}") from err

    # ---------------------------------------------------------------- thread
    def _run(self, opened: Future, busy_timeout_s: float) -> None:
        try:
            conn = self._connect(busy_timeout_s)
        except BaseException as err:  # noqa: BLE001 - handed to the constructor
            opened.set_exception(err)
            return
        opened.set_result(None)
        try:
            while True:
                op = self._ops.get()
                batch = [op]
                while True:  # drain what is queued: one commit per batch
                    try:
                        batch.append(self._ops.get_nowait())
                    except queue.Empty:
                        break
                stop = None in batch
                done = [(future, self._apply(conn, fn)) for fn, future in filter(None, batch)]
                try:
                    conn.commit()
                except sqlite3.Error as err:
                    self.write_errors += 1
                    log.error("store %s: commit failed: %s", self.path or ":memory:", err)
                for future, (result, error) in done:  # answered once committed: flush() means on disk
                    if future is None:
                        continue
                    if error is not None:
                        future.set_exception(error)
                    else:
                        future.set_result(result)
                if stop:
                    return
        finally:
            conn.close()

    def _apply(self, conn: sqlite3.Connection, fn: Callable) -> tuple[Any, StoreError | None]:
        try:
            return fn(conn), None
        except (sqlite3.Error, ValueError) as err:
            self.write_errors += 1
            log.error("store %s: %s", self.path or ":memory:", err)
            return None, StoreError(f"store.path={self.path!r}: {err}")

    def _connect(self, busy_timeout_s: float) -> sqlite3.Connection:
        if self.path:
            Path(self.path).expanduser().parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(str(Path(self.path).expanduser()) if self.path else ":memory:",
                               timeout=busy_timeout_s)
        try:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise sqlite3.DatabaseError(f"schema version {version} is newer than this controller's "
                                            f"{SCHEMA_VERSION}")
            if self.path:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA synchronous=NORMAL")  # WAL: a crash loses at most the last commits
            conn.executescript(_SCHEMA)
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            conn.commit()
        except sqlite3.Error:
            conn.close()
            raise
        return conn

    def _submit(self, fn: Callable[[sqlite3.Connection], Any], want_result: bool) -> Future | None:
        if self._closed:
            raise StoreError(f"store.path={self.path!r}: the store is closed")
        future: Future | None = Future() if want_result else None
        self._ops.put((fn, future))
        return future

    # ----------------------------------------------------------------- writes
    def record_event(self, event: str, alert: dict[str, Any], at: float) -> None:
        """Queue an alert event: its row in ``alert_events`` and the alert's latest state."""
        data = _dumps(alert)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO alert_events (alert_id, event, at, data) VALUES (?, ?, ?, ?)",
                         (alert["id"], event, at, data))
            conn.execute(
                "INSERT INTO alerts (id, drafter_kind, drafter_version, stratum, action, severity, status, opened_at,"
                " resolved_at, acked_at, acked_by, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (id) DO UPDATE SET status = excluded.status, resolved_at = excluded.resolved_at,"
                " acked_at = excluded.acked_at, acked_by = excluded.acked_by, data = excluded.data",
                (alert["id"], alert["drafter_kind"], alert["drafter_version"], alert["stratum"], alert["action"],
                 alert["severity"], alert["status"], alert["opened_at"], alert.get("resolved_at"),
                 alert.get("acked_at"), alert.get("acked_by") or "", data))

        self._submit(write, want_result=False)

    def save_monitor(self, state: dict[str, Any], at: float) -> None:
        """Queue the monitor's ``to_dict()``: one baseline row per drafter version, the rest deleted."""
        versions = [(v["kind"], v["version"], _dumps(v)) for v in state["versions"]]
        config = _dumps(state["config"])
        next_id = str(int(state["next_id"]))

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("DELETE FROM baselines")
            conn.executemany("INSERT INTO baselines (drafter_kind, drafter_version, saved_at, data)"
                             " VALUES (?, ?, ?, ?)", [(k, v, at, d) for k, v, d in versions])
            conn.executemany("INSERT INTO meta (key, value) VALUES (?, ?)"
                             " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                             [("monitor_config", config), ("next_id", next_id)])

        self._submit(write, want_result=False)

    # ------------------------------------------------------------------ reads
    def load_monitor(self) -> Future:
        """Future of ``{"config", "next_id", "versions"}`` as last saved (``None`` if nothing was)."""
        def read(conn: sqlite3.Connection) -> dict[str, Any] | None:
            meta = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            rows = conn.execute("SELECT data FROM baselines ORDER BY drafter_kind, drafter_version").fetchall()
            if "monitor_config" not in meta:
                return None
            return {"config": json.loads(meta["monitor_config"]), "next_id": int(meta.get("next_id", 1)),
                    "versions": [json.loads(d) for (d,) in rows]}

        return self._submit(read, want_result=True)

    def alerts(self, open_only: bool = False, drafter_version: str = "") -> Future:
        """Future of every stored alert's latest state (dicts), oldest first."""
        def read(conn: sqlite3.Connection) -> list[dict[str, Any]]:
            sql, args = "SELECT data FROM alerts WHERE 1=1", []
            if open_only:
                sql += " AND status = 'OPEN'"
            if drafter_version:
                sql += " AND drafter_version = ?"
                args.append(drafter_version)
            return [json.loads(d) for (d,) in conn.execute(sql + " ORDER BY opened_at, id", args)]

        return self._submit(read, want_result=True)

    def alert(self, alert_id: str) -> Future:
        """Future of one alert's latest state, or ``None``."""
        def read(conn: sqlite3.Connection) -> dict[str, Any] | None:
            row = conn.execute("SELECT data FROM alerts WHERE id = ?", (alert_id,)).fetchone()
            return json.loads(row[0]) if row else None

        return self._submit(read, want_result=True)

    def events(self, alert_id: str = "") -> Future:
        """Future of ``(event, at, alert dict)`` in order, for one alert or all."""
        def read(conn: sqlite3.Connection) -> list[tuple[str, float, dict[str, Any]]]:
            sql = "SELECT event, at, data FROM alert_events"
            rows = conn.execute(sql + " WHERE alert_id = ? ORDER BY seq", (alert_id,)) if alert_id else \
                conn.execute(sql + " ORDER BY seq")
            return [(e, at, json.loads(d)) for e, at, d in rows]

        return self._submit(read, want_result=True)

    def max_alert_number(self) -> Future:
        """Future of the largest ``N`` among stored ids ``drift-N`` (0 when none)."""
        def read(conn: sqlite3.Connection) -> int:
            ids = [i for (i,) in conn.execute("SELECT id FROM alerts")]
            numbers = [int(i.rpartition("-")[2]) for i in ids if i.rpartition("-")[2].isdigit()]
            return max(numbers, default=0)

        return self._submit(read, want_result=True)

    # -------------------------------------------------------------- lifecycle
    def flush(self, timeout: float | None = 10.0) -> None:
        """Block until everything queued so far is committed."""
        future = self._submit(lambda conn: None, want_result=True)
        future.result(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Commit what is queued and close the file (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._ops.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("store %s: writer still busy after %.0f s at close", self.path or ":memory:", timeout)
