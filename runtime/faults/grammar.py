"""The one fault grammar of demos, ``launch``, workers and tests: comma-separated ``ACTION:TARGET@WHEN``.

- Devices (single controller, :class:`~elastic_runtime.testing.faults.FaultInjector`): ``lose-slice``,
  ``lose-device``, ``repair-slice``, ``repair-device``; TARGET a slice or device index, or ``random``; WHEN
  a step, or seconds of training (``90s``).
- Processes (the controller signals a worker, :mod:`elastic_runtime.faults.process`): ``kill``, ``stop``,
  ``term`` (SIGKILL, SIGSTOP, SIGTERM); TARGET a process id in the group; WHEN a step the group commits,
  ``forming``: while the next group forms after a failure, or ``restoring``: once it formed, while its members
  restore the step.
- Workers (a worker does it to itself at that exact point): ``die-midstep`` (computed, not committed),
  ``die-writing-replica``, ``hang`` (a deadlock in the step), ``slow`` (a straggler: from that step on, each of
  its iterations takes FACTOR times its own work, the sleep outside the step's collectives), ``corrupt`` (silent
  data corruption: a bit of its copy of the state flipped in what the step after WHEN reads, once) and
  ``corrupt-persistent`` (the same before every step after WHEN: a device that computes wrong); TARGET a process
  id in the first group; WHEN a step, for ``slow`` ``STEPxFACTOR``.

Examples: ``lose-slice:3@100,repair-slice:3@200``; ``kill:1@40``; ``kill:1@10,kill:2@forming``;
``kill:1@10,kill:0@restoring``; ``hang:1@12``;
``slow:2@20x3``; ``corrupt:1@12``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = [
    "DEVICE_ACTIONS",
    "PROCESS_SIGNALS",
    "WORKER_ACTIONS",
    "Fault",
    "format_faults",
    "parse_faults",
]

DEVICE_ACTIONS = ("lose-slice", "lose-device", "repair-slice", "repair-device")
PROCESS_SIGNALS = {"kill": "KILL", "stop": "STOP", "term": "TERM"}
WORKER_ACTIONS = ("die-midstep", "die-writing-replica", "hang", "slow", "corrupt", "corrupt-persistent")
FORMING = "forming"
RESTORING = "restoring"


@dataclass(frozen=True)
class Fault:
    """``action`` on ``target`` (-1: a random one) at a step, at seconds of training, or while a group forms."""

    action: str
    target: int
    step: int | None = None
    seconds: float | None = None  # of training, since the schedule was started
    repeat_s: float | None = None  # applied again this many seconds later, and so on
    forming: bool = False  # while the next group forms after a failure
    restoring: bool = False  # once it formed, while its members restore the step
    factor: float | None = None  # ``slow``: how many times its own work each iteration takes

    def __str__(self) -> str:
        target = "random" if self.target < 0 else str(self.target)
        if self.forming or self.restoring:
            when = FORMING if self.forming else RESTORING
        else:
            when = f"{self.step}" if self.step is not None else f"{self.seconds:g}s"
        when += f"x{self.factor:g}" if self.factor is not None else ""
        return f"{self.action}:{target}@{when}" + (f" (every {self.repeat_s:g}s)" if self.repeat_s else "")

    @property
    def kind(self) -> str:
        """ "device", "process" or "worker": which of the three carries it out."""
        if self.action in DEVICE_ACTIONS:
            return "device"
        return "process" if self.action in PROCESS_SIGNALS else "worker"

    def due(self, step: int, elapsed: float = 0.0) -> bool:
        return (self.step is not None and step >= self.step) or (self.seconds is not None and elapsed >= self.seconds)


def parse_faults(text: str, *, kinds: Iterable[str] = ("device", "process", "worker")) -> list[Fault]:
    """Parse the text form, accepting only actions of ``kinds``.

    Raises:
        ValueError: an item is wrong; the message names it and what was expected.
    """
    allowed = set(kinds)
    actions = [a for kind, names in _ACTIONS.items() if kind in allowed for a in names]
    faults = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            head, when = item.split("@")
            action, target = head.split(":")
            if action not in actions:
                raise ValueError(f"action must be one of {', '.join(actions)}")
            index = -1 if target == "random" and action in DEVICE_ACTIONS else int(target)
            if index < -1:
                raise ValueError("target must be an index >= 0" + (" or 'random'" if action in DEVICE_ACTIONS else ""))
            if when == FORMING and action in PROCESS_SIGNALS:
                faults.append(Fault(action, index, forming=True))
            elif when == RESTORING and action in PROCESS_SIGNALS:
                faults.append(Fault(action, index, restoring=True))
            elif when.endswith("s") and action in DEVICE_ACTIONS:
                faults.append(Fault(action, index, seconds=float(when[:-1])))
            elif action == "slow":
                at, x, factor = when.partition("x")
                if not x or not float(factor) > 1:
                    raise ValueError("slow's WHEN is STEPxFACTOR, a factor > 1 (slow:2@20x3)")
                faults.append(Fault(action, index, step=int(at), factor=float(factor)))
            else:
                step = int(when)
                if step < 0:
                    raise ValueError("the step must be >= 0")
                faults.append(Fault(action, index, step=step))
        except ValueError as exc:
            raise ValueError(f"fault schedule item {item!r}: {exc} (expected ACTION:TARGET@WHEN)") from exc
    return faults


def format_faults(faults: Iterable[Fault]) -> str:
    """The text form of ``faults`` (what :func:`parse_faults` reads back)."""
    return ",".join(str(fault) for fault in faults if fault.repeat_s is None)


_ACTIONS = {"device": DEVICE_ACTIONS, "process": tuple(PROCESS_SIGNALS), "worker": WORKER_ACTIONS}
