"""Torch's intra-op thread count: set once per process, applied in every
thread that runs the model.

``torch.set_num_threads`` reaches ATen and oneDNN process-wide, but MKL keeps
its count per thread: a thread started afterwards runs MKL's matrix products
(``F.linear`` on unpacked weights, Medusa's head matmuls) on every core. On
the 2-core machine here a new thread's ``F.linear`` spent 2.0 process-CPU
seconds per second of its own after ``set_num_threads(1)`` in the main
thread, and 1.0 once the thread set the count itself.
"""

from __future__ import annotations

__all__ = ["inherit_threads", "set_threads"]


def set_threads(threads: int) -> None:
    """Torch intra-op threads (``threads <= 0``: leave torch's default). On a
    small shared CPU one thread per process is the robust choice: OpenMP
    threads that spin on busy cores make small matrix products several times
    slower. Applies to the calling thread and to threads that call
    :func:`inherit_threads`."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)


def inherit_threads() -> None:
    """Apply the process's torch thread count to the calling thread (MKL's
    included); call it first in every thread that runs a model."""
    import torch

    torch.set_num_threads(torch.get_num_threads())
