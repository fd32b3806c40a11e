"""The SDK an engine embeds to run under the controller.

- :mod:`worker.sdk.agent` — :class:`~worker.sdk.agent.SpeculationAgent`:
  ``decide()`` from the last plan (no network; per request class when the plan
  has classes), ``acceptance_rule()`` per class, ``observe()`` / ``finish()``
  into a bounded queue, a background Connect stream with ACK/NACK, receipts,
  heartbeats, reconnects and failover between replicas;
- :mod:`worker.sdk.placement` — which of several controller replicas a worker
  talks to: rendezvous hashing of its id, name resolution, failover and
  return rules;
- :mod:`worker.sdk.telemetry` — the step and request records the engine fills;
- :mod:`worker.sdk.security` — TLS and bearer-token options of a client.

Imports ``protos`` and ``policies.table`` only (no torch, no controller).
"""
