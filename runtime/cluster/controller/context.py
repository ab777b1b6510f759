"""The ``ctx`` a controller-side handler receives: the group, and the requests it may make.

A :class:`~elastic_runtime.core.context.HandlerContext` with the controller's own requests besides (drain, kill,
regroup ...). Requests mean what they mean on a single-process ``RuntimeContext``; those about the state or the
devices (they live in the workers) raise :class:`UnsupportedInMode` pointing to the script's own handlers, which
run in every worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from elastic_runtime.cluster.config import LaunchConfig, Strategy
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.core.errors import RecoveryError, UnsupportedInMode
from elastic_runtime.core.events import Event
from elastic_runtime.core.handler_context import Mode

__all__ = ["ControllerContext"]


class ControllerContext:
    """What a controller-side handler sees as ``ctx``: the group, and the requests it may make."""

    def __init__(self, controller: ControllerState) -> None:
        self._c = controller

    @property
    def config(self) -> LaunchConfig:
        """The launch's configuration."""
        return self._c.config

    @property
    def mode(self) -> Mode:
        """``controller``: the one process where the group's events exist once."""
        return "controller"

    @property
    def lead(self) -> bool:
        """Always True: a controller-side handler runs once per event."""
        return True

    @property
    def process_id(self) -> int:
        """-1: the controller is no process of the group."""
        return -1

    @property
    def num_processes(self) -> int:
        """The group's processes (its members)."""
        return len(self._c.members)

    @property
    def mesh(self) -> None:
        """None: the controller runs no JAX (the group's mesh is in ``RunStarted`` and ``MeshChanged``)."""
        return None

    @property
    def recovering(self) -> bool:
        """True from a failure until the re-formed group's first committed step."""
        return self._c.recovery.current is not None

    @property
    def step(self) -> int:
        """The newest step the whole group committed."""
        return self._c.group_step

    @property
    def members(self) -> tuple[int, ...]:
        """Worker ids of the current group, in process-id order."""
        return tuple(self._c.members)

    @property
    def instances(self) -> dict[int, str]:
        """Where each connected worker still counted on runs: worker id -> its instance (host), as its Hello
        said ("" when it did not say)."""
        return {
            proc.worker: proc.hello.instance
            for proc in self._c.pool
            if proc.hello is not None and not proc.gone and not proc.closed
        }

    @property
    def cordoned(self) -> frozenset[str]:
        """Instances whose workers are kept out of the group (``drain``) until ``readmit``."""
        return frozenset(self._c.supervisor.cordoned)

    def drain(self, instance: str, reason: str) -> None:
        """Take the members on ``instance`` out of the group at a planned step boundary (every other member
        keeps its state in memory: nothing is lost or counted as a failure), and seat no worker of ``instance``
        until :meth:`readmit`. Queued; done by the controller's supervisor once the group is training."""
        self._c.request_drain(instance, reason)

    def readmit(self, instance: str) -> None:
        """Workers on ``instance`` may be seated again; the group grows back when one is ready."""
        self._c.readmit(instance)

    async def publish(self, event: Event) -> None:
        """Put ``event`` on the controller's bus: logged and delivered to the controller's handlers."""
        await self._c.bus.publish(event)

    def kill(self, worker: int, reason: str) -> None:
        """SIGKILL ``worker`` (a hung or stopped worker must not come back half-way through a re-forming)."""
        self._c.kill(worker, "KILL", reason)

    def signal(self, worker: int, signal: str, reason: str) -> None:
        """Send ``SIG<signal>`` (``KILL``, ``STOP``, ``TERM``) to ``worker``'s process; logged as WorkerKilled."""
        self._c.kill(worker, signal, reason)

    def replace(self, worker: int, reason: str) -> None:
        """Take member ``worker`` out of the group at a planned step, a ready spare in its seat (nothing is lost
        or counted as a failure; while no spare is ready and the group is at ``min_nprocs``, one is started and the
        worker stays). Queued; done by the controller's supervisor once the group is training."""
        self._c.request_leave(worker, reason)

    def regroup(self, lost: Iterable[int], reason: str, strategy: Strategy | None = None) -> None:
        """Replace ``lost`` workers and re-form the group (queued; done by the controller's supervisor)."""
        self._c.request_regroup(set(lost), reason, strategy)

    def abort(self, reason: str) -> None:
        """Give up: every worker is stopped and the run ends with RecoveryError(reason)."""
        self._c.end(RecoveryError(f"aborted by a controller-side handler: {reason}", last_committed_step=self.step))

    def transform_state(self, fn: Callable[[Any], Any], reason: str = "") -> None:
        """Not on the controller, which holds no state: the training script's own handlers can.

        Raises:
            UnsupportedInMode: always.
        """
        raise UnsupportedInMode(f"ctx.transform_state is not available on the controller: {_IN_WORKERS}")

    async def request_checkpoint(self, tiers: tuple[str, ...] = (), reason: str = "") -> None:
        """Not on the controller: the training script's own handlers ask for a durable checkpoint.

        Raises:
            UnsupportedInMode: always.
        """
        raise UnsupportedInMode(f"ctx.request_checkpoint is not available on the controller: {_IN_WORKERS}")

    def _unsupported(self, request: str) -> NoReturn:
        raise UnsupportedInMode(f"ctx.{request} is not available on the controller: {_IN_WORKERS}")

    def pause(self, reason: str = "") -> None:
        """Not on the controller: members that stop stepping are the script's to pause (raises)."""
        self._unsupported("pause")

    def resume(self, reason: str = "") -> None:
        """Not on the controller (raises UnsupportedInMode)."""
        self._unsupported("resume")

    def remesh(self, mesh: Any, reason: str = "") -> None:
        """Not on the controller, which forms the group from processes: ``regroup`` or ``drain`` (raises)."""
        self._unsupported("remesh")

    def restore(self, source: str = "latest") -> None:
        """Not on the controller, which picks every re-formed group's restore itself (raises)."""
        self._unsupported("restore")

    def cordon(self, devices: tuple[int, ...]) -> None:
        """Not on the controller, which replaces processes, not devices: ``drain`` a host (raises)."""
        self._unsupported("cordon")

    def uncordon(self, devices: tuple[int, ...]) -> None:
        """Not on the controller: ``readmit`` a host (raises UnsupportedInMode)."""
        self._unsupported("uncordon")

    async def healthy_devices(self) -> list[Any]:
        """Not on the controller, which sees no device (raises UnsupportedInMode)."""
        self._unsupported("healthy_devices")


_IN_WORKERS = (
    "the state lives in the workers; subscribe the handler on the training script's runtime, where it runs in "
    "every worker at the same step boundary (docs/handlers.md, Under launch)"
)
