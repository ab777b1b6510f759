"""The end of forming a generation: every member joined, so the supervisor plans the group's restore from what
each holds (``Membership.plan_restore``), sends ``RestoreStep`` and publishes ``GroupFormed`` (``RunStarted`` for
the first group, ``StateRestored`` in a recovery).
"""

from __future__ import annotations

import logging

from elastic_runtime.cluster.config import Strategy
from elastic_runtime.cluster.controller.membership import JoinReport
from elastic_runtime.cluster.controller.supervision import (
    Action,
    Forming,
    Idle,
    Publish,
    SaveFences,
    Send,
    TopUpSpares,
    WarmSpares,
    Watch,
)
from elastic_runtime.cluster.controller.supervisor_state import SupervisorState
from elastic_runtime.cluster.protocol import Joined, RestoreStep
from elastic_runtime.core.errors import RecoveryError
from elastic_runtime.core.events import GroupFormed, MeshChanged, RunStarted, StateRestored

__all__ = ["send_restore"]

log = logging.getLogger(__name__)


def send_restore(sup: SupervisorState, out: list[Action], forming: Forming) -> None:
    """Every member joined: tell them which step to restore, and from whom."""
    members, strategy, group = sup.group.members, forming.strategy, sup.group
    reports = []
    for worker in members:
        joined = sup.pool[worker].joined
        assert joined is not None
        reports.append(
            JoinReport(joined.best_step, joined.tier, joined.steps, joined.durable_only, joined.neighbour_step)
        )
    plan = group.plan_restore(reports)
    log.info("generation %d restores %s from %s", group.generation, plan, reports)
    if plan.fallback:
        # The run goes on from the initial state rather than ending: StateRestored says how many steps and why.
        log.warning(
            "generation %d goes back to the initial state, %d step(s) lost: %s",
            group.generation,
            plan.lost_steps,
            plan.fallback,
        )
    if 0 <= sup.target_steps < plan.step:
        why = f"refusing to restore step {plan.step}: past the run's target of {sup.target_steps} steps"
        sup.end(out, RecoveryError(why, last_committed_step=group.step))
        return
    gaps = group.restore(plan.step)
    # The older generations' fences are on disk before this one can step (and write replicas): a controller
    # killed now still tells the next workers what not to restore (``--resume``).
    out.append(SaveFences())
    if strategy == Strategy.START:
        gaps = []  # a resumed run: the controller before this one logged those steps
    for gap in gaps:
        # Committed by the member(s) restored from before the old group could report them all: the new
        # group continues from them, so they count as the group's committed steps.
        out.append(Publish(sup.completed(gap, 0.0)))
    restore = RestoreStep(
        generation=group.generation,
        step=plan.step,
        source=plan.source,
        target_steps=sup.target_steps,
        from_neighbour=plan.from_neighbour,
    )
    out.extend(Send(worker, restore) for worker in members)
    sup.restored = True
    out.extend(Watch(worker, "training", from_step=plan.step) for worker in members)
    out.append(WarmSpares())
    formed = GroupFormed(
        step=plan.step,
        source="controller",
        generation=group.generation,
        members=tuple(members),
        coordinator=sup.coordinator,
        strategy=strategy,
        seconds=sup.now - forming.started,
        restore_step=plan.step,
        restore_source=max(plan.source, 0),
        phases=_slowest_phases([sup.pool[w].joined for w in members]),
        traced=sum(len(j.traced) for w in members if (j := sup.pool[w].joined) is not None),
        instances=tuple(_instance_of(sup, w) for w in members),
    )
    out.append(Publish(formed))
    if strategy != Strategy.START or not sup.reform_s:  # what replacing a straggler would cost (stragglers.py)
        sup.reform_s = formed.seconds
    shape = sup.mesh_shape()
    if sup.group_shape and shape != sup.group_shape:
        # The data-parallel size changed (a group gone on smaller, or grown back): the same event as in one
        # process, so that the script's handlers for it (a learning rate scaled to the size) run in every mode.
        changed = MeshChanged(
            step=plan.step,
            source="controller",
            old_shape=sup.group_shape,
            new_shape=shape,
            devices=tuple(range(len(members) * sup.config.local_devices)),
            reason=f"generation {group.generation}: {len(members)} workers ({strategy}: {forming.reason})",
            needs_restore=strategy == Strategy.RESTART,
        )
        out.append(Publish(changed))
    sup.group_shape = shape
    if strategy == Strategy.START:
        started = RunStarted(
            step=plan.step,
            source="controller",
            target_steps=sup.target_steps,
            mesh_shape=sup.mesh_shape(),
            devices=tuple(range(len(members) * sup.config.local_devices)),
        )
        out.append(Publish(started))
    recovery = sup.recovery.current
    if recovery is not None:
        sup.recovery.restored(
            plan.step, restored_from=plan.restored_from, lost_steps=plan.lost_steps, strategy=strategy
        )
        state = StateRestored(
            step=plan.step,
            source="controller",
            restored_from=plan.restored_from,
            lost_steps=plan.lost_steps,
            seconds=sup.now - recovery.started,
            reason=plan.fallback,
        )
        out.append(Publish(state))
    # Only now: a new spare importing JAX would compete for the CPUs with the re-forming group.
    out.append(TopUpSpares())
    sup.phase = Idle()


def _instance_of(sup: SupervisorState, worker: int) -> str:
    hello = sup.pool[worker].hello
    return hello.instance if hello is not None else ""


def _slowest_phases(joins: list[Joined | None]) -> dict[str, float]:
    """Each phase of a join (``Joined.phases``) at its longest among the members: the one the group waited for."""
    slowest: dict[str, float] = {}
    for joined in joins:
        for phase, seconds in (joined.phases if joined is not None else {}).items():
            slowest[phase] = max(slowest.get(phase, 0.0), round(seconds, 4))
    return slowest
