"""Planned re-formings, which lose nothing and count no failure: draining the members on hosts under maintenance
(cordoned) at a planned step, and growing a group that shrank (``min_nprocs``) back once a spare is ready.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from runtime.cluster.config import Strategy
from runtime.cluster.controller.forming import PLANNED_AHEAD, cordoned, form_generation, seatable
from runtime.cluster.controller.supervision import Action

if TYPE_CHECKING:
    from runtime.cluster.controller.supervisor import Supervisor

__all__ = ["can_grow", "drain"]

log = logging.getLogger(__name__)


def drain(sup: Supervisor, out: list[Action]) -> None:
    """Take the members on cordoned hosts out at a planned step: the rest (and ready spares) re-form there,
    every member's state in memory, nothing lost or counted. Not when the run ends first, nor when the
    group would be smaller than ``min_nprocs``: then the host's loss is a failure like any other."""
    reason = "; ".join(sup.drains.values())
    sup.drains.clear()
    members = sup.group.members
    leaving = [w for w in members if cordoned(sup, sup.pool[w])]
    if not leaving:
        return
    staying = [w for w in members if w not in leaving]
    ready = [p.worker for p in sup.pool if seatable(sup, p)]
    ahead = max(sup.pool[w].step for w in members) + PLANNED_AHEAD
    if 0 <= sup.target_steps <= ahead + 1:
        log.warning("not draining workers %s (%s): the run ends first", leaving, reason)
        return
    assert sup.config.min_nprocs is not None
    if len(sup.group.seat(staying, ready)) < sup.config.min_nprocs:
        log.warning("cannot drain workers %s (%s): fewer than min_nprocs would be left", leaving, reason)
        return
    sup.leaving = leaving
    form_generation(sup, out, Strategy.DRAIN, f"drain: {reason}")


def can_grow(sup: Supervisor) -> bool:
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
