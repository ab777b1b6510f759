"""The cascade: RAM snapshots promoted to disk every n steps, committed disk checkpoints uploaded to GCS every m.

Training blocks only for the device-to-host copy the RAM tier already makes; the disk tier writes that same
host snapshot (no second device copy) in its own background thread, and the GCS tier uploads the committed
disk directory in another. Each tier runs at most one save at a time: a save that comes due while its tier is
still busy waits for it and runs next, announced (``CheckpointBehind``: how far the tier is behind), and a newer
due save replaces a waiting one (``CheckpointSkipped``), so a slow tier holds at most one snapshot more and its
newest commit is at most one write behind (``storage/lane.py``). An explicit request (``SaveCheckpoint``, e.g. on
a maintenance notice) is never dropped: it waits for the save in progress and runs next.

Retention keeps the newest ``keep`` committed checkpoints of each tier. It runs only after a commit, and the
newest committed checkpoint is always among those kept, so a tier never lacks one while its successor is
being written. A disk checkpoint that GCS is uploading is not deleted under it.

The threads report through a queue that the component's ``run`` drains into the event bus; a component
opens no task group of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from elastic_runtime.core.cadence import EveryN, SavePolicy
from elastic_runtime.core.config import RuntimeConfig
from elastic_runtime.core.context import RuntimeContext
from elastic_runtime.core.errors import BusClosed, CheckpointInvalid, SnapshotUnavailable
from elastic_runtime.core.events import (
    CheckpointBehind,
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointFailed,
    CheckpointSkipped,
    CheckpointStarted,
    Event,
    SaveCheckpoint,
)
from elastic_runtime.core.snapshot import HostSnapshot, RamTier
from elastic_runtime.storage.disk import DiskTier
from elastic_runtime.storage.lane import Lane
from elastic_runtime.storage.tier import CheckpointInfo, CheckpointTier

if TYPE_CHECKING:
    from elastic_runtime.core.runtime import Runtime
    from elastic_runtime.storage.gcs import GcsTier

log = logging.getLogger(__name__)

_SOURCE = "checkpointer"


def _step(item: HostSnapshot | CheckpointInfo) -> int:
    return item.step


class TieredCheckpointer:
    """Promotes RAM snapshots to disk and disk checkpoints to GCS in the background, and restores from them.

    Args:
        ram: the executor's RAM tier; every completed snapshot is offered to the disk tier.
        shm: a tier in ``/dev/shm`` (a :class:`DiskTier` there) that mirrors every RAM snapshot, so the newest
            one survives a restart of this process; or None.
        disk: the persistent-disk tier, or None.
        gcs: the GCS tier, or None (it uploads committed disk checkpoints, so it needs ``disk``).
        disk_every: promote a snapshot each time the step crosses a multiple of this.
        gcs_every: upload a disk checkpoint each time the committed step crosses a multiple of this.
        keep: committed checkpoints kept per durable tier (>= 1).
        timeout_s: deadline of one save or upload.
        save_on_finish: when the run ends, commit its final snapshot to every tier before stopping.
    """

    def __init__(
        self,
        ram: RamTier,
        *,
        shm: DiskTier | None = None,
        disk: DiskTier | None = None,
        gcs: GcsTier | None = None,
        disk_every: int = 100,
        gcs_every: int = 1000,
        keep: int = 3,
        timeout_s: float = 600.0,
        save_on_finish: bool = True,
    ) -> None:
        if gcs is not None and disk is None:
            raise ValueError("the GCS tier uploads committed disk checkpoints: configure a disk tier too")
        if disk_every < 1 or gcs_every < 1 or keep < 1:
            raise ValueError(f"disk_every={disk_every}, gcs_every={gcs_every}, keep={keep} must all be >= 1")
        self.ram = ram
        self.shm = shm
        self.disk = disk
        self.gcs = gcs
        self.disk_every, self.gcs_every = disk_every, gcs_every
        # The same policies as the RAM snapshots' and the multi-process durable checkpoints'
        # (elastic_runtime.core.cadence).
        self.disk_policy: SavePolicy = EveryN(disk_every)
        self.gcs_policy: SavePolicy = EveryN(gcs_every)
        self.keep = keep
        self.timeout_s = timeout_s
        self.save_on_finish = save_on_finish
        self._events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        # ``run``'s loop and what it waits on, woken by each event a writer's thread reports (``_emit``).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._arrived: anyio.Event | None = None
        self._lock = threading.Lock()
        # One lane per tier: a save that comes due while its tier is busy waits for it (the newest one only). The
        # mirror copies every snapshot: it being behind is no news (its skips are events).
        self._shm_lane: Lane[HostSnapshot] = Lane(
            "ckpt-shm", self._mirror, step_of=_step, on_skip=self._skipped(shm), doing="copy"
        )
        self._disk_lane: Lane[tuple[HostSnapshot, bool]] = Lane(
            "ckpt-disk",
            self._save_to_disk,
            step_of=lambda item: item[0].step,
            on_skip=self._skipped(disk),
            on_wait=self._behind(disk),
        )
        self._gcs_lane: Lane[CheckpointInfo] = Lane(
            "ckpt-gcs",
            self._upload,
            step_of=_step,
            on_skip=self._not_uploaded,
            on_wait=self._behind(gcs),
            doing="upload",
        )
        self._uploading: set[int] = set()  # disk steps GCS is reading: retention leaves them alone
        self.report_every_s = 10.0  # how often the end of a run says what it still waits for
        self.newest: dict[str, int] = {}  # tier -> newest step committed by this checkpointer
        self._first_step: int | None = None  # the first snapshot this checkpointer was offered
        self._due_disk = 0  # newest snapshot step that came due for the disk (saved or skipped)
        self._last_uploaded = 0  # newest disk step handed to GCS
        self._ctx: RuntimeContext | None = None
        for tier in self.restore_tiers:
            tier.corruption_listeners.append(self._on_corrupt)
        ram.listeners.append(self._on_snapshot)

    @classmethod
    def from_config(cls, config: RuntimeConfig, ram: RamTier) -> TieredCheckpointer | None:
        """The checkpointer a config asks for, or None when it names no durable tier.

        The disk tier lives in ``checkpoint_dir``, by default ``<run_dir>/checkpoints``; GCS is on once
        ``gcs_uri`` names a bucket.
        """
        directory = config.checkpoint_dir
        if directory is None and config.run_dir:
            directory = str(Path(config.run_dir) / "checkpoints")
        disk = DiskTier(directory) if directory else None
        shm = DiskTier(config.ram_dir, name="shm", packed=True, sync=False) if config.ram_dir else None
        gcs = None
        if config.gcs_uri:
            from elastic_runtime.storage.gcs import GcsTier  # google-cloud-storage loads only when a bucket is named

            gcs = GcsTier(config.gcs_uri, workers=config.gcs_workers)
        if disk is None and shm is None:
            return None
        return cls(
            ram,
            shm=shm,
            disk=disk,
            gcs=gcs,
            disk_every=config.disk_every,
            gcs_every=config.gcs_every,
            keep=config.keep,
            timeout_s=config.checkpoint_timeout_s,
            save_on_finish=config.checkpoint_on_finish,
        )

    @property
    def tiers(self) -> list[CheckpointTier]:
        """The durable tiers (disk, GCS), fastest first: the ones a SaveCheckpoint request writes."""
        return [t for t in (self.disk, self.gcs) if t is not None]

    @property
    def restore_tiers(self) -> list[CheckpointTier]:
        """Every tier a restore may read after RAM, fastest first (shm, disk, GCS)."""
        return [t for t in (self.shm, self.disk, self.gcs) if t is not None]

    def attach(self, runtime: Runtime) -> TieredCheckpointer:
        """Plug into a runtime: run as its component, answer SaveCheckpoint, act as restore sources after RAM."""
        runtime.add_component(self)
        runtime.subscribe(SaveCheckpoint, self.handle_save_request)
        runtime.executor.restore_sources.extend(self.restore_tiers)
        return self

    # --- the component ---------------------------------------------------------------------------------

    async def run(self, ctx: RuntimeContext) -> None:
        """Sweep torn writes of an earlier process, then forward the worker threads' events to the bus."""
        self._ctx = ctx
        for tier in (self.shm, self.disk):
            if tier is not None:
                for path in await anyio.to_thread.run_sync(tier.sweep):
                    log.warning("removed %s: a checkpoint write that never committed", path)
        self._loop = asyncio.get_running_loop()
        while True:
            self._arrived = anyio.Event()  # before the flush: an event reported during it wakes the next wait
            await self._flush(ctx)
            await self._arrived.wait()

    async def finish(self, ctx: RuntimeContext) -> None:
        """At the end of a run: commit the final snapshot to every durable tier, wait, publish the events.

        A tier that does not finish within ``timeout_s`` is left to its thread and logged: a slow bucket must
        not turn a finished run into a failed one.
        """
        try:
            await self._wait_saying_so(ctx)
            if self.shm is not None:  # the mirror skipped the last snapshot if it was still copying one
                await anyio.to_thread.run_sync(self._mirror_final)
                await self._wait_saying_so(ctx)
            if self.save_on_finish and self.disk is not None:
                await anyio.to_thread.run_sync(self._commit_final)
                await self._wait_saying_so(ctx)
        except TimeoutError as exc:
            log.warning("checkpoints at the end of the run: %s", exc)
        await self._flush(ctx)

    async def _wait_saying_so(self, ctx: RuntimeContext) -> None:
        """Wait for the saves in progress; every ``report_every_s``, say what the run waits for and how far
        it got (a final upload to a slow bucket can take minutes).

        Raises:
            TimeoutError: they are still running after ``timeout_s``.
        """
        started, every_s = time.monotonic(), self.report_every_s
        while True:
            left = self.timeout_s - (time.monotonic() - started)
            try:
                await anyio.to_thread.run_sync(self.wait, min(every_s, max(left, 0.0)))
                return
            except TimeoutError:
                if left <= every_s:
                    raise
            await self._flush(ctx)
            log.warning("the run is over; %s (%.0f s so far)", self._in_progress(), time.monotonic() - started)

    def _in_progress(self) -> str:
        """What the lanes are saving now, for the message while the end of a run waits for them."""
        parts = []
        if self._shm_lane.busy() and self.shm is not None:
            parts.append(f"copying step {self._shm_lane.step} to {self.shm.name}")
        if self._disk_lane.busy():
            parts.append(f"saving step {self._disk_lane.step} to disk")
        if self._gcs_lane.busy() and self.gcs is not None:
            step, done, total = self.gcs.upload_progress
            parts.append(f"uploading step {step} to {self.gcs.uri}: {done / 2**20:.1f} of {total / 2**20:.1f} MiB")
        return "waiting for " + ("; ".join(parts) or "the checkpoint saves")

    def _mirror_final(self) -> None:
        try:
            final = self.ram.latest_verified(None, self.timeout_s)
        except SnapshotUnavailable:
            return
        if self._shm_lane.step < final.step:
            self._shm_lane.submit(final)

    def _commit_final(self) -> None:
        assert self.disk is not None
        try:
            final = self.ram.latest_verified(None, self.timeout_s)
        except SnapshotUnavailable:
            return
        with self._lock:
            on_disk = self.newest.get(self.disk.name, -1)
            on_gcs = self.newest.get(self.gcs.name, -1) if self.gcs is not None else final.step
        if on_disk < final.step:
            self._disk_lane.submit((final, self.gcs is not None), forced=True)
        elif on_gcs < final.step:
            info = next((i for i in self.disk.list(timeout=self.timeout_s) if i.step == final.step), None)
            if info is not None:
                self._submit_gcs(info, forced=True)

    async def _flush(self, ctx: RuntimeContext) -> None:
        for event in self.take_events():
            try:
                await ctx.publish(event)
            except BusClosed:
                log.info("bus closed: dropped %s", event)

    def take_events(self) -> list[Event]:
        """The events the worker threads reported since the last call (``run`` forwards them to the bus)."""
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def _emit(self, event: Event) -> None:
        self._events.put(event)
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: ``finish`` took the events
                self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        if self._arrived is not None:
            self._arrived.set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until no save or upload is running or waiting (for tests and shutdown).

        Raises:
            TimeoutError: one still runs after ``timeout`` seconds.
        """
        end = None if timeout is None else time.monotonic() + timeout
        # A disk save hands its checkpoint to the GCS lane: wait for the lanes in the order work flows.
        for lane in (self._shm_lane, self._disk_lane, self._gcs_lane):
            lane.wait(None if end is None else max(end - time.monotonic(), 0.0))

    def close(self) -> None:
        """Stop the tiers' background writers, after the writes already started or queued have finished."""
        for lane in (self._shm_lane, self._disk_lane, self._gcs_lane):
            lane.close()

    def _skipped(self, tier: CheckpointTier | None) -> Callable[[int, str], None]:
        name = tier.name if tier is not None else "none"
        return lambda step, reason: self._emit(CheckpointSkipped(step=step, source=_SOURCE, tier=name, reason=reason))

    def _not_uploaded(self, step: int, reason: str) -> None:
        with self._lock:
            self._uploading.discard(step)  # retention may delete it again
        self._skipped(self.gcs)(step, reason)

    def _behind(self, tier: CheckpointTier | None) -> Callable[[int, int], None]:
        name = tier.name if tier is not None else "none"

        def behind(step: int, writing: int) -> None:
            with self._lock:
                committed = self.newest.get(name)
            lag = step - committed if committed is not None else step
            log.info(
                "%s is behind its cadence: step %d waits for the write of step %d (%d steps)", name, step, writing, lag
            )
            self._emit(CheckpointBehind(step=step, source=_SOURCE, tier=name, writing=writing, behind_steps=lag))

        return behind

    # --- requests --------------------------------------------------------------------------------------

    async def handle_save_request(self, event: SaveCheckpoint, ctx: RuntimeContext) -> None:
        """On SaveCheckpoint: commit the newest RAM snapshot to the requested tiers (all durable by default).

        The newest, not the newest verified (runtime/core/fingerprint.py): a request (a notice before a preemption)
        is for the progress made, and the state is at most ``fingerprint_every - 1`` steps past a verified one;
        the cadence's saves and the final one are of verified states."""
        wanted = set(event.tiers) or {t.name for t in self.tiers}
        unknown = wanted - {t.name for t in self.tiers}
        for name in sorted(unknown):
            await ctx.publish(CheckpointSkipped(step=ctx.step, source=_SOURCE, tier=name, reason="no such tier"))
        if self.disk is None or not wanted - unknown:
            return
        try:
            snapshot = await anyio.to_thread.run_sync(self.ram.latest, None, self.timeout_s)
        except SnapshotUnavailable as exc:
            for name in sorted(wanted - unknown):
                await ctx.publish(CheckpointSkipped(step=ctx.step, source=_SOURCE, tier=name, reason=str(exc)))
            return
        upload = self.gcs is not None and self.gcs.name in wanted
        self._disk_lane.submit((snapshot, upload), forced=True)

    def _on_snapshot(self, snapshot: HostSnapshot) -> None:
        """From the RAM copy thread: hand a due snapshot to the shm and disk threads (never blocks)."""
        if self._first_step is None:
            # The cadences count from here: a resumed run's first snapshot is no reason to save at once.
            self._first_step = snapshot.step
            self._due_disk = self._last_uploaded = snapshot.step - 1
        if self.shm is not None:
            self._shm_lane.submit(snapshot)
        # "Crosses a multiple" rather than "is a multiple": any RAM cadence then still reaches the disk.
        if self.disk is not None and self.disk_policy.should_save(snapshot.step, self._due_disk):
            self._due_disk = snapshot.step
            self._disk_lane.submit((snapshot, False))

    def _mirror(self, snapshot: HostSnapshot) -> None:
        assert self.shm is not None
        self._save(self.shm, snapshot)

    def _save(self, tier: DiskTier, snapshot: HostSnapshot) -> CheckpointInfo | None:
        """Write ``snapshot`` to a local tier with its events and retention; None when it failed."""
        step = snapshot.step
        self._emit(CheckpointStarted(step=step, source=_SOURCE, tier=tier.name))
        started = time.monotonic()
        try:
            info = tier.save(snapshot, timeout=self.timeout_s)
        except Exception as exc:
            log.error("%s checkpoint of step %d failed: %s", tier.name, step, exc)
            self._emit(
                CheckpointFailed(
                    step=step,
                    source=_SOURCE,
                    tier=tier.name,
                    reason=str(exc),
                    error_type=type(exc).__name__,
                    message=str(exc),
                )
            )
            return None
        self._emit(
            CheckpointCommitted(
                step=step,
                source=_SOURCE,
                tier=tier.name,
                path=info.location,
                bytes=info.nbytes,
                seconds=time.monotonic() - started,
            )
        )
        with self._lock:
            self.newest[tier.name] = max(self.newest.get(tier.name, -1), step)
        # The shm tier holds host memory: two copies are enough for a restart to find a complete one.
        self._retain(tier, keep=2 if tier is self.shm else self.keep)
        return info

    def _save_to_disk(self, item: tuple[HostSnapshot, bool]) -> None:
        snapshot, upload = item
        assert self.disk is not None
        info = self._save(self.disk, snapshot)
        if info is None:
            return
        step = info.step
        if self.gcs is not None and (upload or self.gcs_policy.should_save(step, self._last_uploaded)):
            self._submit_gcs(info, forced=upload)

    def _submit_gcs(self, info: CheckpointInfo, *, forced: bool) -> None:
        with self._lock:
            self._uploading.add(info.step)  # before the lane can start it: retention must not delete it
        if self._gcs_lane.submit(info, forced=forced):  # skipped: ``_not_uploaded`` let retention have it again
            with self._lock:
                self._last_uploaded = max(self._last_uploaded, info.step)

    def _upload(self, info: CheckpointInfo) -> None:
        try:
            self._upload_one(info)
        finally:
            with self._lock:
                self._uploading.discard(info.step)

    def _upload_one(self, info: CheckpointInfo) -> None:
        gcs = self.gcs
        assert gcs is not None
        self._emit(CheckpointStarted(step=info.step, source=_SOURCE, tier=gcs.name))
        started = time.monotonic()
        try:
            done = gcs.upload(info.location, timeout=self.timeout_s)
        except Exception as exc:
            log.error("GCS upload of step %d failed: %s", info.step, exc)
            self._emit(
                CheckpointFailed(
                    step=info.step,
                    source=_SOURCE,
                    tier=gcs.name,
                    reason=str(exc),
                    error_type=type(exc).__name__,
                    message=str(exc),
                )
            )
            return
        self._emit(
            CheckpointCommitted(
                step=info.step,
                source=_SOURCE,
                tier=gcs.name,
                path=done.location,
                bytes=done.nbytes,
                seconds=time.monotonic() - started,
            )
        )
        with self._lock:
            self.newest[gcs.name] = max(self.newest.get(gcs.name, -1), info.step)
        self._retain(gcs)

    def _retain(self, tier: CheckpointTier, *, keep: int | None = None) -> None:
        """Keep the newest ``keep`` committed checkpoints; only ever called right after a commit."""
        try:
            infos = [i for i in tier.list(timeout=self.timeout_s) if i.nbytes >= 0]
            with self._lock:
                protected = set(self._uploading) if tier is self.disk else set()
            for info in infos[self.keep if keep is None else keep :]:
                if info.step not in protected:
                    tier.delete(info.step, timeout=self.timeout_s)
        except Exception as exc:  # retention is housekeeping: a failure must not fail the commit
            log.warning("retention on %s failed: %s", tier.name, exc)

    # --- restore ---------------------------------------------------------------------------------------

    def _on_corrupt(self, tier: str, step: int, exc: CheckpointInvalid) -> None:
        self._emit(
            CheckpointCorrupt(
                step=step,
                source=_SOURCE,
                tier=tier,
                path=exc.path,
                reason=exc.reason,
                error_type=type(exc).__name__,
                message=str(exc),
            )
        )

    def status(self) -> dict[str, Any]:
        """Newest committed step per tier and what is running now, for logs and tests."""
        with self._lock:
            newest = dict(self.newest)
        return {
            "newest": newest,
            "shm_running": self._shm_lane.busy(),
            "disk_running": self._disk_lane.busy(),
            "gcs_running": self._gcs_lane.busy(),
        }
