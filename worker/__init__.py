"""Everything that runs on the worker side of speculation.v1, in three rooms:

- :mod:`worker.sdk` — what an engine embeds: the agent (local decisions, the
  telemetry/control stream), telemetry records, client security. Depends on
  ``protos`` and ``policies.table`` only; imports without torch.
- :mod:`worker.sim` — a simulated GPU fleet and its scenarios, for the
  policy and controller benchmarks.
- :mod:`worker.reference` — the reference engine on a real model (SmolLM2):
  engine, drafters, draft heads, models, HTTP server, prompts, load.
"""
