"""Drift alerts around the monitor: raising and resolving them
(:mod:`controller.alerts.alerting`), the SQLite store
(:mod:`controller.alerts.store`), webhook and command sinks
(:mod:`controller.alerts.sinks`) and their proto mapping
(:mod:`controller.alerts.proto`)."""
