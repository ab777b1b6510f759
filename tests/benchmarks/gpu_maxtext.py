"""MaxText's model on one accelerator: the same figures as the flax example's (``gpu_resume.py``: ``kill -9`` and
``resume=True`` against a plain Orbax restart; ``gpu_steady.py``: the runtime at defaults against the bare loop, the
RAM snapshot's cost), for examples/maxtext_lm.py's llama2. A part of tests/benchmarks/gpu_campaign.sh; not
collected by pytest.

    python3 tests/benchmarks/gpu_maxtext.py [--deadline-s 60]

MaxText lives in its own environment (``make maxtext``: Python 3.13, constraints/maxtext.txt); where ``maxtext``
does not import (the project's ``.venv``, a GPU host without its wheels) the part says so and measures nothing:
``{"skipped": "MaxText not importable: ..."}``. The resume comes first: its processes need the accelerator to
themselves, and this one starts its backend only for the steady figures. The last line printed is JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--deadline-s", type=float, default=None, help="start nothing that would end after this")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    try:
        import maxtext  # noqa: F401  (the check; imports no backend)
    except Exception as exc:  # an ImportError, or a broken install's own error: either way nothing to measure
        print(json.dumps({"skipped": f"MaxText not importable: {type(exc).__name__}: {exc}"}), flush=True)
        return
    from gpu_resume import resume_benchmark

    started = time.monotonic()
    total = args.deadline_s
    resume = resume_benchmark(
        "maxtext",
        "example",
        kill_at=20,
        disk_every=10,
        variants=["shm_warm", "disk_warm", "orbax_cold", "orbax_warm"],
        deadline_s=None if total is None else total / 2,
    )
    from gpu_common import Deadline
    from gpu_steady import steady

    left = None if total is None else total - (time.monotonic() - started)
    figures = steady(
        "maxtext", ["example"], steps=args.steps, warmup=10, repeats=args.repeats, config=None, deadline=Deadline(left)
    )
    print(json.dumps({"resume": resume, "steady": figures}, default=float), flush=True)
    failed = [variant for variant, detail in resume["detail"].items() if "error" in detail]
    if failed:
        sys.exit(f"resume variants failed: {', '.join(failed)} (their errors are in the result)")


if __name__ == "__main__":
    main()
