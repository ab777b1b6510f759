"""``elastic-runtime launch --backend ray --nprocs N [--ray-address HOST:PORT] -- python train.py``.

The controller runs in this process, beside the Ray driver, in service mode; Ray places the workers, one
actor per node (``runtime/cluster/controller/ray_backend.py``). Without ``--ray-address`` a local cluster of N + 1 nodes
starts on 127.0.0.1 (one node for a replacement), and stops with the run. See ``docs/cluster.md``, *Ray*.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import msgspec

from elastic_runtime.cluster import auth
from elastic_runtime.cluster.config import LaunchConfig, LaunchError
from elastic_runtime.core.errors import ElasticRuntimeError
from elastic_runtime.defaults import ray_controller


def ray_config(config: LaunchConfig, *, host: str, min_nprocs: int | None) -> LaunchConfig:
    """``launch``'s config as a service-mode controller's on ``host``, with a fresh secret for the run. The
    survivors of a loss go on without waiting for Ray's replacement unless ``--min-nprocs`` says otherwise.

    Raises:
        SystemExit: a setting the Ray backend does not take.
    """
    if config.faults:
        raise SystemExit("elastic-runtime launch: --fault signals local processes; not with --backend ray")
    if config.replica_dir:
        raise SystemExit("elastic-runtime launch: --replica-dir: each Ray worker keeps its replicas on its node")
    return msgspec.structs.replace(
        config,
        command=[],
        min_nprocs=min_nprocs if min_nprocs is not None else max(1, config.nprocs - 1),
        result_path=None,  # handed to the workers as ELASTIC_RESULT instead (service mode)
        secret=config.secret or auth.new_secret(),
        listen_host=host,
        listen_port=0,
    )


def launch_on_ray(args: argparse.Namespace, config: LaunchConfig) -> int:
    from elastic_runtime.cluster.controller.ray_cluster import local_cluster, ray_session

    env = {"ELASTIC_RESULT": config.result_path} if config.result_path else {}
    try:
        with contextlib.ExitStack() as stack:
            address = args.ray_address
            if address is None:
                address = stack.enter_context(local_cluster(config.nprocs + 1)).address
            host = stack.enter_context(ray_session(address))
            service = ray_config(config, host=host, min_nprocs=args.min_nprocs)
            controller, placement = ray_controller(service, list(config.command), env=env)
            stack.callback(placement.close)
            result = controller.run()
    except (LaunchError, ElasticRuntimeError, ValueError) as exc:
        print(f"elastic-runtime launch: {exc}", file=sys.stderr)
        return 1
    summary = {k: v for k, v in result.__dict__.items() if k != "digests"}
    summary["replacements"] = placement.replacements
    print(json.dumps(summary, default=str))
    return 0 if result.ok else 1
