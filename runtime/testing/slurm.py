"""A real SLURM cluster on one machine (tests): ``munged``, ``slurmctld`` and one ``slurmd`` per simulated host.

    with SlurmCluster(4, logs=tmp_path / "slurm") as cluster:  # nodes host0..host3, one per network namespace
        job = cluster.sbatch(["examples/slurm/elastic.sbatch"], env, cwd)
        cluster.steps(job)                  # {step id: (name, node)} of the job's running steps
        cluster.cancel_step(job, step)      # scancel --signal=KILL JOB.STEP
        cluster.hosts.kill(1)               # host 1's slurmd and its steps killed; SLURM reports it down

The daemons are Debian's ``slurm-wlm`` and ``munge`` (``.ci/install-slurm``), run as root with a configuration
of their own: a fresh munge key and socket, state and spool folders and logs in a new folder in the temporary
directory (not under a test's ``tmp_path``: munged wants every folder above its socket open to all), ``slurmctld``
in this (the root) namespace on a free port of the bridge's address, each ``slurmd`` in its host's namespace
(where it names its node after the host), no accounting, no cgroup-based tracking (``proctrack/linuxproc``,
``task/none``; slurmd still reads the machine's ``/sys/fs/cgroup``, which is why the hosts keep its ``/sys``).
``SlurmdTimeout`` (``slurmd_timeout_s``) and ``MessageTimeout`` are short, so that a node whose slurmd died is
reported down within a test (~13 s), not after the default 300 s.

Everything started is stopped on exit, the namespaces removed and the folder deleted (its logs copied to
``logs`` first, when given). If a tool is missing :class:`SlurmMissing` is raised; if a daemon does not start
or the nodes never come up, ``RuntimeError`` (both after everything started is stopped).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

from elastic_runtime.testing.hosts import SimulatedHosts

__all__ = ["SlurmCluster", "SlurmMissing"]

_SBIN = ("/usr/sbin", "/sbin")
_TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
_TIMEOUT_S = 30.0  # any one client command
_UP_S = 60.0  # the nodes idle after start


def _free_port(host: str) -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


class SlurmMissing(RuntimeError):
    """A SLURM or munge program is not installed (``.ci/install-slurm`` installs them)."""


def _which(tool: str) -> str:
    found = shutil.which(tool, path=os.pathsep.join([os.environ.get("PATH", ""), *_SBIN]))
    if found is None:
        raise SlurmMissing(f"{tool} is not installed (.ci/install-slurm installs slurm-wlm and munge)")
    return found


class SlurmCluster:
    """``nodes`` SLURM nodes ``host0``.. on :class:`SimulatedHosts`; a context manager that removes all of it."""

    def __init__(self, nodes: int, *, logs: Path | None = None, slurmd_timeout_s: int = 5) -> None:
        self.tools = {tool: _which(tool) for tool in _TOOLS}
        self.nodes = [f"host{k}" for k in range(nodes)]
        self.logs = logs
        self.hosts = SimulatedHosts(nodes)
        self.folder = Path()  # made on entry
        self._slurmd_timeout_s = slurmd_timeout_s
        self._daemons: list[subprocess.Popen[bytes]] = []  # munged, slurmctld (the slurmds live in the hosts)

    @property
    def conf(self) -> Path:
        return self.folder / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """What a SLURM client needs: this cluster's configuration (and the daemons' folder on PATH)."""
        return self.env_for(os.environ)

    def env_for(self, env: Mapping[str, str]) -> dict[str, str]:
        """``env`` with this cluster's configuration, its PATH ending with the daemons' folders."""
        return {**env, "SLURM_CONF": str(self.conf), "PATH": os.pathsep.join([env.get("PATH", ""), *_SBIN])}

    def __enter__(self) -> SlurmCluster:
        self.folder = Path(tempfile.mkdtemp(prefix="er-slurm-"))
        self.folder.chmod(0o755)  # munged: its socket's folders open to all, none writable by others
        try:
            self.hosts.__enter__()
            self._start_munge()
            self._write_conf()
            self._start(["slurmctld", "-D", "-f", str(self.conf)], "slurmctld.out")
            for k, node in enumerate(self.nodes):
                slurmd = [self.tools["slurmd"], "-D", "-N", node, "-f", str(self.conf)]
                self.hosts.start(k, slurmd, self.env, self.folder / f"slurmd-{node}.out")
            self._wait_idle()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def _start(self, command: list[str], log: str) -> None:
        with open(self.folder / log, "ab") as out:
            proc = subprocess.Popen(
                [self.tools[command[0]], *command[1:]],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._daemons.append(proc)

    def _start_munge(self) -> None:
        munge = self.folder / "munge"
        munge.mkdir(mode=0o755)
        key = munge / "munge.key"
        subprocess.run([self.tools["mungekey"], "-c", "-k", str(key)], check=True, timeout=_TIMEOUT_S)
        self.socket = munge / "munge.socket"
        self._start(
            [
                *("munged", "-F", f"--socket={self.socket}", f"--key-file={key}"),
                *(f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}"),
                f"--log-file={munge / 'munged.log'}",
            ],
            "munged.out",
        )
        self._wait("munged's socket", self.socket.exists)

    def _write_conf(self) -> None:
        for name in ("state", "spool", "log", *(f"spool/{node}" for node in self.nodes)):
            (self.folder / name).mkdir()
        hosts, f = self.hosts, self.folder
        controller_port = _free_port(hosts.controller_address)
        lines = [
            "ClusterName=elastic",
            f"SlurmctldHost={socket.gethostname().split('.')[0]}({hosts.controller_address})",
            f"SlurmctldPort={controller_port}",
            f"SlurmdPort={_free_port(hosts.controller_address)}",  # in each host's namespace: free there too
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={f / 'state'}",
            f"SlurmdSpoolDir={f / 'spool'}/%n",
            f"SlurmctldPidFile={f / 'slurmctld.pid'}",
            f"SlurmdPidFile={f / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={f / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={f / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SchedulerType=sched/builtin",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            f"SlurmdTimeout={self._slurmd_timeout_s}",
            "MessageTimeout=4",  # also how long a ping to a dead node waits: the default 10 s doubles the detection
            "InactiveLimit=0",
            "KillWait=5",
            "MinJobAge=30",
            *(
                f"NodeName={node} NodeAddr={hosts.address(k)} CPUs={os.cpu_count()} State=UNKNOWN"
                for k, node in enumerate(self.nodes)
            ),
            "PartitionName=main Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _wait(self, what: str, condition: Callable[[], bool], timeout_s: float = _UP_S) -> None:
        deadline = time.monotonic() + timeout_s
        where = f"the daemons' logs: {self.logs}" if self.logs else "pass logs= to keep the daemons' logs"
        while not condition():
            for proc in self._daemons:
                if proc.poll() is not None:
                    raise RuntimeError(f"{proc.args!r} exited ({proc.returncode}) before {what} ({where})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"no {what} within {timeout_s:.0f} s ({where})")
            time.sleep(0.2)

    def _wait_idle(self) -> None:
        def idle() -> bool:
            done = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
            states = dict(line.split() for line in done.splitlines() if line.strip())
            return all(states.get(node) == "idle" for node in self.nodes)

        self._wait(f"idle nodes {','.join(self.nodes)}", idle)

    def run(self, tool: str, *args: str, check: bool = True) -> str:
        """A SLURM client command against this cluster; its standard output."""
        done = subprocess.run(
            [self.tools[tool], *args], env=self.env, capture_output=True, text=True, timeout=_TIMEOUT_S
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return done.stdout

    def sbatch(self, args: list[str], env: Mapping[str, str], cwd: Path) -> int:
        """Submit a batch job with ``env`` as its whole environment (with this cluster's added); its id."""
        done = subprocess.run(
            [self.tools["sbatch"], "--parsable", *args],
            env=self.env_for(env),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
        )
        if done.returncode != 0:
            raise RuntimeError(f"sbatch {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job_state(self, job: int) -> str:
        """The job's state (``RUNNING``, ``COMPLETED``, ...), or ``""`` once SLURM no longer knows it."""
        out = self.run("scontrol", "-o", "show", "job", str(job), check=False)
        for field in out.split():
            if field.startswith("JobState="):
                return field.partition("=")[2]
        return ""

    def steps(self, job: int) -> dict[int, tuple[str, str]]:
        """The job's running steps (not the batch step): step id -> (its name, that is its command; its node)."""
        out = self.run("squeue", "-h", "-s", "-j", str(job), "-o", "%i %j %N")
        found = {}
        for line in out.splitlines():
            step, name, node = line.split()
            step_id = step.partition(".")[2]
            if step_id.isdigit():
                found[int(step_id)] = (name, node)
        return found

    def cancel_step(self, job: int, step: int) -> None:
        """Kill one step's processes (``scancel --signal=KILL``), as when a step's task crashes."""
        self.run("scancel", "--signal=KILL", f"{job}.{step}")

    def node_state(self, node: str) -> str:
        """The node's state as ``sinfo`` reports it (``idle``, ``alloc``, ``down*``, ...)."""
        return self.run("sinfo", "-h", "-n", node, "-N", "-o", "%t").strip()

    def close(self) -> None:
        """Stop every slurmd (and its steps) with its host, then slurmctld and munged; remove the folder.
        Idempotent."""
        self.hosts.close()
        for proc in reversed(self._daemons):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        self._daemons.clear()
        if self.folder == Path():
            return
        if self.logs is not None:
            self.logs.mkdir(parents=True, exist_ok=True)
            for log in [*self.folder.glob("*.out"), *self.folder.glob("log/*"), *self.folder.glob("munge/*.log")]:
                shutil.copy(log, self.logs / log.name)
        shutil.rmtree(self.folder, ignore_errors=True)
