"""What to do with a straggler: replace it with a ready spare at a planned step, or keep it. Replacing costs a
re-forming (the group pauses while the spare joins); keeping costs the slowdown on every remaining step. A pure
function of those figures, so the choice and its reason can be tested from numbers alone."""

from __future__ import annotations

__all__ = ["judge_straggler"]


def judge_straggler(
    *, excess_s: float, slowdown: float, remaining_steps: int | None, reform_s: float, spare_ready: bool
) -> tuple[str, str]:
    """``("replace" | "keep", reason)`` for a worker that costs the group ``excess_s`` per step (``slowdown``
    times its pace without it), with ``remaining_steps`` to go (None: no end set) and a re-forming measured at
    ``reform_s``."""
    costs = f"{slowdown:.2f}x slower, {excess_s:.3f} s a step"
    if remaining_steps is None:
        cost, costs = float("inf"), f"{costs}, and the run has no end set"
    else:
        cost = excess_s * remaining_steps
        costs = f"{costs}: about {cost:.1f} s over the {remaining_steps} remaining steps"
    if not spare_ready:
        return "keep", f"{costs}; kept: no spare is ready to take its place"
    if cost <= reform_s:
        return "keep", f"{costs}; kept: a re-forming costs more (about {reform_s:.1f} s)"
    return "replace", f"{costs}; replaced by a ready spare: a re-forming costs about {reform_s:.1f} s"
