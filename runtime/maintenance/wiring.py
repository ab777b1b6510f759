"""Plug maintenance notices into a runtime from its config: sources, the drain scheduler and the handlers.

Called by :class:`~runtime.runtime.ElasticRuntime` when it is built. Sources start only when named in the
config (``maintenance_subscription``, ``metadata_host``); the handlers are subscribed with the other
built-in handlers and can be replaced like them (``default_handlers=False``, then subscribe your own).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runtime.config import RuntimeConfig
from runtime.events import MaintenanceScheduled, MaintenanceStarted, Preempted
from runtime.maintenance.intake import NoticeIntake

if TYPE_CHECKING:
    from handlers.maintenance import DrainScheduler
    from runtime.maintenance.metadata import MetadataWatcher
    from runtime.maintenance.pubsub import PubSubListener
    from runtime.runtime import ElasticRuntime

__all__ = ["Maintenance", "attach_maintenance", "intake_from_config"]

log = logging.getLogger(__name__)


@dataclass
class Maintenance:
    """What :func:`attach_maintenance` added to a runtime (each part None when not configured)."""

    intake: NoticeIntake
    listener: PubSubListener | None = None
    watcher: MetadataWatcher | None = None
    scheduler: DrainScheduler | None = None
    sources: list[object] = field(default_factory=list)


def intake_from_config(config: RuntimeConfig) -> NoticeIntake:
    """The intake for this job's instances: ``instances``, else the keys of ``instance_devices``."""
    instances = config.instances or tuple(config.instance_devices)
    if not instances and (config.maintenance_subscription or config.metadata_host):
        log.warning("maintenance notices: no instances configured, so notices for every instance count")
    return NoticeIntake(instances)


def attach_maintenance(runtime: ElasticRuntime, *, default_handlers: bool = True) -> Maintenance:
    """Add the configured notice sources as components and subscribe the built-in maintenance handlers."""
    config = runtime.config
    parts = Maintenance(intake=intake_from_config(config))
    if config.maintenance_subscription:
        from runtime.maintenance.pubsub import PubSubListener

        parts.listener = PubSubListener(
            config.maintenance_subscription, parts.intake, max_messages=config.pubsub_max_messages
        )
        runtime.add_component(parts.listener)
        parts.sources.append(parts.listener)
    if config.metadata_host:
        from runtime.maintenance.metadata import MetadataWatcher

        parts.watcher = MetadataWatcher(
            config.metadata_host, parts.intake, poll_timeout_s=config.metadata_poll_timeout_s
        )
        runtime.add_component(parts.watcher)
        parts.sources.append(parts.watcher)
    if default_handlers:
        from handlers.maintenance import (
            DrainScheduler,
            checkpoint_on_notice,
            checkpoint_on_preemption,
            drain_on_start,
            plan_drain,
        )

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
