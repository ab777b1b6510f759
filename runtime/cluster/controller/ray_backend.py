"""Ray as the cluster scheduler: one worker actor per Ray node, replaced on a healthy node when it is lost.

``elastic-runtime launch --backend ray`` runs the controller in service mode (it starts no process itself)
beside the Ray driver; :class:`RayPlacement` places the workers. Each is a Ray actor pinned to a node of its
own (``NodeAffinitySchedulingStrategy``, hard) that runs the training command as a child process with the
worker's environment. The run's secret travels as an argument of the actor's ``start`` call over Ray's own
connections and ends in the child's environment: never on a command line, in ``runtime_env`` (which Ray's
dashboard and state API show) or in a log.

Two signals say that a worker is lost, and the first wins (``WorkerLost.detected_by``): the controller's
own (heartbeat silence, a closed connection) and Ray's (the actor's long-running ``wait`` call fails with
``ActorDiedError``: the actor, its process or its node died), which :meth:`RayPlacement.run` hands to the
controller's monitor. On either, :meth:`RayPlacement.on_lost` stops what is left of the worker and asks Ray
for a replacement with a new id on a node that hosts none of the run's workers; it says hello like any
service-mode worker, and the group grows back (``docs/cluster.md``, *Ray*).

The child runs in a session of its own, so it outlives an actor that Ray kills (the node's raylet gone, the
actor's process killed): Ray's signal is then the only one, and the controller tells the orphan to exit at
its next heartbeat, as it does a partitioned worker.

Not a placement group: a ``STRICT_SPREAD`` group re-creates a lost node's bundle wherever Ray likes and
cannot be told to avoid the survivors' nodes; node affinity puts each actor exactly where it must go.

``ray`` is imported in this module only, and only when a run uses it (``pip install elastic-runtime[ray]``):
the core runs without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from elastic_runtime.cluster.auth import ENV_TOKEN, ENV_TOKEN_FILE
from elastic_runtime.cluster.config import LaunchError
from elastic_runtime.cluster.controller import ray_actor
from elastic_runtime.cluster.controller.processes import log_tail
from elastic_runtime.cluster.controller.ray_actor import WorkerActor
from elastic_runtime.cluster.controller.ray_cluster import ray_module
from elastic_runtime.cluster.controller.workers import START_FAILURES
from elastic_runtime.cluster.protocol import (
    ENV_CONTROLLER,
    ENV_HEARTBEAT_S,
    ENV_LOCAL_DEVICES,
    ENV_REPLICA_DIR,
    ENV_WORKER,
)
from elastic_runtime.compat.xla import ENV_COLLECTIVE_TIMEOUT
from elastic_runtime.core.events import WorkerHung, WorkerLost, WorkerStarted

if TYPE_CHECKING:
    from elastic_runtime.cluster.controller import Controller
    from elastic_runtime.cluster.controller.context import ControllerContext

__all__ = ["RayPlacement", "WorkerActor"]

log = logging.getLogger(__name__)

_STOP_TIMEOUT_S = 2.0  # a lost worker's actor gets this long to kill its child before Ray kills the actor


@dataclass
class _Placed:
    """One worker's actor and what is known of it."""

    worker: int
    node: str  # Ray's node id (hex)
    actor: Any
    pending: Any  # the call being watched: ``start`` (the child's pid), then ``wait`` (its exit code)
    pid: int = -1
    lost: bool = False  # judged lost (by either signal): stopped, and replaced
    settled: bool = False  # nothing more to watch: the child exited or the actor died


class RayPlacement:
    """Places a service-mode controller's workers as Ray actors, one per node, and replaces lost ones.

    Args:
        command: the worker command (``python train.py ...``), run on the worker's node.
        nprocs: workers in the first group (ids 0..nprocs-1); a replacement takes the next unused id.
        logs: where each worker's output goes (``worker-<id>.log``), on its own node.
        env: more environment for every worker (the user's ``ELASTIC_*`` settings are passed on anyway).
        cwd: the workers' working folder, where a node has it (default: this process's).
        replica_dir: one folder for every worker's replica files (shared storage, kept); default: a folder of
            each worker's own in its node's ``/dev/shm``, removed when its process exits.
        cpus_per_worker: the CPUs each actor reserves on its node.
        poll_s: how long one wait on Ray lasts: the bound on detecting an actor's death late.

    Ray must be connected (``ray_cluster.ray_session``) before :meth:`run` starts.

    Raises:
        ValueError: an empty ``command``.
    """

    def __init__(
        self,
        command: Sequence[str],
        *,
        nprocs: int,
        logs: Path,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        replica_dir: str | None = None,
        cpus_per_worker: float = 1.0,
        poll_s: float = 0.2,
    ) -> None:
        if not command:
            raise ValueError("RayPlacement needs the worker command")
        self.command = list(command)
        self.logs = logs
        self.env = dict(env or {})
        self.cwd = cwd if cwd is not None else os.getcwd()
        self.replica_dir = replica_dir
        self.cpus_per_worker = cpus_per_worker
        self.poll_s = poll_s
        self.placed: dict[int, _Placed] = {}
        self.replacements: list[tuple[int, int]] = []  # (lost worker, its replacement)
        self._pending: list[int] = list(range(nprocs))
        self._next_worker = nprocs
        self._suspect_nodes: set[str] = set()  # nodes that lost a worker: used last
        self._early_deaths = 0
        self._waiting_logged = False
        self._controller: Controller | None = None
        self._actor_class: Any = None

    def attach(self, controller: Controller) -> None:
        """Place ``controller``'s workers: its companion task, and its handler for lost and hung workers.

        Raises:
            ValueError: ``controller`` starts workers of its own (``config.command`` is set).
        """
        if controller.config.starts_workers:
            raise ValueError("RayPlacement places the workers of a service-mode controller (config.command empty)")
        self._controller = controller
        controller.companions.append(self.run)
        controller.bus.subscribe(WorkerLost, self.on_lost)
        controller.bus.subscribe(WorkerHung, self.on_lost)

    # --- the async shell ------------------------------------------------------------------------------------

    async def run(self) -> None:
        """Place pending workers on free nodes and watch every actor until cancelled (with the controller's
        helpers, at the run's end)."""
        while True:
            self._place_pending()
            watched = [p.pending for p in self.placed.values() if not p.settled]
            if watched:
                ready = await anyio.to_thread.run_sync(self._ready, watched)
            else:
                ready = []
                await anyio.sleep(self.poll_s)
            for ref in ready:
                await self._settle(ref)

    async def on_lost(self, event: WorkerLost | WorkerHung, ctx: ControllerContext) -> None:
        """On WorkerLost or WorkerHung, whichever signal came first: stop what is left of the worker (its child,
        then its actor) and ask Ray for a replacement with a new id on another node."""
        placed = self.placed.get(event.worker)
        if placed is None or placed.lost:
            return
        placed.lost = True
        self._suspect_nodes.add(placed.node)
        await anyio.to_thread.run_sync(self._stop, placed)
        if not self._stopping:
            self._replace(event.worker, why=type(event).__name__)

    def close(self, timeout_s: float = 10.0) -> None:
        """After the run: stop every child still running, then every actor. Raises nothing."""
        ray = ray_module()
        live = [p for p in self.placed.values() if not (p.settled and p.lost)]
        stops = []
        for placed in live:
            with contextlib.suppress(ray.exceptions.RayError):
                stops.append(placed.actor.stop.remote())
        if stops:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.wait(stops, num_returns=len(stops), timeout=timeout_s)
        for placed in self.placed.values():
            with contextlib.suppress(ray.exceptions.RayError, ValueError):
                ray.kill(placed.actor, no_restart=True)

    # --- the synchronous core -------------------------------------------------------------------------------

    @property
    def _stopping(self) -> bool:
        return self._controller is None or self._controller.stopping

    def _ready(self, refs: list[Any]) -> list[Any]:
        ready, _ = ray_module().wait(refs, num_returns=1, timeout=self.poll_s, fetch_local=False)
        return list(ready)

    def _free_nodes(self) -> list[str]:
        """Alive nodes with room for a worker and none of the run's live ones; nodes that lost one last."""
        busy = {p.node for p in self.placed.values() if not p.lost and not p.settled}
        free = [
            node["NodeID"]
            for node in ray_module().nodes()
            if node["Alive"] and node["Resources"].get("CPU", 0) >= self.cpus_per_worker and node["NodeID"] not in busy
        ]
        return sorted(free, key=lambda node: node in self._suspect_nodes)

    def _place_pending(self) -> None:
        if not self._pending or self._controller is None or self._controller.port == 0:
            return
        if self._stopping:
            self._pending.clear()
            return
        free = self._free_nodes()
        while self._pending and free:
            worker, node = self._pending.pop(0), free.pop(0)
            actor = self._actor(node)
            log_path = str(self.logs / f"worker-{worker}.log")
            env = self._worker_env(worker)
            scratch = "" if self.replica_dir else env[ENV_REPLICA_DIR]
            pending = actor.start.remote(self.command, env, log_path, self.cwd, scratch)
            self.placed[worker] = _Placed(worker=worker, node=node, actor=actor, pending=pending)
            log.info("ray: worker %d placed on node %s", worker, node[:12])
            self._waiting_logged = False
        if self._pending and not self._waiting_logged:
            self._waiting_logged = True
            log.warning("ray: no free node for worker(s) %s; waiting for one", self._pending)

    def _actor(self, node: str) -> Any:
        ray = ray_module()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        if self._actor_class is None:
            # Sent by value: an actor's process then imports none of this package, nor JAX (seconds per actor,
            # minutes on a loaded machine), to start a child that imports them itself.
            ray.cloudpickle.register_pickle_by_value(ray_actor)
            self._actor_class = ray.remote(max_concurrency=3, max_restarts=0, max_task_retries=0)(WorkerActor)
        strategy = NodeAffinitySchedulingStrategy(node, soft=False)
        return self._actor_class.options(num_cpus=self.cpus_per_worker, scheduling_strategy=strategy).remote()

    def _worker_env(self, worker: int) -> dict[str, str]:
        """What the worker's child gets besides its node's environment; the secret among it."""
        controller = self._controller
        assert controller is not None
        config = controller.config
        passed_on = {k: v for k, v in os.environ.items() if k.startswith("ELASTIC_") and k != ENV_TOKEN_FILE}
        host = config.coordinator_host or config.listen_host
        return (
            passed_on
            | self.env
            | {
                ENV_CONTROLLER: f"{host}:{controller.port}",
                ENV_WORKER: str(worker),
                ENV_LOCAL_DEVICES: str(config.local_devices),
                ENV_HEARTBEAT_S: str(config.heartbeat_interval_s),
                ENV_COLLECTIVE_TIMEOUT: str(config.collective_timeout_s),
                # By default one folder per worker: on a test cluster all nodes share this machine's /dev/shm, and a
                # replacement must start as empty as on a new host.
                ENV_REPLICA_DIR: self.replica_dir or f"/dev/shm/elastic-runtime-{controller.record.run_id}-{worker}",
                ENV_TOKEN: controller.secret,
            }
        )

    async def _settle(self, ref: Any) -> None:
        placed = next((p for p in self.placed.values() if p.pending is ref and not p.settled), None)
        if placed is None:
            return
        ray = ray_module()
        try:
            value = ray.get(ref, timeout=0)
        except ray.exceptions.ActorUnavailableError:
            placed.pending = placed.actor.wait.remote()  # unreachable for now, maybe not dead: ask again
            return
        except ray.exceptions.RayError as exc:
            placed.settled = True
            self._actor_died(placed, exc)
            return
        controller = self._controller
        assert controller is not None
        if placed.pid < 0:
            placed.pid = int(value)
            placed.pending = placed.actor.wait.remote()
            await controller.bus.publish(WorkerStarted(source="ray", worker=placed.worker, pid=placed.pid, spare=True))
        else:
            # The child exited: its connection closed, which the controller saw itself (a loss, or the end),
            # unless it never connected.
            placed.settled = True
            log.info("ray: worker %d's process exited with %s", placed.worker, value)
            proc = controller.pool.get(placed.worker)
            if (proc is None or proc.hello is None) and not controller.stopping:
                self._died_early(placed, f"its process exited with code {value} before connecting")

    def _actor_died(self, placed: _Placed, exc: Exception) -> None:
        """Ray's signal: the actor (its process, or its node) died. Handed to the controller's monitor, where
        it wins unless the heartbeats were first."""
        controller = self._controller
        if placed.lost or controller is None or controller.stopping:
            return
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        reason = f"Ray: the actor of worker {placed.worker} died ({type(exc).__name__}: {first_line[:200]})"
        if controller.mark_lost(placed.worker, reason, detected_by="ray"):
            self._early_deaths = 0
            return
        proc = controller.pool.get(placed.worker)
        if proc is None or proc.hello is None:  # died before its hello: no verdict will come, replace it now
            self._suspect_nodes.add(placed.node)
            self._died_early(placed, reason)

    def _died_early(self, placed: _Placed, why: str) -> None:
        """Worker ``placed`` ended before its Hello: replaced, unless ``START_FAILURES`` did in a row (the worker
        command fails before it reaches the runtime; the run ends with the last one's log)."""
        controller = self._controller
        assert controller is not None
        placed.lost = True
        self._early_deaths += 1
        if self._early_deaths < START_FAILURES:
            self._replace(placed.worker, why=why)
            return
        path = self.logs / f"worker-{placed.worker}.log"
        controller.end(
            LaunchError(
                f"{self._early_deaths} workers in a row ended before connecting (the last, worker {placed.worker}: "
                f"{why}): the worker command fails before it reaches the runtime, and every replacement would "
                f"too. The end of {path} (on its node):\n{log_tail(path)}"
            )
        )

    def _stop(self, placed: _Placed) -> None:
        ray = ray_module()
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(placed.actor.stop.remote(), timeout=_STOP_TIMEOUT_S)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(placed.actor, no_restart=True)

    def _replace(self, lost: int, *, why: str) -> None:
        worker = self._next_worker
        self._next_worker += 1
        self._pending.append(worker)
        self.replacements.append((lost, worker))
        log.warning("ray: worker %d lost (%s); placing worker %d on another node", lost, why, worker)
