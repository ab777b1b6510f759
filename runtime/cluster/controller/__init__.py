"""The controller side of a multi-process run: the never-restarted process that supervises the group.

``shell`` is the async shell (the ``Controller``; its state in ``state``, and its parts ``actions``, ``messages``,
``admission``, ``commits``, ``workers``, ``ending``, functions over that state), ``supervisor`` the synchronous
decisions it carries out (inputs, actions and phases in ``supervision``, its state in ``supervisor_state``; forming
a generation in ``forming``, its restore in ``restore``, draining and growing in ``planned``), ``standin`` the
process that fills a given-up generation's lost seats, ``membership`` the group, ``heartbeat`` the liveness
verdicts, ``processes`` and ``server`` the workers' processes and connections, ``durable`` the durable commits,
``relay`` the group's events to the script's handlers, ``ray_backend`` Ray as the scheduler (``ray_cluster``
connecting to it).
"""

from elastic_runtime.cluster.controller.shell import Controller

__all__ = ["Controller"]
