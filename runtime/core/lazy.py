"""A package's public names, each imported from its home module on first use (PEP 562).

Why: ``elastic_runtime``, ``elastic_runtime.defaults`` and ``elastic_runtime.storage`` export names whose modules import
JAX, and every import of a submodule runs its package's ``__init__`` first. Loaded lazily, the controller (which never
runs JAX) and ``--help`` import only what they use, and JAX starts only in the processes that train.

A name must not also be a submodule's: importing the submodule would set the package's attribute to it (as
``elastic_runtime.handlers.scale_up`` would do to the function ``scale_up``, which is why ``elastic_runtime.handlers``
loads its names at once: none of them imports JAX).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any


def lazy_exports(package: str, homes: Mapping[str, Sequence[str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package``: ``homes`` maps each home module to the names it exports."""
    home_of = {name: module for module, names in homes.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = home_of.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return __getattr__
