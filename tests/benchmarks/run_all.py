"""Run every benchmark of the project and write docs/benchmarks-latest.md (``make bench``).

Each benchmark is a script in this folder that prints one JSON object with ``--json``. This runner runs them
one after another (never in parallel: they would measure each other), and writes each figure next to what
it was compared with in the same run, with the command and the machine.

    .venv/bin/python tests/benchmarks/run_all.py [--only NAME ...] [--out docs/benchmarks-latest.md]

The page's text above its marker is kept; docs/benchmarks.md, written by hand, takes its current figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


@dataclass(frozen=True)
class Benchmark:
    name: str
    title: str
    script: str
    args: tuple[str, ...]
    goal: str
    verdict: Callable[[dict[str, Any]], bool]


BENCHMARKS = [
    Benchmark(
        "bus",
        "Event bus: throughput and publish-to-handler latency",
        "bench_bus.py",
        ("--events", "200000"),
        "throughput >= 100k events/s, p99 latency <= 1 ms",
        lambda r: r["throughput_median_per_s"] >= 100_000 and r["latency_ms_p99"] <= 1.0,
    ),
    Benchmark(
        "overhead",
        "Steady-state overhead against the bare JAX loop",
        "bench_overhead.py",
        ("--steps", "200", "--repeats", "12"),
        "<= 1.02x with snapshots off, <= 1.05x with a RAM snapshot every step",
        lambda r: (
            r["runtime, snapshots off"]["ratio_to_bare"] <= 1.02
            and r["runtime, RAM snapshot every step"]["ratio_to_bare"] <= 1.05
        ),
    ),
    Benchmark(
        "recovery",
        "In-process recovery against a process restart with Orbax",
        "bench_recovery.py",
        ("--repeats", "5"),
        ">= 5x faster; demo recovery <= 2 s with 0 lost steps",
        lambda r: r["speedup_median"] >= 5 and r["in_process_recovery_s_max"] <= 2,
    ),
    Benchmark(
        "goodput",
        "Goodput under one fault per minute",
        "bench_goodput.py",
        ("--steps", "12000", "--rounds", "3"),  # one round is at the mercy of the machine's drift
        "runtime goodput >= 95%, checkpoint-and-restart reported beside it",
        lambda r: max(r["runtime"]["goodput"], r["runtime_young_daly"]["goodput"]) >= 0.95,
    ),
    Benchmark(
        "goodput_multiprocess",
        "Multi-process goodput under one fault per minute",
        "bench_goodput_multiprocess.py",
        ("--steps", "4000", "--rounds", "3"),  # as in docs/benchmarks.md
        "runtime goodput >= 95%, checkpoint-and-restart of every worker reported beside it",
        lambda r: r["runtime"]["goodput"] >= 0.95,
    ),
    Benchmark(
        "checkpoint",
        "Checkpointing",
        "bench_checkpoint.py",
        ("--mb", "256", "--repeats", "5"),
        "blocking <= 1.0x Orbax async; disk commit >= 70% of raw write; restore: disk >= 5x RAM, <= 1.0x Orbax",
        lambda r: (
            r["blocking_ratio_ours_to_orbax"] <= 1.0
            and r["disk_commit_to_raw"] >= 0.7
            and r["restore_disk_to_ram"] >= 5
            and r["restore_disk_to_orbax"] <= 1.0
        ),
    ),
    Benchmark(
        "notices",
        "Maintenance notices",
        "bench_notice_latency.py",
        ("--messages", "300", "--rate", "20"),
        "notice-to-event latency p99 <= 1 s (from the publisher's call, steady and burst)",
        lambda r: max(r["steady_p99_ms_from_publisher_call"], r["burst_p99_ms_from_publisher_call"]) <= 1000,
    ),
    Benchmark(
        "ray",
        "Ray: a node removed, against Ray Train's restart policy (emulated)",
        "bench_ray.py",
        ("--repeats", "3"),
        "detection <= 3 s, the survivors' next commit <= 5 s, no committed step lost (medians; a local Ray cluster)",
        lambda r: (
            r["elastic"]["detected_after_s"]["max"] <= 3.0
            and r["elastic"]["next_commit_after_s"]["median"] <= 5.0
            and r["elastic"]["lost_steps"]["max"] == 0
        ),
    ),
]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())  # fmt: skip
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import jax

    return (
        f"{os.cpu_count()} cores ({cpu}), {memory:.0f} GiB, Python {platform.python_version()}, "
        f"jax {jax.__version__}, {platform.system()} {platform.release()}"
    )


def render_value(value: Any) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k}: {render_value(v)}" for k, v in value.items())
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


MARKER = "<!-- Everything below is written by `make bench` (tests/benchmarks/run_all.py); edit above it. -->"


def split_document(path: Path) -> tuple[list[str], dict[str, list[str]]]:
    """The hand-written part of docs/benchmarks-latest.md, and the body of each generated ``### title`` section."""
    text = path.read_text().splitlines() if path.exists() else []
    if MARKER not in text:
        return text, {}
    cut = text.index(MARKER)
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text[cut + 1 :]:
        if line.startswith("### "):
            current = sections[line[4:]] = []
        elif current is not None:
            current.append(line)
    return text[:cut], {title: body[:-1] if body and not body[-1] else body for title, body in sections.items()}


def run(bench: Benchmark) -> tuple[dict[str, Any] | None, str, float]:
    command = [sys.executable, str(HERE / bench.script), *bench.args, "--json"]
    shown = " ".join([".venv/bin/python", f"tests/benchmarks/{bench.script}", *bench.args])
    started = time.monotonic()
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, check=False)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        print(f"{bench.name} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None, shown, elapsed
    return json.loads(proc.stdout.strip().splitlines()[-1]), shown, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", help="run only these (by name)")
    parser.add_argument("--out", default=str(ROOT / "docs" / "benchmarks-latest.md"))
    args = parser.parse_args()
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    out = Path(args.out)
    handwritten, sections = split_document(out)  # --only keeps the other benchmarks' last figures
    while handwritten and not handwritten[-1]:
        handwritten.pop()
    lines = [
        *handwritten,
        "",
        MARKER,
        "",
        "## Latest `make bench` run",
        "",
        "Every benchmark of the project, run one after another by `make bench`. Each figure comes with what it",
        "was compared with in the same run and the command that measured it. These machines are shared and",
        "noisy: the figures are medians and ratios, and a rerun moves them by several percent.",
        "",
        f"Machine: {machine()}.",
    ]
    failed = 0
    for bench in chosen:
        print(f"running {bench.name} ...", file=sys.stderr, flush=True)
        load = os.getloadavg()[0]
        result, command, elapsed = run(bench)
        paragraphs = (HERE / bench.script).read_text().split('"""')[1].strip().split("\n\n")
        prose = [" ".join(p.split()) for p in paragraphs if not p.strip().startswith(".venv/")]
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        section = [line for p in prose for line in ("", p)]
        section += ["", f"Command: `{command}` ({elapsed:.0f} s, {when}, load average before {load:.1f})"]
        if result is None:
            failed += 1
            section += ["", "**The benchmark failed in this run**; see the runner's output."]
        else:
            met = bench.verdict(result)
            section += ["", f"Goal: {bench.goal}. **{'Met' if met else 'Not met'}** in this run.", ""]
            section += ["| figure | value |", "| --- | --- |"]
            section += [f"| {key} | {render_value(value)} |" for key, value in result.items()]
        sections[bench.title] = section
    for bench in BENCHMARKS:
        if bench.title in sections:
            lines += ["", f"### {bench.title}", *sections[bench.title]]
    out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
