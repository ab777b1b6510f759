"""The controller side of a multi-process run: the never-restarted process that supervises the group.

``shell`` is the async shell (the ``Controller``), ``supervisor`` the synchronous decisions it carries out
(inputs and actions in ``supervision``), ``membership`` the group, ``heartbeat`` the liveness verdicts,
``processes`` and ``server`` the workers' processes and connections, ``durable`` the durable commits,
``relay`` the group's events to the script's handlers, ``ray_backend`` Ray as the scheduler.
"""

from runtime.cluster.controller.shell import Controller

__all__ = ["Controller"]
