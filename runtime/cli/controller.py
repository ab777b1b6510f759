"""``elastic-runtime controller --listen HOST:PORT --nprocs N``: coordinate workers that other hosts start.

It starts no worker: the cluster (a JobSet, TPU VMs, a script per host) starts them with
``ELASTIC_CONTROLLER=HOST:PORT``, ``ELASTIC_WORKER_ID`` and the run's secret, and the controller coordinates
whatever says hello with that secret; see ``docs/multiprocess.md``, *Several hosts*.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from elastic_runtime.cli.launch import (
    DEFAULTS,
    add_handlers_argument,
    add_local_devices_argument,
    add_maintenance_arguments,
    add_max_failures_argument,
    add_quiet_argument,
    add_replica_file_argument,
    add_slices_argument,
    add_strategy_argument,
    add_timeout_arguments,
    shared_settings,
)
from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchError
from elastic_runtime.core.errors import AuthenticationFailed, ConfigError, ElasticRuntimeError
from elastic_runtime.defaults import default_controller


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "controller",
        help="coordinate N worker processes that the cluster starts (on other hosts)",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT", help="the controller's port")
    parser.add_argument("--nprocs", type=int, required=True, help="worker processes in the full group")
    parser.add_argument("--min-nprocs", type=int, default=None, help="smallest group to go on with after a loss")
    add_local_devices_argument(parser)
    add_slices_argument(parser)
    parser.add_argument("--steps", type=int, default=None, help="the run's target (default: the first worker's)")
    add_strategy_argument(parser)
    parser.add_argument(
        "--heartbeat-interval",
        type=float,
        default=DEFAULTS["heartbeat_interval_s"],
        help="seconds between lease renewals (the workers' interval)",
    )
    add_max_failures_argument(parser)
    parser.add_argument("--run-dir", default=None, help="event log and summary.json (default: a new temp dir)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished run in --run-dir from the newest step any worker's replica holds (error if none)",
    )
    parser.add_argument(
        "--coordinator-host",
        default=None,
        help="the address workers reach the JAX coordination services at; they bind the --listen host (default)",
    )
    parser.add_argument(
        "--coordinator-ports",
        type=_ports,
        default=None,
        metavar="LO-HI",
        help="ports for the coordination services, one per group generation (default: any free port)",
    )
    add_timeout_arguments(parser)
    add_replica_file_argument(parser)
    add_handlers_argument(parser)
    add_maintenance_arguments(parser)
    add_quiet_argument(parser)
    parser.set_defaults(func=controller_main)
    return parser


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def _ports(text: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    if not low.isdigit() or not high.isdigit():
        raise argparse.ArgumentTypeError(f"expected a port range LO-HI, got {text!r}")
    return int(low), int(high)


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """The run's settings. Raises AuthenticationFailed when the token file cannot be used."""
    host, port = args.listen
    if args.resume and not args.run_dir:
        raise SystemExit("elastic-runtime controller: --resume needs --run-dir (the run folder names the run)")
    if host in ("0.0.0.0", "::") and not args.coordinator_host:
        raise SystemExit("elastic-runtime controller: --listen on a wildcard address needs --coordinator-host")
    return LaunchConfig(
        command=[],
        heartbeat_interval_s=args.heartbeat_interval,
        secret=auth.load_secret(),
        listen_host=host,
        listen_port=port,
        coordinator_host=args.coordinator_host,
        coordinator_ports=args.coordinator_ports,
        **shared_settings(args),
    )


def controller_main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:  # a bad value on the command line: the message names the setting
        print(f"elastic-runtime controller: {exc}", file=sys.stderr)
        return 2
    except AuthenticationFailed as exc:  # the token file
        print(f"elastic-runtime controller: {exc}", file=sys.stderr)
        return 1
    try:
        result = default_controller(config).run()
    except (LaunchError, ElasticRuntimeError, AuthenticationFailed, ValueError) as exc:
        print(f"elastic-runtime controller: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in result.__dict__.items() if k != "digests"}, default=str))
    return 0 if result.ok else 1
