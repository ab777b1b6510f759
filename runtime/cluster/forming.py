"""Forming a generation of the group: recruit spares, seat the members, hand out a coordination service,
wait for every member to join, then tell them which step to restore and from whom.

A part of :class:`~runtime.cluster.controller.Controller`, kept in its own module: the controller supervises
and reacts to workers, this forms groups. The decisions (seats, the restore plan, the failure budget) are
made by the synchronous :class:`~runtime.cluster.membership.Membership` and
:class:`~runtime.core.recovery.RecoveryTracker`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from runtime.cluster.config import LaunchConfig, LaunchError, LaunchResult, Strategy
from runtime.cluster.coordination import free_port, start_coordination_service
from runtime.cluster.durable import DurableCommits
from runtime.cluster.heartbeat import HeartbeatMonitor
from runtime.cluster.membership import JoinReport, Membership
from runtime.cluster.processes import ProcessPool, WorkerProcess, log_tail
from runtime.cluster.protocol import EXIT_REPLACE, Form, Restore, Stop
from runtime.cluster.server import WorkerServer
from runtime.core.bus import EventBus
from runtime.core.errors import RecoveryError
from runtime.core.events import Event, GroupFormed, GroupForming, RunStarted, StateRestored, StepCompleted
from runtime.core.recovery import RecoveryTracker
from runtime.testing.process_faults import worker_faults_text

__all__ = ["GroupFormer"]

log = logging.getLogger(__name__)


class GroupFormer:
    """The group-forming half of the controller (a mixin: the controller provides these attributes)."""

    config: LaunchConfig
    bus: EventBus
    monitor: HeartbeatMonitor
    pool: ProcessPool
    group: Membership
    recovery: RecoveryTracker
    server: WorkerServer
    result: LaunchResult
    target_steps: int
    _restored: bool
    _requests: set[int]
    _request_strategy: Strategy | None
    _wake: anyio.Event
    _services: list[Any]
    durable: DurableCommits | None
    restored_bytes: dict[str, int]

    # Provided by the controller.
    def kill(self, worker: int, sig: str, reason: str) -> None:
        raise NotImplementedError

    def _spawn(self) -> WorkerProcess:
        raise NotImplementedError

    def _publish_nowait(self, event: Event) -> None:
        raise NotImplementedError

    def _top_up_spares(self) -> None:
        raise NotImplementedError

    async def _warm_spares(self) -> None:
        raise NotImplementedError

    def _save_fences(self) -> None:
        raise NotImplementedError

    def _mesh_shape(self) -> dict[str, int]:
        raise NotImplementedError

    async def _regroup(self, lost: set[int], reason: str, strategy: Strategy | None) -> None:
        """Replace ``lost`` and re-form. Raises RecoveryError when the failure budget is spent or the step
        the group was running has failed as often as the retry policy allows; a step that failed before is
        tried again only after the policy's backoff."""
        committed = self.group.step
        if self.recovery.over_budget:
            raise RecoveryError(
                f"{self.recovery.failures} failures exceed max_failures={self.config.max_failures} "
                f"(the last: {reason} at step {committed + 1}){self._why(lost)}",
                last_committed_step=committed,
            )
        if self._restored:  # the group was training: its attempt at the next step failed
            attempt = self.recovery.attempt_failed(committed + 1)
            wait = self.config.retry(attempt)
            if wait is None:
                raise RecoveryError(
                    f"step {attempt.step} failed {attempt.attempts} times ({reason}); giving up{self._why(lost)}",
                    last_committed_step=committed,
                )
            if wait > 0:
                log.warning("step %d failed %d times; retrying in %.2f s", attempt.step, attempt.attempts, wait)
                await anyio.sleep(wait)
        strategy = strategy or self.config.strategy
        self._request_strategy = None
        await self._form(reason=reason, strategy=strategy)

    def _why(self, lost: set[int]) -> str:
        """What the lost workers' logs say (their tracebacks): the reason a step keeps failing is in there."""
        logs = [self.pool.logs / f"worker-{w}.log" for w in sorted(lost)]
        return "".join(f"\nworker log {path}:\n{log_tail(path)}" for path in logs)

    async def _form(self, *, reason: str, strategy: Strategy) -> None:
        """Form a new generation of the group; on a member lost meanwhile, form again; falls back to restart."""
        while True:
            started = time.monotonic()
            survivors = [w for w in self.group.members if not self.pool[w].gone and w not in self._requests]
            if strategy == Strategy.RESTART:
                for worker in survivors:
                    self.kill(worker, "KILL", "restart strategy: every worker is replaced")
                    if self.pool[worker].popen is None:  # not ours to kill: asked to exit, the cluster replaces it
                        replaced = Stop(reason="restart strategy: every worker is replaced", exit_code=EXIT_REPLACE)
                        await self.server.send(self.pool[worker], replaced)
                    self.pool[worker].gone = True
                    self.monitor.forget(worker)
                self.result.survivor_restarts += len(survivors)
                survivors = []
            elif strategy == Strategy.REFORM and not survivors:
                strategy = Strategy.RESTART  # nobody left to re-form with: the state must come from the replica files
            timeout = self.config.start_timeout_s if strategy == Strategy.START else self.config.spawn_timeout_s
            recruits = await self._recruit(survivors, timeout)
            members = self.group.seat(survivors, recruits)
            for worker in set(survivors) | set(recruits):
                if worker not in members:  # in a slice short of a process: it waits, as a spare, for a replacement
                    self.pool[worker].spare = True
                    self.monitor.expect_progress(worker, False)
            self._requests.clear()
            generation = self.group.new_generation(members)
            self._save_fences()  # a resumed controller numbers its generations after this one
            self._restored = False
            self.restored_bytes.clear()
            if self.durable is not None:
                self.durable.new_generation(generation)
            for worker in members:
                proc = self.pool[worker]
                proc.spare, proc.joined, proc.finished = False, None, None
                self.monitor.expect_progress(worker, False)
            # Growing is planned: every member re-forms after committing the same step, so no collective is
            # cut off; after a failure the group re-forms now (in-flight steps are abandoned).
            at_step = max(self.pool[w].step for w in survivors) + 3 if strategy == Strategy.GROW and survivors else -1
            # Bound where the controller's own port is (a local address, or a wildcard), and named to the workers
            # by the address they reach it at (a Kubernetes Service's name is not an address one can bind).
            port, service = self._new_service(self.config.listen_host, len(members))
            self._services.append(service)
            coordinator = f"{self.config.coordinator_host or self.config.listen_host}:{port}"
            for process_id, worker in enumerate(members):
                form = Form(
                    generation=generation,
                    coordinator=coordinator,
                    process_id=process_id,
                    num_processes=len(members),
                    # With a state sharded over a slice, a process's shards may be nowhere else: every member
                    # lists its replica files too, so the group can roll back to a step the slice holds whole.
                    read_files=strategy != Strategy.REFORM or self.config.slice_size > 1,
                    faults=worker_faults_text(self.config.faults, process_id) if strategy == Strategy.START else "",
                    at_step=at_step,
                    run_id=self.result.run_id,
                    slice_size=self.config.slice_size,
                    durable_dir=self.config.durable_dir or "",
                    durable_every=self.config.durable_every,
                    neighbour_replicas=self.config.neighbour_replicas,
                    fences=dict(self.group.fences),
                )
                await self.server.send(self.pool[worker], form)
            await self.bus.publish(
                GroupForming(
                    step=self.group.step,
                    source="controller",
                    generation=generation,
                    members=tuple(members),
                    strategy=strategy,
                )
            )
            outcome = await self._await_joins(members)
            if outcome == "joined":
                break
            # A member died or stalled while the group formed. Members blocked in initialize() wait for it
            # until JAX's initialization timeout, so they are replaced too: fall back to restarting.
            log.warning("generation %d did not form (%s); restarting its workers", generation, outcome)
            strategy = Strategy.RESTART
            lost = {w for w in members if self.pool[w].gone}
            if not lost:  # a stall; a lost member was counted when it was reported
                step = self.group.step
                self._publish_nowait(self.recovery.fail(outcome, failed_step=step + 1, last_committed_step=step))
            if self.recovery.over_budget:  # members that die while forming, again and again, end the run too
                raise RecoveryError(
                    f"{self.recovery.failures} failures exceed max_failures={self.config.max_failures} "
                    f"(the last: {outcome} in generation {generation}){self._why(lost)}",
                    last_committed_step=self.group.step,
                )
        await self._restore(members, strategy, coordinator, started)
        # Only now: a new spare importing JAX would compete for the CPUs with the re-forming group.
        self._top_up_spares()

    def _new_service(self, host: str, num_processes: int, attempts: int = 5) -> tuple[int, Any]:
        """A coordination service on a free port of ``host`` (in ``coordinator_ports``, if given); another port
        if the chosen one was taken meanwhile."""
        for attempt in range(attempts):
            try:
                port = free_port(host, self.config.coordinator_ports)
            except OSError as exc:
                generation = self.group.generation
                raise LaunchError(f"cannot host generation {generation}'s coordination service: {exc}") from exc
            try:
                return port, start_coordination_service(host, port, num_processes)
            except Exception as exc:  # port taken between free_port() and the bind (shared machine)
                log.warning("coordination service on port %d failed (attempt %d): %s", port, attempt + 1, exc)
        raise LaunchError(f"could not start a coordination service in {attempts} attempts")

    async def _recruit(self, survivors: list[int], timeout_s: float) -> list[int]:
        """Enough spares (started now if needed) to fill the group around ``survivors``; waits for their Hello."""
        need = self.config.nprocs - len(survivors)
        chosen: list[int] = []
        deadline = time.monotonic() + timeout_s
        while len(chosen) < need:
            chosen = [w for w in chosen if self.pool[w].ready_spare]  # one chosen earlier may be gone since
            ready = [p.worker for p in self.pool if p.ready_spare and p.worker not in chosen]
            chosen.extend(ready[: need - len(chosen)])
            if len(chosen) >= need:
                break
            starting = [p for p in self.pool if p.spare and not p.gone and p.hello is None]
            if self.config.starts_workers and len(starting) + len(chosen) < need:
                self._spawn()
                continue
            # Workers the controller does not start are the orchestrator's to replace: after a loss the group
            # goes on without them at once where min_nprocs allows, and grows back when they say hello.
            soon = not self.config.starts_workers and bool(survivors)
            assert self.config.min_nprocs is not None
            enough = len(self.group.seat(survivors, chosen)) >= self.config.min_nprocs  # whole slices
            if (soon or time.monotonic() > deadline) and enough:
                break  # go on smaller; the next re-forming grows the group back
            if time.monotonic() > deadline:
                raise LaunchError(f"only {len(survivors) + len(chosen)} workers ready after {timeout_s} s")
            with anyio.move_on_after(0.1):
                await self._wake.wait()
            self._wake = anyio.Event()
        return chosen

    async def _await_joins(self, members: list[int]) -> str:
        deadline = time.monotonic() + self.config.form_timeout_s
        while True:
            procs = [self.pool[w] for w in members]
            if any(p.gone for p in procs):
                return "member lost while forming"
            if all(p.joined is not None for p in procs):
                return "joined"
            if time.monotonic() > deadline:
                return f"not joined within {self.config.form_timeout_s} s"
            await anyio.sleep(0.01)

    async def _restore(self, members: list[int], strategy: Strategy, coordinator: str, started: float) -> None:
        reports = []
        for worker in members:
            joined = self.pool[worker].joined
            assert joined is not None
            reports.append(
                JoinReport(joined.best_step, joined.tier, joined.steps, joined.durable_only, joined.neighbour_step)
            )
        plan = self.group.plan_restore(reports)
        log.info("generation %d restores %s from %s", self.group.generation, plan, reports)
        if plan.missing:
            raise RecoveryError(
                f"cannot restore generation {self.group.generation}: {plan.missing}",
                last_committed_step=self.group.step,
            )
        if 0 <= self.target_steps < plan.step:
            raise RecoveryError(
                f"refusing to restore step {plan.step}: past the run's target of {self.target_steps} steps",
                last_committed_step=self.group.step,
            )
        gaps = self.group.restore(plan.step)
        # The older generations' fences are on disk before this one can step (and write replicas): a controller
        # killed now still tells the next workers what not to restore (``--resume``).
        self._save_fences()
        if strategy == Strategy.START:
            self.result.resumed_from = plan.step if plan.step > 0 else -1
            gaps = []  # a resumed run: the controller before this one logged those steps
        for gap in gaps:
            # Committed by the member(s) restored from before the old group could report them all: the new
            # group continues from them, so they count as the group's committed steps.
            await self.bus.publish(
                StepCompleted(
                    step=gap, source="controller", duration_s=0.0, mesh_shape=self._mesh_shape(), data_position=gap
                )
            )
        for worker in members:
            self.pool[worker].step = plan.step
        for worker in members:
            restore = Restore(
                generation=self.group.generation,
                step=plan.step,
                source=plan.source,
                target_steps=self.target_steps,
                from_neighbour=plan.from_neighbour,
            )
            await self.server.send(self.pool[worker], restore)
        self._restored = True
        for worker in members:
            self.monitor.expect_progress(worker, True)
        await self._warm_spares()
        self.result.world_size_history.append(len(members))
        self.result.strategies.append(strategy)
        await self.bus.publish(
            GroupFormed(
                step=plan.step,
                source="controller",
                generation=self.group.generation,
                members=tuple(members),
                coordinator=coordinator,
                strategy=strategy,
                seconds=time.monotonic() - started,
                restore_step=plan.step,
                restore_source=max(plan.source, 0),
            )
        )
        if strategy == Strategy.START:
            await self.bus.publish(
                RunStarted(
                    step=plan.step,
                    source="controller",
                    target_steps=self.target_steps,
                    mesh_shape=self._mesh_shape(),
                    devices=tuple(range(len(members) * self.config.local_devices)),
                )
            )
        recovery = self.recovery.current
        if recovery is not None:
            self.recovery.restored(
                plan.step, restored_from=plan.restored_from, lost_steps=plan.lost_steps, strategy=strategy
            )
            await self.bus.publish(
                StateRestored(
                    step=plan.step,
                    source="controller",
                    restored_from=plan.restored_from,
                    lost_steps=plan.lost_steps,
                    seconds=time.monotonic() - recovery.started,
                )
            )
        if self.target_steps >= 0 and plan.step >= self.target_steps:
            self._wake.set()
