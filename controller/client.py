"""The controller's client side for operators and tools: read its status.

Kept apart from the command line (``specctl status`` renders what this
fetches) so benchmarks and tests can ask a controller for its state without
importing the CLI. Security is whatever object opens the channel: anything
with ``channel(target)`` and ``metadata()`` (the SDK's ``ClientSecurity``);
none means plaintext without a token.
"""

from __future__ import annotations

from typing import Protocol

import grpc

from controller.models.cost import CostParams
from protos.speculation.v1 import controller_pb2, controller_pb2_grpc


class ChannelSecurity(Protocol):
    def channel(self, target: str) -> grpc.Channel: ...

    def metadata(self) -> tuple[tuple[str, str], ...] | None: ...


def fetch_status(target: str, worker_id: str = "", timeout: float = 5.0,
                 security: ChannelSecurity | None = None) -> controller_pb2.GetStatusResponse:
    """``GetStatus`` of the controller at ``target`` (one worker, or all of them)."""
    channel = security.channel(target) if security is not None else grpc.insecure_channel(target)
    with channel:
        stub = controller_pb2_grpc.SpeculationControllerStub(channel)
        return stub.GetStatus(controller_pb2.GetStatusRequest(worker_id=worker_id), timeout=timeout,
                              metadata=security.metadata() if security is not None else None)


def cost_params(c: controller_pb2.CostModel) -> CostParams:
    """The fitted cost model of a ``GetStatus`` answer, as the controller holds it."""
    return CostParams(mem_ms=c.mem_ms, mem_ms_per_kv_token=c.mem_ms_per_kv_token, compute_ms=c.compute_ms,
                      compute_ms_per_token=c.compute_ms_per_token, compute_ms_per_pair=c.compute_ms_per_pair,
                      compute_ms_per_kv_token=c.compute_ms_per_kv_token,
                      compute_knots=tuple(c.compute_knots), compute_rise_ms=tuple(c.compute_rise_ms),
                      draft_fixed_ms=c.draft_fixed_ms, draft_ms_per_level=c.draft_ms_per_level,
                      draft_ms_per_node=c.draft_ms_per_node, draft_ms_per_level_kv_token=c.draft_ms_per_level_kv_token,
                      catch_up_ms_per_token=c.catch_up_ms_per_token)
