"""Controller-side handlers named on the command line: ``--handlers package.module:function``.

The named function is an ordinary handler, ``async def function(event, ctx)``, subscribed on the controller's
bus for the event type its first parameter is annotated with (a union subscribes it to each; no annotation:
every event), with a :class:`~elastic_runtime.cluster.controller.context.ControllerContext` as ``ctx``. It runs once per
event: the controller is the one process where the group's events exist once. The module is looked for in the
training script's folder first, then the current folder, then the rest of the path: a ``handlers.py`` beside the
script is the one loaded, and every error names the file that was.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from elastic_runtime.core.bus import EventBus, Handler
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.events import Event

__all__ = ["load_handler", "script_folder", "subscribe_named"]


def script_folder(command: Sequence[str]) -> str | None:
    """The folder of the training script ``command`` runs (its first ``.py`` argument), None if it names none."""
    script = next((arg for arg in command if arg.endswith(".py") and Path(arg).is_file()), None)
    return str(Path(script).resolve().parent) if script else None


def load_handler(spec: str, first: Sequence[str] = ()) -> tuple[tuple[type[Event], ...], Handler[Any]]:
    """The event types and the handler ``spec`` (``package.module:function``) names, its module looked for in the
    folders ``first``, then the current folder, before the rest of the path.

    Raises:
        ConfigError: the spec is malformed, its module or function is not found, the function is not an
            ``async def``, or its first parameter is annotated with something other than event types.
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"--handlers {spec!r}: name a handler as package.module:function")
    for folder in reversed([*first, os.getcwd()]):
        if folder in sys.path:
            sys.path.remove(folder)
        sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--handlers {spec!r}: cannot import {module_name}: {exc}") from exc
    loaded = f"{spec!r} ({module_name} from {getattr(module, '__file__', None) or 'no file'})"
    handler = getattr(module, name, None)
    if handler is None:
        raise ConfigError(f"--handlers {loaded}: {module_name} has no {name}")
    if not inspect.iscoroutinefunction(handler):
        raise ConfigError(f"--handlers {loaded}: a handler is an `async def {name}(event, ctx)`")
    params = list(inspect.signature(handler).parameters)
    if len(params) < 2:
        raise ConfigError(f"--handlers {loaded}: a handler takes (event, ctx)")
    annotation = typing.get_type_hints(handler).get(params[0], Event)
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if not all(isinstance(kind, type) and issubclass(kind, Event) for kind in kinds):
        raise ConfigError(f"--handlers {loaded}: its event parameter is annotated {annotation!r}, not event types")
    return tuple(kinds), handler


def subscribe_named(bus: EventBus, specs: Iterable[str], first: Sequence[str] = ()) -> None:
    """Subscribe every handler ``specs`` names on ``bus`` (the controller's), each module looked for in the
    folders ``first`` before the current folder and the rest of the path."""
    for spec in specs:
        kinds, handler = load_handler(spec, first)
        for kind in kinds:
            bus.subscribe(kind, handler)
