"""The simulated worker's self-description as a ``speculation.v1.Hello``."""

from __future__ import annotations

from protos.speculation.v1 import worker_pb2
from worker.sim.worker import HelloInfo

DRAFTER_KINDS = {
    "medusa": worker_pb2.DRAFTER_KIND_MEDUSA,
    "eagle": worker_pb2.DRAFTER_KIND_EAGLE,
    "ngram": worker_pb2.DRAFTER_KIND_NGRAM,
    "draft_model": worker_pb2.DRAFTER_KIND_DRAFT_MODEL,
    "mtp": worker_pb2.DRAFTER_KIND_MTP,
}


def hello_proto(info: HelloInfo) -> worker_pb2.Hello:
    hw, d = info.hardware, info.drafter
    return worker_pb2.Hello(
        worker_id=info.worker_id,
        engine=info.engine,
        model=info.model,
        hardware=worker_pb2.Hardware(
            accelerator=hw.accelerator, count=hw.count, memory_bandwidth_gb_s=hw.memory_bandwidth_gb_s,
            peak_tflops=hw.peak_tflops, weight_bytes=hw.weight_bytes, kv_bytes_per_token=hw.kv_bytes_per_token,
            params=hw.params,
        ),
        drafter=worker_pb2.Drafter(
            kind=DRAFTER_KINDS[d.kind], version=d.version, max_depth=d.max_depth, max_width=d.max_width,
            max_tree_nodes=d.max_tree_nodes, trained_context_len=d.trained_context_len,
        ),
        max_batch_size=info.max_batch_size,
    )
