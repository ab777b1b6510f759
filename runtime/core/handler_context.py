"""What every handler's ``ctx`` has, in every mode: embedded (``RuntimeContext``), in a worker under
``elastic-runtime launch`` (``WorkerContext``) and on the controller (``ControllerContext``).

A handler typed with :class:`HandlerContext` runs in any of them. A request a mode cannot carry out raises
:class:`~elastic_runtime.core.errors.UnsupportedInMode` naming the request and the mode; none is a silent no-op
(``docs/handlers.md`` has the table). No JAX here: the controller, which never imports it, has a context too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from elastic_runtime.core.events import Event

if TYPE_CHECKING:
    from jax.sharding import Mesh

__all__ = ["HandlerContext", "Mode"]

Mode = Literal["embedded", "worker", "controller"]


@runtime_checkable
class HandlerContext(Protocol):
    """The members every handler's ``ctx`` has, in every mode (see the module's docstring)."""

    @property
    def mode(self) -> Mode:
        """Where the handler runs: ``embedded`` (one process), ``worker`` (each process of a ``launch`` group),
        ``controller`` (``launch --handlers``)."""
        ...

    @property
    def lead(self) -> bool:
        """True in one process for each event: the only one embedded, process 0 of a group, the controller.
        For side effects wanted once (a message, a file); state changes must run in every process."""
        ...

    @property
    def step(self) -> int:
        """The newest committed step (of the whole group, under ``launch``)."""
        ...

    @property
    def process_id(self) -> int:
        """This process's index in the group: 0 embedded; -1 on the controller, which is no member."""
        ...

    @property
    def num_processes(self) -> int:
        """The group's processes: 1 embedded."""
        ...

    @property
    def mesh(self) -> Mesh | None:
        """The mesh the steps run on now; None before the first one, and on the controller (which runs no JAX)."""
        ...

    @property
    def recovering(self) -> bool:
        """True from a failure until the next committed step."""
        ...

    async def publish(self, event: Event) -> None:
        """Put ``event`` on the run's bus and into its event log (once per event, from the lead, in a group)."""
        ...

    async def request_checkpoint(self, tiers: tuple[str, ...] = (), reason: str = "") -> None:
        """A durable checkpoint of the newest committed step (``tiers``: by name; all durable ones by default)."""
        ...

    def transform_state(self, fn: Callable[[Any], Any], reason: str = "") -> None:
        """Replace the state with ``fn(state)`` at the next step boundary (in every process of a group)."""
        ...

    def abort(self, reason: str) -> None:
        """Give up: the run ends with ``RecoveryError(reason)``."""
        ...

    def pause(self, reason: str = "") -> None:
        """Stop running steps at the next boundary until :meth:`resume`."""
        ...

    def resume(self, reason: str = "") -> None:
        """Run steps again after :meth:`pause` or a recovery."""
        ...

    def remesh(self, mesh: Mesh, reason: str = "") -> None:
        """Move to ``mesh`` at the next boundary."""
        ...

    def restore(self, source: str = "latest") -> None:
        """Restore onto the current mesh from ``source`` (a tier, or ``latest``)."""
        ...

    def cordon(self, devices: tuple[int, ...]) -> None:
        """Treat ``devices`` as unhealthy until :meth:`uncordon`."""
        ...

    def uncordon(self, devices: tuple[int, ...]) -> None:
        """Let ``devices`` count as healthy again."""
        ...

    async def healthy_devices(self) -> list[Any]:
        """Probe every device; the healthy ones."""
        ...
