"""Observability: Prometheus metrics (:mod:`controller.observe.metrics`), the
status history and page (:mod:`controller.observe.history`,
:mod:`controller.observe.charts`, :mod:`controller.observe.web` on
:mod:`controller.observe.http`) and the telemetry recorder
(:mod:`controller.observe.recorder`)."""
