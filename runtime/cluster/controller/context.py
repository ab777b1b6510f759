"""The ``ctx`` a controller-side handler receives: the group, and the requests it may make.

Requests mean what they mean on a single-process ``RuntimeContext``; those about the state (it lives in the
workers) raise :class:`UnsupportedInMode` pointing to the script's own handlers, which run in every worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from elastic_runtime.cluster.config import LaunchConfig, Strategy
from elastic_runtime.core.errors import RecoveryError, UnsupportedInMode
from elastic_runtime.core.events import Event

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller import Controller

__all__ = ["ControllerContext"]


class ControllerContext:
    """What a controller-side handler sees as ``ctx``: the group, and the requests it may make."""

    def __init__(self, controller: Controller) -> None:
        self._c = controller

    @property
    def config(self) -> LaunchConfig:
        """The launch's configuration."""
        return self._c.config

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


_IN_WORKERS = (
    "the state lives in the workers; subscribe the handler on the training script's runtime, where it runs in "
    "every worker at the same step boundary (docs/handlers.md, Under launch)"
)
