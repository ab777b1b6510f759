"""Compatibility layer: every private entry point of a dependency that elastic-runtime uses, one module each.

``elastic_runtime.compat.jax`` (jax and jaxlib), ``elastic_runtime.compat.orbax`` (orbax-checkpoint) and
``elastic_runtime.compat.cloud_storage`` (google-cloud-storage). They import nothing from the rest of the project.
When a release removes or changes one of those entry points, the call raises
``elastic_runtime.compat.errors.IncompatibleVersion`` naming the entry point, the installed version and the versions
supported, instead of an ``AttributeError`` deep inside a worker; ``tests/test_compat.py`` checks each one on
the installed versions.
"""

__all__: list[str] = []
