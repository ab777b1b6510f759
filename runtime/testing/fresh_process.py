"""A test script run in a fresh Python interpreter whose JAX persistent compilation cache is a given folder, set
before JAX starts (JAX opens its cache once per process), and every compile cached however quick."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

__all__ = ["run_with_compile_cache"]

RESULT = "RESULT "  # the script prints its findings as one line: RESULT <json>


def run_with_compile_cache(script: str, cache: Path, timeout_s: float = 300) -> dict[str, Any]:
    """The JSON ``script`` printed after ``RESULT``; fails the test with the script's stderr when it printed none."""
    env = os.environ | {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
        "JAX_PLATFORMS": "cpu",
    }
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=timeout_s)
    line = next((x for x in done.stdout.splitlines() if x.startswith(RESULT)), None)
    assert line is not None, done.stderr[-3000:]
    found: dict[str, Any] = json.loads(line[len(RESULT) :])
    return found
