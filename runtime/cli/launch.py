"""``elastic-runtime launch --nprocs N -- python train.py ...``: run a script as supervised worker processes.

The controller (``runtime/cluster/controller/shell.py``) starts the workers, watches them and re-forms the group
when one is lost; see ``docs/multiprocess.md``. With ``--backend ray`` Ray places them, one actor per node
(``runtime/cli/launch_ray.py``, ``docs/cluster.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import msgspec

from elastic_runtime.cluster.config import RECOVERY_STRATEGIES, LaunchConfig, LaunchError
from elastic_runtime.core.errors import ConfigError, ElasticRuntimeError
from elastic_runtime.defaults import default_controller
from elastic_runtime.faults.grammar import Fault, parse_faults

# LaunchConfig's defaults, for the options that show them (a Struct's class attributes are its fields, not them).
DEFAULTS: dict[str, Any] = {field.name: field.default for field in msgspec.structs.fields(LaunchConfig)}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "launch",
        help="run a training script as N supervised worker processes",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("--nprocs", type=int, required=True, help="worker processes in the group")
    parser.add_argument(
        "--backend",
        choices=["local", "ray"],
        default="local",
        help="who starts the workers: this process (local, default) or Ray, one actor per node (ray)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        metavar="HOST:PORT",
        help="--backend ray: the Ray cluster to run on (default: a local one, nprocs + 1 nodes on 127.0.0.1)",
    )
    parser.add_argument("--min-nprocs", type=int, default=None, help="smallest group to go on with")
    parser.add_argument(
        "--spares", type=int, default=DEFAULTS["spares"], help="warm spare processes (default %(default)s)"
    )
    add_local_devices_argument(parser)
    add_slices_argument(parser)
    parser.add_argument(
        "--durable",
        default=None,
        metavar="DIR|gs://BUCKET/PREFIX",
        help="durable checkpoints of the group's state, each process writing its own shards (default: none)",
    )
    parser.add_argument(
        "--durable-every", type=int, default=DEFAULTS["durable_every"], help="steps between durable checkpoints"
    )
    parser.add_argument(
        "--durable-keep", type=int, default=DEFAULTS["durable_keep"], help="durable checkpoints kept (the newest)"
    )
    parser.add_argument(
        "--grace-s",
        type=float,
        default=DEFAULTS["grace_s"],
        help="on SIGTERM/SIGINT with --durable: seconds to commit a durable checkpoint of the newest step "
        "(default %(default)g)",
    )
    parser.add_argument(
        "--neighbour-replicas",
        action="store_true",
        help="each process also keeps the previous process's shards in RAM: a lost process's shards come from there",
    )
    parser.add_argument(
        "--no-fork-spares",
        dest="fork_spares",
        action="store_false",
        help="start every worker as a new process (default: forked from one process that imported JAX once)",
    )
    add_strategy_argument(parser)
    parser.add_argument(
        "--run-dir",
        default=None,
        help="event log, worker logs, summary.json; an unfinished run in it is continued (default: a new temp dir)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue the unfinished run in --run-dir from the newest step any replica holds (error if none)",
    )
    parser.add_argument(
        "--result", default=None, help="a folder where process 0 commits the final state (disk tier format)"
    )
    parser.add_argument(
        "--replica-dir",
        default=None,
        help="replica files (default: /dev/shm/elastic-runtime-<hash of --run-dir>, removed when the run ends)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="the run's target, the controller's own (a worker whose script asks for another is refused); "
        "default: what the first of the controller's workers asks for",
    )
    add_max_failures_argument(parser)
    parser.add_argument(
        "--fault",
        type=_faults,
        action="append",
        default=[],
        metavar="ACTION:PID@WHEN",
        help="fault injection, e.g. kill:1@40, stop:0@20, kill:2@forming, hang:1@12 (elastic_runtime.faults.grammar)",
    )
    add_timeout_arguments(parser)
    add_replica_file_argument(parser)
    add_handlers_argument(parser)
    add_maintenance_arguments(parser)
    add_quiet_argument(parser)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    parser.set_defaults(func=launch_main)
    return parser


def add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """When a worker is lost or hung, and how long forming may take, as ``launch`` and ``controller`` take it.
    Joining a group compiles the step (a real model: a minute or more on CPU): the first group gets
    ``--start-timeout``, a re-formed one ``--form-timeout`` or twice the slowest join seen so far, whichever is
    longer."""
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=DEFAULTS["heartbeat_timeout_s"],
        help=f"seconds of silence = lost, for a worker that trains (default {DEFAULTS['heartbeat_timeout_s']:g}); "
        "one started here whose process still runs is lost at --hang-timeout instead",
    )
    parser.add_argument(
        "--heartbeat-start-timeout",
        type=float,
        default=DEFAULTS["heartbeat_start_timeout_s"],
        help="seconds of silence = lost, before a worker's first step in its group: start-up, restore, compile "
        f"(default {DEFAULTS['heartbeat_start_timeout_s']:g})",
    )
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=DEFAULTS["hang_timeout_s"],
        help=f"seconds without progress = hung (default {DEFAULTS['hang_timeout_s']:g})",
    )
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=DEFAULTS["start_timeout_s"],
        help="seconds for the first group to form (default %(default)g)",
    )
    parser.add_argument(
        "--form-timeout",
        type=float,
        default=DEFAULTS["form_timeout_s"],
        help="seconds for a re-formed group to join, at least twice the slowest join seen "
        f"(default {DEFAULTS['form_timeout_s']:g})",
    )
    parser.add_argument(
        "--spawn-timeout",
        type=float,
        default=DEFAULTS["spawn_timeout_s"],
        help=f"seconds a re-forming waits for replacements (default {DEFAULTS['spawn_timeout_s']:g})",
    )


def add_replica_file_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replica-file-every",
        type=int,
        default=DEFAULTS["replica_file_every"],
        metavar="N",
        help="steps between a process's replica files where every process holds the whole state and the group "
        "re-forms in place (a whole group lost then goes back up to N-1 steps); every step otherwise "
        "(default: %(default)s)",
    )


def add_quiet_argument(parser: argparse.ArgumentParser) -> None:
    """``--quiet`` and ``--finish-timeout``, as ``launch`` and ``controller`` take them."""
    parser.add_argument(
        "--finish-timeout",
        type=float,
        default=DEFAULTS["finish_timeout_s"],
        metavar="SECONDS",
        help="after the run finished, how long the workers' scripts may go on after run() returned "
        f"(default {DEFAULTS['finish_timeout_s']:g})",
    )
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress on the console (default: what the first group waits for, the steps every 10 s, every "
        "lost worker, re-forming and recovery, on stderr)",
    )


def add_handlers_argument(parser: argparse.ArgumentParser) -> None:
    """``--handlers``, as ``launch`` and ``controller`` take it."""
    parser.add_argument(
        "--handlers",
        action="append",
        default=[],
        metavar="PKG.MODULE:FUNCTION",
        help="a controller-side handler, async def FUNCTION(event, ctx), for the event type its first parameter "
        "is annotated with; once per event (repeatable; docs/handlers.md)",
    )


def add_maintenance_arguments(parser: argparse.ArgumentParser) -> None:
    """``--maintenance-subscription``, ``--drain-lead`` and ``--require-maintenance-notices``, as ``launch`` and
    ``controller`` take them."""
    parser.add_argument(
        "--maintenance-subscription",
        default=None,
        metavar="projects/P/subscriptions/S",
        help="Google Cloud maintenance notices (Pub/Sub): a host's workers are drained before its window "
        "(docs/gcp-setup.md)",
    )
    parser.add_argument(
        "--drain-lead",
        type=float,
        default=DEFAULTS["drain_lead_s"],
        metavar="SECONDS",
        help="drain a host this long before its maintenance window starts (default %(default)g)",
    )
    parser.add_argument(
        "--require-maintenance-notices",
        action="store_true",
        help="fail at start when the maintenance subscription cannot be read (no credentials, it does not exist, "
        "no permission), instead of running without maintenance protection",
    )


def add_local_devices_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--local-devices",
        type=int,
        default=DEFAULTS["local_devices"],
        help="CPU devices per worker (default %(default)s)",
    )


def add_strategy_argument(parser: argparse.ArgumentParser) -> None:
    strategies = [str(s) for s in RECOVERY_STRATEGIES]
    parser.add_argument("--strategy", choices=strategies, default=str(DEFAULTS["strategy"]))


def add_max_failures_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-failures",
        type=int,
        default=DEFAULTS["max_failures"],
        help="failures survived (0: stop at the first; default %(default)s)",
    )


def add_slices_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slices",
        type=int,
        default=DEFAULTS["slices"],
        help="slices the processes form, each holding the state sharded over its processes (default: one per process)",
    )


# The settings `launch` and `controller` both take, from the arguments they both add: argument -> LaunchConfig field.
_SHARED = {
    "nprocs": "nprocs",
    "min_nprocs": "min_nprocs",
    "local_devices": "local_devices",
    "slices": "slices",
    "strategy": "strategy",
    "heartbeat_timeout": "heartbeat_timeout_s",
    "heartbeat_start_timeout": "heartbeat_start_timeout_s",
    "hang_timeout": "hang_timeout_s",
    "start_timeout": "start_timeout_s",
    "form_timeout": "form_timeout_s",
    "spawn_timeout": "spawn_timeout_s",
    "finish_timeout": "finish_timeout_s",
    "max_failures": "max_failures",
    "replica_file_every": "replica_file_every",
    "run_dir": "run_dir",
    "resume": "resume",
    "steps": "target_steps",
    "maintenance_subscription": "maintenance_subscription",
    "drain_lead": "drain_lead_s",
    "require_maintenance_notices": "require_maintenance_notices",
}


def shared_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The LaunchConfig fields of the arguments both ``launch`` and ``controller`` take, in one place."""
    settings = {field: getattr(args, name) for name, field in _SHARED.items()}
    return settings | {"progress": not args.quiet, "handlers": list(args.handlers)}


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise SystemExit("elastic-runtime launch: give the worker command after --")
    if args.resume and not args.run_dir:
        raise SystemExit("elastic-runtime launch: --resume needs --run-dir (the run folder names the run)")
    return LaunchConfig(
        command=command,
        spares=args.spares,
        neighbour_replicas=args.neighbour_replicas,
        fork_spares=args.fork_spares,
        durable_dir=args.durable,
        durable_every=args.durable_every,
        durable_keep=args.durable_keep,
        grace_s=args.grace_s,
        result_path=args.result,
        replica_dir=args.replica_dir,
        faults=[fault for faults in args.fault for fault in faults],
        **shared_settings(args),
    )


def _faults(text: str) -> list[Fault]:
    try:
        return parse_faults(text, kinds=("process", "worker"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def launch_main(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ConfigError as exc:  # a bad value on the command line: the message names the setting
        print(f"elastic-runtime launch: {exc}", file=sys.stderr)
        return 2
    if args.backend == "ray":
        from elastic_runtime.cli.launch_ray import launch_on_ray

        return launch_on_ray(args, config)
    if args.ray_address:
        raise SystemExit("elastic-runtime launch: --ray-address needs --backend ray")
    try:
        result = default_controller(config).run()
    except (LaunchError, ElasticRuntimeError, ValueError) as exc:
        print(f"elastic-runtime launch: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: v for k, v in result.__dict__.items() if k != "digests"}, default=str))
    return 0 if result.ok else 1
