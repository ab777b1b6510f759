"""``elastic-runtime demo --hosts N --lose-host-at STEP``: the multi-host demonstration, on simulated hosts.

Each host is a network namespace on a bridge (:mod:`elastic_runtime.testing.hosts`: its own address in
198.18.0.0/15, hostname and ``/dev/shm``), so it needs root. The controller (``elastic-runtime controller``,
a real process in this namespace) listens on the bridge with a secret from a token file; one worker x 2 CPU
devices runs on each of the N hosts, started as a cluster would start them. At ``STEP`` host 1 is lost (its
link goes down, every process on it is killed: only the missing heartbeats tell the controller) or, with
``--partition-host-at``, cut off the network and healed once the survivors re-formed. The survivors go on
without it; then a replacement with a new id (N) starts on an extra, empty host and the group grows back.

With ``--full-restart`` the loss is handled as a job without in-process recovery handles it, for comparison:
the controller stops at the first failure (``--max-failures 0``) and stops every worker, then a new
controller (``--resume``, the same run folder) and a worker on every host start again, the lost host's on
the extra, empty host, and the run goes on from the newest replica the workers wrote to disk (a folder per
host, standing for each host's persistent checkpoint; ``/dev/shm`` is lost with the processes' host).

With ``--json`` the last line is a summary (the multi-process demo's fields and ``hosts_history``, the hosts
in each group, ``refused_connections`` and ``controller_restarts``); ``--verify`` runs the same job
fault-free as a group on this host and compares the final parameters: bitwise when every group had all N
hosts (a fault-free run, a full restart), else within 1e-5 relative (some steps ran on a smaller data axis).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_STEPS = 60
LOST_HOST = 1
_WAIT_S = 120.0  # a bound on each wait, so that a broken run ends instead of hanging


def add_hosts_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's multi-host options (added to ``elastic-runtime demo``)."""
    group = parser.add_argument_group("multi-host (simulated hosts: network namespaces; needs root)")
    group.add_argument("--hosts", type=int, default=0, help="run on N simulated hosts, one worker each")
    group.add_argument("--lose-host-at", type=int, default=None, metavar="STEP", help="lose host 1 after STEP")
    group.add_argument(
        "--partition-host-at", type=int, default=None, metavar="STEP", help="cut host 1 off after STEP instead"
    )
    group.add_argument(
        "--full-restart",
        action="store_true",
        help="on the loss stop the controller and every worker, then start them all again with --resume",
    )
    group.add_argument(
        "--step-delay",
        type=float,
        default=None,
        metavar="S",
        help="extra seconds per step, in every worker (default 0.25 with --hosts, else 0)",
    )


_HOSTS_STEP_DELAY_S = 0.25  # room to see the hosts' steps and the loss


class _DemoError(Exception):
    """The demo cannot run here (exit 2)."""


def run_hosts_demo(args: argparse.Namespace) -> int:
    """The ``demo --hosts N`` entry point."""
    try:
        summary = _run(args)
    except _DemoError as exc:
        print(f"elastic-runtime demo: {exc}", file=sys.stderr)
        return 2
    return 0 if summary["ok"] and summary.get("reference_match", {}).get("match", True) else 1


def _check(args: argparse.Namespace) -> None:
    if args.hosts < 2:
        raise _DemoError("--hosts needs at least 2 hosts")
    if args.lose_host_at is not None and args.partition_host_at is not None:
        raise _DemoError("--lose-host-at and --partition-host-at are exclusive")
    if getattr(args, "full_restart", False) and args.lose_host_at is None:
        raise _DemoError("--full-restart needs --lose-host-at")
    at = args.lose_host_at if args.lose_host_at is not None else args.partition_host_at
    if at is not None and not 0 < at < args.steps:
        raise _DemoError(f"the fault's step must be between 1 and {args.steps - 1}, got {at}")
    if os.geteuid() != 0:
        raise _DemoError("--hosts needs root: each simulated host is a network namespace")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        raise _DemoError(f"--hosts needs {' and '.join(missing)} (iproute2, util-linux)")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from elastic_runtime.testing.hosts import SimulatedHosts

    _check(args)
    hosts_count, steps = args.hosts, args.steps
    fault = "partition" if args.partition_host_at is not None else "lose" if args.lose_host_at is not None else None
    fault_at = args.partition_host_at if fault == "partition" else args.lose_host_at
    if args.no_fault:
        fault = fault_at = None
    full_restart = bool(getattr(args, "full_restart", False)) and fault == "lose"
    run_dir = Path(args.run_dir or f"runs/demo-hosts-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if args.quiet else print
    say(f"elastic-runtime demo: {steps} steps on {hosts_count} simulated hosts x 1 worker x 2 CPU devices")
    if full_restart:
        say(
            f"  host {LOST_HOST} lost after step {fault_at}; then every process stops and all start again "
            f"(--resume, replicas on disk), worker {hosts_count} on host {hosts_count} instead of host {LOST_HOST}"
        )
    elif fault:
        say(
            f"  host {LOST_HOST} {'lost' if fault == 'lose' else 'partitioned'} after step {fault_at}; "
            f"a replacement (worker {hosts_count}) then starts on host {hosts_count}"
        )
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        try:  # the last host: the replacement's, empty until then
            hosts = stack.enter_context(SimulatedHosts(hosts_count + (1 if fault else 0)))
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
            raise _DemoError(f"cannot make the simulated hosts: {exc}") from exc
        # A full restart keeps the group at N (no --min-nprocs) and its replicas on disk, one folder per host.
        disk = run_dir / "disk" if full_restart else None
        faulty = fault is not None and not full_restart
        run = HostedRun(hosts, run_dir, steps=steps, nprocs=hosts_count, faulty=faulty, disk=disk)
        stack.callback(run.stop)
        delay = _HOSTS_STEP_DELAY_S if args.step_delay is None else args.step_delay
        run.start(step_delay_s=delay, controller_args=["--max-failures", "0"] if full_restart else [])
        lost_at = None
        if fault and fault_at is not None:
            at = fault_at
            run.wait_for(f"step {at}", lambda: run.committed(at))
            lost_at = time.monotonic()  # the events' mono_time is the same clock (CLOCK_MONOTONIC)
            hosts.lose(LOST_HOST) if fault == "lose" else hosts.partition(LOST_HOST)
            say(f"host {LOST_HOST} {'lost' if fault == 'lose' else 'partitioned'} after step {fault_at}")
        if full_restart:
            run.wait_for_exit("the controller's stop at the loss")
            run.wait_for_hosts_idle([k for k in range(hosts_count) if k != LOST_HOST])
            say("the controller and every worker stopped")
            run = HostedRun(hosts, run_dir, steps=steps, nprocs=hosts_count, faulty=False, disk=disk)
            stack.callback(run.stop)
            # What a cluster does after a failure: the whole job again, the lost host's share on a new one.
            run.start(
                step_delay_s=delay,
                controller_args=["--resume"],
                hosts=[k if k != LOST_HOST else hosts_count for k in range(hosts_count)],
            )
            say(f"all started again with --resume, worker {hosts_count} on host {hosts_count}")
        elif fault and fault_at is not None:
            run.wait_for("the survivors' group", lambda: run.formed(2))
            say("the survivors re-formed without it")
            if fault == "partition":
                hosts.heal(LOST_HOST)
            run.start_worker(hosts_count, hosts_count)  # a new process on a new host, a new id
            say(f"replacement worker {hosts_count} started on host {hosts_count}")
        result = run.finish()
    events = run.events()
    summary = _summary(
        result,
        events,
        lost_at=lost_at,
        hosts_count=hosts_count,
        fault=fault,
        fault_at=fault_at,
        full_restart=full_restart,
    )
    summary["seconds"] = round(time.monotonic() - started, 3)
    summary["run_dir"] = str(run_dir)
    if args.verify:
        say("verifying: fault-free run of the same group ...")
        full = all(len(group) == hosts_count for group in summary["hosts_history"])
        summary["reference_match"] = _verify(
            run_dir, processes=hosts_count, steps=steps, ok=summary["ok"], bitwise=full
        )
    say(_render(summary))
    if args.json:
        print(json.dumps(summary))
    return summary


class HostedRun:
    """``elastic-runtime controller`` in this namespace with a token file, and its workers on the hosts (the
    demo job, or ``command``: the same job at another size, ``tests/benchmarks/bench_wire.py``)."""

    def __init__(
        self,
        hosts: Any,
        run_dir: Path,
        *,
        steps: int,
        nprocs: int,
        faulty: bool,
        disk: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        from elastic_runtime.cli.demo_multiprocess import worker_command
        from elastic_runtime.cluster.controller.coordination import free_port

        self.hosts, self.run_dir, self.steps, self.nprocs, self.faulty = hosts, run_dir, steps, nprocs, faulty
        self.command = command or worker_command(steps)
        self.disk = disk  # the workers' replica folders, one per host under it; None: each host's /dev/shm
        self.events_path = run_dir / "run" / "events.jsonl"
        self.address = f"{hosts.controller_address}:{free_port(hosts.controller_address)}"
        self.low_port = free_port(hosts.controller_address)
        self.controller: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    def start(self, *, step_delay_s: float, controller_args: list[str], hosts: list[int] | None = None) -> None:
        """The controller (with ``controller_args``), then worker k on ``hosts[k]`` (default: host k)."""
        token = self.run_dir / "token"
        with contextlib.suppress(FileNotFoundError):
            token.unlink()
        token.touch(mode=0o600)
        token.write_text(os.urandom(32).hex())
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        env["ELASTIC_RUNTIME_TOKEN_FILE"] = str(token)
        command = [sys.executable, "-m", "elastic_runtime.cli", "controller", "--listen", self.address]
        command += ["--nprocs", str(self.nprocs), "--steps", str(self.steps)]
        command += ["--min-nprocs", str(self.nprocs - 1)] if self.faulty else []
        command += ["--run-dir", str(self.run_dir / "run")]
        command += ["--coordinator-ports", f"{self.low_port}-{self.low_port + 20}", *controller_args]
        with open(self.run_dir / "controller.log", "ab") as log:
            self.controller = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
        # What a cluster gives each worker: the controller's address, a worker id, the secret (a file).
        self.env = env | {
            "ELASTIC_CONTROLLER": self.address,
            "ELASTIC_RESULT": str(self.run_dir / "final"),  # process 0 commits the final state there
            "ELASTIC_STEP_DELAY_S": str(step_delay_s),
            "ELASTIC_COMPILE_CACHE": str(self.run_dir / "xla-cache"),
        }
        for host in hosts or range(self.nprocs):
            self.start_worker(host, host)  # worker k on host k (a replacement, worker N, on host N)

    def start_worker(self, host: int, worker: int) -> None:
        log = self.run_dir / f"worker-{worker}.log"
        env = self.env | {"ELASTIC_WORKER_ID": str(worker)}
        if self.disk is not None:
            env["ELASTIC_REPLICA_DIR"] = str(self.disk / f"host{host}")
        self.hosts.start(host, self.command, env, log)

    def events(self) -> list[Any]:
        from elastic_runtime.core.eventlog import read_events

        return read_events(self.events_path) if self.events_path.exists() else []

    def committed(self, step: int) -> bool:
        from elastic_runtime.core.events import StepCompleted

        return any(isinstance(e, StepCompleted) and (e.step or 0) >= step for e in self.events())

    def formed(self, generation: int) -> bool:
        from elastic_runtime.core.events import GroupFormed

        return any(isinstance(e, GroupFormed) and e.generation >= generation for e in self.events())

    def wait_for(self, what: str, condition: Callable[[], bool]) -> None:
        assert self.controller is not None
        deadline = time.monotonic() + _WAIT_S
        while not condition():
            if self.controller.poll() is not None:
                raise _DemoError(f"the controller exited ({self.controller.returncode}) before {what}; {self._log()}")
            if time.monotonic() > deadline:
                raise _DemoError(f"no {what} within {_WAIT_S:.0f} s; {self._log()}")
            time.sleep(0.05)

    def wait_for_exit(self, what: str) -> None:
        assert self.controller is not None
        try:
            self.controller.wait(timeout=_WAIT_S)
        except subprocess.TimeoutExpired as exc:
            raise _DemoError(f"no {what} within {_WAIT_S:.0f} s; {self._log()}") from exc

    def wait_for_hosts_idle(self, hosts: list[int]) -> None:
        """Every process on ``hosts`` gone (told to stop by the controller); killed after a bounded wait."""
        deadline = time.monotonic() + 30.0
        while any(self.hosts.pids(k) for k in hosts) and time.monotonic() < deadline:
            time.sleep(0.05)
        for k in hosts:
            self.hosts.kill(k)

    def finish(self) -> dict[str, Any]:
        """The controller's result line."""
        assert self.controller is not None
        try:
            out, _ = self.controller.communicate(timeout=_WAIT_S + 60 + 2 * self.steps)
        except subprocess.TimeoutExpired as exc:
            raise _DemoError(f"the run did not end in time; {self._log()}") from exc
        lines = out.decode().strip().splitlines()
        if not lines:
            raise _DemoError(f"the controller exited ({self.controller.returncode}) without a result; {self._log()}")
        result: dict[str, Any] = json.loads(lines[-1])
        return result

    def stop(self) -> None:
        if self.controller is not None and self.controller.poll() is None:
            self.controller.kill()
            self.controller.wait()

    def _log(self) -> str:
        path = self.run_dir / "controller.log"
        tail = path.read_text(errors="replace").strip().splitlines()[-5:] if path.exists() else []
        return f"see {path}" + (":\n  " + "\n  ".join(tail) if tail else "")


def _summary(
    result: dict[str, Any],
    events: list[Any],
    *,
    lost_at: float | None,
    hosts_count: int,
    fault: str | None,
    fault_at: int | None,
    full_restart: bool,
) -> dict[str, Any]:
    from elastic_runtime.cli.demo_multiprocess import _first
    from elastic_runtime.core.events import ConnectionRefused, GroupFormed, RunStarted, StepCompleted, WorkerLost

    recoveries = result.get("recoveries", [])
    detected_after_s = recovered_after_s = None
    before = 0
    if lost_at is not None:
        lost = [e for e in events if isinstance(e, WorkerLost) and e.worker == LOST_HOST]
        if lost:
            detected_after_s = round(lost[0].mono_time - lost_at, 3)
        done = [e for e in events if isinstance(e, StepCompleted) and e.step is not None]
        before = max((e.step or 0 for e in done if e.mono_time < lost_at), default=0)
        # The first step the group trains after the loss: past those committed before it and past the step
        # it restored (the survivors may hold a step the controller heard of only as they re-formed; a full
        # restart may resume from one the old controller never heard of).
        formed = [e.restore_step for e in events if isinstance(e, GroupFormed) and e.mono_time > lost_at]
        floor = max(before, formed[0] if formed else 0)
        after = [e.mono_time for e in done if (e.step or 0) > floor and e.mono_time > lost_at]
        recovered_after_s = round(min(after) - lost_at, 3) if after else None
    # Worker k runs on host k (the replacement, worker N, on host N).
    hosts_history = [[f"host{m}" for m in sorted(e.members)] for e in events if isinstance(e, GroupFormed)]
    # Each controller publishes RunStarted once, at its first group: a second one is a restarted controller.
    controller_restarts = max(0, sum(isinstance(e, RunStarted) for e in events) - 1)
    lost_steps = sum(r["lost_steps"] for r in recoveries)
    survivor_restarts = result.get("survivor_restarts")
    if full_restart:
        # The resumed controller knows only its own start: what it resumed from, not what the first committed.
        resumed_from = result.get("resumed_from", -1)
        lost_steps = max(0, before - max(resumed_from, 0))
        survivor_restarts = (survivor_restarts or 0) + hosts_count - 1  # every survivor stopped and started
    summary = {
        "ok": bool(result.get("ok")),
        "hosts": hosts_count,
        "fault": fault,
        "fault_step": fault_at,
        "step": result.get("step"),
        "steps_completed": result.get("step"),
        "detected_after_s": detected_after_s,
        "recovered_after_s": recovered_after_s,
        "recovery_s": _first([r["recovery_s"] for r in recoveries]),
        "lost_steps": lost_steps,
        "restored_from": _first([r["restored_from"] for r in recoveries]),
        "strategy": _first([r["strategy"] for r in recoveries]),
        "strategies": result.get("strategies", []),
        "recoveries": len(recoveries),
        "survivor_restarts": survivor_restarts,
        "controller_restarts": controller_restarts,
        "world_size_history": result.get("world_size_history", []),
        "hosts_history": hosts_history,
        "refused_connections": sum(e.count for e in events if isinstance(e, ConnectionRefused)),
    }
    if full_restart:
        summary["strategy"], summary["restored_from"] = "full restart", "disk"
        summary["resumed_from"] = result.get("resumed_from")
    return summary


def _verify(run_dir: Path, *, processes: int, steps: int, ok: bool, bitwise: bool) -> dict[str, Any]:
    """A fault-free run of the same job as a group on this host, compared bit for bit or within 1e-5 relative."""
    from elastic_runtime.cli.demo_multiprocess import run_group
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.storage.disk import DiskTier

    reference = run_group(processes=processes, steps=steps, run_dir=run_dir / "reference", faults=[])
    if not (ok and reference.ok and (run_dir / "final").exists()):
        return {"match": False}
    got = DiskTier(run_dir / "final").latest(None).tree
    want = DiskTier(run_dir / "reference" / "final").latest(None).tree
    return compare_states(got, want, bitwise=bitwise)


def _render(summary: dict[str, Any]) -> str:
    lines = [
        "",
        f"finished {summary['steps_completed']} steps in {summary['seconds']:.2f} s on {summary['hosts']} hosts; "
        f"detected after {summary['detected_after_s']} s, next commit {summary['recovered_after_s']} s after the "
        f"fault, lost {summary['lost_steps']} step(s), survivor restarts {summary['survivor_restarts']}, "
        f"controller restarts {summary['controller_restarts']}",
        "groups: " + " -> ".join("{" + ", ".join(group) + "}" for group in summary["hosts_history"]),
        f"refused connections: {summary['refused_connections']}",
    ]
    match = summary.get("reference_match")
    if match:
        verdict = "holds" if match["match"] else "FAILS"
        lines.append(f"reference check ({match.get('comparison')}) {verdict}: {match.get('max_rel_error')}")
    lines.append(f"event log: {summary['run_dir']}/run/events.jsonl")
    return "\n".join(lines)
