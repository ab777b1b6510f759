"""What a multi-process controller gets unless told otherwise: the built-in straggler handler,
the controller's maintenance notice source and drain handlers, the config's process faults and named handlers.

It imports no JAX (nor anything that does): a controller never runs a step, and starts its workers sooner
without JAX's import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from elastic_runtime.cluster.config import LaunchConfig
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.events import Straggler
from elastic_runtime.faults.process import ProcessFaults
from elastic_runtime.handlers.drain_host import HostDrains
from elastic_runtime.handlers.regroup import replace_straggler
from elastic_runtime.maintenance.intake import NoticeIntake
from elastic_runtime.maintenance.source import BusContext, require_working

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller import Controller
    from elastic_runtime.cluster.controller.ray_backend import RayPlacement

__all__ = ["attach_controller_maintenance", "default_controller", "ray_controller"]


def default_controller(config: LaunchConfig) -> Controller:
    """A multi-process controller (its supervisor replaces a lost or hung worker) that replaces the stragglers it
    chose to (and injects the config's process faults, if any), with the handlers ``config.handlers`` names after
    the built-in one.

    Raises:
        ConfigError: a handler ``config.handlers`` names cannot be loaded (before any worker starts).
    """
    from elastic_runtime.cluster.controller import Controller  # the controller (and GCS) only where a controller runs
    from elastic_runtime.cluster.controller.named_handlers import script_folder, subscribe_named

    controller = Controller(config)
    if config.faults:
        ProcessFaults(config.faults).attach(controller.bus)
    controller.bus.subscribe(Straggler, replace_straggler)
    attach_controller_maintenance(controller)
    script = script_folder(config.command)
    subscribe_named(controller.bus, config.handlers, first=[script] if script else [])
    return controller


def attach_controller_maintenance(controller: Controller, *, default_handlers: bool = True) -> HostDrains | None:
    """The controller's notice source (``config.maintenance_subscription``) and the drain handlers
    (``handlers/drain_host.py``), which map a notice to the workers on its instance. ``default_handlers=False``
    leaves the handlers out, for your own on ``controller.bus`` (with ``ctx.drain``, ``ctx.readmit``). With
    ``config.require_maintenance_notices`` a subscription that cannot be read at start ends the run with a
    ``ConfigError`` naming it and why."""
    config = controller.config
    if config.maintenance_subscription:
        # google-cloud-pubsub only when a subscription is named
        from elastic_runtime.maintenance.pubsub import PubSubListener

        project = config.maintenance_subscription.split("/")[1]
        intake = NoticeIntake(project=project, report_ignored=True)
        listener = PubSubListener(config.maintenance_subscription, intake)
        controller.companions.append(lambda: listener.run(BusContext(controller.bus)))
        if config.require_maintenance_notices:

            async def check_listener() -> None:
                try:
                    await require_working([listener])
                except ConfigError as exc:
                    controller.end(exc)

            controller.companions.append(check_listener)
    if not default_handlers:
        return None
    drains = HostDrains()
    drains.attach(controller.bus)
    controller.companions.append(lambda: drains.run(controller.context))
    return drains


def ray_controller(
    config: LaunchConfig, command: list[str], *, env: dict[str, str] | None = None, replica_dir: str | None = None
) -> tuple[Controller, RayPlacement]:
    """A service-mode controller (``config.command`` empty) whose workers Ray places, one actor per node, each
    running ``command``; a lost one is replaced on another node (:class:`RayPlacement` says what ``env`` and
    ``replica_dir`` do). Connect to Ray first (``elastic_runtime.cluster.controller.ray_cluster.ray_session``); after
    ``controller.run()``, ``placement.close()``."""
    from elastic_runtime.cluster.controller.ray_backend import RayPlacement

    controller = default_controller(config)
    placement = RayPlacement(
        command, nprocs=config.nprocs, logs=controller.run_dir / "workers", env=env, replica_dir=replica_dir
    )
    placement.attach(controller)
    return controller, placement
