"""Several hosts (issue 18): a lost host recovered in-process against a full restart of every host. Not
collected by pytest; needs root (each simulated host is a network namespace).

    sudo .venv/bin/python tests/benchmarks/bench_hosts.py [--repeats 3] [--json out.json]

Each repeat runs the multi-host demo twice, the order alternating between repeats (the machine is shared):

- reform: ``elastic-runtime demo --hosts 4 --lose-host-at 20 --json --verify``: the controller as a service,
  4 simulated hosts x 1 worker x 2 CPU devices, 60 steps; after step 20 host 1 is lost (link down, every
  process on it killed); the survivors re-form in-process without it, a replacement joins from a fifth,
  empty host and the group grows back to 4;
- full restart: the same with ``--full-restart``: the controller stops at the loss (``--max-failures 0``)
  and stops every worker; then a new controller (``--resume``, the same run folder) and a worker on every
  host start again, the lost host's on the fifth host, from the newest replica each worker wrote to a folder
  on disk (one per host; not ``/dev/shm``, which a host loses with its processes).

Both detect the loss the same way (the controller's heartbeat timeout: 0.8 s without heartbeats) and both are
timed by the demo from the moment the link went down to the first step the group trains and commits after
it; the demo's ``--verify`` compares each run's final parameters with a fault-free run of the same 4-process
group on loopback (bitwise where every group had 4 hosts, as in the full restart; else within 1e-5
relative). Once per invocation, before the pairs, the demo also runs fault-free on the 4 hosts
(``--no-fault``: bitwise). The phases come from the event log.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupFormed, GroupForming, RunFinished, WorkerLost

HOSTS = 4
LOSE_AT = 20
GOALS = {"detected_after_s": 1.0, "recovered_after_s": 5.0}  # detection: issue 34's goal; next commit: issue 18's


MODES = {"reform": [], "full_restart": ["--full-restart"], "fault_free": ["--no-fault"]}


def demo(run_dir: Path, mode: str) -> dict[str, Any]:
    """One multi-host demo run through the CLI; its JSON summary, with the phases from its event log."""
    command = [
        sys.executable,
        "-m",
        "elastic_runtime.cli",
        "demo",
        "--hosts",
        str(HOSTS),
        "--lose-host-at",
        str(LOSE_AT),
    ]
    command += ["--json", "--verify", "--quiet", "--run-dir", str(run_dir), *MODES[mode]]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTIC_")}
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    summary: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    summary["load_before"] = round(load, 2)
    if mode != "fault_free":
        summary["phases"] = phases(run_dir / "run" / "events.jsonl", summary)
    return summary


def phases(path: Path, summary: dict[str, Any]) -> dict[str, float]:
    """Seconds after the loss at which each step of the recovery ended (from the event log)."""
    events = read_events(path)
    lost = next(e for e in events if isinstance(e, WorkerLost))
    lost_at = lost.mono_time - summary["detected_after_s"]
    after = [e for e in events if e.mono_time > lost_at]

    def first(kind: type) -> float | None:
        found = [e.mono_time for e in after if isinstance(e, kind)]
        return round(found[0] - lost_at, 3) if found else None

    out = {"detected": round(lost.mono_time - lost_at, 3)}
    if summary.get("strategy") == "full restart":
        out["old controller finished"] = first(RunFinished)
        out["new group forming"] = first(GroupForming)
    out["group formed"] = first(GroupFormed)
    out["next commit"] = summary["recovered_after_s"]
    return {k: v for k, v in out.items() if v is not None}


def stats(values: list[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "median": round(statistics.median(values), 3), "min": min(values), "max": max(values)}


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    names = sorted({name for run in runs for name in run["phases"]}, key=lambda n: runs[0]["phases"].get(n, 99))
    return {
        "detected_after_s": stats([r["detected_after_s"] for r in runs]),
        "recovered_after_s": stats([r["recovered_after_s"] for r in runs]),
        "lost_steps": [r["lost_steps"] for r in runs],
        "survivor_restarts": [r["survivor_restarts"] for r in runs],
        "controller_restarts": [r["controller_restarts"] for r in runs],
        "hosts_history": runs[0]["hosts_history"],
        "reference": sorted({r["reference_match"]["comparison"] for r in runs}),
        "reference_match": all(r["reference_match"]["match"] for r in runs),
        "max_rel_error": max(r["reference_match"]["max_rel_error"] for r in runs),
        "phases_median_s": {
            n: round(statistics.median(r["phases"][n] for r in runs if n in r["phases"]), 3) for n in names
        },
    }


def markdown(results: dict[str, Any]) -> str:
    rows = [
        "| path | runs | detected after | next commit after (median, min-max) | lost steps | survivor / controller "
        "restarts | group sizes | vs fault-free run |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, label in (("reform", "in-process re-forming"), ("full_restart", "full restart from disk")):
        a = results[name]
        detected, recovered = a["detected_after_s"], a["recovered_after_s"]
        sizes = " -> ".join(str(len(g)) for g in a["hosts_history"])
        restarts = f"{'/'.join(map(str, sorted(set(a['survivor_restarts']))))} / "
        restarts += "/".join(map(str, sorted(set(a["controller_restarts"]))))
        verdict = f"{', '.join(a['reference'])}: {'holds' if a['reference_match'] else 'FAILS'} "
        verdict += f"(max rel. error {a['max_rel_error']:.1e})"
        rows.append(
            f"| {label} | {recovered['n']} | {detected['median']} ({detected['min']}-{detected['max']}) | "
            f"**{recovered['median']}** ({recovered['min']}-{recovered['max']}) | "
            f"{'/'.join(map(str, sorted(set(a['lost_steps']))))} | {restarts} | {sizes} | {verdict} |"
        )
    rows.append("")
    rows.append(f"full restart / re-forming (medians): **{results['ratio']}x**")
    fault_free = results["fault_free"]
    match = fault_free["reference_match"]
    rows.insert(
        2,
        f"| fault-free (`--no-fault`) | 1 | | | {fault_free['lost_steps']} | {fault_free['survivor_restarts']} / "
        f"{fault_free['controller_restarts']} | 4 | {match['comparison']}: {'holds' if match['match'] else 'FAILS'} "
        f"(max rel. error {match['max_rel_error']:.1e}) |",
    )
    for name in ("reform", "full_restart"):
        phases = ", ".join(f"{k} {v}" for k, v in results[name]["phases_median_s"].items())
        rows.append(f"- {name} phases (s after the loss, medians): {phases}")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (default %(default)s)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the run folders (their path is printed)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench_hosts.py needs root: each simulated host is a network namespace", file=sys.stderr)
        return 2
    import jax

    root = Path(tempfile.mkdtemp(prefix="bench-hosts-", dir="/var/tmp"))  # on disk, not a tmpfs
    started = time.time()
    results: dict[str, Any] = {
        "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus, python "
        f"{platform.python_version()}, jax {jax.__version__}",
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "load_at_start": [round(x, 2) for x in os.getloadavg()],
        "hosts": HOSTS,
        "lose_at": LOSE_AT,
        "runs": {"reform": [], "full_restart": []},
    }
    try:
        results["fault_free"] = demo(root / "fault-free", "fault_free")
        print(json.dumps({"run": "fault-free", "reference_match": results["fault_free"]["reference_match"]}))
        for i in range(args.repeats):
            order = ["reform", "full_restart"] if i % 2 == 0 else ["full_restart", "reform"]
            for name in order:
                summary = demo(root / f"{name}-{i}", name)
                results["runs"][name].append(summary)
                keys = ("detected_after_s", "recovered_after_s", "lost_steps", "survivor_restarts", "phases")
                print(json.dumps({"run": f"{name}-{i}"} | {k: summary[k] for k in keys}), flush=True)
    except BaseException:
        print(f"failed; run folders kept under {root}", file=sys.stderr)
        raise
    for name in ("reform", "full_restart"):
        results[name] = aggregate(results["runs"][name])
    reform = results["reform"]["recovered_after_s"]["median"]
    results["ratio"] = round(results["full_restart"]["recovered_after_s"]["median"] / reform, 2)
    results["goals_met"] = {
        "detection <= 1 s": results["reform"]["detected_after_s"]["max"] <= GOALS["detected_after_s"],
        "next commit <= 5 s": results["reform"]["recovered_after_s"]["max"] <= GOALS["recovered_after_s"],
        "0 committed steps lost": set(results["reform"]["lost_steps"]) == {0},
        "0 survivor / controller restarts": set(results["reform"]["survivor_restarts"]) == {0}
        and set(results["reform"]["controller_restarts"]) == {0},
        "final parameters match": results["reform"]["reference_match"]
        and results["full_restart"]["reference_match"]
        and results["fault_free"]["reference_match"]["match"],
    }
    results["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
    results["seconds"] = round(time.time() - started, 1)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        results["run_folders"] = str(root)
    print(json.dumps({k: v for k, v in results.items() if k != "runs"}))
    print(markdown(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0 if all(results["goals_met"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
