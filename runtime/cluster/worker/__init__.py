"""The worker side of a multi-process run: what each process of ``elastic-runtime launch`` runs.

``boot`` starts a worker process, ``link`` is its connection to the controller, ``group`` joins and leaves a
generation's ``jax.distributed`` group, ``state`` is the worker's state and ``loop`` its message loop, whose parts,
functions over the state, are ``forming`` (laying a group out), ``restore`` (what it holds, the group's restore),
``training`` (the steps and their commit), ``stepping`` (the step thread's calls, which ``thread`` runs),
``durable`` (its durable writes) and ``smaller`` (the group one slice smaller, prepared while it trains);
``handlers`` runs the script's handlers at step boundaries, ``settings`` is its environment.
"""

from elastic_runtime.cluster.worker.boot import is_worker, run_worker
from elastic_runtime.cluster.worker.link import ControllerLink, connect
from elastic_runtime.cluster.worker.loop import Worker

__all__ = ["ControllerLink", "Worker", "connect", "is_worker", "run_worker"]
