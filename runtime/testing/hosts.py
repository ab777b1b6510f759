"""Simulated hosts (tests, `demo --hosts`): each a network namespace with its own address, hostname, `/dev/shm`.

    with SimulatedHosts(3) as hosts:                # namespaces er-<pid>-h0..h2, a bridge, veth pairs
        hosts.controller_address                    # the bridge's address, in this (the root) namespace
        hosts.start(0, ["python", ...], env, log)   # a process on host 0
        hosts.add_address(3)                        # another address on host 3 (198.18.N.128 on)
        hosts.lose(1)                               # every process on host 1 killed, its link removed
        hosts.lose(2, 3)                            # a rack: both links down, then both hosts' processes killed
        hosts.partition(2)                          # host 2's link down (its processes live on)
        hosts.cut_from_controller(2)                # only host 2 <-> the controller cut; its peers reach it
        hosts.reconnect(2)                          # ... and mended
        hosts.kill(0)                               # every process on host 0 killed (its link stays)
        hosts.shape(2, 1e9)                         # host 2's link limited to 1 Gbit/s each way (tc tbf)

Addresses come from 198.18.0.0/15, the range reserved for network tests (RFC 2544), never a real private
range: 198.18.N.1 is the bridge (where the controller listens), 198.18.N.(10+K) host K, with N picked so that
no other bridge on the machine has the same subnet. Each host's processes run in a mount namespace of their
own with a fresh tmpfs on ``/dev/shm`` (what a host's RAM replica files live in) and an ``/etc/hosts`` in
which every host's name (``hostK``) resolves to its address, as on a real cluster: gloo (JAX's CPU
collectives) advertises the address the host's own name resolves to.

Everything made is removed on exit, each command bounded in time. Needs root and ``ip``; if the namespaces
cannot be made, :class:`SimulatedHosts` raises (the tests fail, they do not skip).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

__all__ = ["SimulatedHosts"]

_TIMEOUT_S = 10.0  # any one `ip` command


def _ip(*args: str, check: bool = True) -> str:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_TIMEOUT_S)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"tc {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")


def _free_subnet() -> int:
    """A third octet N such that no address of 198.18.N.0/24 is on any interface here."""
    taken = _ip("-4", "-o", "addr", "show")
    start = os.getpid() % 250
    for n in (start + i for i in range(250)):
        octet = n % 250 + 1
        if f"inet 198.18.{octet}." not in taken:
            return octet
    raise RuntimeError("no free /24 in 198.18.0.0/16 for the simulated hosts")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> None:
    """Remove what a test process killed before its cleanup (SIGKILL, a lost CI runner) left behind: the
    namespaces, links and bridges named after a process that no longer exists."""
    for name in _ip("netns", "list", check=False).split():
        found = re.fullmatch(r"er-(\d+)-h\d+", name)
        if found and not _alive(int(found[1])):
            for pid in _ip("netns", "pids", name, check=False).split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", name, check=False)
    for name in re.findall(r"^\d+: (er\d+(?:br|h\d+))[@:]", _ip("-o", "link", "show", check=False), re.M):
        found = re.match(r"er(\d+)", name)
        if found and not _alive(int(found[1])):
            _ip("link", "del", name, check=False)
    # A blackhole route to a host (cut_from_controller) whose bridge is gone: it would cut the next run there.
    taken = _ip("-4", "-o", "addr", "show", check=False)
    for address, octet in re.findall(r"^blackhole (198\.18\.(\d+)\.\d+)", _ip("route", "show", check=False), re.M):
        if f"inet 198.18.{octet}." not in taken:
            _ip("route", "del", "blackhole", f"{address}/32", check=False)


class SimulatedHosts:
    """``count`` network namespaces on one bridge; a context manager that removes all of it on exit.

    Raises:
        RuntimeError: a namespace, link or address could not be made (not root, no ``ip``, no netns support).
    """

    def __init__(self, count: int) -> None:
        tag = str(os.getpid())
        self.count = count
        self.bridge = f"er{tag}br"
        self.namespaces = [f"er-{tag}-h{k}" for k in range(count)]
        self._links = [f"er{tag}h{k}" for k in range(count)]  # the root end of each host's veth pair
        self._folder = Path(tempfile.mkdtemp(prefix="er-hosts-"))
        self._procs: list[subprocess.Popen[bytes]] = []
        self._octet = 0
        self._extra = 0  # addresses added to hosts beyond their own (add_address)

    @property
    def controller_address(self) -> str:
        """The bridge's address: the controller, in the root namespace, listens here."""
        return f"198.18.{self._octet}.1"

    def address(self, k: int) -> str:
        return f"198.18.{self._octet}.{10 + k}"

    def add_address(self, k: int) -> str:
        """Another address for host ``k`` (198.18.N.128 on): a process there can send from several hosts' addresses."""
        address = f"198.18.{self._octet}.{128 + self._extra}"
        _ip("-n", self.namespaces[k], "addr", "add", f"{address}/24", "dev", f"{self._links[k]}p")
        self._extra += 1
        return address

    def __enter__(self) -> SimulatedHosts:
        try:
            sweep_stale()
            self._octet = _free_subnet()
            _ip("link", "add", self.bridge, "type", "bridge")
            # A bridge without an address of its own takes its lowest port's: losing that host would change
            # the controller's MAC address, and every other host's traffic to it would go nowhere until
            # their ARP entries expired (seen: every worker judged lost at once).
            _ip("link", "set", self.bridge, "address", f"02:00:00:00:{self._octet:02x}:01")
            _ip("addr", "add", f"{self.controller_address}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for k, (ns, link) in enumerate(zip(self.namespaces, self._links, strict=True)):
                _ip("netns", "add", ns)
                _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
                _ip("link", "set", f"{link}p", "netns", ns)
                _ip("link", "set", link, "master", self.bridge)
                _ip("link", "set", link, "up")
                _ip("-n", ns, "addr", "add", f"{self.address(k)}/24", "dev", f"{link}p")
                _ip("-n", ns, "link", "set", f"{link}p", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
            # Every host's name resolves to its address on every host, as on a real cluster (a SLURM job names
            # its nodes); so the host's own name to its own address (gloo advertises that address to its peers).
            names = "".join(f"{self.address(k)} host{k}\n" for k in range(self.count))
            (self._folder / "hosts").write_text(f"127.0.0.1 localhost\n{names}")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()

    def start(self, k: int, command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
        """Start ``command`` on host ``k``: its namespace, hostname ``hostK``, its own ``/dev/shm``."""
        setup = 'mount -t tmpfs tmpfs /dev/shm && mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        wrapped = [
            # nsenter, not `ip netns exec`: that mounts a fresh /sys, without the cgroup filesystems (slurmd's
            # cgroup plugin needs them); the network is the namespace's all the same.
            *("nsenter", f"--net=/run/netns/{self.namespaces[k]}"),
            *("unshare", "--mount", "--uts", "--propagation", "private"),
            *("sh", "-c", setup, str(self._folder / "hosts"), f"host{k}", *command),
        ]
        with open(log, "ab") as out:
            proc = subprocess.Popen(wrapped, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self._procs.append(proc)
        return proc

    def pids(self, k: int) -> list[int]:
        """Every process in host ``k``'s network namespace."""
        return [int(pid) for pid in _ip("netns", "pids", self.namespaces[k], check=False).split()]

    def lose(self, *hosts: int) -> None:
        """The hosts vanish as machines that lose power do: their links go down first (no FIN, no RST reaches
        anyone), then every process in them is killed and their links removed. Several hosts (a rack, a
        switch) go together: every link is down before anything on them is killed."""
        for k in hosts:
            _ip("link", "set", self._links[k], "down", check=False)
        for k in hosts:
            self._kill(k)
        for k in hosts:
            _ip("link", "del", self._links[k], check=False)

    def partition(self, k: int) -> None:
        """Cut host ``k`` off the network; its processes go on."""
        _ip("link", "set", self._links[k], "down")

    def heal(self, k: int) -> None:
        _ip("link", "set", self._links[k], "up")

    def cut_from_controller(self, k: int) -> None:
        """Drop every packet between host ``k`` and the controller's address, both ways; host ``k`` and its
        peers still reach each other (their traffic crosses the bridge, never the root namespace's routes).
        A blackhole route each way: in host ``k``'s namespace to the controller, and in the root namespace
        (the controller's) to host ``k``; the incoming side alone would still deliver the controller's
        messages to host ``k`` (only its acknowledgements would be lost)."""
        _ip("-n", self.namespaces[k], "route", "add", "blackhole", f"{self.controller_address}/32")
        _ip("route", "add", "blackhole", f"{self.address(k)}/32")

    def reconnect(self, k: int) -> None:
        """Undo :meth:`cut_from_controller`."""
        _ip("-n", self.namespaces[k], "route", "del", "blackhole", f"{self.controller_address}/32", check=False)
        _ip("route", "del", "blackhole", f"{self.address(k)}/32", check=False)

    def shape(self, k: int, bits_per_s: float) -> None:
        """Limit host ``k``'s link to ``bits_per_s`` each way: a token bucket (``tc``'s ``tbf``) on both ends of
        its veth pair, the host's end for what it sends, the bridge's for what it receives. The bucket holds
        4 ms at that rate (at least 1 MB): a 64 KB segment of the kernel's segmentation offload always fits."""
        rate, burst = f"{int(bits_per_s)}bit", str(max(2**20, int(bits_per_s / 8 * 0.004)))
        shaping = ("qdisc", "replace", "dev")
        limit = ("root", "tbf", "rate", rate, "burst", burst, "latency", "100ms")
        _tc("-n", self.namespaces[k], *shaping, f"{self._links[k]}p", *limit)
        _tc(*shaping, self._links[k], *limit)

    def kill(self, k: int) -> None:
        """Kill every process on host ``k``; its link stays (the host lives on, as when a job is stopped)."""
        self._kill(k)

    def _kill(self, k: int) -> None:
        for _ in range(5):  # a process may fork while we kill; bounded
            pids = self.pids(k)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)

    def close(self) -> None:
        """Kill every process on every host, remove the namespaces, links and the bridge. Idempotent."""
        for k, ns in enumerate(self.namespaces):
            if ns in _ip("netns", "list", check=False).split():
                self._kill(k)
                _ip("netns", "del", ns, check=False)
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_TIMEOUT_S)
        for k in range(self.count):  # a root-namespace route a test left (cut_from_controller)
            _ip("route", "del", "blackhole", f"{self.address(k)}/32", check=False)
        for link in self._links:  # deleting a namespace removes its end of the pair, and so the pair
            _ip("link", "del", link, check=False)
        _ip("link", "del", self.bridge, check=False)
        for path in self._folder.glob("*"):
            path.unlink()
        with contextlib.suppress(OSError):
            self._folder.rmdir()
