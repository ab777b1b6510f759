"""Who may join the run: an authenticated connection's ``Hello`` is taken only from a worker this controller
started (its id, not connected yet, its process), or in the service mode from a worker with an id never seen in
this run; and only when it asks for the run's target step.
"""

from __future__ import annotations

import logging
from pathlib import Path

from elastic_runtime.cluster.controller.connection import Connection
from elastic_runtime.cluster.controller.processes import WorkerProcess, descends_from
from elastic_runtime.cluster.controller.state import ControllerState
from elastic_runtime.cluster.controller.supervision import WorkerChanged
from elastic_runtime.cluster.controller.workers import warm_spares
from elastic_runtime.cluster.protocol import Hello, Message, Stop
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.events import ConfigOverridden

__all__ = ["admit", "external_hello", "hello"]

log = logging.getLogger(__name__)

_MAX_WORKER_ID = 2**31 - 1  # ids a worker not started here may claim


async def hello(controller: ControllerState, message: Message, stream: Connection, peer: str) -> WorkerProcess | str:
    """The worker an authenticated connection's first message names, or why it is refused."""
    if not isinstance(message, Hello):
        return f"first message must be Hello, got {type(message).__name__}"
    if not controller.config.starts_workers:
        return await external_hello(controller, message, stream)
    proc = controller.pool.get(message.worker)
    if proc is None or proc.stream is not None or proc.gone:
        return f"worker id {message.worker} was not started by this controller, is already connected, or is gone"
    if not descends_from(message.pid, proc.pid):
        # A cross-check, not a proof (the pid is what the peer says): the secret is the proof.
        return f"worker {message.worker} is process {proc.pid}, not {message.pid}"
    if controller.target_steps >= 0 and message.target_steps != controller.target_steps:
        target = controller.target_steps
        why = f"worker {message.worker} asks for {message.target_steps} steps; this run's target is {target}"
        # Our own process (it proved the secret, its pid checks out): the worker command disagrees with the
        # run, and every replacement would too. End the run rather than replace workers forever.
        controller.end(ConfigError(f"{why}: the worker command and `launch --steps` must agree"))
        return why
    if not controller.settings_checked:
        controller.settings_checked = True
        refused = await apply_settings(controller, message.settings)
        if refused:
            controller.end(ConfigError(refused))
            return refused
    return await admit(controller, proc, message, stream)


# Of what a script may set itself (its RuntimeConfig, its MeshPolicy), what the launch does instead: the flag that
# sets it, or why it has no effect there. Every RuntimeConfig field but those a worker applies itself
# (``elastic_runtime.defaults.elastic.APPLIED_IN_WORKERS``), ``run_dir`` and ``resume`` (refused when they
# contradict the launch) is here; ``tests/test_config.py`` checks it.
OVERRIDDEN = {
    "mesh_policy": "--nprocs, --slices and --local-devices set the group's mesh (the job's process_mesh on them)",
    "checkpoint_dir": "--durable DIR sets the group's durable tier",
    "disk_every": "--durable-every sets it",
    "keep": "--durable-keep sets it",
    "gcs_uri": "--durable gs://BUCKET/PREFIX sets the group's durable tier",
    "gcs_every": "--durable-every sets it",
    "gcs_workers": "the group's durable checkpoint is written by the first slice's processes, each its own part",
    "checkpoint_timeout_s": "the group's durable writes have no timeout of their own (--durable)",
    "checkpoint_on_finish": "the run's last step always goes to the durable tier (--durable)",
    "ram_dir": "--replica-dir sets it",
    "snapshot_every": "every member keeps each committed step in RAM; --replica-file-every sets its files' cadence",
    "snapshot_mtbf_s": "every member keeps each committed step in RAM; --replica-file-every sets its files' cadence",
    "max_failures": "--max-failures sets the group's failure budget",
    "recovery_timeout_s": "--form-timeout and --hang-timeout bound a re-forming",
    "max_pending_events": "no effect: the controller holds the group's events",
    "device_wait_s": "no effect: a lost device is its worker's loss, and the controller re-forms the group",
    "device_poll_s": "no effect: a lost device is its worker's loss, and the controller re-forms the group",
    "scale_up_poll_s": "no effect: the group grows back when a replacement joins",
    "precompile": "the group one slice smaller is always prepared while this one trains",
    "compile_cache": "the launch's workers share one compilation cache, beside their replica files",
    "event_batch_s": "no effect: a worker reports every step to the controller",
    "check_data": "not done under launch: the batches read are not fingerprinted there",
    "progress": "the controller prints the group's progress; --quiet turns it off",
    "progress_every_s": "the controller prints a line about the group's steps every 10 s",
    "maintenance_subscription": "--maintenance-subscription sets the controller's",
    "require_maintenance_notices": "--require-maintenance-notices sets it",
    "drain_lead_s": "--drain-lead sets it",
    "metadata_host": "each worker watches its own host's metadata server when ELASTIC_METADATA_HOST is set",
    "instances": "each worker's instance is the host it runs on, as its Hello names it",
    "instance_devices": "each worker's instance is the host it runs on, as its Hello names it",
    "maintenance_checkpoint_tiers": "a drained host's group writes its durable checkpoint (--durable)",
    "preemption_checkpoint_tiers": "a drained host's group writes its durable checkpoint (--durable)",
    "pubsub_max_messages": "the controller's notice source sets its own",
    "metadata_poll_timeout_s": "the controller's notice source sets its own",
}


async def apply_settings(controller: ControllerState, settings: dict[str, str]) -> str:
    """The training script's own settings of what the launch sets for the group (``Hello.settings``), from the
    first worker that says hello: each is applied, or refused (the returned reason ends the run), or announced as
    overridden (``ConfigOverridden``, on the console too). Nothing the script set is ignored without a word."""
    where = settings.get("run_dir")
    ours = controller.run_dir.resolve()
    if where is not None and controller.config.starts_workers and Path(where).resolve() != ours:
        if controller.config.run_dir:  # two run folders named: which one the user meant is not ours to guess
            return (
                f"the training script's RuntimeConfig.run_dir={where!r} is not the launch's run folder "
                f"(`--run-dir` {ours}): give the launch `--run-dir {where}`, or leave RuntimeConfig.run_dir unset"
            )
        flag = f"--run-dir sets it (this run's folder: {ours}; give `--run-dir {where}` to use the script's)"
        await controller.bus.publish(ConfigOverridden(source="controller", setting="run_dir", value=where, flag=flag))
    if settings.get("resume") and not controller.config.resume:
        return (
            "the training script asks for run(resume=True); under launch resuming is the launch's: start it with "
            "`launch --resume --run-dir DIR` (the run folder of the run to go on with)"
        )
    for setting, value in settings.items():
        if setting not in ("run_dir", "resume"):
            instead = OVERRIDDEN.get(setting, "no effect under launch")
            overridden = ConfigOverridden(source="controller", setting=setting, value=value, flag=instead)
            await controller.bus.publish(overridden)
    return ""


async def external_hello(controller: ControllerState, message: Hello, stream: Connection) -> WorkerProcess | str:
    """A worker the controller did not start: any id not seen before in this run (ids are never reused, so
    that nothing the lost worker's connection still says can be taken for its replacement's); 0..N-1 are
    the first group's, a replacement takes a new one (see ``docs/multiprocess.md``, *Several hosts*)."""
    if not 0 <= message.worker <= _MAX_WORKER_ID:
        return f"worker id {message.worker} is out of range"
    if message.worker in controller.pool.procs:
        return f"worker id {message.worker} is already connected or was lost; a replacement takes a new id"
    if controller.target_steps >= 0 and message.target_steps != controller.target_steps:
        target = controller.target_steps
        return f"worker {message.worker} asks for {message.target_steps} steps; this run's target is {target}"
    return await admit(controller, controller.pool.admit(message.worker), message, stream)


async def admit(controller: ControllerState, proc: WorkerProcess, message: Hello, stream: Connection) -> WorkerProcess:
    proc.stream, proc.hello = stream, message
    if controller.stopping:
        await controller.server.send(proc, Stop(reason="the run is over"))
        return proc
    if controller.supervisor.restored:
        await warm_spares(controller)
    if controller.target_steps < 0:
        controller.target_steps = message.target_steps  # the first of the controller's own workers to say hello
    controller.monitor.register(proc.worker)
    controller.dead_before_hello = 0
    controller.feed(WorkerChanged(proc.worker))
    return proc
