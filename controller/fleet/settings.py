"""The ``state:`` section of the controller config: where replicas share what they learn.

Without it (``backend: embedded``) nothing is shared and nothing here runs
(``controller.config.ServerConfig.state``; this module imports no Redis client).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_REPLICA_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def redact_url(url: str) -> str:
    """``url`` with its password masked: URLs go into error messages, status output and logs.

    >>> redact_url("redis://ops:s3cret@10.0.0.5:6379/0"), redact_url("redis://10.0.0.5:6379/0")
    ('redis://ops:***@10.0.0.5:6379/0', 'redis://10.0.0.5:6379/0')
    """
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest:
        return url
    creds, _, host = rest.rpartition("@")
    user, colon, _ = creds.partition(":")
    return f"{scheme}{sep}{user}{':***' if colon else ''}@{host}"


class StateSettings(BaseModel):
    """Shared state of several controller replicas.

    Examples
    --------
    >>> StateSettings.model_validate({"backend": "redis", "url": "redis://10.0.0.5:6379/0"}).merge_interval_s
    1.0
    >>> StateSettings.model_validate({"backend": "redis"})
    Traceback (most recent call last):
    ...
    pydantic_core._pydantic_core.ValidationError: 1 validation error for StateSettings
      Value error, backend: redis needs url (e.g. redis://host:6379/0) [type=value_error, input_value={'backend': 'redis'}, input_type=dict]
    ...
    """

    model_config = ConfigDict(extra="forbid")

    backend: Literal["embedded", "redis"] = Field("embedded", description="embedded: one replica, nothing shared")
    url: str = Field("", description="redis://[user:password@]host:port/db or rediss:// (TLS)")
    fleet: str = Field("default", pattern=r"^[A-Za-z0-9._-]{1,64}$",
                       description="namespace: replicas with the same fleet name share state")
    replica_id: str = Field("", description="this replica's name in the directory (default: host name and port)")
    op_timeout_s: float = Field(0.5, gt=0, le=10, description="socket timeout of one Redis call")
    connect_timeout_s: float = Field(0.5, gt=0, le=10, description="timeout of a new Redis connection")
    merge_interval_s: float = Field(1.0, gt=0, le=60, description="acceptance deltas pushed and totals read this often")
    heartbeat_interval_s: float = Field(2.0, gt=0, le=60, description="directory heartbeat and assignment sync")
    replica_ttl_s: float = Field(10.0, gt=0, le=600, description="a replica silent this long is dropped")
    lease_ttl_s: float = Field(10.0, gt=0, le=600, description=(
        "drift-alert lease per stratum, drift-monitor lease per drafter version"))
    drift_monitor: Literal["fleet", "replica"] = Field("replica", description=(
        "replica (default): one drift monitor per replica; fleet: one per drafter version, fed every replica's "
        "outcomes (opt-in until its sampling adapts to the owner's budget: docs/operations.md)"))
    drift_interval_s: float = Field(0.5, gt=0, le=60, description="drift evidence sent and read this often")
    drift_checkpoint_interval_s: float = Field(5.0, gt=0, le=600, description="a version's monitor saved this often")
    drift_stream_maxlen: int = Field(2_000, ge=100, description="entries kept per version's evidence stream")
    stratum_ttl_s: float = Field(7 * 86400.0, gt=0, description="a stratum nobody pushes to expires after this")
    seed_grace_s: float = Field(3.0, ge=0, le=600, description=(
        "a replica that never synced waits this long for a synced one to re-seed a store that lost its data"))

    @model_validator(mode="after")
    def _url_for_redis(self) -> "StateSettings":
        if self.backend == "redis" and not self.url:
            raise ValueError("backend: redis needs url (e.g. redis://host:6379/0)")
        if self.url and not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"url {redact_url(self.url)!r}: must start with redis://, rediss:// or unix://")
        if self.replica_id and not _REPLICA_ID.fullmatch(self.replica_id):
            raise ValueError(f"replica_id {self.replica_id!r}: 1-64 of letters, digits, '.', '_', '-'")
        return self
