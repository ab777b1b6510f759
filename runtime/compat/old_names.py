"""The import names before ``elastic_runtime``: ``runtime``, ``handlers`` and ``storage``, kept for one release.

They were generic: a user's own ``handlers.py`` or ``storage/`` beside the training script came first on
``sys.path`` and broke the library's own imports. The library now imports only ``elastic_runtime...``; the old
names still work, with a ``DeprecationWarning`` naming the new import, and go in the next release.

Each old package's ``__init__`` (the same file as the new package's: ``runtime/`` is ``elastic_runtime``) calls
``redirect`` when it runs under its old name. The old name, and every module below it, then *is* the new module
(one module object each), so classes, the event registry and ``isinstance`` are the same under both names.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

# old name -> new name
NEW_NAMES = {"runtime": "elastic_runtime", "handlers": "elastic_runtime.handlers", "storage": "elastic_runtime.storage"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``old.x.y`` as the module ``new.x.y`` itself, ahead of every other finder."""

    def __init__(self, old: str, new: str) -> None:
        self.old = old
        self.new = new

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(self.old + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new + spec.name[len(self.old) :])
        # The import system sets __spec__ on what this returns to `spec`; exec_module puts the module's own back.
        spec.loader_state = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        assert module.__spec__ is not None
        module.__spec__ = module.__spec__.loader_state


def redirect(old: str) -> None:
    """Make the old package name ``old`` (and its submodules) the new package, with a DeprecationWarning."""
    new = NEW_NAMES[old]
    warnings.warn(
        f"the import name {old!r} is deprecated and goes in the next release: import {new!r} instead "
        f"(a file of your own named {old}.py or a folder {old}/ would shadow the old name)",
        DeprecationWarning,
        stacklevel=_first_frame_outside_the_import(),
    )
    if not any(isinstance(finder, _Alias) and finder.old == old for finder in sys.meta_path):
        sys.meta_path.insert(0, _Alias(old, new))
    sys.modules[old] = importlib.import_module(new)


def _first_frame_outside_the_import() -> int:
    """The ``stacklevel`` of the user's ``import`` statement, past importlib's frames and this package's."""
    frame = sys._getframe(2)
    level = 2
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith("<frozen importlib")
        or frame.f_globals.get("__name__", "").split(".")[0] in (*NEW_NAMES, "elastic_runtime")
    ):
        frame = frame.f_back
        level += 1
    return level
