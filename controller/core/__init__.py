"""The controller's state and logic, free of gRPC.

- :mod:`controller.core.state` — ``WorkerState`` and its parts (session,
  load, requests in flight, plan ledger, counters);
- :mod:`controller.core.ingest` — one validated step into a worker's state;
- :mod:`controller.core.classes` — its traffic and TPOT per request class;
- :mod:`controller.core.plans` — plans out, ACK / NACK in;
- :mod:`controller.core.controller` — ``Controller``, which ties them to the
  config, the policy and the shared acceptance models (strict, and typical
  for request classes that may use it).
"""

from controller.core.controller import Controller
from controller.core.state import MAX_PENDING, WorkerState

__all__ = ["Controller", "MAX_PENDING", "WorkerState"]
