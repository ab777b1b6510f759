"""Fault injection for multi-process runs: the fault grammar and the process and worker faults.

A feature of the product (``launch --fault``, the demos, the chaos loop), so it lives here, on the production
path, and not in :mod:`elastic_runtime.testing`, which production code never imports (``make lint`` checks it).
"""

from elastic_runtime.faults.grammar import Fault, format_faults, parse_faults
from elastic_runtime.faults.process import ProcessFaults, attach_worker_faults, worker_faults_text

__all__ = ["Fault", "ProcessFaults", "attach_worker_faults", "format_faults", "parse_faults", "worker_faults_text"]
