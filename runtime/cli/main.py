"""The ``elastic-runtime`` command. Each subcommand lives in its own module with ``add_parser``.

A subcommand module exposes ``add_parser(subparsers) -> argparse.ArgumentParser`` and sets ``func`` (taking
the parsed arguments, returning an exit code) on the parser it adds. Modules import JAX lazily, so that
``--help`` is instant and the demo can set the number of CPU devices before JAX starts its backend.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

SUBCOMMAND_MODULES = (
    "runtime.cli.demo",
    "runtime.cli.launch",
    "runtime.cli.controller",
    "runtime.cli.maintenance",
    "runtime.cli.report",
    "runtime.cli.checkpoints",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="elastic-runtime", description=__doc__.splitlines()[0])
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
