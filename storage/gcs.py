"""The GCS tier: committed disk checkpoints copied to a bucket, for the loss of the whole machine.

Layout mirrors the disk tier under a prefix: ``gs://BUCKET/PREFIX/step_0000000120/state/...`` and
``.../step_0000000120/manifest.json``. Upload: every data file first, in parallel, each checked against the
manifest's CRC32C as the server computed it; the manifest object last. A reader lists only steps whose manifest
object exists, so an upload cut off at any point (a killed process, a lost network) is invisible. GCS
generation preconditions are not relied on.

google-cloud-storage does the transfers and the retries: each request carries a timeout and a
:class:`RequestRetry`, api_core's ``Retry`` on 408, 429, 5xx, timeouts and broken connections, with jittered
exponential backoff, at most ``max_attempts`` attempts of one request, within the caller's deadline. It is
passed explicitly because the library's default retries an upload only under a generation precondition.
Restores go through ``transfer_manager.download_many``. One part is our own: files above ``chunk_size`` go
over a resumable session that, after a failed piece, asks the server how much it holds
(:meth:`GcsTier._upload_resumable` says why the library's cannot). Google Cloud errors are converted to
:class:`~elastic_runtime.core.errors.StorageError` and :class:`~elastic_runtime.core.errors.CheckpointInvalid` here, at
the adapter.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import requests
from google.api_core import exceptions as api_exceptions
from google.api_core.retry import Retry
from google.cloud import storage
from google.cloud.storage import transfer_manager
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse

from elastic_runtime.compat import cloud_storage as cloud_storage_compat
from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from elastic_runtime.core.snapshot import HostSnapshot
from elastic_runtime.storage import manifest as mf
from elastic_runtime.storage.checked_read import Deadline, load_directory
from elastic_runtime.storage.disk import DiskTier, read_manifest
from elastic_runtime.storage.manifest import FileEntry, Manifest
from elastic_runtime.storage.tier import CheckpointInfo, CorruptionListener, PyTree, latest_verified, snapshot_from

log = logging.getLogger(__name__)

T = TypeVar("T")

_RETRYABLE_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_RETRYABLE_TYPES: tuple[type[BaseException], ...] = (
    api_exceptions.TooManyRequests,
    api_exceptions.InternalServerError,
    api_exceptions.BadGateway,
    api_exceptions.ServiceUnavailable,
    api_exceptions.GatewayTimeout,
    ConnectionError,  # includes ConnectionResetError and BrokenPipeError
    TimeoutError,
    requests.ConnectionError,
    requests.Timeout,
    requests.exceptions.ChunkedEncodingError,
    http.client.HTTPException,  # RemoteDisconnected, IncompleteRead, BadStatusLine
    DataCorruption,  # bytes damaged in transit: the next attempt transfers them again
)


def is_retryable(exc: BaseException) -> bool:
    """Whether a failed GCS request is worth repeating: throttling, server errors, timeouts, broken connections."""
    if isinstance(exc, _RETRYABLE_TYPES):
        return True
    if isinstance(exc, api_exceptions.GoogleAPICallError):
        return exc.code in _RETRYABLE_STATUS
    if isinstance(exc, InvalidResponse):
        return getattr(exc.response, "status_code", None) in _RETRYABLE_STATUS
    cause = exc.__cause__ or exc.__context__
    return cause is not None and cause is not exc and is_retryable(cause)


def _is_retryable_download(exc: BaseException) -> bool:
    # The library resumes a repeated download after the bytes it already holds, so damaged bytes are not cured
    # by repeating the request: the whole file is downloaded again instead (GcsTier._download_many).
    return not isinstance(exc, DataCorruption) and is_retryable(exc)


class RequestRetry(Retry):
    """api_core's ``Retry`` that also gives up after ``max_attempts`` attempts of one request.

    The library wraps each request it makes (one piece of a resumable upload, one page of a listing, one
    download) in ``retry(func)``; every wrapped call counts its own attempts, as it keeps its own timeout.
    """

    max_attempts = 0  # 0: only the timeout bounds the attempts

    def __call__(self, func: Callable[..., T], on_error: Callable[[Exception], Any] | None = None) -> Callable[..., T]:
        if not self.max_attempts:
            return super().__call__(func, on_error)
        retryable, limit = self._predicate, self.max_attempts

        @functools.wraps(func)
        def attempts_bounded(*args: Any, **kwargs: Any) -> T:
            failures = itertools.count(1)
            one = self.with_predicate(lambda exc: retryable(exc) and next(failures) < limit)
            return one(func, on_error)(*args, **kwargs)

        return attempts_bounded


def parse_gs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/some/prefix`` -> ("bucket", "some/prefix"). Raises ValueError for anything else."""
    if not uri.startswith("gs://"):
        raise ValueError(f"a GCS location must look like gs://BUCKET[/PREFIX], got {uri!r}")
    bucket, _, prefix = uri[len("gs://") :].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}")
    return bucket, prefix.strip("/")


def make_client(project: str | None = None, *, endpoint: str | None = None) -> storage.Client:
    """A storage client with the default credentials.

    Against an emulator (``endpoint``, or ``STORAGE_EMULATOR_HOST`` in the environment) it uses anonymous
    credentials, as the emulator expects.
    """
    if endpoint or os.environ.get("STORAGE_EMULATOR_HOST"):
        from google.auth.credentials import AnonymousCredentials

        options = {"api_endpoint": endpoint} if endpoint else None
        return storage.Client(project=project or "emulator", credentials=AnonymousCredentials(), client_options=options)
    return storage.Client(project=project)


class GcsTier:
    """Checkpoints under ``gs://bucket/prefix``, committed by their manifest object.

    Args:
        uri: ``gs://BUCKET[/PREFIX]``.
        client: a ``google.cloud.storage.Client``; by default one is made on first use.
        name: the tier's name in events and restore sources.
        workers: parallel transfers.
        chunk_size: files larger than this go as resumable uploads, in pieces of this size, each retried on
            its own.
        request_timeout_s: per-request read timeout (connect timeout is the smaller of it and 10 s).
        max_attempts: attempts per request before its error is final.
        backoff_s: the first retry's longest wait; each later one may wait twice as long, up to 4 s (tests
            pass 0, which never waits).
        staging_dir: where a restore downloads to before verifying and loading (default: the system temp dir).
    """

    def __init__(
        self,
        uri: str,
        *,
        client: storage.Client | None = None,
        name: str = "gcs",
        workers: int = 8,
        chunk_size: int = 32 << 20,
        request_timeout_s: float = 60.0,
        max_attempts: int = 10,
        backoff_s: float = 0.1,
        staging_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        self.bucket_name, self.prefix = parse_gs_uri(uri)
        self.uri = f"gs://{self.bucket_name}/{self.prefix}".rstrip("/")
        self.name = name
        self.workers = max(1, workers)
        # Resumable uploads go in multiples of 256 KiB.
        self.chunk_size = max(256 << 10, chunk_size // (256 << 10) * (256 << 10))
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max(1, max_attempts)
        self.backoff_s = max(0.0, backoff_s)
        self.staging_dir = staging_dir
        self.corruption_listeners: list[CorruptionListener] = []
        self._client = client
        self.retries = 0  # requests repeated after a retryable error, for tests and logs
        self.upload_progress = (-1, 0, 0)  # (step, bytes uploaded, bytes in all) of the newest upload

    # --- plumbing ------------------------------------------------------------------------------------

    @property
    def client(self) -> storage.Client:
        """The google-cloud-storage client, made on first use with the default credentials."""
        if self._client is None:
            self._client = make_client()
        return self._client

    def _bucket(self) -> storage.Bucket:
        return self.client.bucket(self.bucket_name)

    def _key(self, step: int, rel: str = "") -> str:
        parts = [p for p in (self.prefix, mf.step_dirname(step), rel) if p]
        return "/".join(parts)

    def location(self, step: int) -> str:
        """The ``gs://`` address of the checkpoint of ``step``."""
        return f"gs://{self.bucket_name}/{self._key(step)}"

    def _timeout(self, deadline: float) -> tuple[float, float]:
        left = max(deadline - time.monotonic(), 0.1)
        read = min(self.request_timeout_s, left)
        return (min(10.0, read), read)

    def _retry(self, deadline: float, retryable: Callable[[BaseException], bool] = is_retryable) -> RequestRetry:
        """The retry policy for requests made before ``deadline``: passed to every library call."""

        def on_error(exc: Exception) -> None:
            self.retries += 1
            log.info("%s: retrying a request after %s: %s", self.name, type(exc).__name__, exc)

        retry = RequestRetry(
            predicate=lambda exc: time.monotonic() < deadline and retryable(exc),
            initial=self.backoff_s,
            maximum=4.0,
            timeout=max(deadline - time.monotonic(), 0.0),
            on_error=on_error,
        )
        retry.max_attempts = self.max_attempts
        return retry

    def _request_args(
        self, deadline: float, retryable: Callable[[BaseException], bool] = is_retryable
    ) -> dict[str, Any]:
        return {"timeout": self._timeout(deadline), "retry": self._retry(deadline, retryable)}

    def _parallel(self, job: Callable[[T], None], items: Sequence[T]) -> None:
        """``job`` on every item in ``self.workers`` threads; raises the first error once all have ended."""
        if items:
            with ThreadPoolExecutor(max_workers=min(self.workers, len(items)), thread_name_prefix="gcs") as pool:
                for _ in pool.map(job, items):
                    pass

    @contextlib.contextmanager
    def _failing_as_storage_error(self, what: str) -> Iterator[None]:
        """Convert a Google Cloud or network error that the retries did not cure; NotFound passes through."""
        try:
            yield
        except (api_exceptions.NotFound, CheckpointInvalid, SnapshotUnavailable, StorageError):
            raise
        except Exception as exc:
            raise StorageError(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def _download_many(self, step: int, entries: Sequence[FileEntry], staging: Path, deadline: float) -> None:
        """Download ``entries`` of ``step`` into ``staging`` through ``transfer_manager``, in ``self.workers`` threads.

        The library retries each request; a file whose bytes arrived damaged (DataCorruption) is downloaded
        again whole, up to ``max_attempts`` times.

        Raises:
            CheckpointInvalid: an object does not exist.
            StorageError: a download failed beyond the retries, or the deadline passed.
        """
        for entry in entries:
            (staging / entry.path).parent.mkdir(parents=True, exist_ok=True)
        pending = entries
        for attempt in itertools.count(1):
            blobs = [self._bucket().blob(self._key(step, entry.path)) for entry in pending]
            results = transfer_manager.download_many(
                [(blob, str(staging / entry.path)) for blob, entry in zip(blobs, pending, strict=True)],
                download_kwargs={"checksum": "crc32c", **self._request_args(deadline, _is_retryable_download)},
                worker_type=transfer_manager.THREAD,
                max_workers=min(self.workers, len(pending)),
                raise_exception=False,  # every outcome, so that each failure is named and damage is retried
            )
            damaged = []
            for entry, blob, result in zip(pending, blobs, results, strict=True):
                where = f"gs://{self.bucket_name}/{blob.name}"
                if isinstance(result, DataCorruption) and attempt < self.max_attempts and time.monotonic() < deadline:
                    log.info("%s: downloading %s again after %s", self.name, where, result)
                    damaged.append(entry)
                elif isinstance(result, api_exceptions.NotFound):
                    raise CheckpointInvalid(f"{where} is missing", path=where, reason="missing") from result
                elif isinstance(result, Exception):
                    with self._failing_as_storage_error(f"downloading {where}"):
                        raise result
            if not damaged:
                return
            self.retries += len(damaged)
            pending = damaged

    # --- writing -------------------------------------------------------------------------------------

    def upload(self, directory: str | os.PathLike[str], *, timeout: float) -> CheckpointInfo:
        """Copy a committed local checkpoint directory (one the disk tier wrote) to GCS and commit it there.

        Raises:
            SnapshotUnavailable: ``directory`` is not a committed checkpoint.
            CheckpointInvalid: a local file no longer matches its manifest (it is not uploaded).
            StorageError: GCS failed beyond the retries, or ``timeout`` passed; nothing becomes visible.
        """
        deadline = time.monotonic() + timeout
        directory = Path(directory)
        manifest = read_manifest(directory)
        self.upload_files(manifest.step, directory, manifest.files, timeout=timeout)
        # Last: until this object exists, no reader sees the step.
        self.put_manifest(manifest, timeout=max(deadline - time.monotonic(), 0.1))
        return self._info(manifest)

    def upload_files(
        self, step: int, directory: str | os.PathLike[str], entries: Sequence[FileEntry], *, timeout: float
    ) -> None:
        """Upload ``entries`` (relative to the local ``directory``) as ``step``'s objects, in parallel, each
        checked against its CRC32C as the server computed it. Commits nothing: see :meth:`put_manifest`.

        Raises:
            CheckpointInvalid: what the server stored differs from an entry's CRC32C.
            StorageError: GCS failed beyond the retries, or ``timeout`` passed.
        """
        deadline = time.monotonic() + timeout
        directory = Path(directory)
        bucket = self._bucket()
        total = sum(entry.size for entry in entries)
        self.upload_progress = (step, 0, total)
        lock = threading.Lock()

        def upload_one(entry: FileEntry) -> None:
            local = directory / entry.path
            key = self._key(step, entry.path)
            if entry.size > self.chunk_size:
                crc = self._upload_resumable(bucket, key, local, entry.size, deadline)
            else:
                blob = bucket.blob(key)
                with self._failing_as_storage_error(f"uploading {local} to gs://{self.bucket_name}/{key}"):
                    blob.upload_from_filename(str(local), checksum="crc32c", **self._request_args(deadline))
                crc = _crc_of(blob.crc32c)
            # The server's CRC32C of what it stored must be the one the manifest promises.
            if crc is not None and crc != entry.crc32c:
                reason = f"crc32c {crc:08x} after upload, manifest says {entry.crc32c:08x}"
                raise CheckpointInvalid(
                    f"{local} -> gs://{self.bucket_name}/{key}: {reason}", path=str(local), reason=reason
                )
            with lock:
                at, done, _ = self.upload_progress
                self.upload_progress = (at, done + entry.size, total)

        # Not transfer_manager.upload_many: it can only call the library's uploads (see _upload_resumable).
        self._parallel(upload_one, entries)

    def put_manifest(self, manifest: Manifest, *, timeout: float) -> None:
        """Commit ``manifest.step``: write its manifest object, after every file it lists is uploaded.

        Raises:
            StorageError: GCS failed beyond the retries, or ``timeout`` passed.
        """
        key = self._key(manifest.step, mf.MANIFEST_NAME)
        with self._failing_as_storage_error(f"committing {key}"):
            self._bucket().blob(key).upload_from_string(
                mf.encode(manifest), content_type="application/json", **self._request_args(time.monotonic() + timeout)
            )

    def read_file(self, step: int, rel: str, *, timeout: float) -> bytes:
        """The bytes of ``step``'s file ``rel`` (a path its manifest lists), checked in transit.

        Raises:
            CheckpointInvalid: the object does not exist.
            StorageError: GCS failed beyond the retries, or ``timeout`` passed.
        """
        key = self._key(step, rel)
        where = f"gs://{self.bucket_name}/{key}"
        try:
            with self._failing_as_storage_error(f"reading {where}"):
                return bytes(
                    self._bucket()
                    .blob(key)
                    .download_as_bytes(
                        checksum="crc32c", **self._request_args(time.monotonic() + timeout, _is_retryable_download)
                    )
                )
        except api_exceptions.NotFound as exc:
            raise CheckpointInvalid(f"{where} is missing", path=where, reason="missing") from exc

    def _upload_resumable(
        self, bucket: storage.Bucket, key: str, local: Path, size: int, deadline: float
    ) -> int | None:
        """Upload a large file in ``chunk_size`` pieces over one resumable session; returns the server's CRC32C.

        A failed piece does not restart the file: the next attempt asks the server how much it holds
        (``Content-Range: bytes */SIZE``) and goes on from there, so a 30% fault rate still converges.

        Not the library's resumable upload (``Blob.upload_from_file`` with ``chunk_size``): its
        ``transmit_next_chunk`` prepares a piece once and its retry resends it from the same offset, never
        calling ``recover()``. A server that applied the piece before the connection dropped refuses that
        (the emulator: 400 "Invalid Content-Range start: expected 1048576, got 0"), and 400 is final. So
        this method puts its pieces through the client's authorized session itself.
        """
        where = f"gs://{self.bucket_name}/{key}"
        blob = bucket.blob(key)
        with self._failing_as_storage_error(f"starting a resumable upload of {where}"):
            session: str = blob.create_resumable_upload_session(size=size, **self._request_args(deadline))
        http = cloud_storage_compat.authorized_session(self.client)
        state: dict[str, Any] = {"offset": 0, "resync": False, "done": None}

        def query() -> None:
            response = http.put(
                session, data=b"", headers={"Content-Range": f"bytes */{size}"}, timeout=self._timeout(deadline)
            )
            if response.status_code in (200, 201):
                state["done"] = response.json()
            elif response.status_code == 308:
                state["offset"] = _committed(response)
            elif response.status_code == 404:
                # The session ended: it completed (and the answer was lost) or it expired. Ask for the object.
                found = bucket.get_blob(key, timeout=self._timeout(deadline), retry=None)
                if found is None or found.size != size:
                    raise StorageError(f"{where}: the resumable session vanished before the upload completed")
                state["done"] = {"crc32c": found.crc32c}
            else:
                raise api_exceptions.from_http_response(response)

        def attempt() -> None:
            if state["resync"]:
                query()
                state["resync"] = False
                if state["done"] is not None:
                    return
            offset = state["offset"]
            with open(local, "rb") as f:
                f.seek(offset)
                data = f.read(self.chunk_size)
            end = offset + len(data) - 1
            try:
                response = http.put(
                    session,
                    data=data,
                    headers={"Content-Range": f"bytes {offset}-{end}/{size}"},
                    timeout=self._timeout(deadline),
                )
                if response.status_code in (200, 201):
                    state["done"] = response.json()
                elif response.status_code == 308:
                    state["offset"] = _committed(response)
                elif response.status_code == 400 and offset > 0:
                    # gcp-storage-emulator can report holding a byte it does not hold (Range: bytes=0-0 for an
                    # empty upload), then refuses the next offset: send the file again from the start.
                    log.warning("%s: server refused offset %d (%s); resending from 0", where, offset, response.text)
                    state["offset"] = 0
                else:
                    raise api_exceptions.from_http_response(response)
            except Exception:
                state["resync"] = True  # how much of this piece arrived is unknown: ask before sending more
                raise

        while state["done"] is None:
            if time.monotonic() > deadline:
                raise StorageError(f"{self.name}: uploading {local} to {where}: deadline passed")
            with self._failing_as_storage_error(f"uploading {local} at byte {state['offset']}"):
                self._retry(deadline)(attempt)()
        return _crc_of(state["done"].get("crc32c"))

    def save(self, snapshot: HostSnapshot, *, timeout: float) -> CheckpointInfo:
        """Write ``snapshot`` to a local staging directory in the disk format, then upload it."""
        started = time.monotonic()
        staging = Path(tempfile.mkdtemp(prefix="gcs-save-", dir=self.staging_dir))
        try:
            local = DiskTier(staging, name=f"{self.name}-staging").save(snapshot, timeout=timeout)
            return self.upload(local.location, timeout=max(timeout - (time.monotonic() - started), 0.1))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def delete(self, step: int, *, timeout: float) -> None:
        """Remove ``step``: its manifest object first (the step vanishes), then the data objects."""
        deadline = time.monotonic() + timeout
        bucket = self._bucket()
        manifest_key = self._key(step, mf.MANIFEST_NAME)
        with self._failing_as_storage_error(f"deleting {manifest_key}"), contextlib.suppress(api_exceptions.NotFound):
            bucket.blob(manifest_key).delete(**self._request_args(deadline))
        names = list(self._blobs(deadline, self._key(step) + "/"))

        def delete_one(name: str) -> None:
            with self._failing_as_storage_error(f"deleting {name}"), contextlib.suppress(api_exceptions.NotFound):
                bucket.blob(name).delete(**self._request_args(deadline))

        # transfer_manager has no deletes, and Bucket.delete_blobs deletes one object after another.
        self._parallel(delete_one, names)

    def withdraw(self, step: int, *, timeout: float) -> None:
        """Make committed ``step`` invisible (a damaged one): its manifest object is copied to
        ``manifest.json.unreadable`` and deleted; the data objects stay for a look."""
        deadline = time.monotonic() + timeout
        bucket = self._bucket()
        key = self._key(step, mf.MANIFEST_NAME)
        with self._failing_as_storage_error(f"withdrawing {key}"), contextlib.suppress(api_exceptions.NotFound):
            blob = bucket.blob(key)
            bucket.copy_blob(blob, bucket, key + ".unreadable", **self._request_args(deadline))
            blob.delete(**self._request_args(deadline))

    # --- reading -------------------------------------------------------------------------------------

    def _blobs(self, deadline: float, prefix: str) -> dict[str, Any]:
        """The objects under ``prefix``. Raises StorageError, also when the bucket does not exist."""
        try:
            with self._failing_as_storage_error(f"listing gs://{self.bucket_name}/{prefix}"):
                return {
                    b.name: b
                    for b in self.client.list_blobs(self.bucket_name, prefix=prefix, **self._request_args(deadline))
                }
        except api_exceptions.NotFound as exc:  # a listing finds no object missing: the bucket is
            raise StorageError(f"{self.name}: bucket gs://{self.bucket_name} does not exist") from exc

    def _read_manifest(self, step: int, deadline: float) -> Manifest:
        key = self._key(step, mf.MANIFEST_NAME)
        where = f"gs://{self.bucket_name}/{key}"
        try:
            with self._failing_as_storage_error(f"reading {where}"):
                data = self._bucket().blob(key).download_as_bytes(**self._request_args(deadline))
        except api_exceptions.NotFound as exc:
            raise SnapshotUnavailable(f"{where} does not exist: step {step} is not committed in GCS") from exc
        return mf.decode(data, where=where)

    def manifest(self, step: int, *, timeout: float = 60.0) -> Manifest:
        """The manifest of ``step``.

        Raises:
            SnapshotUnavailable: ``step`` is not committed in this bucket.
            StorageError: the bucket cannot be read.
        """
        return self._read_manifest(step, time.monotonic() + timeout)

    def steps(self, *, timeout: float) -> list[int]:
        """The committed steps, newest first."""
        return [info.step for info in self.list(timeout=timeout)]

    def list(self, *, timeout: float) -> list[CheckpointInfo]:
        """Committed steps (those with a manifest object), newest first."""
        deadline = time.monotonic() + timeout
        root = f"{self.prefix}/" if self.prefix else ""
        found = []
        for name in self._blobs(deadline, root):
            rest = name[len(root) :].split("/")
            if len(rest) != 2 or rest[1] != mf.MANIFEST_NAME:
                continue
            step = mf.parse_step_dirname(rest[0])
            if step is None:
                continue
            try:
                found.append(self._info(self._read_manifest(step, deadline)))
            except (CheckpointInvalid, SnapshotUnavailable):
                found.append(CheckpointInfo(self.name, step, self.location(step), -1, -1, 0.0, 0))
        return sorted(found, key=lambda info: info.step, reverse=True)

    def verify(self, step: int, *, timeout: float) -> CheckpointInfo:
        """Check every object of ``step`` against the manifest, by the size and CRC32C the server reports.

        Raises:
            CheckpointInvalid: an object is missing or differs; names its gs:// path.
            SnapshotUnavailable: ``step`` is not committed in GCS.
        """
        deadline = time.monotonic() + timeout
        manifest = self._read_manifest(step, deadline)
        blobs = self._blobs(deadline, self._key(step) + "/")
        for entry in manifest.files:
            key = self._key(step, entry.path)
            where = f"gs://{self.bucket_name}/{key}"
            blob = blobs.get(key)
            if blob is None:
                raise CheckpointInvalid(f"{where} is missing", path=where, reason="missing")
            if blob.size != entry.size:
                reason = f"size {blob.size}, manifest says {entry.size}"
                raise CheckpointInvalid(f"{where}: {reason} (truncated or overwritten)", path=where, reason=reason)
            crc = _crc_of(blob.crc32c)
            if crc is not None and crc != entry.crc32c:
                reason = f"crc32c {crc:08x}, manifest says {entry.crc32c:08x}"
                raise CheckpointInvalid(f"{where}: {reason} (altered bytes)", path=where, reason=reason)
        return self._info(manifest)

    def restore(self, step: int, like: PyTree = None, *, timeout: float) -> HostSnapshot:
        """Download ``step`` in parallel to a staging directory, verify every file, load it, remove the staging.

        Raises:
            CheckpointInvalid: a file is missing, short or altered (named by its gs:// path).
            SnapshotUnavailable: ``step`` is not committed, or holds another structure than ``like``.
            StorageError: GCS failed beyond the retries, or ``timeout`` passed.
        """
        started = time.monotonic()
        deadline = started + timeout
        manifest = self._read_manifest(step, deadline)
        staging = Path(tempfile.mkdtemp(prefix="gcs-restore-", dir=self.staging_dir))
        try:
            self._download_many(step, manifest.files, staging, deadline)
            try:
                tree = load_directory(staging, manifest, like, Deadline(deadline - time.monotonic(), "loading"))
            except CheckpointInvalid as exc:
                where = exc.path.replace(str(staging), self.location(step), 1)
                raise CheckpointInvalid(
                    str(exc).replace(str(staging), self.location(step)), path=where, reason=exc.reason
                ) from exc
            return snapshot_from(manifest, tree, time.monotonic() - started, where=self.location(step))
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest checkpoint in GCS that verifies (see :func:`elastic_runtime.storage.tier.latest_verified`)."""
        return latest_verified(self, like, timeout)

    def _info(self, manifest: Manifest) -> CheckpointInfo:
        return CheckpointInfo(
            tier=self.name,
            step=manifest.step,
            location=self.location(manifest.step),
            nbytes=manifest.nbytes,
            data_position=manifest.data_position,
            created=manifest.created,
            files=len(manifest.files),
        )


def _committed(response: Any) -> int:
    """The next offset to send after a 308: one past the end of the ``Range: bytes=0-N`` the server holds."""
    held = response.headers.get("Range")
    if not held:
        return 0
    return int(held.rsplit("-", 1)[1]) + 1


def _crc_of(encoded: str | None) -> int | None:
    """GCS reports CRC32C as base64 of the big-endian 4 bytes."""
    if not encoded:
        return None
    return int.from_bytes(base64.b64decode(encoded), "big")
