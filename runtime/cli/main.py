"""The ``elastic-runtime`` command: what ``--help`` says to a user (``DESCRIPTION``) and the subcommands.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers) -> argparse.ArgumentParser``
and sets ``func`` (taking the parsed arguments, returning an exit code) on the parser it adds. Modules import
JAX lazily, so that ``--help`` is instant and the demo can set the number of CPU devices before JAX starts
its backend.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

SUBCOMMAND_MODULES = (
    "elastic_runtime.cli.demo",
    "elastic_runtime.cli.launch",
    "elastic_runtime.cli.controller",
    "elastic_runtime.cli.maintenance",
    "elastic_runtime.cli.report",
    "elastic_runtime.cli.checkpoints",
)


DESCRIPTION = """\
Elastic training for JAX. A lost device or slice, a killed worker, a lost host or a Google Cloud
maintenance notice becomes an event; the runtime re-meshes onto the healthy devices, restores the state
from the fastest checkpoint tier that holds it, and goes on from the last committed step.

Try it:
  elastic-runtime demo                                   lose a slice of 8 CPU devices, recover in-process
  elastic-runtime demo --processes 4 --kill-worker-at 40 kill -9 one of 4 worker processes
  elastic-runtime launch --nprocs 4 -- python train.py   run your own script as supervised workers
  elastic-runtime report RUN_DIR                         where a run's time went

`elastic-runtime COMMAND --help` describes each command."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elastic-runtime", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
