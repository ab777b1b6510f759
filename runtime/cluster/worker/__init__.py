"""The worker side of a multi-process run: what each process of ``elastic-runtime launch`` runs.

``boot`` starts a worker process, ``link`` is its connection to the controller, ``group`` joins and leaves a
generation's ``jax.distributed`` group, ``loop`` is the worker's loop, whose parts are ``forming`` (laying a
group out), ``restore`` (what it holds, the group's restore), ``training`` (the steps and their commit),
``stepping`` (the step thread), ``durable`` (its durable writes) and ``smaller`` (the group one slice smaller,
prepared while it trains); ``handlers`` runs the script's handlers at
step boundaries, ``settings`` is its environment.
"""

from elastic_runtime.cluster.worker.boot import is_worker, run_worker
from elastic_runtime.cluster.worker.link import ControllerLink, connect
from elastic_runtime.cluster.worker.loop import Worker

__all__ = ["ControllerLink", "Worker", "connect", "is_worker", "run_worker"]
