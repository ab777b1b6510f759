"""The controller never imports JAX: it starts its fork server (which does) a second sooner, and holds none of
JAX's memory. Checked in a real ``launch`` with a worker killed, so the re-form's coordination service (the
one piece of jaxlib a controller runs) is in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from elastic_runtime.cli.demo_multiprocess import worker_command

# A launch through the CLI, then what the controller's process imported.
PROBE = """
import json, sys
from elastic_runtime.cli.main import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "jax": sorted(m for m in sys.modules if m == "jax" or m.startswith("jax."))}))
"""


@pytest.mark.timeout(150)
def test_a_launch_with_a_re_form_imports_no_jax_in_the_controller(tmp_path: Path) -> None:
    launch = ["launch", "--nprocs", "2", "--run-dir", str(tmp_path / "run"), "--fault", "kill:1@8"]
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *launch, "--", *worker_command(20)],
        capture_output=True,
        text=True,
        timeout=140,
    )
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary, probe = json.loads(lines[-2]), json.loads(lines[-1])
    assert summary["ok"] and len(summary["recoveries"]) == 1  # a re-form took place
    assert probe == {"code": 0, "jax": []}
