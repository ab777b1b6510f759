"""Tools for demos and tests: fault injection and the demo model. Not on any production path."""

from elastic_runtime.testing.faults import FaultInjector, FaultSchedule

__all__ = ["FaultInjector", "FaultSchedule"]
