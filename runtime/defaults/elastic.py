"""What a runtime gets unless told otherwise: :class:`ElasticRuntime`, with the recovery handlers of
``handlers/``, the checkpoint tiers the config names (``storage/``), the maintenance notice sources and their
handlers (``runtime/maintenance``), and multi-process worker mode (``runtime/cluster/worker``) wired in
through the same calls a user makes (``subscribe``, ``add_component``). To replace a link, pass
``default_handlers=False`` and subscribe your own.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from elastic_runtime.cluster.worker import is_worker, run_worker
from elastic_runtime.core.bus import EventBus
from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.errors import UnsupportedInMode
from elastic_runtime.core.eventlog import encode_event
from elastic_runtime.core.events import (
    DeviceLost,
    MaintenanceScheduled,
    MaintenanceStarted,
    MeshChanged,
    Notice,
    Preempted,
    SaveCheckpoint,
    ScaleUpAvailable,
    SilentCorruption,
)
from elastic_runtime.core.executor import RunResult
from elastic_runtime.core.job import TrainJob
from elastic_runtime.core.mesh import MeshPolicy
from elastic_runtime.core.runtime import Runtime
from elastic_runtime.handlers import (
    DrainScheduler,
    checkpoint_on_notice,
    checkpoint_on_preemption,
    drain_on_start,
    heal_silent_corruption,
    plan_drain,
    remesh_on_device_loss,
    restore_after_remesh,
    scale_up,
)
from elastic_runtime.handlers.drain_host import save_when_asked
from elastic_runtime.maintenance.intake import NoticeIntake
from elastic_runtime.maintenance.metadata import MetadataWatcher
from elastic_runtime.maintenance.source import BusContext, NoticeSource, require_working
from elastic_runtime.storage.cascade import TieredCheckpointer

if TYPE_CHECKING:
    from elastic_runtime.maintenance.pubsub import PubSubListener

__all__ = ["ElasticRuntime", "Maintenance", "attach_maintenance", "intake_from_config", "watch_own_host"]

log = logging.getLogger(__name__)


class ElasticRuntime(Runtime):
    """Runs one training job elastically, with the built-in handlers, tiers and notice sources wired in.

    Args:
        job: what to train.
        config: runtime settings (defaults work on a laptop).
        mesh_policy: mesh layout and shrink rules; default: every device on one ``data`` axis.
        default_handlers: subscribe the built-in re-mesh, restore, scale-up and maintenance handlers.
    """

    def __init__(
        self,
        job: TrainJob,
        *,
        config: RuntimeConfig | None = None,
        mesh_policy: MeshPolicy | None = None,
        default_handlers: bool = True,
    ) -> None:
        super().__init__(job, config=config, mesh_policy=mesh_policy)
        if default_handlers:
            wait = self.config.device_wait_s + self.config.handler_timeout_s
            self.subscribe(DeviceLost, remesh_on_device_loss, timeout=wait)
            self.subscribe(MeshChanged, restore_after_remesh)
            self.subscribe(ScaleUpAvailable, scale_up)
            self.subscribe(SilentCorruption, heal_silent_corruption, timeout=wait)
        # The durable checkpoint tiers (disk, GCS) the config asks for; None when it names none.
        self.checkpointer = TieredCheckpointer.from_config(self.config, self.executor.ram)
        if self.checkpointer is not None:
            self.checkpointer.attach(self)
        self.maintenance = attach_maintenance(self, default_handlers=default_handlers)
        # What is subscribed now is built in; what the script subscribes after this runs under launch too.
        self._builtin = {id(sub) for sub in self.bus.subscriptions}
        if default_handlers and is_worker():  # the controller's request before it drains a host, in every worker
            self.subscribe(SaveCheckpoint, save_when_asked)

    def run(self, steps: int, *, resume: bool = False, gather: bool = False) -> RunResult:
        """Run to ``steps`` committed steps in a new event loop (see :meth:`Runtime.run_async`).

        Under ``elastic-runtime launch`` this process is one worker of a multi-process group: the job runs
        as that worker (``elastic_runtime.cluster.worker.run_worker``) and ``run`` returns this process's result
        once the whole group finished (``RunResult.lead`` in process 0), so the code after it runs in every worker;
        the controller keeps the run's record. The final state stays where it trained, in every process's shards
        (and in the durable tier, with ``launch --durable``): ``RunResult.state`` is None, unless ``gather``, which
        gathers the whole state into the lead's memory for its ``RunResult.state`` (one more copy of the state
        there; every process runs the gather). Embedded, ``gather`` changes nothing: the state is in this process.
        The handlers the script subscribed (not the built-in ones: the controller re-forms the group) run in every
        worker for the group's events the controller forwards (``docs/handlers.md``, *Under launch*).
        """
        if is_worker():
            mine = [sub for sub in self.bus.subscriptions if id(sub) not in self._builtin]
            return run_worker(
                self.job,
                steps,
                handlers=mine,
                handler_timeout=self.config.handler_timeout_s,
                watch_notices=watch_own_host,
                script_settings=launch_owned(self.config, self.policy if self.policy_given else None, resume),
                fingerprint_every=self.config.fingerprint_every,
                gather=gather,
            )
        return super().run(steps, resume=resume)

    async def run_async(self, steps: int, *, resume: bool = False) -> RunResult:
        """See :meth:`Runtime.run_async`. Under ``elastic-runtime launch`` a worker runs in its process's main
        thread (it takes the signals a node drain sends): call :meth:`run` there.

        Raises:
            UnsupportedInMode: in a worker of ``elastic-runtime launch``.
        """
        if is_worker():
            raise UnsupportedInMode(
                "run_async under `elastic-runtime launch` (a worker of a multi-process group): call run(), which "
                "returns once the group finished"
            )
        return await super().run_async(steps, resume=resume)


def under_launch() -> bool:
    """Whether this process is a worker of ``elastic-runtime launch`` (or of a cluster's: SLURM, Ray, a Kubernetes
    Job). There :meth:`ElasticRuntime.run` makes it a member of the group, and the launch owns the run folder, the
    durable tier and the mesh: a script that sets them (``RuntimeConfig.run_dir``, ``checkpoint_dir``, a
    ``MeshPolicy``) is told they do not apply, or refused where they contradict the launch's, so a script run both
    ways sets them only when this is False."""
    return is_worker()


# The RuntimeConfig fields a worker of ``launch`` applies itself, as in one process.
APPLIED_IN_WORKERS = frozenset({"handler_timeout_s", "fingerprint_every"})


def launch_owned(config: RuntimeConfig, policy: MeshPolicy | None, resume: bool) -> dict[str, str]:
    """What the script set that ``elastic-runtime launch`` decides for the whole group: the run folder, the mesh,
    resuming, and every ``RuntimeConfig`` field off its default but those a worker applies itself
    (``APPLIED_IN_WORKERS``). The controller applies or refuses each (``Hello.settings``), or says what sets it
    instead (``ConfigOverridden``), so that none is ignored without a word."""
    default = RuntimeConfig()
    owned = {"run_dir": os.path.abspath(config.run_dir)} if config.run_dir else {}
    for name in RuntimeConfig.__struct_fields__:
        if name not in APPLIED_IN_WORKERS and name != "run_dir" and getattr(config, name) != getattr(default, name):
            owned[name] = str(getattr(config, name))
    if policy is not None:
        owned["mesh_policy"] = ",".join(f"{axis}={size}" for axis, size in policy.target_shape.items())
    if resume:
        owned["resume"] = "true"
    return owned


# --- maintenance notices -----------------------------------------------------------------------------


@dataclass
class Maintenance:
    """What :func:`attach_maintenance` added to a runtime (each part None when not configured)."""

    intake: NoticeIntake
    listener: PubSubListener | None = None
    watcher: MetadataWatcher | None = None
    scheduler: DrainScheduler | None = None
    sources: list[NoticeSource] = field(default_factory=list)


def intake_from_config(config: RuntimeConfig) -> NoticeIntake:
    """The intake for this job's instances: ``instances``, else the keys of ``instance_devices``."""
    instances = config.instances or tuple(config.instance_devices)
    if not instances and (config.maintenance_subscription or config.metadata_host):
        log.warning("maintenance notices: no instances configured, so notices for every instance count")
    return NoticeIntake(instances)


def attach_maintenance(runtime: Runtime, *, default_handlers: bool = True) -> Maintenance:
    """Add the configured notice sources as components and subscribe the built-in maintenance handlers.

    Sources start only when named in the config (``maintenance_subscription``, ``metadata_host``). With
    ``require_maintenance_notices`` each is checked before the first step: the run then raises ``ConfigError``
    (naming the source and why) when one does not work.
    """
    config = runtime.config
    parts = Maintenance(intake=intake_from_config(config))
    if config.maintenance_subscription:
        # google-cloud-pubsub only when a subscription is named
        from elastic_runtime.maintenance.pubsub import PubSubListener

        parts.listener = PubSubListener(
            config.maintenance_subscription, parts.intake, max_messages=config.pubsub_max_messages
        )
        runtime.add_component(parts.listener)
        parts.sources.append(parts.listener)
    if config.metadata_host:
        parts.watcher = MetadataWatcher(
            config.metadata_host, parts.intake, poll_timeout_s=config.metadata_poll_timeout_s
        )
        runtime.add_component(parts.watcher)
        parts.sources.append(parts.watcher)
    if config.require_maintenance_notices:

        async def check_sources(step: int) -> None:
            # An async hook makes every step hop to the event loop: once it ran it gives its place to a sync
            # no-op (in place, as the executor may be going through the list), and the steps run batched again.
            hooks = runtime.executor.hooks
            hooks[hooks.index(check_sources)] = _checked
            await require_working(parts.sources)

        runtime.at_step_boundary(check_sources)
    if default_handlers:
        # The checkpoint is asked for before the drain, so it saves the state the instance still holds.
        runtime.subscribe(MaintenanceScheduled, checkpoint_on_notice, priority=10)
        runtime.subscribe(MaintenanceStarted, checkpoint_on_notice, priority=10)
        runtime.subscribe(MaintenanceScheduled, plan_drain)
        runtime.subscribe(MaintenanceStarted, drain_on_start)
        runtime.subscribe(Preempted, checkpoint_on_preemption, priority=10)
        parts.scheduler = DrainScheduler()
        parts.scheduler.attach(runtime.context)
        runtime.add_component(parts.scheduler)
    return parts


def _checked(step: int) -> None:
    """What the start-up check of the notice sources leaves in its place among the boundary hooks."""


def watch_own_host(metadata_host: str, forward: Callable[[bytes], None]) -> None:
    """A worker's watch of its own host's notices (``elastic_runtime.cluster.worker.run_worker``'s ``watch_notices``):
    the metadata server at ``metadata_host`` long-polled by a :class:`MetadataWatcher` in an event loop of its
    own, each notice's JSON handed to ``forward`` (which sends it to the controller). Blocks until the process
    ends."""
    watcher = MetadataWatcher(metadata_host, NoticeIntake())

    async def send(event: Notice, ctx: Any) -> None:
        await anyio.to_thread.run_sync(forward, encode_event(event))

    async def main() -> None:
        bus = EventBus(handler_timeout=None)
        bus.subscribe(Notice, send)
        async with anyio.create_task_group() as tg:
            tg.start_soon(bus.run)
            await watcher.run(BusContext(bus))

    anyio.run(main)
