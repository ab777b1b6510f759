"""A controller for thousands of hosts (issue 32): what the real controller costs as its group grows.

    .venv/bin/python tests/benchmarks/bench_controller_scale.py [--workers N] [--json] [--plot PNG]

For each size N (default 16, 256, 1024, 4096) it starts the real controller in service mode
(``elastic-runtime controller --listen``, with ``ELASTIC_SIMULATED_WORKERS=1``: no JAX coordination service)
and N simulated workers in this process (``tests/multiprocess/simworkers.py``: the real protocol and handshake,
0.5 s heartbeats, a step every 0.1 s), then:

- all N connect at once and form (``connect_all_s``, ``form_all_s``: the last ``RestoreStep`` received);
- steady state: the controller's CPU (``controller_cpu``, cores) and memory (``controller_rss_mb``) over
  ``--window`` seconds, and the event log's growth;
- one worker goes silent: time to detect it after its last heartbeat (``detect_one_s``), until every
  survivor has its ``Form`` (``form_after_loss_s``) and its ``RestoreStep`` (``restore_after_loss_s``); a
  replacement joins;
- 1% go silent at once (a rack): detection of each, ``Form`` at every survivor after the last detection
  (``form_after_rack_s``; after the first: ``form_after_rack_first_s``), and the re-forms it took
  (``rack_reforms``: 1 is the goal); replacements join;
- 10% are cut off (a partition): detected, the group re-forms without them; the partition heals, the
  controller tells each to exit (``heal_stopped_s``), and replacements bring the group back to N
  (``partition_full_s``);
- the restore plan alone for N members (``plan_s``, ``Membership.plan_restore`` in this process).

``detect_one_p99_s`` is over every silent loss of the run. Each result carries the 1-minute load average
before and after: figures taken at a load above the machine's cores are indicative only. The last line is
JSON: one size's figures, or with several sizes ``{"results": [...]}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from elastic_runtime.cluster.controller.membership import JoinReport, Membership
from elastic_runtime.cluster.tiers import Tier
from elastic_runtime.core.eventlog import read_events
from elastic_runtime.core.events import GroupForming, WorkerLost

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess"))
from simworkers import Fleet, Loss, start_controller

SIZES = (16, 256, 1024, 4096)
INTERVAL_S = 0.5
TIMEOUT_S = 2.0
GOALS = {"controller_cpu": 0.5, "detect_one_p99_s": TIMEOUT_S + 0.5, "form_after_rack_s": 1.0, "rack_reforms": 1}


def raise_file_limit(need: int) -> None:
    """Two sockets per worker (ours and the controller's, which inherits the limit), and some to spare."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, need)) if hard != resource.RLIM_INFINITY else max(soft, need)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    if want < need:
        raise SystemExit(f"need {need} open files, the hard limit is {hard}")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def controller_args(n: int) -> tuple[str, ...]:
    """Goes on at once without the lost (down to 10% fewer, and one), never gives up, never finishes."""
    args = ["--min-nprocs", str(max(1, n - math.ceil(n / 10) - 1)), "--steps", "1000000000"]
    args += ["--heartbeat-timeout", str(TIMEOUT_S), "--hang-timeout", "30", "--start-timeout", "600"]
    return (*args, "--max-failures", "1000000")


def plan_time(n: int) -> float:
    """The restore plan alone, for N members: all but one hold the step in RAM, one replacement nothing."""
    group = Membership(n)
    reports = [JoinReport(100, Tier.RAM, (99, 100)) for _ in range(n - 1)] + [JoinReport(0, Tier.NONE)]
    started = time.perf_counter()
    group.plan_restore(reports)
    return time.perf_counter() - started


def newest_generation(fleet: Fleet, workers: list[int]) -> int:
    return max((t.generation for w in workers for t in fleet.workers[w].record.forms), default=0)


async def lose_and_recover(fleet: Fleet, members: list[int], lost: list[int], what: str) -> dict[str, Any]:
    """``lost`` go silent; wait for every survivor's Form and Restore of the next generation. Times are
    monotonic; the detection comes from the event log afterwards."""
    before = newest_generation(fleet, members)
    survivors = [w for w in members if w not in set(lost)]
    at = fleet.lose(lost, Loss.SILENT)

    def formed() -> bool:
        gen = newest_generation(fleet, survivors)
        return gen > before and fleet.told(gen, survivors, restore=True)

    await fleet.until(formed, 120, f"survivors of {what} formed again")
    gen = newest_generation(fleet, survivors)
    forms = [next(t.at for t in fleet.workers[w].record.forms if t.generation > before) for w in survivors]
    restores = [next(t.at for t in fleet.workers[w].record.restores if t.generation > before) for w in survivors]
    return {"at": at, "generation": gen, "last_form": max(forms), "last_restore": max(restores), "survivors": survivors}


async def replace(fleet: Fleet, count: int) -> tuple[list[int], float]:
    started = time.monotonic()
    new = await fleet.replace(count)

    def joined() -> bool:
        return all(fleet.workers[w].record.restores for w in new)

    done = await fleet.until(joined, 120, f"{count} replacements joined the group")
    return new, done - started


async def scenario(n: int, address: str, secret: str, pid: int, window_s: float) -> dict[str, Any]:
    fleet = Fleet(address, secret, interval_s=INTERVAL_S, step_s=0.1)
    out: dict[str, Any] = {}
    cpu_start = cpu_seconds(pid)
    t0 = time.monotonic()
    members = await fleet.start(n)
    out["connect_all_s"] = max(fleet.workers[w].record.welcomed_at for w in members) - t0
    await fleet.until(lambda: fleet.told(1, members, restore=True), 600, "the first group formed")
    out["form_all_s"] = max(fleet.workers[w].record.restores[0].at for w in members) - t0
    out["form_all_cpu_s"] = cpu_seconds(pid) - cpu_start  # the controller's CPU time, not the machine's load

    await asyncio.sleep(2.0)  # past the first steps
    cpu0, mine0, w0 = cpu_seconds(pid), time.process_time(), time.monotonic()
    await asyncio.sleep(window_s)
    elapsed = time.monotonic() - w0
    out["controller_cpu"] = (cpu_seconds(pid) - cpu0) / elapsed
    out["simulator_cpu"] = (time.process_time() - mine0) / elapsed
    out["controller_rss_mb"] = rss_mb(pid)

    phases: dict[str, dict[str, Any]] = {}
    one = [members[n // 2]]
    cpu_before, started = cpu_seconds(pid), time.monotonic()
    phases["one"] = await lose_and_recover(fleet, members, one, "one loss")
    # The re-forming's own CPU time: beyond the steady state's over the same span (the timeout, mostly).
    spent = cpu_seconds(pid) - cpu_before
    out["reform_cpu_s"] = max(0.0, spent - out["controller_cpu"] * (time.monotonic() - started))
    members = phases["one"]["survivors"]
    new, phases["one"]["replace_s"] = await replace(fleet, 1)
    members = members + new
    await asyncio.sleep(1.0)

    rack = members[: max(1, n // 100)]
    phases["rack"] = await lose_and_recover(fleet, members, rack, "a rack's loss")
    members = phases["rack"]["survivors"]
    phases["rack"]["replaced_at"] = time.monotonic()
    new, phases["rack"]["replace_s"] = await replace(fleet, len(rack))
    members = members + new
    await asyncio.sleep(1.0)

    cut = members[-math.ceil(n / 10) :]
    phases["partition"] = await lose_and_recover(fleet, members, cut, "a partition")
    members = phases["partition"]["survivors"]
    healed = time.monotonic()
    fleet.heal(cut)
    stopped = await fleet.until(
        lambda: all(fleet.workers[w].record.stopped is not None for w in cut), 60, "the healed workers told to exit"
    )
    out["heal_stopped_s"] = stopped - healed
    new, out["partition_full_s"] = await replace(fleet, len(cut))
    out["partition_full_s"] += stopped - healed
    await fleet.close()
    return {"fleet": fleet, "phases": phases, **out}


def analyse(run: dict[str, Any], events_path: Path) -> dict[str, Any]:
    fleet: Fleet = run.pop("fleet")
    phases = run.pop("phases")
    events = read_events(events_path)
    # Only the workers made to fail (closing the fleet at the end loses every other one).
    lost = [e for e in events if isinstance(e, WorkerLost) and 0 < fleet.workers[e.worker].record.lost_at < e.mono_time]
    detect = {e.worker: e.mono_time - fleet.workers[e.worker].record.silent_since for e in lost}
    detected_at = {e.worker: e.mono_time for e in lost}
    forming = [e for e in events if isinstance(e, GroupForming)]
    out = dict(run)
    one, rack, cut = phases["one"], phases["rack"], phases["partition"]
    [lost_one] = [w for w in detect if fleet.workers[w].record.lost_at == one["at"]]
    out["detect_one_s"] = detect[lost_one]
    out["form_after_loss_s"] = one["last_form"] - detected_at[lost_one]
    out["restore_after_loss_s"] = one["last_restore"] - detected_at[lost_one]
    out["restore_after_form_s"] = one["last_restore"] - one["last_form"]
    rack_ids = [w for w, s in fleet.workers.items() if s.record.lost_at == rack["at"]]
    out["rack_size"] = len(rack_ids)
    out["form_after_rack_s"] = rack["last_form"] - max(detected_at[w] for w in rack_ids)
    out["form_after_rack_first_s"] = rack["last_form"] - min(detected_at[w] for w in rack_ids)
    out["rack_reforms"] = sum(rack["at"] <= e.mono_time < rack["replaced_at"] for e in forming)
    out["restarts"] = sum(e.strategy == "restart" for e in forming)
    silent = sorted(detect.values())
    out["detect_one_p99_s"] = silent[min(len(silent) - 1, math.ceil(0.99 * len(silent)) - 1)]
    out["detect_median_s"] = statistics.median(silent)
    out["losses_detected"] = len(silent)
    out["partition_size"] = len([w for w, s in fleet.workers.items() if s.record.lost_at == cut["at"]])
    out["event_log_mb"] = events_path.stat().st_size / 1e6
    return out


def run_size(n: int, window_s: float, keep: bool) -> dict[str, Any]:
    raise_file_limit(2 * n + 4 * n // 10 + 512)
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench-scale-{n}-"))
    secret = secrets.token_hex(32)
    load_before = os.getloadavg()[0]
    controller, address = start_controller(n, run_dir, secret, interval_s=INTERVAL_S, args=controller_args(n))
    try:
        run = asyncio.run(scenario(n, address, secret, controller.pid, window_s))
    finally:
        controller.send_signal(signal.SIGTERM)
        try:
            controller.wait(timeout=60)
        except subprocess.TimeoutExpired:
            controller.kill()
            controller.wait()
    result: dict[str, Any] = {"workers": n, "heartbeat_interval_s": INTERVAL_S, "heartbeat_timeout_s": TIMEOUT_S}
    result.update(analyse(run, run_dir / "events.jsonl"))
    result["plan_s"] = plan_time(n)
    result["load_before"], result["load_after"] = load_before, os.getloadavg()[0]
    if keep:
        result["run_dir"] = str(run_dir)
    else:
        result.pop("run_dir", None)
        shutil.rmtree(run_dir, ignore_errors=True)
    return result


COSTS = (
    "controller_cpu",
    "controller_rss_mb",
    "form_all_s",
    "form_all_cpu_s",
    "detect_one_p99_s",
    "form_after_loss_s",
    "form_after_rack_s",
    "reform_cpu_s",
    "plan_s",
)


def plot(results: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 3, figsize=(13, 10))
    for ax, key in zip(axes.flat, COSTS, strict=True):
        measured = [(r["workers"], r[key]) for r in results if r.get(key, 0) > 0]
        if not measured:
            continue
        sizes, values = [n for n, _ in measured], [v for _, v in measured]
        ax.plot(sizes, values, "o-", label="measured")
        ref = values[0] * sizes[-1] / sizes[0] if values[0] > 0 else None
        if ref is not None and len(sizes) > 1:
            ax.plot([sizes[0], sizes[-1]], [values[0], ref], ":", color="grey", label="linear from the smallest")
        goal = GOALS.get(key)
        if goal is not None:
            ax.axhline(goal, color="red", linestyle="--", label=f"goal at 4096: {goal}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(key)
        ax.set_xlabel("simulated workers")
        ax.legend(fontsize=7)
    loads = ", ".join(f"{r['workers']}: {r['load_before']:.1f}" for r in results)
    fig.suptitle(f"The controller's costs against the group's size (0.5 s heartbeats; load average {loads})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, action="append", help="one size (repeatable); default: 16 256 1024 4096")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of steady state to measure CPU over")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    parser.add_argument("--plot", default=None, help="write a PNG of every cost against N here")
    parser.add_argument("--keep", action="store_true", help="keep each size's run folder (event log, controller.log)")
    parser.add_argument(
        "--replot", nargs="+", metavar="JSON", help="plot (--plot) the results earlier runs printed; run nothing"
    )
    args = parser.parse_args()
    if args.replot:
        loaded = [json.loads(Path(p).read_text().strip().splitlines()[-1]) for p in args.replot]
        done = sorted((r for x in loaded for r in x.get("results", [x])), key=lambda r: r["workers"])
        plot(done, args.plot)
        return
    results = []
    for n in args.workers or SIZES:
        result = run_size(n, args.window, args.keep)
        results.append(result)
        if not args.json:
            print(
                " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()), flush=True
            )
    if args.plot:
        plot(results, args.plot)
    print(json.dumps(results[0] if len(results) == 1 else {"results": results}))


if __name__ == "__main__":
    main()
