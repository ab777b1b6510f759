"""The single-controller core: events, bus, event log, config, job, context, the runtime, the step executor,
meshes, compiles, snapshot cadence, failure classification, device health and the host snapshot.

It imports nothing from ``elastic_runtime.handlers``, ``elastic_runtime.storage`` or the other subpackages; they build
on it.
"""

__all__: list[str] = []
