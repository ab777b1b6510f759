"""Controller-side handlers named on the command line: ``--handlers package.module:function``.

The named function is an ordinary handler, ``async def function(event, ctx)``, subscribed on the controller's
bus for the event type its first parameter is annotated with (a union subscribes it to each; no annotation:
every event), with a :class:`~runtime.cluster.controller.context.ControllerContext` as ``ctx``. It runs once per
event: the controller is the one process where the group's events exist once. The module is imported as
``python -m`` would (the current folder first on the path), so a handler beside the training script is found.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
import typing
from collections.abc import Iterable
from typing import Any

from runtime.core.bus import EventBus, Handler
from runtime.core.errors import ConfigError
from runtime.core.events import Event

__all__ = ["load_handler", "subscribe_named"]


def load_handler(spec: str) -> tuple[tuple[type[Event], ...], Handler[Any]]:
    """The event types and the handler ``spec`` (``package.module:function``) names.

    Raises:
        ConfigError: the spec is malformed, its module or function is not found, the function is not an
            ``async def``, or its first parameter is annotated with something other than event types.
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ConfigError(f"--handlers {spec!r}: name a handler as package.module:function")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"--handlers {spec!r}: cannot import {module_name}: {exc}") from exc
    handler = getattr(module, name, None)
    if handler is None:
        raise ConfigError(f"--handlers {spec!r}: {module_name} has no {name}")
    if not inspect.iscoroutinefunction(handler):
        raise ConfigError(f"--handlers {spec!r}: a handler is an `async def {name}(event, ctx)`")
    params = list(inspect.signature(handler).parameters)
    if len(params) < 2:
        raise ConfigError(f"--handlers {spec!r}: a handler takes (event, ctx)")
    annotation = typing.get_type_hints(handler).get(params[0], Event)
    kinds = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    if not all(isinstance(kind, type) and issubclass(kind, Event) for kind in kinds):
        raise ConfigError(f"--handlers {spec!r}: its event parameter is annotated {annotation!r}, not event types")
    return tuple(kinds), handler


def subscribe_named(bus: EventBus, specs: Iterable[str]) -> None:
    """Subscribe every handler ``specs`` names on ``bus`` (the controller's)."""
    for spec in specs:
        kinds, handler = load_handler(spec)
        for kind in kinds:
            bus.subscribe(kind, handler)
