"""The settings and outcome of a multi-process run, and the strategies a re-forming group may take."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from elastic_runtime.core.config import (
    NonNegative,
    Port,
    Positive,
    Seconds,
    SecondsOrZero,
    check_ranges,
    check_subscription,
)
from elastic_runtime.core.errors import ConfigError
from elastic_runtime.core.retry import Backoff, RetryPolicy
from elastic_runtime.faults.grammar import Fault

__all__ = ["LaunchConfig", "LaunchError", "LaunchResult", "Strategy"]


class Strategy(StrEnum):
    """How a group is formed. ``REFORM`` and ``RESTART`` are the recovery strategies a user may choose."""

    START = "start"  # the first group
    GROW = "grow"  # a spare joins a smaller group at a planned step
    DRAIN = "drain"  # members on a host about to go down leave the group at a planned step
    REFORM = "reform"  # survivors re-initialize jax.distributed in-process; replacements take state from peers
    RESTART = "restart"  # every worker process replaced, state from the replica files in /dev/shm


RECOVERY_STRATEGIES = (Strategy.REFORM, Strategy.RESTART)


class LaunchError(RuntimeError):
    """The run could not go on: too few workers, or a group that never formed. (Too many failures, or a step
    that keeps failing, is a ``RecoveryError``; an error in the user's code a ``StepError``.)"""


_ORIGIN = "launch config"  # how its errors start: "launch config: nprocs=0 is out of range (must be >= 1)"


class LaunchConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Settings of one multi-process run.

    Attributes:
        command: the worker command line (``python train.py ...``); empty: the controller starts no worker and
            coordinates those that say hello on their own (``elastic-runtime controller``, the service mode).
        nprocs: the group's full size.
        min_nprocs: the smallest group training may go on with while replacements start.
        spares: warm spare processes kept ready to replace a lost worker at once.
        local_devices: CPU devices per worker process.
        slices: how many slices the group's processes form (0: one per process). A slice is a fixed group of
            ``nprocs // slices`` processes holding one copy of the state, sharded over its processes (the
            ``model`` axis); slices replicate each other (``data``). Losing a process loses its slice until a
            replacement takes the process's place; ``min_nprocs`` then counts whole slices.
        heartbeat_interval_s, heartbeat_timeout_s, heartbeat_start_timeout_s, hang_timeout_s: see
            :class:`HeartbeatMonitor`. 0.8 s of silence loses a training worker (under the chaos loop's load its
            longest silence was 0.29 s); 2 s (never less than the first) one that has not stepped in its group
            yet: joining, restoring, compiling, where long silences were seen (a first compile starved of CPU
            at load 2.5: 2.03 s). docs/benchmarks.md, *Heartbeat timeouts under load*, has the figures.
        strategy: "reform" (in-process re-forming, falling back to "restart") or "restart" always.
        form_timeout_s: how long a new group may take to form before its stragglers are replaced.
        spawn_timeout_s: how long a re-forming waits for replacements before going on with ``min_nprocs``.
        start_timeout_s: how long the first group may take to start.
        max_failures: failures the run survives: every lost or hung member counts, also one lost during a
            recovery.
        retry: when a step that failed is tried again, and when the run gives up on it
            (:mod:`elastic_runtime.core.retry`; default: 3 failures of one step, backing off 0, 0.5 s).
        run_dir: event log, worker logs and ``summary.json``; a temporary directory when unset. The run
            folder names the run: an unfinished run in it is continued (``runtime/cluster/controller/runfolder.py``).
        replica_dir: the workers' replica files; default ``/dev/shm/elastic-runtime-<hash of run_dir>``,
            removed when the controller ends (it stays only when the controller itself was killed).
        resume: require an unfinished run in ``run_dir`` to continue (raise ValueError if there is none).
        drain_timeout_s: on SIGTERM/SIGINT or at the end of a failed run, how long workers get to stop before
            SIGKILL.
        finish_timeout_s: after a finished run, how long the workers' scripts may go on after ``run()`` returned
            (an evaluation, a save) before SIGKILL.
        grace_s: on SIGTERM/SIGINT with a durable tier, how long after the signal the group may take to hold
            and commit a durable checkpoint of its newest step (``controller/drain.py``); within a scheduler's
            grace period (Kubernetes: 30 s by default).
        result_path: a folder where process 0 commits the final state, in the disk tier's format.
        durable_dir: where the group keeps durable checkpoints (a disk every host reaches): the first slice's
            processes each write their own shards every ``durable_every`` steps and the controller commits the
            step once all have (``storage/sharded.py``); None: none (the replica files are the only copy).
        durable_every: steps between durable checkpoints.
        replica_file_every: steps between a process's replica files when every process holds the whole state
            (one process per slice, two slices or more) and the group re-forms in place (``strategy`` reform,
            ``max_failures`` > 0); they are also written at every durable step. A lost process's state is then
            in every survivor's memory, and the files matter only when every process is lost: the controller
            killed (its workers go with it) or every worker crashing at once goes back up to
            ``replica_file_every - 1`` steps. A deadlock loses none: a step running ``hang_timeout_s / 2`` gets
            the step before it written, before any member is judged hung. At the demo's size, 10 took a third
            off the workers' CPU a step. With a state sharded over a slice, always every step: a process's
            shards may be nowhere else.
        durable_keep: durable checkpoints kept (the newest ones).
        neighbour_replicas: every process also keeps the shards of the process before it in its slice in host
            memory (one collective permute per step), so that a lost process's shards come from its neighbour
            rather than from the durable tier. Needs slices of 2 processes or more.
        faults: fault injection: process and worker faults of ``elastic_runtime.faults.grammar``
            (``parse_faults("kill:1@40,hang:2@12")``), carried out by ``elastic_runtime.faults.process``.
        target_steps: the run's target; None: the first of the controller's own workers to say ``Hello``
            sets it. Either way a worker cannot change it: a ``Hello`` with another target is refused.
        secret: what every connection to the controller's port proves (``elastic_runtime.cluster.auth``); None: a
            fresh random one for this run, handed to the workers the controller starts in their environment.
            Kept out of ``repr``.
        auth_timeout_s: how long a connection may take to prove the secret before it is closed.
        listen_host, listen_port: the controller's port (port 0: any free one). Anything but a loopback
            address needs a ``secret`` from the user.
        coordinator_host: the address the workers reach each generation's JAX coordination service at (the
            service binds ``listen_host``); default: ``listen_host``.
        coordinator_ports: (low, high), the ports those services may take (one per generation, each kept
            until the run ends); default: any free port.
        handlers: controller-side handlers, each ``package.module:function`` (``launch --handlers``), subscribed
            by ``elastic_runtime.defaults.default_controller`` (``runtime/cluster/controller/named_handlers.py``).
        maintenance_subscription: ``projects/P/subscriptions/S``: the controller listens there for Google Cloud
            maintenance notices and drains a host's workers before its window (``handlers/drain_host.py``);
            notices about another project's instances (not P) are ignored. None: no notices.
        drain_lead_s: drain a host's workers this long before its maintenance window starts.
        require_maintenance_notices: a ``maintenance_subscription`` the controller cannot read at start (no
            credentials, it does not exist, no permission) ends the run with a ``ConfigError`` naming it and why,
            at once (workers already started are stopped); off: it is a ``NoticeSourceFailed`` event and the run
            goes on without that protection while the listener retries (``launch --require-maintenance-notices``).
        fork_spares: workers, the first ones and the spares, are forked from a process that imported JAX already
            (``runtime/cluster/controller/forkserver.py``), ready without JAX's import; False: each is a new
            process. Only for a command that runs Python with ``-m module`` or a script.
        progress: print the group's progress on the controller's console (stderr): what the first group waits
            for while it starts, the steps now and then, every lost worker, re-forming and recovery
            (``runtime/cluster/controller/console.py``). ``launch --quiet`` turns it off.
    """

    command: list[str]
    nprocs: Positive
    min_nprocs: Positive | None = None
    spares: NonNegative = 1
    local_devices: Positive = 2
    slices: NonNegative = 0
    heartbeat_interval_s: Seconds = 0.2
    heartbeat_timeout_s: Seconds = 0.8
    heartbeat_start_timeout_s: Seconds = 2.0
    hang_timeout_s: Seconds = 5.0
    strategy: Strategy = Strategy.REFORM
    form_timeout_s: Seconds = 20.0
    spawn_timeout_s: Seconds = 60.0
    # The first start of a real model (imports, the script's set-up) took 65-112 s on 2 cores (MaxText):
    # room for a slower host. A script that fails before it connects ends the run at once (``START_FAILURES``).
    start_timeout_s: Seconds = 300.0
    max_failures: NonNegative = 10
    retry: RetryPolicy = msgspec.field(default_factory=Backoff)
    run_dir: str | None = None
    replica_dir: str | None = None
    result_path: str | None = None
    durable_dir: str | None = None
    durable_every: Positive = 10
    replica_file_every: Positive = 10
    durable_keep: Positive = 3
    neighbour_replicas: bool = False
    faults: list[Fault] = []
    resume: bool = False
    drain_timeout_s: SecondsOrZero = 10.0
    finish_timeout_s: Seconds = 3600.0
    grace_s: SecondsOrZero = 25.0
    extra_env: dict[str, str] = {}
    target_steps: NonNegative | None = None
    secret: str | None = None
    auth_timeout_s: Seconds = 5.0
    listen_host: str = "127.0.0.1"
    listen_port: Port = 0
    coordinator_host: str | None = None
    coordinator_ports: tuple[int, int] | None = None
    handlers: list[str] = []
    maintenance_subscription: str | None = None
    drain_lead_s: SecondsOrZero = 60.0
    require_maintenance_notices: bool = False
    fork_spares: bool = True
    progress: bool = True

    @property
    def slice_size(self) -> int:
        """Processes per slice."""
        return self.nprocs // self.slices

    @property
    def collective_timeout_s(self) -> float:
        """How long a worker's gloo operation waits for its peers before it fails (``runtime/compat/xla.py``).
        Past the hang timeout the controller has replaced a member whose step does not move, so a longer wait
        is one abandoned after a peer died, and the old group's backend lives, slowing the new group's steps,
        until it ends. Host work of uneven length (a restore's reads, a final durable write) is waited for at
        a meeting point before its collective (``elastic_runtime.cluster.worker.group.meet``), not inside it. At least
        10 s, at most 240 s: XLA aborts the process at 300 s (the terminate timeout)."""
        return min(240.0, max(10.0, 2 * self.hang_timeout_s))

    @property
    def starts_workers(self) -> bool:
        """Whether the controller starts its workers (``launch``) or only coordinates them (the service mode)."""
        return bool(self.command)

    def __post_init__(self) -> None:
        check_ranges(self, origin=_ORIGIN)
        # Normalized once, here: a field left to its default takes the value it stands for.
        if self.min_nprocs is None:
            msgspec.structs.force_setattr(self, "min_nprocs", self.nprocs)
        if self.slices == 0:
            msgspec.structs.force_setattr(self, "slices", self.nprocs)
        if self.strategy not in RECOVERY_STRATEGIES:
            choices = ", ".join(RECOVERY_STRATEGIES)
            raise ConfigError(f"{_ORIGIN}: strategy={self.strategy!r} must be one of {choices}")
        msgspec.structs.force_setattr(self, "strategy", Strategy(self.strategy))
        if not self.starts_workers:
            msgspec.structs.force_setattr(self, "spares", 0)  # nothing to start: the orchestrator brings one up
        self._check_group()
        if self.heartbeat_interval_s >= min(self.heartbeat_timeout_s, self.hang_timeout_s):
            raise ConfigError(
                f"{_ORIGIN}: heartbeat_interval_s={self.heartbeat_interval_s:g} must be shorter than "
                f"heartbeat_timeout_s={self.heartbeat_timeout_s:g} and hang_timeout_s={self.hang_timeout_s:g}: "
                "every live worker would be judged lost between two beats"
            )
        if self.coordinator_ports is not None:
            low, high = self.coordinator_ports
            if not 0 < low <= high < 65536:
                raise ConfigError(f"{_ORIGIN}: coordinator_ports={low}-{high} must be a range LO-HI within 1-65535")
        if self.maintenance_subscription:
            check_subscription(self.maintenance_subscription, field=f"{_ORIGIN}: maintenance_subscription")
        elif self.require_maintenance_notices:
            raise ConfigError(f"{_ORIGIN}: require_maintenance_notices needs a maintenance_subscription")

    def _check_group(self) -> None:
        """The group's sizes against each other: ``min_nprocs`` and ``slices`` against ``nprocs``."""
        assert self.min_nprocs is not None  # normalized by __post_init__
        if self.min_nprocs > self.nprocs:
            raise ConfigError(f"{_ORIGIN}: min_nprocs={self.min_nprocs} must be <= nprocs={self.nprocs}")
        if self.nprocs % self.slices:
            raise ConfigError(f"{_ORIGIN}: slices={self.slices} must divide nprocs={self.nprocs}")
        if self.min_nprocs % self.slice_size:
            raise ConfigError(
                f"{_ORIGIN}: min_nprocs={self.min_nprocs} must be whole slices of {self.slice_size} processes "
                f"(slices={self.slices}, nprocs={self.nprocs})"
            )
        if self.neighbour_replicas and self.slice_size < 2:
            raise ConfigError(
                f"{_ORIGIN}: neighbour_replicas needs slices of 2 processes or more "
                f"(slices={self.slices}, nprocs={self.nprocs})"
            )

    def __repr__(self) -> str:
        """Every field but ``secret``, which stays out of logs."""
        shown = ", ".join(f"{name}={value!r}" for name, value in self.__rich_repr__())
        return f"LaunchConfig({shown})"

    def __rich_repr__(self) -> list[tuple[str, Any]]:
        """What ``repr`` shows: every field but ``secret``."""
        return [(name, getattr(self, name)) for name in self.__struct_fields__ if name != "secret"]


@dataclass
class LaunchResult:
    """What a run leaves: its outcome and the figures the demo's summary reports."""

    ok: bool
    step: int
    target_steps: int
    digests: dict[int, str]
    world_size_history: list[int]
    strategies: list[str]
    recoveries: list[dict[str, Any]]
    detected_after_s: list[float]
    survivor_restarts: int
    events_path: str
    run_dir: str
    reason: str = ""
    run_id: str = ""
    resumed_from: int = -1  # the step a resumed run continued from; -1 when it did not resume
    drain_s: float | None = None  # stopped by a signal: from the signal until every worker was gone
    drain_checkpoint: int = -1  # stopped by a signal: the durable step committed for --resume; -1: none
    longest_heartbeat_gap_s: float = 0.0  # the longest silence of a watched worker (the start timeout's margin)
    longest_training_heartbeat_gap_s: float = 0.0  # ... of a training one (the heartbeat timeout's margin)
