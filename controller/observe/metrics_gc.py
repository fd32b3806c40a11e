"""Pauses of Python's cyclic garbage collector, for ``/metrics`` and the benchmarks.

A collection runs on whatever thread allocated the object that crossed a
threshold, with the GIL held: on the controller that is mostly the event
loop, which stands still meanwhile. :class:`GcPauses` times every
collection through ``gc.callbacks`` (two calls per collection, no allocation
of tracked objects in them) into a histogram per generation;
:func:`gc_families` turns one into the ``specctl_gc_*`` metric families.

The collector is process-wide, so is the recorder: :func:`gc_pauses` installs
one per process on first use.

>>> import gc
>>> pauses = GcPauses()
>>> pauses.install()
>>> _ = gc.collect(1)
>>> pauses.collections[1] >= 1 and pauses.seconds[1] > 0
True
>>> pauses.uninstall()
"""

from __future__ import annotations

import bisect
import gc
import time
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

# Upper bounds (seconds): a young collection takes well under a millisecond on an idle
# process; a full one over a few hundred thousand objects tens to hundreds of milliseconds.
PAUSE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


class GcPauses:
    """Collections, their total time, the longest and a pause histogram per generation."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest_s = [0.0, 0.0, 0.0]
        self.collected = [0, 0, 0]
        self.holds = 0  # collections held off while a plan was on its way out (controller.service)
        # Objects in the permanent generation as of the last freeze (see record_freeze).
        self.frozen = 0
        # buckets[g][i]: pauses of generation g at most PAUSE_BUCKETS_S[i] (not cumulative; the last is +Inf)
        self.buckets = [[0] * (len(PAUSE_BUCKETS_S) + 1) for _ in GENERATIONS]
        self._started = 0.0
        self._installed = False

    def install(self) -> None:
        if not self._installed:
            gc.callbacks.append(self._callback)
            self._installed = True

    def uninstall(self) -> None:
        if self._installed:
            gc.callbacks.remove(self._callback)
            self._installed = False

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = self.clock()
            return
        pause = self.clock() - self._started
        g = info["generation"]
        self.collections[g] += 1
        self.seconds[g] += pause
        self.collected[g] += info["collected"]
        if pause > self.longest_s[g]:
            self.longest_s[g] = pause
        self.buckets[g][bisect.bisect_left(PAUSE_BUCKETS_S, pause)] += 1

    def record_freeze(self) -> int:
        """Note how many objects are frozen, right after a ``gc.freeze()``. Not
        in :meth:`snapshot`: ``gc.get_freeze_count`` walks the whole permanent
        generation with the GIL held (~10 ms for 100 k objects)."""
        self.frozen = gc.get_freeze_count()
        return self.frozen

    def snapshot(self) -> dict:
        """Plain copies (any thread; a collection in between shows up in the next one)."""
        return {"collections": list(self.collections), "seconds": list(self.seconds),
                "longest_s": list(self.longest_s), "collected": list(self.collected),
                "buckets": [list(b) for b in self.buckets], "frozen": self.frozen,
                "thresholds": list(gc.get_threshold()), "enabled": gc.isenabled(), "holds": self.holds}


_PAUSES: GcPauses | None = None


def gc_pauses() -> GcPauses:
    """This process's recorder, installed on first use."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = GcPauses()
        _PAUSES.install()
    return _PAUSES


def gc_families(snap: dict) -> Iterator[Metric]:
    """``specctl_gc_*`` families from :meth:`GcPauses.snapshot`."""
    pauses = HistogramMetricFamily("specctl_gc_pause_seconds",
                                   "Event-loop time stopped by Python's cyclic garbage collector, per collection.",
                                   labels=["generation"])
    for g in GENERATIONS:
        running, buckets = 0, []
        for bound, n in zip((*map(str, PAUSE_BUCKETS_S), "+Inf"), snap["buckets"][g]):
            running += n
            buckets.append((bound, running))
        pauses.add_metric([str(g)], buckets, snap["seconds"][g])
    yield pauses
    longest = GaugeMetricFamily("specctl_gc_pause_longest_seconds", "The longest collection so far.",
                                labels=["generation"])
    collected = CounterMetricFamily("specctl_gc_collected_objects_total",
                                    "Unreachable objects the collector freed.", labels=["generation"])
    for g in GENERATIONS:
        longest.add_metric([str(g)], snap["longest_s"][g])
        collected.add_metric([str(g)], snap["collected"][g])
    yield longest
    yield collected
    yield GaugeMetricFamily("specctl_gc_frozen_objects",
                            "Objects moved out of the collector's reach by the last gc.freeze "
                            "(gc.freeze_after_start).", value=snap["frozen"])
    threshold = GaugeMetricFamily("specctl_gc_threshold", "The collector's thresholds in force (gc.thresholds).",
                                  labels=["generation"])
    for g in GENERATIONS:
        threshold.add_metric([str(g)], snap["thresholds"][g])
    yield threshold
    yield CounterMetricFamily("specctl_gc_plan_push_holds_total",
                              "Times automatic collection was held while a plan was on its way out "
                              "(gc.hold_during_plan_push).", value=snap["holds"])
