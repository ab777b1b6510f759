"""The soak campaign (issue 62, ``make soak``): seeded rounds, each drawing a mode and its faults, run, and checked
against a fault-free run of the same layout; the last line is JSON.

Fault kinds, each round one or more of them:

- one process, the demo model on 8 virtual CPU devices (data 4 x model 2): a slice lost (``lose-slice``, repaired
  later or not), a device lost (``lose-device``), a slice lost while the degraded meshes compile in the background
  (``lose-compiling``), during a disk save (``lose-saving``), two slices one after the other (``lose-two``), a bit
  flipped in one replica (``sdc``), a device that computes wrong (``sdc-persistent``), a run resumed from a
  disk tier whose newest checkpoint was damaged on disk, a bit flipped or the file cut short (``corrupt-durable``),
  a disk that fills up for a while, then a run resumed from what it holds (``disk-full``: a small tmpfs,
  root only), and GCS unreachable for a while (every request to the emulator refused or cut, ``gcs-down``),
  then a run on a new host resumed from GCS alone, and a maintenance notice that arrives while a lost slice is
  being recovered (``notice-recovering``: the metadata server's ``MIGRATE_ON_HOST_MAINTENANCE`` for another
  slice's host, set when the recovery starts, then ``NONE``: the host drained, then readmitted);
- multi-process, 3 workers under a controller: every case of the chaos loop (``tests/multiprocess/chaos.py``):
  ``kill`` (kill -9), ``stop`` (SIGSTOP), ``two``, ``together``, ``during-recovery``, ``midstep``, ``replica``
  (mid replica-file write), ``hang``, ``impostor``, ``flood``, ``leave`` (SIGTERM of a worker), ``leave-killed``,
  ``slow`` (a straggler, 3x), ``resume`` (the controller killed, then ``--resume``), ``sigterm`` and
  ``sigterm-durable`` (the controller stopped), ``corrupt`` and ``corrupt-persistent`` (a bit of one worker's
  copy of the state flipped once, or before every step: the slices' comparison finds it), ``during-restore`` (a
  second kill while the re-formed group restores) and ``durable-write`` (a kill right after a durable step's
  commit, when its checkpoint's write starts);
- simulated hosts (network namespaces, root only), ``elastic-runtime demo --hosts 3``: a host lost at a random
  step, its link down and every process on it killed (``host-lost``), or cut off the network and healed
  (``host-partitioned``); a replacement joins from a new host.

Every round runs in a process of its own, bounded in time (past it: ``hung``), and kills only the processes it
started. A round is ``wrong`` when its final state differs from the fault-free run's (bitwise when every step ran
on its original mesh, within ``compare_states``' tolerance otherwise), ``ended`` when it stopped with an error
although a restore was possible, ``recovered`` otherwise. The JSON: ``faults``, ``recovered``, ``wrong``, ``hung``,
``ended``, per kind the faults, the recovered and the median and 99th percentile recovery time, and the seed of
every round that failed (``--round SEED`` replays one).

    .venv/bin/python tests/benchmarks/soak.py --faults 1000 --seed 1 [--minutes M] [--kinds lose-slice,kill] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "multiprocess"))  # chaos.py and its attacker
sys.path.insert(0, str(HERE.parent / "maintenance"))  # the metadata server's stand-in

ONE_PROCESS = (
    "lose-slice", "lose-device", "lose-compiling", "lose-saving", "lose-two", "sdc", "sdc-persistent",
    "corrupt-durable", "disk-full", "gcs-down", "notice-recovering",
)  # fmt: skip
MULTI_PROCESS = (
    "kill", "stop", "two", "together", "during-recovery", "midstep", "replica", "hang", "impostor", "flood", "leave",
    "leave-killed", "slow", "resume", "sigterm", "sigterm-durable", "corrupt", "corrupt-persistent",
    "during-restore", "durable-write",
)  # fmt: skip
HOSTS = ("host-lost", "host-partitioned")
KINDS = ONE_PROCESS + MULTI_PROCESS + HOSTS
ROUND_TIMEOUT_S = 300.0  # a round past this is hung (a multi-process round takes 10-40 s here)
STEPS = 60  # of a one-process round


def one_process_round(kind: str, rng: random.Random, run_dir: Path) -> dict[str, Any]:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    from elastic_runtime import ElasticRuntime, MeshPolicy, RecoveryCompleted, RuntimeConfig, read_events
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.testing import FaultInjector
    from elastic_runtime.testing.demo_model import demo_job

    policy = MeshPolicy({"data": 4, "model": 2}, global_batch=24, slice_size=2)
    job = demo_job(global_batch=24, features=16, hidden=64)
    if kind == "corrupt-durable":
        return resume_from_damaged_disk(rng, run_dir, policy, job)
    if kind == "disk-full":
        return resume_after_a_full_disk(rng, run_dir, policy, job)
    if kind == "gcs-down":
        return resume_after_gcs_was_down(rng, run_dir, policy, job)
    if kind == "notice-recovering":
        return notice_while_recovering(rng, run_dir, policy, job)
    step = rng.randrange(3, STEPS - 12)
    injector = FaultInjector()
    options: dict[str, Any] = {"precompile": False, "scale_up_poll_s": 0.2}
    faults = 1
    if kind == "lose-slice":
        chosen = rng.randrange(4)
        injector.lose_slice(step, chosen, 2)
        if rng.random() < 0.5:
            injector.repair(step + rng.randrange(3, 10), range(2 * chosen, 2 * chosen + 2))
    elif kind == "lose-device":
        injector.lose_devices(step, [rng.randrange(8)])
    elif kind == "lose-compiling":
        options["precompile"] = True  # the likely meshes compile in the background from the first step
        injector.lose_slice(rng.randrange(1, 4), rng.randrange(4), 2)
    elif kind == "lose-saving":
        options["disk_every"] = 5
        injector.lose_slice(5 * rng.randrange(1, STEPS // 5 - 2) + 1, rng.randrange(4), 2)
    elif kind == "lose-two":
        first, second = rng.sample(range(4), 2)
        injector.lose_slice(step, first, 2).lose_slice(step + rng.randrange(1, 4), second, 2)
        faults = 2
    else:  # sdc, sdc-persistent
        options["fingerprint_every"] = 1
        injector.corrupt(step, rng.randrange(8), persistent=kind == "sdc-persistent")
    reference = fault_free(job, policy)
    config = RuntimeConfig(run_dir=str(run_dir), progress=False, **options)
    result = injector.attach(ElasticRuntime(job, config=config, mesh_policy=policy)).run(STEPS)
    events = read_events(run_dir / "events.jsonl")
    # Bitwise only when every step ran on the full mesh: steps on a smaller one (a slice lost, then repaired)
    # reduce in another order, within the tolerance (docs/storage.md, what tolerance to expect).
    full = all(shape == policy.target_shape for shape in result.mesh_history)
    match = compare_states(result.state, reference, bitwise=full)
    recoveries = [e for e in events if isinstance(e, RecoveryCompleted)]
    return {
        "faults": faults,
        "problems": [] if match["match"] else [f"final state differs: {match}"],
        "recovery_s": [e.recovery_s for e in recoveries],
        "lost_steps": sum(e.lost_steps for e in recoveries),
    }


def fault_free(job: Any, policy: Any) -> Any:
    """The final state of the same job run fault-free, no tier but RAM."""
    from elastic_runtime import ElasticRuntime, RuntimeConfig

    config = RuntimeConfig(precompile=False, scale_up_poll_s=None, progress=False)
    return ElasticRuntime(job, config=config, mesh_policy=policy).run(STEPS).state


def notice_while_recovering(rng: random.Random, run_dir: Path, policy: Any, job: Any) -> dict[str, Any]:
    """A slice is lost; when its recovery starts, the metadata server says another slice's host is going into
    maintenance (``MIGRATE_ON_HOST_MAINTENANCE``), and some steps later that it is over (``NONE``). Right when the
    run finishes, the host was drained and then readmitted (the last mesh has its devices again), and the final
    state is within the tolerance of the fault-free run's (steps ran on smaller meshes)."""
    import anyio
    from metadata_server import FakeMetadataServer  # tests/maintenance

    from elastic_runtime import (
        ElasticRuntime,
        Event,
        MaintenanceCompleted,
        MaintenanceStarted,
        MeshChanged,
        RecoveryCompleted,
        RecoveryStarted,
        RuntimeConfig,
    )
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.testing import FaultInjector

    lost, host = rng.sample(range(4), 2)
    drained = (2 * host, 2 * host + 1)
    at = rng.randrange(3, STEPS // 2)
    seen: list[Event] = []
    with FakeMetadataServer() as server:
        config = RuntimeConfig(
            run_dir=str(run_dir),
            metadata_host=server.host,
            instance_devices={"meta-vm": drained},
            scale_up_poll_s=0.2,
            precompile=False,
            progress=False,
        )
        rt = FaultInjector().lose_slice(at, lost, 2).attach(ElasticRuntime(job, config=config, mesh_policy=policy))

        @rt.on(Event, priority=-1)
        async def record(event: Event, ctx: object) -> None:
            seen.append(event)
            if isinstance(event, RecoveryStarted) and not any(isinstance(e, MaintenanceStarted) for e in seen):
                server.set("instance/maintenance-event", b"MIGRATE_ON_HOST_MAINTENANCE")

        def readmitted() -> bool:
            over = [e.wall_time for e in seen if isinstance(e, MaintenanceCompleted)]
            meshes = [e for e in seen if isinstance(e, MeshChanged) and over and e.wall_time > over[0]]
            return bool(meshes) and set(drained) <= set(meshes[-1].devices)

        async def pace(step: int) -> None:
            await anyio.sleep(0.02)  # the demo's steps take milliseconds: a drain and a readmission need a few
            if step == at + 10 and any(isinstance(e, MaintenanceStarted) for e in seen):
                server.set("instance/maintenance-event", b"NONE")
            if step == STEPS - 1:  # the last step waits (bounded) for the readmission, however loaded the machine
                with anyio.move_on_after(60):
                    while not readmitted():
                        await anyio.sleep(0.05)

        rt.at_step_boundary(pace)
        result = rt.run(STEPS)
    problems = [] if readmitted() else [f"host of devices {drained} not drained and readmitted: {_kinds(seen)}"]
    match = compare_states(result.state, fault_free(job, policy), bitwise=False)
    problems += [] if match["match"] else [f"final state differs: {match}"]
    recoveries = [e for e in seen if isinstance(e, RecoveryCompleted)]
    began = [e.wall_time for e in seen if isinstance(e, RecoveryStarted)]
    noticed = [e.wall_time for e in seen if isinstance(e, MaintenanceStarted)]
    return {
        "faults": 2,
        "problems": problems,
        "recovery_s": [e.recovery_s for e in recoveries],
        "lost_steps": sum(e.lost_steps for e in recoveries),
        # whether the notice came while the recovery ran (a long poll answers in milliseconds; under load later)
        "during_recovery": bool(began and noticed and recoveries and began[0] <= noticed[0] <= recoveries[0].wall_time),
    }


def _kinds(events: list[Any]) -> list[str]:
    return [type(e).__name__ for e in events if type(e).__name__ not in ("StepCompleted", "CheckpointCommitted")]


def resume_from_damaged_disk(rng: random.Random, run_dir: Path, policy: Any, job: Any) -> dict[str, Any]:
    """A run stops at a disk save; its newest checkpoint is damaged on disk; a new run resumes from the disk tier.
    Right when the damage is reported (``CheckpointCorrupt``), the previous disk checkpoint is restored and the final
    state is bitwise the fault-free run's."""
    from elastic_runtime import (
        CheckpointCommitted,
        CheckpointCorrupt,
        ElasticRuntime,
        RuntimeConfig,
        StateRestored,
        read_events,
    )
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.storage.disk import DiskTier

    stop = 5 * rng.randrange(2, STEPS // 5 - 1)
    checkpoints = run_dir / "checkpoints"
    first = RuntimeConfig(run_dir=str(run_dir / "first"), checkpoint_dir=str(checkpoints), disk_every=5, progress=False)
    ElasticRuntime(job, config=first, mesh_policy=policy).run(stop)
    saved = read_events(run_dir / "first" / "events.jsonl")
    previous = max(e.step or 0 for e in saved if isinstance(e, CheckpointCommitted) and (e.step or 0) < stop)
    # (the previous disk save: one due while another is in flight is skipped)
    disk = DiskTier(checkpoints)
    victim = disk.path_of(stop) / rng.choice(disk.manifest(stop).files).path  # any file the manifest vouches for
    data = bytearray(victim.read_bytes())
    if rng.random() < 0.5:
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    else:
        del data[rng.randrange(len(data)) :]
    victim.write_bytes(bytes(data))
    second = RuntimeConfig(run_dir=str(run_dir / "second"), checkpoint_dir=str(checkpoints), progress=False)
    result = ElasticRuntime(job, config=second, mesh_policy=policy).run(STEPS, resume=True)
    events = read_events(run_dir / "second" / "events.jsonl")
    reference = fault_free(job, policy)
    match = compare_states(result.state, reference, bitwise=True)
    reported = [e.step for e in events if isinstance(e, CheckpointCorrupt)]
    restored = [e.step for e in events if isinstance(e, StateRestored)]
    problems = [] if match["match"] else [f"final state differs: {match}"]
    if reported != [stop] or restored[:1] != [previous]:
        problems.append(f"damage at step {stop}: reported {reported}, restored {restored}")
    return {"faults": 1, "problems": problems, "recovery_s": [], "lost_steps": stop - previous}


def resume_after_a_full_disk(rng: random.Random, run_dir: Path, policy: Any, job: Any) -> dict[str, Any]:
    """The disk tier on a 1 MB tmpfs; another writer fills it at a random step and frees it some steps later.
    Right when every save meanwhile fails with an event (``CheckpointFailed``) and training goes on, the saves
    after it commit, and a run resumed from the disk tier restores its newest commit and ends bitwise the
    fault-free run's."""
    import anyio

    from elastic_runtime import CheckpointCommitted, CheckpointFailed, ElasticRuntime, RuntimeConfig, read_events
    from elastic_runtime.core.compare import compare_states

    disk = run_dir / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True, timeout=30)
    try:
        full_at = rng.randrange(15, STEPS - 25)
        freed_at, stop = full_at + rng.randrange(5, 15), STEPS - 5 * rng.randrange(1, 3)
        filler = disk / "filler"

        saves_failed: list[int] = []

        async def other_writer(next_step: int) -> None:
            await anyio.sleep(0.02)  # steps of 20 ms: a save is due every 100 ms
            if next_step == full_at:
                with contextlib.suppress(OSError), open(filler, "wb") as out:  # until the disk is full
                    while True:
                        out.write(bytes(4096))
                        out.flush()
            elif next_step == freed_at:
                # Freed once a save has met the full disk (bounded): a save due meanwhile waits for one still
                # writing (a slow first one, under load), so the window is held open until it has been tried.
                with anyio.move_on_after(60):
                    while not saves_failed:
                        await anyio.sleep(0.05)
                filler.unlink()

        folders = {"checkpoint_dir": str(disk / "ckpt"), "progress": False}
        first = RuntimeConfig(run_dir=str(run_dir / "first"), disk_every=5, **folders)  # type: ignore[arg-type]
        runtime = ElasticRuntime(job, config=first, mesh_policy=policy)
        runtime.at_step_boundary(other_writer)

        @runtime.on(CheckpointFailed)
        async def failed_save(event: CheckpointFailed, ctx: Any) -> None:
            saves_failed.append(event.step or 0)

        runtime.run(stop)
        saved = read_events(run_dir / "first" / "events.jsonl")
        failed = [e.step or 0 for e in saved if isinstance(e, CheckpointFailed)]
        committed = [e.step or 0 for e in saved if isinstance(e, CheckpointCommitted) and e.tier == "disk"]
        second = RuntimeConfig(run_dir=str(run_dir / "second"), **folders)  # type: ignore[arg-type]
        result = ElasticRuntime(job, config=second, mesh_policy=policy).run(STEPS, resume=True)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False, timeout=30)
    reference = fault_free(job, policy)
    match = compare_states(result.state, reference, bitwise=True)
    problems = [] if match["match"] else [f"final state differs: {match}"]
    if not failed or not any(step > max(failed) for step in committed):
        problems.append(f"disk full from step {full_at} to {freed_at}: failed {failed}, committed {committed}")
    return {"faults": 1, "problems": problems, "recovery_s": [], "lost_steps": stop - max(committed, default=0)}


def resume_after_gcs_was_down(rng: random.Random, run_dir: Path, policy: Any, job: Any) -> dict[str, Any]:
    """The GCS tier (the emulator, behind a proxy) refuses or cuts every request from a random step for some
    steps. Right when training goes on through it, an upload commits after it, and a run on a new host (an
    empty disk tier) resumes from GCS alone, its newest upload, and ends bitwise the fault-free run's."""
    from elastic_runtime import CheckpointCommitted, ElasticRuntime, RuntimeConfig, StateRestored, read_events
    from elastic_runtime.core.compare import compare_states
    from elastic_runtime.testing.gcs_emulator import running_emulator

    down_at = rng.randrange(10, STEPS - 30)
    up_at, stop = down_at + rng.randrange(5, 15), STEPS - 5 * rng.randrange(1, 3)
    with running_emulator("soak", run_dir / "emulator.log") as emulator:
        os.environ["STORAGE_EMULATOR_HOST"] = emulator.url  # this round's process only

        def outage(next_step: int) -> None:
            time.sleep(0.02)  # steps of 20 ms: a save is due every 100 ms
            if next_step == down_at:
                emulator.proxy.faults, emulator.proxy.rate = ("error", "drop"), 1.0
            elif next_step == up_at:
                emulator.proxy.rate = 0.0

        tiers = {"gcs_uri": "gs://soak/run", "disk_every": 5, "gcs_every": 5, "progress": False}
        first = RuntimeConfig(run_dir=str(run_dir / "first"), **tiers)  # type: ignore[arg-type]
        runtime = ElasticRuntime(job, config=first, mesh_policy=policy)
        runtime.at_step_boundary(outage)
        runtime.run(stop)
        saved = read_events(run_dir / "first" / "events.jsonl")
        uploaded = [e.step or 0 for e in saved if isinstance(e, CheckpointCommitted) and e.tier == "gcs"]
        second = RuntimeConfig(run_dir=str(run_dir / "second"), **tiers)  # type: ignore[arg-type]
        result = ElasticRuntime(job, config=second, mesh_policy=policy).run(STEPS, resume=True)
    restored = [e for e in read_events(run_dir / "second" / "events.jsonl") if isinstance(e, StateRestored)]
    reference = fault_free(job, policy)
    match = compare_states(result.state, reference, bitwise=True)
    problems = [] if match["match"] else [f"final state differs: {match}"]
    newest = max(uploaded, default=0)
    if newest <= up_at or [(e.restored_from, e.step) for e in restored[:1]] != [("gcs", newest)]:
        why = f"restored {[(e.restored_from, e.step) for e in restored]}"
        problems.append(f"GCS down from step {down_at} to {up_at}: uploaded {uploaded}, {why}")
    return {"faults": 1, "problems": problems, "recovery_s": [], "lost_steps": stop - newest}


def multi_process_round(kind: str, rng: random.Random, run_dir: Path) -> dict[str, Any]:
    import chaos  # tests/multiprocess/chaos.py

    reference = run_dir.parent / "reference"
    if not (reference / "final").exists():
        done = chaos.run_group(processes=chaos.NPROCS, steps=chaos.STEPS, run_dir=reference, faults=[])
        assert done.ok, done.reason
    spec = chaos.plan(rng, (kind,))
    faults = len(spec.get("faults", [])) or 1
    if "case" in spec:
        problems = chaos.controller_round(spec["case"], spec["step"], run_dir, reference / "final")
        return {"faults": faults, "problems": problems, "recovery_s": [], "lost_steps": 0}
    result, problems = chaos.run_round(run_dir, dict(spec))
    problems += [] if result.ok else [f"run failed: {result.reason}"]
    if result.ok:
        problems += chaos.check(run_dir, reference / "final")
    problems += chaos.false_alarms(run_dir, spec)
    return {
        "faults": faults,
        "problems": problems,
        "recovery_s": [r["recovery_s"] for r in result.recoveries],
        "lost_steps": sum(r["lost_steps"] for r in result.recoveries),
        "ended": not result.ok,
    }


def hosts_round(kind: str, rng: random.Random, run_dir: Path) -> dict[str, Any]:
    """``elastic-runtime demo --hosts 3`` with host 1 lost (or partitioned) at a random step, checked against the
    same job fault-free (``--verify``: within 1e-5 when some steps ran on 2 hosts)."""
    steps, at = 30, rng.randrange(3, 20)
    fault = "--lose-host-at" if kind == "host-lost" else "--partition-host-at"
    command = [sys.executable, "-m", "elastic_runtime.cli", "demo", "--hosts", "3", "--steps", str(steps)]
    command += [fault, str(at), "--step-delay", "0.05", "--run-dir", str(run_dir), "--verify", "--json", "--quiet"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S - 20)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"faults": 1, "problems": [f"demo exited {done.returncode}: {done.stderr[-300:]}"], "ended": True}
    summary = json.loads(lines[-1])
    match = summary.get("reference_match", {})
    problems = [] if summary["ok"] else [f"run failed: {done.stderr[-300:]}"]
    problems += [] if match.get("match") else [f"final state differs: {match}"]
    recovered = summary.get("recovered_after_s")
    return {
        "faults": 1,
        "problems": problems,
        "recovery_s": [recovered] if recovered is not None else [],
        "lost_steps": summary.get("lost_steps", 0),
        "ended": not summary["ok"],
    }


def play(seed: int, kinds: tuple[str, ...], root: Path) -> dict[str, Any]:
    """One round, in this process: its kind drawn from ``kinds`` by ``seed``."""
    rng = random.Random(seed)
    kind = rng.choice(kinds)
    run_dir = root / f"round-{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    try:
        rounds = {**dict.fromkeys(ONE_PROCESS, one_process_round), **dict.fromkeys(HOSTS, hosts_round)}
        out = rounds.get(kind, multi_process_round)(kind, rng, run_dir)
    except Exception as exc:  # the run stopped with an error: a restore was possible for every kind here
        out = {"faults": 1, "problems": [f"{type(exc).__name__}: {str(exc)[:300]}"], "ended": True}
    return {"seed": seed, "kind": kind, "seconds": round(time.monotonic() - started, 1)} | out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--faults", type=int, default=100, help="stop once this many faults were injected")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=None, help="start no round after this many minutes")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to draw from")
    parser.add_argument("--round", type=int, default=None, help=argparse.SUPPRESS)  # one round, in a child
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    kinds = tuple(args.kinds.split(","))
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; known: {', '.join(KINDS)}")
    if args.round is not None:
        print(json.dumps(play(args.round, kinds, Path(args.root))), flush=True)
        return 0
    root = Path(tempfile.mkdtemp(prefix="soak-"))
    rounds: list[dict[str, Any]] = []
    injected, index = 0, 0
    started = time.monotonic()
    deadline = started + args.minutes * 60 if args.minutes is not None else float("inf")
    while injected < args.faults and time.monotonic() < deadline:
        seed = args.seed * 100_000 + index
        index += 1
        command = [sys.executable, __file__, "--round", str(seed), "--kinds", args.kinds, "--root", str(root)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=ROUND_TIMEOUT_S)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            outcome = json.loads(lines[-1]) if lines else {"seed": seed, "kind": "?", "faults": 1, "ended": True}
            if not lines:
                outcome["problems"] = [f"the round's process exited with {done.returncode}: {done.stderr[-500:]}"]
        except subprocess.TimeoutExpired:
            outcome = {"seed": seed, "kind": "?", "faults": 1, "hung": True, "problems": ["past its bound"]}
        rounds.append(outcome)
        injected += outcome.get("faults", 1)
        verdict = "ok" if not outcome.get("problems") else "FAIL " + "; ".join(outcome["problems"])
        print(f"round {index} seed {seed} {outcome.get('kind')}: {verdict}", file=sys.stderr, flush=True)
    summary = summarize(rounds, args.seed)
    summary |= {"minutes": round((time.monotonic() - started) / 60, 1), "stopped_by": "faults"}
    if injected < args.faults:
        summary["stopped_by"] = f"--minutes {args.minutes:g}, before --faults {args.faults}"
    print(json.dumps(summary), flush=True)
    return 1 if any(r.get("problems") for r in rounds) else 0


def summarize(rounds: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    failed = [r for r in rounds if r.get("problems")]
    per_kind: dict[str, dict[str, Any]] = {}
    for kind in sorted({r["kind"] for r in rounds}):
        mine = [r for r in rounds if r["kind"] == kind]
        times = [t for r in mine for t in r.get("recovery_s", []) if t is not None]
        per_kind[kind] = {
            "faults": sum(r.get("faults", 1) for r in mine),
            "recovered": sum(r.get("faults", 1) for r in mine if not r.get("problems")),
            "median_recovery_s": round(float(np.median(times)), 3) if times else None,
            "p99_recovery_s": round(float(np.percentile(times, 99)), 3) if times else None,
            "median_lost_steps": float(np.median([r.get("lost_steps", 0) for r in mine])),
        }
    return {
        "seed": seed,
        "rounds": len(rounds),
        "faults": sum(r.get("faults", 1) for r in rounds),
        "recovered": sum(r.get("faults", 1) for r in rounds if not r.get("problems")),
        "wrong": sum(any("differ" in p for p in r.get("problems", [])) for r in rounds),
        "hung": sum(bool(r.get("hung")) for r in rounds),
        "ended": sum(bool(r.get("ended")) for r in rounds if r.get("problems")),
        "per_kind": per_kind,
        "failed_seeds": [r["seed"] for r in failed],
        "load_average": os.getloadavg(),
    }


if __name__ == "__main__":
    sys.exit(main())
