"""Planned re-formings, which lose nothing and count no failure: draining at a planned step the members on hosts
under maintenance (cordoned) and those that asked to leave (SIGTERM from their host), and growing a group that
shrank (``min_nprocs``) back once a spare is ready.
"""

from __future__ import annotations

import logging

from elastic_runtime.cluster.config import Strategy
from elastic_runtime.cluster.controller.forming import PLANNED_AHEAD, cordoned, form_generation, seatable
from elastic_runtime.cluster.controller.supervision import Action, Spawn
from elastic_runtime.cluster.controller.supervisor_state import SupervisorState

__all__ = ["can_grow", "drain"]

log = logging.getLogger(__name__)


def drain(sup: SupervisorState, out: list[Action]) -> None:
    """Take the members on cordoned hosts and those that asked to leave out at a planned step: the rest (and ready
    spares) re-form there, every member's state in memory, nothing lost or counted. Not when the run ends first
    (a member that asked to leave then ends with the run), nor when the group would be smaller than
    ``min_nprocs``: then a host's loss is a failure like any other, and a member that asked to leave waits for
    a spare (one is started) while its grace period lasts."""
    members = sup.group.members
    sup.departures = {w: why for w, why in sup.departures.items() if w in members and not sup.gone(w)}
    reason = "; ".join([*sup.drains.values(), *(f"worker {w} leaves: {why}" for w, why in sup.departures.items())])
    sup.drains.clear()
    leaving = [w for w in members if cordoned(sup, sup.pool[w]) or w in sup.departures]
    if not leaving:
        return
    staying = [w for w in members if w not in leaving]
    ready = [p.worker for p in sup.pool if seatable(sup, p)]
    ahead = max(sup.pool[w].step for w in members) + PLANNED_AHEAD
    if 0 <= sup.target_steps <= ahead + 1:
        log.warning("not draining workers %s (%s): the run ends first", leaving, reason)
        sup.departures.clear()
        return
    assert sup.config.min_nprocs is not None
    if len(sup.group.seat(staying, ready)) < sup.config.min_nprocs:
        starting = any(sup.spare(p.worker) and p.hello is None for p in sup.pool)
        if sup.departures and sup.config.starts_workers and not starting:
            log.warning(
                "workers %s cannot leave yet (%s): fewer than min_nprocs would be left; starting a spare",
                leaving,
                reason,
            )
            out.append(Spawn(len(leaving)))
        elif not sup.departures:
            log.warning("cannot drain workers %s (%s): fewer than min_nprocs would be left", leaving, reason)
        return
    form_generation(sup, out, Strategy.DRAIN, f"drain: {reason}", tuple(leaving))


def can_grow(sup: SupervisorState) -> bool:
    """A group that shrank (``min_nprocs``) grows back once a spare is ready, away from the run's end."""
    members = sup.group.members
    if not (
        len(members) < sup.config.nprocs
        and sup.recovery.current is None
        and not sup.stopped
        and sup.group.step + 5 < sup.target_steps
    ):
        return False
    if sup.growable is None:  # counted again only after an input that may change it
        ready = sum(seatable(sup, p) for p in sup.pool)
        sup.growable = len(sup.group.seat(members, [-1] * ready)) > len(members)  # a whole slice more
    return sup.growable
