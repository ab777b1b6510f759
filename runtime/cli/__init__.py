"""The ``elastic-runtime`` command and its subcommands (demo, launch, listen, report, checkpoints)."""

from elastic_runtime.cli.main import main

__all__ = ["main"]
