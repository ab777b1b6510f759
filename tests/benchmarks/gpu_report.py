"""The GPU campaign's bookkeeping (tests/benchmarks/gpu_campaign.sh): the environment part, one JSON file per part
with its status, and the Markdown table of them all. Not collected by pytest.

    python3 tests/benchmarks/gpu_report.py env
        prints the machine and software as JSON (the campaign's ``env`` part; it starts JAX's backend)
    python3 tests/benchmarks/gpu_report.py record --out DIR --part NAME --budget S --rc RC --seconds S
        --stdout FILE --stderr FILE [--dry-run] -- COMMAND...
        writes DIR/NAME.json: ``status`` (ok, skipped, failed, timeout), ``result`` (the part's last JSON line),
        the tail of its stderr, its time against its budget
    python3 tests/benchmarks/gpu_report.py skip --out DIR --part NAME --reason TEXT [--budget S]
        writes DIR/NAME.json for a part that did not run, and why
    python3 tests/benchmarks/gpu_report.py table --out DIR [--parts NAME...]
        writes DIR/summary.md (one row a part: status, time, the figures that matter) and prints it

``record``, ``skip`` and ``table`` import nothing beyond the standard library: they work even where the part they
record could not start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

TIMEOUT_CODES = (124, 137)  # timeout(1): SIGTERM sent (124), or SIGKILL after its grace (128 + 9)
TAIL = 3000  # characters of a part's stderr kept in its JSON
# What the parts import (module: distribution); the last three are the wheels carried to the GPU host.
PACKAGES = {
    "jax": "jax",
    "jaxlib": "jaxlib",
    "orbax.checkpoint": "orbax-checkpoint",
    "flax": "flax",
    "optax": "optax",
    "numpy": "numpy",
    "anyio": "anyio",
    "msgspec": "msgspec",
    "tenacity": "tenacity",
    "google_crc32c": "google-crc32c",
}


def last_json(text: str) -> dict[str, Any] | None:
    """The last line of ``text`` that is a JSON object (a part prints its result last)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


def record(args: argparse.Namespace) -> None:
    stdout = Path(args.stdout).read_text(errors="replace") if Path(args.stdout).exists() else ""
    stderr = Path(args.stderr).read_text(errors="replace") if Path(args.stderr).exists() else ""
    result = last_json(stdout)
    if args.rc in TIMEOUT_CODES:
        status, reason = "timeout", f"stopped at its budget of {args.budget} s"
    elif args.rc != 0:
        last = [line.strip() for line in stderr.splitlines() if line.strip()][-1:]  # the error, as a rule
        status, reason = "failed", f"exit status {args.rc}" + (f": {last[0][:300]}" if last else "")
    elif result is None:
        status, reason = "failed", "no JSON result on its standard output"
    elif "skipped" in result:
        status, reason = "skipped", str(result["skipped"])
    else:
        status, reason = "ok", ""
    write(
        args.out,
        args.part,
        {
            "part": args.part,
            "status": status,
            "reason": reason,
            "seconds": round(args.seconds, 1),
            "budget_s": args.budget,
            "dry_run": args.dry_run,
            "command": " ".join(args.argv),
            "result": result,
            "stderr_tail": stderr[-TAIL:],
        },
    )


def skip(args: argparse.Namespace) -> None:
    entry = {"part": args.part, "status": "skipped", "reason": args.reason, "seconds": 0.0, "budget_s": args.budget}
    write(args.out, args.part, {**entry, "dry_run": args.dry_run, "command": "", "result": None, "stderr_tail": ""})


def write(out: str, part: str, entry: dict[str, Any]) -> None:
    path = Path(out) / f"{part}.json"
    path.write_text(json.dumps(entry, indent=1, default=str) + "\n")
    print(f"== {part}: {entry['status']} in {entry['seconds']} s (budget {entry['budget_s']} s) {entry['reason']}")


def env() -> None:
    """The machine and the software the campaign runs on; the import of every package a part needs."""
    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "machine": platform.machine(),
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "dry_run": os.environ.get("GPU_CAMPAIGN_DRY_RUN") == "1",
        "wheels_installed": os.environ.get("GPU_CAMPAIGN_WHEELS", ""),
        "jax_platforms": os.environ.get("JAX_PLATFORMS", ""),
    }
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        info["memory_gb"] = round(int(fields["MemTotal"].split()[0]) / 1e6, 1)
    for name, path in (("shm_free_gb", "/dev/shm"), ("tmp_free_gb", "/tmp")):
        if Path(path).is_dir():
            stat = os.statvfs(path)
            info[name] = round(stat.f_bavail * stat.f_frsize / 1e9, 1)
    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.SubprocessError) as exc:
        info["nvidia_smi"] = f"not available: {type(exc).__name__}"
    from importlib import import_module, metadata

    versions: dict[str, str] = {}
    for module, dist in PACKAGES.items():
        try:
            import_module(module)
            versions[dist] = metadata.version(dist)
        except Exception as exc:  # report every missing package, not only the first
            versions[dist] = f"missing: {type(exc).__name__}: {exc}"
    info["versions"] = versions
    import jax

    started = time.monotonic()
    devices = jax.devices()
    info["backend_start_s"] = round(time.monotonic() - started, 2)
    info["devices"] = {"count": len(devices), "platform": devices[0].platform, "kind": devices[0].device_kind}
    import elastic_runtime
    from elastic_runtime import ElasticRuntime  # noqa: F401  (the whole import chain the parts use)

    info["elastic_runtime"] = str(Path(elastic_runtime.__file__).parent)
    missing = [m for m, v in versions.items() if v.startswith("missing")]
    info["missing"] = missing
    print(json.dumps(info), flush=True)
    if missing:
        sys.exit(f"missing packages: {', '.join(missing)}")


# --- the table ------------------------------------------------------------------------------------------------


def num(value: Any, digits: int = 3) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int | float):
        return "nan" if isinstance(value, float) and math.isnan(value) else f"{value:.{digits}g}"
    return str(value)


def figures_env(r: dict[str, Any]) -> str:
    d = r.get("devices", {})
    v = r.get("versions", {})
    return (
        f"{d.get('count')} x {d.get('kind')} ({d.get('platform')}), {r.get('cores')} cores, "
        f"{r.get('memory_gb')} GB; Python {r.get('python')}, jax {v.get('jax')}, orbax {v.get('orbax-checkpoint')}"
    )


def figures_compile_ahead(r: dict[str, Any]) -> str:
    goal = r.get("goal", {})
    return (
        f"LikelyMeshesReady {num(r.get('likely_ready_s_median'))} s, goal {num(r.get('likely_ready_goal_s'))} s "
        f"({num(r.get('likely_ready_over_goal'))}x; within 1.5x: {goal.get('likely_ready_within_1_5x')}); "
        f"a slice lost after it: recovery {num(r.get('after_compiles_recovery_s_median'))} s, compiles in it "
        f"{r.get('after_compiles_compiles_during_recovery_max')}, "
        f"waited {num(r.get('after_compiles_compile_wait_s_max'))} s; "
        f"early loss {num(r.get('early_recovery_s_median'))} s; "
        + (f"Orbax restart {num(r['restart_with_orbax_s_median'])} s; " if "restart_with_orbax_s_median" in r else "")
        + f"{r.get('repeats')} repeats, {r.get('cores')} cores"
    )


def figures_steady(r: dict[str, Any]) -> str:
    rows = []
    for size, s in r.get("sizes", {}).items():
        if "skipped" in s:
            rows.append(f"{size}: skipped ({s['skipped']})")
            continue
        bare = s.get("contenders", {}).get("bare", {})
        rows.append(
            f"{s.get('model')} {size} ({num(s.get('state_mb'))} MB): bare {num(bare.get('median_ms'))} ms, "
            f"defaults {num(s.get('defaults_over_bare'))}x bare, RAM snapshot every step +"
            f"{num(s.get('snapshot_cost_ms'))} ms (host copy alone +{num(s.get('host_copy_cost_ms'))} ms)"
            + (f", config {num(s['config_over_defaults'])}x defaults" if s.get("config_over_defaults") else "")
            + (" (partial: its budget ran out)" if s.get("partial") else "")
        )
    return "; ".join(rows)


def figures_fingerprint(r: dict[str, Any]) -> str:
    rows = []
    for size, s in r.get("sizes", {}).items():
        c = s.get("contenders", {})
        with_it, without = c.get("runtime_defaults_config", {}), c.get("runtime_defaults", {})
        rows.append(
            f"{s.get('model')} {size}: {num(with_it.get('median_ms'))} ms a step against the defaults' "
            f"{num(without.get('median_ms'))} ms ({num(s.get('config_over_defaults'))}x, paired)"
        )
    return "; ".join(rows)


def figures_resume(r: dict[str, Any]) -> str:
    times = ", ".join(f"{k} {num(v)} s" for k, v in r.get("first_commit_s", {}).items())
    skipped = [k for k, v in r.get("detail", {}).items() if "skipped" in v]
    failed = [k for k, v in r.get("detail", {}).items() if "error" in v]
    return (
        f"{r.get('model')} {r.get('size')}, killed at step {r.get('killed_at')}; to the first committed step: {times}"
        + (f" (not run, its budget ran out: {', '.join(skipped)})" if skipped else "")
        + (f" (failed: {', '.join(failed)})" if failed else "")
    )


def figures_maxtext(r: dict[str, Any]) -> str:
    return f"resume: {figures_resume(r.get('resume', {}))}; steady: {figures_steady(r.get('steady', {}))}"


def figures_tiers(r: dict[str, Any]) -> str:
    rows = []
    for size, s in r.get("sizes", {}).items():
        if "skipped" in s:
            rows.append(f"{size}: skipped ({s['skipped']})")
            continue
        c, disk = s.get("contenders", {}), s.get("disk", {})
        every, yd = c.get("runtime_every_step", {}), c.get("runtime_young_daly", {})
        if len(c) < 4 or "skipped" in disk:
            size = f"{size} (partial: its budget ran out)"
        rows.append(
            f"{size}: step {num(c.get('runtime_off', {}).get('mean_ms'))} ms, snapshot every step "
            f"+{num(every.get('blocking_ms'))} ms, Young-Daly +{num(yd.get('blocking_ms'))} ms "
            f"({yd.get('snapshots')} snapshots); disk commit {num(disk.get('commit_gb_per_s'))} GB/s "
            f"(raw {num(disk.get('raw_write_gb_per_s'))} GB/s)"
        )
    return "; ".join(rows) + f" [{r.get('directory_fs')}]"


FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "env": figures_env,
    "compile_ahead": figures_compile_ahead,
    "steady": figures_steady,
    "resume": figures_resume,
    "maxtext": figures_maxtext,
    "tiers": figures_tiers,
    "fingerprint": figures_fingerprint,
}


def table(args: argparse.Namespace) -> None:
    out = Path(args.out)
    names = args.parts or sorted(p.stem for p in out.glob("*.json"))
    lines = [
        f"# GPU campaign{' (dry run, CPU)' if args.dry_run else ''}",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}; every part's figures in `<part>.json` beside this file.",
        "",
        "| part | status | seconds (budget) | figures |",
        "| --- | --- | --- | --- |",
    ]
    for name in names:
        path = out / f"{name}.json"
        if not path.exists():
            lines.append(f"| {name} | missing | | the part wrote no JSON |")
            continue
        entry = json.loads(path.read_text())
        result = entry.get("result") or {}
        if entry["status"] == "ok" and name in FIGURES:
            try:
                text = FIGURES[name](result)
            except Exception as exc:  # a figure the table cannot read must not hide the others
                text = f"(table: {type(exc).__name__}: {exc})"
        else:
            text = entry.get("reason", "")
        text = text.replace("|", "/").replace("\n", " ")
        lines.append(f"| {name} | {entry['status']} | {entry['seconds']} ({entry['budget_s']}) | {text} |")
    summary = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(summary)
    print(summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("env")
    rec = sub.add_parser("record")
    rec.add_argument("--part", required=True)
    rec.add_argument("--budget", type=int, required=True)
    rec.add_argument("--rc", type=int, required=True)
    rec.add_argument("--seconds", type=float, required=True)
    rec.add_argument("--stdout", required=True)
    rec.add_argument("--stderr", required=True)
    rec.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the part's command")
    sk = sub.add_parser("skip")
    sk.add_argument("--part", required=True)
    sk.add_argument("--reason", required=True)
    sk.add_argument("--budget", type=int, default=0)
    tab = sub.add_parser("table")
    tab.add_argument("--parts", nargs="*", default=None)
    for p in (rec, sk, tab):
        p.add_argument("--out", required=True)
        p.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    if args.what == "env":
        env()
    elif args.what == "record":
        args.argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        record(args)
    elif args.what == "skip":
        skip(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
