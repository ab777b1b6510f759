"""The buffers a worker's step writes its new state into: those of a replica replaced unread, two steps back, so
that a step takes no fresh memory (``elastic_runtime.core.compiler``, ``into_spare``).

The RAM replica of each committed step is that step's state on the devices
(``elastic_runtime.storage.replicas.device_replica``); when the next commit replaces it and no one has read it (no
restore, no durable write, no neighbour copy took its host copy) its arrays are handed back here. Fresh memory for every
step's state cost the most on CPU devices, where it is pages the kernel faults in and zeroes (docs/benchmarks.md,
"Multi-process steady state").
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import jax

PyTree = Any

__all__ = ["SpareStates"]


class SpareStates:
    """States no one holds any more, of the current group: handed back by replicas (:meth:`hand_back`), taken by
    the next step (:meth:`take`). Replicas may be dropped in any thread (a replica writer's)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spares: deque[PyTree] = deque(maxlen=1)  # a step takes one; more would be held for nothing
        self._generation = -1
        self._fresh: Callable[[], PyTree] | None = None

    @property
    def on(self) -> bool:
        """Whether this group's step takes a spare (its compiled step has the third argument)."""
        return self._fresh is not None

    def reset(self, generation: int, fresh: Callable[[], PyTree] | None) -> None:
        """A new group: spares of the old one are on its backend, and its layout may differ. ``fresh`` makes
        new buffers on this group's mesh; None: its step takes none."""
        with self._lock:
            self._generation, self._fresh = generation, fresh
            self._spares.clear()

    def hand_back(self, generation: int) -> Callable[[PyTree], None]:
        """What a replica made by group ``generation`` calls with its state once it is dropped unread."""

        def back(state: PyTree) -> None:
            with self._lock:
                if generation == self._generation:  # one of an old group comes too late: it is dropped
                    self._spares.append(state)

        return back

    def take(self, live: PyTree) -> PyTree:
        """Buffers for the next step's new state: a spare none of whose arrays is one of ``live`` (the state the
        step reads: jit hands an input it returns unchanged back as the same array), else fresh ones."""
        held = {id(leaf) for leaf in jax.tree.leaves(live)}
        with self._lock:
            fresh = self._fresh
            while self._spares:
                spare = self._spares.pop()
                if held.isdisjoint(id(leaf) for leaf in jax.tree.leaves(spare)):
                    return spare
        assert fresh is not None, "take before reset"
        return fresh()
