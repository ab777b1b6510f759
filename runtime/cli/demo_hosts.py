"""``elastic-runtime demo --hosts N --lose-host-at STEP``: the multi-host demonstration, on simulated hosts.

Each host is a network namespace on a bridge (:mod:`runtime.testing.hosts`: its own address in
198.18.0.0/15, hostname and ``/dev/shm``), so it needs root. The controller (``elastic-runtime controller``,
a real process in this namespace) listens on the bridge with a secret from a token file; one worker x 2 CPU
devices runs on each of the N hosts, started as a cluster would start them. At ``STEP`` host 1 is lost (its
link goes down, every process on it is killed: only the missing heartbeats tell the controller) or, with
``--partition-host-at``, cut off the network and healed once the survivors re-formed. The survivors go on
without it; then a replacement with a new id (N) starts on an extra, empty host and the group grows back.

With ``--json`` the last line is a summary (the multi-process demo's fields and ``hosts_history``, the hosts
in each group, and ``refused_connections``); ``--verify`` runs the same job fault-free as a group on this
host and compares the final parameters within 1e-5 relative (some steps ran on a smaller data axis).
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
        "--step-delay", type=float, default=0.25, metavar="S", help="extra seconds per step (default %(default)s)"
    )


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
    at = args.lose_host_at if args.lose_host_at is not None else args.partition_host_at
    if at is not None and not 0 < at < args.steps:
        raise _DemoError(f"the fault's step must be between 1 and {args.steps - 1}, got {at}")
    if os.geteuid() != 0:
        raise _DemoError("--hosts needs root: each simulated host is a network namespace")
    missing = [tool for tool in ("ip", "unshare") if shutil.which(tool) is None]
    if missing:
        raise _DemoError(f"--hosts needs {' and '.join(missing)} (iproute2, util-linux)")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    from runtime.testing.hosts import SimulatedHosts

    _check(args)
    hosts_count, steps = args.hosts, args.steps
    fault = "partition" if args.partition_host_at is not None else "lose" if args.lose_host_at is not None else None
    fault_at = args.partition_host_at if fault == "partition" else args.lose_host_at
    if args.no_fault:
        fault = fault_at = None
    run_dir = Path(args.run_dir or f"runs/demo-hosts-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: None) if args.quiet else print
    say(f"elastic-runtime demo: {steps} steps on {hosts_count} simulated hosts x 1 worker x 2 CPU devices")
    if fault:
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
        run = _Service(hosts, run_dir, steps=steps, nprocs=hosts_count, faulty=fault is not None)
        stack.callback(run.stop)
        run.start(step_delay_s=args.step_delay)
        lost_at = None
        if fault and fault_at is not None:
            at = fault_at
            run.wait_for(f"step {at}", lambda: run.committed(at))
            lost_at = time.monotonic()  # the events' mono_time is the same clock (CLOCK_MONOTONIC)
            hosts.lose(LOST_HOST) if fault == "lose" else hosts.partition(LOST_HOST)
            say(f"host {LOST_HOST} {'lost' if fault == 'lose' else 'partitioned'} after step {fault_at}")
            run.wait_for("the survivors' group", lambda: run.formed(2))
            say("the survivors re-formed without it")
            if fault == "partition":
                hosts.heal(LOST_HOST)
            run.start_worker(hosts_count, hosts_count)  # a new process on a new host, a new id
            say(f"replacement worker {hosts_count} started on host {hosts_count}")
        result = run.finish()
    events = run.events()
    summary = _summary(result, events, lost_at=lost_at, hosts_count=hosts_count, fault=fault, fault_at=fault_at)
    summary["seconds"] = round(time.monotonic() - started, 3)
    summary["run_dir"] = str(run_dir)
    if args.verify:
        say("verifying: fault-free run of the same group ...")
        summary["reference_match"] = _verify(run_dir, processes=hosts_count, steps=steps, ok=summary["ok"])
    say(_render(summary))
    if args.json:
        print(json.dumps(summary))
    return summary


class _Service:
    """``elastic-runtime controller`` in this namespace with a token file, and its workers on the hosts."""

    def __init__(self, hosts: Any, run_dir: Path, *, steps: int, nprocs: int, faulty: bool) -> None:
        from runtime.cluster.coordination import free_port

        self.hosts, self.run_dir, self.steps, self.nprocs, self.faulty = hosts, run_dir, steps, nprocs, faulty
        self.events_path = run_dir / "run" / "events.jsonl"
        self.address = f"{hosts.controller_address}:{free_port(hosts.controller_address)}"
        self.low_port = free_port(hosts.controller_address)
        self.controller: subprocess.Popen[bytes] | None = None
        self.env: dict[str, str] = {}

    def start(self, *, step_delay_s: float) -> None:
        token = self.run_dir / "token"
        with contextlib.suppress(FileNotFoundError):
            token.unlink()
        token.touch(mode=0o600)
        token.write_text(os.urandom(32).hex())
        env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
        env["ELASTIC_RUNTIME_TOKEN_FILE"] = str(token)
        command = [sys.executable, "-m", "runtime.cli", "controller", "--listen", self.address]
        command += ["--nprocs", str(self.nprocs), "--steps", str(self.steps)]
        command += ["--min-nprocs", str(self.nprocs - 1)] if self.faulty else []
        command += ["--run-dir", str(self.run_dir / "run")]
        command += ["--coordinator-ports", f"{self.low_port}-{self.low_port + 20}"]
        with open(self.run_dir / "controller.log", "wb") as log:
            self.controller = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=log)
        # What a cluster gives each worker: the controller's address, a worker id, the secret (a file).
        self.env = env | {
            "ELASTIC_CONTROLLER": self.address,
            "ELASTIC_RESULT": str(self.run_dir / "final"),  # process 0 commits the final state there
            "ELASTIC_STEP_DELAY_S": str(step_delay_s),
            "ELASTIC_COMPILE_CACHE": str(self.run_dir / "xla-cache"),
        }
        for k in range(self.nprocs):
            self.start_worker(k, k)

    def start_worker(self, host: int, worker: int) -> None:
        from runtime.cli.demo_multiprocess import worker_command

        log = self.run_dir / f"worker-{worker}.log"
        self.hosts.start(host, worker_command(self.steps), self.env | {"ELASTIC_WORKER_ID": str(worker)}, log)

    def events(self) -> list[Any]:
        from runtime.core.eventlog import read_events

        return read_events(self.events_path) if self.events_path.exists() else []

    def committed(self, step: int) -> bool:
        from runtime.core.events import StepCompleted

        return any(isinstance(e, StepCompleted) and (e.step or 0) >= step for e in self.events())

    def formed(self, generation: int) -> bool:
        from runtime.core.events import GroupFormed

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
) -> dict[str, Any]:
    from runtime.cli.demo_multiprocess import _first
    from runtime.core.events import ConnectionRefused, GroupFormed, StepCompleted, WorkerLost

    recoveries = result.get("recoveries", [])
    detected_after_s = recovered_after_s = None
    if lost_at is not None:
        lost = [e for e in events if isinstance(e, WorkerLost) and e.worker == LOST_HOST]
        if lost:
            detected_after_s = round(lost[0].mono_time - lost_at, 3)
        done = [e for e in events if isinstance(e, StepCompleted) and e.step is not None]
        before = max((e.step or 0 for e in done if e.mono_time < lost_at), default=0)
        after = [e.mono_time for e in done if e.step == before + 1 and e.mono_time > lost_at]
        recovered_after_s = round(min(after) - lost_at, 3) if after else None
    # Worker k runs on host k (the replacement, worker N, on host N).
    hosts_history = [[f"host{m}" for m in sorted(e.members)] for e in events if isinstance(e, GroupFormed)]
    return {
        "ok": bool(result.get("ok")),
        "hosts": hosts_count,
        "fault": fault,
        "fault_step": fault_at,
        "step": result.get("step"),
        "steps_completed": result.get("step"),
        "detected_after_s": detected_after_s,
        "recovered_after_s": recovered_after_s,
        "recovery_s": _first([r["recovery_s"] for r in recoveries]),
        "lost_steps": sum(r["lost_steps"] for r in recoveries),
        "restored_from": _first([r["restored_from"] for r in recoveries]),
        "strategy": _first([r["strategy"] for r in recoveries]),
        "strategies": result.get("strategies", []),
        "recoveries": len(recoveries),
        "survivor_restarts": result.get("survivor_restarts"),
        "world_size_history": result.get("world_size_history", []),
        "hosts_history": hosts_history,
        "refused_connections": sum(e.count for e in events if isinstance(e, ConnectionRefused)),
    }


def _verify(run_dir: Path, *, processes: int, steps: int, ok: bool) -> dict[str, Any]:
    """A fault-free run of the same job as a group on this host, compared within 1e-5 relative."""
    from runtime.cli.demo_multiprocess import run_group
    from runtime.testing.compare import compare_states
    from storage.disk import DiskTier

    reference = run_group(processes=processes, steps=steps, run_dir=run_dir / "reference", faults=[])
    if not (ok and reference.ok and (run_dir / "final").exists()):
        return {"match": False}
    got = DiskTier(run_dir / "final").latest(None).tree
    want = DiskTier(run_dir / "reference" / "final").latest(None).tree
    return compare_states(got, want, bitwise=False)


def _render(summary: dict[str, Any]) -> str:
    lines = [
        "",
        f"finished {summary['steps_completed']} steps in {summary['seconds']:.2f} s on {summary['hosts']} hosts; "
        f"detected after {summary['detected_after_s']} s, next commit {summary['recovered_after_s']} s after the "
        f"fault, lost {summary['lost_steps']} step(s), survivor restarts {summary['survivor_restarts']}",
        "groups: " + " -> ".join("{" + ", ".join(group) + "}" for group in summary["hosts_history"]),
        f"refused connections: {summary['refused_connections']}",
    ]
    match = summary.get("reference_match")
    if match:
        verdict = "holds" if match["match"] else "FAILS"
        lines.append(f"reference check ({match.get('comparison')}) {verdict}: {match.get('max_rel_error')}")
    lines.append(f"event log: {summary['run_dir']}/run/events.jsonl")
    return "\n".join(lines)
