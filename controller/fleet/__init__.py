"""Several controller replicas sharing what they learn, through Redis.

Self-contained building blocks; ``state: {backend: redis}`` in the config
wires them into the controller (docs/operations.md, "Several replicas").

* :mod:`~controller.fleet.store` — the connection, timeouts, health, backoff;
* :mod:`~controller.fleet.acceptance_sync` — acceptance evidence merged as
  idempotent deltas into fleet totals;
* :mod:`~controller.fleet.cost_priors` — fitted step-cost parameters per
  accelerator × model, a new worker's starting point;
* :mod:`~controller.fleet.leases` — one holder per drift stratum (and per drafter version's monitor);
* :mod:`~controller.fleet.drift_stream` / :mod:`~controller.fleet.drift_owner` — one drift monitor
  per drafter version fleet-wide: its evidence stream, its owner, its handover;
* :mod:`~controller.fleet.alert_log` — alert events and state every replica
  reads and follows;
* :mod:`~controller.fleet.bus` — policy reloads reaching every replica;
* :mod:`~controller.fleet.directory` — live replicas and which serves which worker;
* :mod:`~controller.fleet.bench` — the sync path's CPU per 1,000 steps.
"""
