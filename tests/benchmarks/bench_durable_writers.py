"""Whether the group's durable writers write the same steps (issue 62): the slow-tier run of
``tests/multiprocess/test_durable.py`` (4 processes in one slice, the GCS emulator, a durable step due every step of
30, steps 0.1 s) and what it leaves in the bucket: the steps committed (whole, a manifest written) and those with
some writers' parts only. Not collected by pytest.

    .venv/bin/python tests/benchmarks/bench_durable_writers.py [--runs 3]

The last line is JSON, one entry per run. Run it on two checkouts (``PYTHONPATH=CHECKOUT``, from that folder) to
compare them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "multiprocess"))  # the test's run() and its layout

import test_durable  # noqa: E402

from elastic_runtime.storage.gcs import make_client, parse_gs_uri  # noqa: E402
from elastic_runtime.testing.gcs_emulator import running_emulator  # noqa: E402


def one_run() -> dict[str, object]:
    folder = Path(tempfile.mkdtemp(prefix="bench-durable-writers-"))
    with running_emulator("durable", folder / "emulator.log") as emulator:
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url  # the workers started now reach it
        uri = "gs://durable/run"
        result, committed = test_durable.run(folder / "run", kill=None, durable=uri, step_delay_s=0.1, every=1)
        bucket, prefix = parse_gs_uri(uri)
        names = {blob.name for blob in make_client().list_blobs(bucket, prefix=f"{prefix}/")}
    steps = {name.removeprefix(f"{prefix}/").split("/")[0] for name in names}
    partial = sorted(step for step in steps if f"{prefix}/{step}/manifest.json" not in names)
    return {"ok": result.ok, "steps": test_durable.STEPS, "committed": len(committed), "partial": len(partial)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    print(json.dumps({"load": round(os.getloadavg()[0], 2), "runs": runs}))


if __name__ == "__main__":
    main()
