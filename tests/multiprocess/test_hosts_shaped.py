"""A simulated host's link shaped to a rate (``SimulatedHosts.shape``, what ``bench_wire.py`` measures recovery
over): bytes cross it no faster than the rate, each way. Needs root, as every simulated-host test."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from elastic_runtime.testing.hosts import SimulatedHosts

RATE_BITS = 100e6  # 12.5 MB/s
SENT = 5 * 2**20  # 5 MiB: at least (5 - 1 MiB of burst) / 12.5 MB/s = 0.34 s through the shaped link

RECEIVER = """
import socket, sys
server = socket.create_server((sys.argv[1], 5001))
connection, _ = server.accept()
received = 0
while chunk := connection.recv(1 << 20):
    received += len(chunk)
print(received, flush=True)
"""
SENDER = """
import socket, sys, time
for _ in range(100):  # the receiver may not listen yet
    try:
        connection = socket.create_connection((sys.argv[1], 5001))
        break
    except OSError:
        time.sleep(0.05)
started = time.monotonic()
connection.sendall(bytes(int(sys.argv[2])))
connection.close()
print(time.monotonic() - started, flush=True)
"""


def test_a_shaped_link_carries_bytes_no_faster_than_its_rate_each_way(tmp_path: Path) -> None:
    with SimulatedHosts(2) as hosts:
        hosts.shape(0, RATE_BITS)
        hosts.shape(1, RATE_BITS)
        shown = subprocess.run(["tc", "-n", hosts.namespaces[0], "qdisc", "show"], capture_output=True, text=True)
        assert "tbf" in shown.stdout and "rate 100Mbit" in shown.stdout, shown.stdout
        for receiving, sending in ((0, 1), (1, 0)):  # host 0's link is shaped on both ends: in and out
            log_in, log_out = tmp_path / f"in-{receiving}.log", tmp_path / f"out-{sending}.log"
            address = hosts.address(receiving)
            receiver = hosts.start(receiving, [sys.executable, "-c", RECEIVER, address], {}, log_in)
            started = time.monotonic()
            sender = hosts.start(sending, [sys.executable, "-c", SENDER, address, str(SENT)], {}, log_out)
            assert sender.wait(timeout=60) == 0 and receiver.wait(timeout=60) == 0, log_out.read_text()
            elapsed = time.monotonic() - started
            assert int(log_in.read_text().split()[-1]) == SENT
            # A lower bound only: a loaded machine makes it slower, never faster than the link allows.
            assert elapsed >= (SENT - 2**20) / (RATE_BITS / 8), f"{SENT} bytes in {elapsed:.3f} s"
