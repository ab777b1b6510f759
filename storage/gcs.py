"""The GCS tier: committed disk checkpoints copied to a bucket, for the loss of the whole machine.

Layout mirrors the disk tier under a prefix: ``gs://BUCKET/PREFIX/step_0000000120/state/...`` and
``.../step_0000000120/manifest.json``. Upload: every data file first, in parallel (files above
``chunk_size`` go as resumable uploads), each checked against the manifest's CRC32C as the server computed
it; the manifest object last. A reader lists only steps whose manifest object exists, so an upload cut off at
any point (a killed process, a lost network) is invisible. GCS generation preconditions are not relied on.

Every request carries a timeout and is retried with tenacity on 429, 5xx, timeouts and broken connections,
with jittered exponential backoff, within the caller's deadline. Google Cloud errors are converted to
:class:`~runtime.core.errors.StorageError` and :class:`~runtime.core.errors.CheckpointInvalid` here, at the adapter.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import http.client
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import requests
from google.api_core import exceptions as api_exceptions
from google.cloud import storage
from google.cloud.storage.exceptions import DataCorruption, InvalidResponse
from tenacity import Retrying, retry_if_exception, stop_after_attempt, stop_after_delay, wait_exponential_jitter

from runtime.compat import cloud_storage as cloud_storage_compat
from runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError
from runtime.core.snapshot import HostSnapshot
from storage import manifest as mf
from storage.disk import Deadline, DiskTier, load_directory, read_manifest
from storage.manifest import FileEntry, Manifest
from storage.tier import CheckpointInfo, CorruptionListener, PyTree, latest_verified, snapshot_from

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
        staging_dir: where a restore downloads to before verifying and loading (default: the system temp dir).
        sleep: the backoff's sleep (tests inject one that does not wait).
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
        staging_dir: str | os.PathLike[str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.bucket_name, self.prefix = parse_gs_uri(uri)
        self.uri = f"gs://{self.bucket_name}/{self.prefix}".rstrip("/")
        self.name = name
        self.workers = max(1, workers)
        # Resumable uploads go in multiples of 256 KiB.
        self.chunk_size = max(256 << 10, chunk_size // (256 << 10) * (256 << 10))
        self.request_timeout_s = request_timeout_s
        self.max_attempts = max(1, max_attempts)
        self.staging_dir = staging_dir
        self.corruption_listeners: list[CorruptionListener] = []
        self._sleep = sleep
        self._client = client
        self.retries = 0  # requests repeated after a retryable error, for tests and logs

    # --- plumbing ------------------------------------------------------------------------------------

    @property
    def client(self) -> storage.Client:
        if self._client is None:
            self._client = make_client()
        return self._client

    def _bucket(self) -> storage.Bucket:
        return self.client.bucket(self.bucket_name)

    def _key(self, step: int, rel: str = "") -> str:
        parts = [p for p in (self.prefix, mf.step_dirname(step), rel) if p]
        return "/".join(parts)

    def location(self, step: int) -> str:
        return f"gs://{self.bucket_name}/{self._key(step)}"

    def _timeout(self, deadline: float) -> tuple[float, float]:
        left = max(deadline - time.monotonic(), 0.1)
        read = min(self.request_timeout_s, left)
        return (min(10.0, read), read)

    def _call(self, what: str, deadline: float, fn: Callable[[], T]) -> T:
        """Run one request with retries inside ``deadline``. Raises StorageError; NotFound passes through."""

        def before_sleep(state: Any) -> None:
            self.retries += 1
            exc = state.outcome.exception() if state.outcome else None
            log.info("%s: retrying %s after %s: %s", self.name, what, type(exc).__name__, exc)

        retrying = Retrying(
            retry=retry_if_exception(is_retryable),
            stop=stop_after_attempt(self.max_attempts) | stop_after_delay(max(deadline - time.monotonic(), 0)),
            wait=wait_exponential_jitter(multiplier=0.1, max=4.0),
            sleep=self._sleep,
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(fn)
        except api_exceptions.NotFound:
            raise
        except (CheckpointInvalid, StorageError):
            raise
        except Exception as exc:
            raise StorageError(f"{self.name}: {what} failed: {type(exc).__name__}: {exc}") from exc

    def _parallel(self, jobs: list[Callable[[], None]]) -> None:
        if not jobs:
            return
        with ThreadPoolExecutor(max_workers=min(self.workers, len(jobs)), thread_name_prefix="gcs") as pool:
            futures = [pool.submit(job) for job in jobs]
            errors = []
            for future in futures:
                try:
                    future.result()
                except Exception as exc:
                    errors.append(exc)
            if errors:
                raise errors[0]

    # --- writing -------------------------------------------------------------------------------------

    def upload(self, directory: str | os.PathLike[str], *, timeout: float) -> CheckpointInfo:
        """Copy a committed local checkpoint directory (one the disk tier wrote) to GCS and commit it there.

        Raises:
            SnapshotUnavailable: ``directory`` is not a committed checkpoint.
            CheckpointInvalid: a local file no longer matches its manifest (it is not uploaded).
            StorageError: GCS failed beyond the retries, or ``timeout`` passed; nothing becomes visible.
        """
        started = time.monotonic()
        deadline = started + timeout
        directory = Path(directory)
        manifest = read_manifest(directory)
        bucket = self._bucket()

        def upload_one(entry: FileEntry) -> None:
            local = directory / entry.path
            key = self._key(manifest.step, entry.path)
            if entry.size > self.chunk_size:
                crc = self._upload_resumable(bucket, key, local, entry.size, deadline)
            else:

                def attempt() -> int | None:
                    blob = bucket.blob(key)
                    blob.upload_from_filename(
                        str(local), timeout=self._timeout(deadline), retry=None, checksum="crc32c"
                    )
                    return _crc_of(blob.crc32c)

                crc = self._call(f"uploading {local}", deadline, attempt)
            # The server's CRC32C of what it stored must be the one the manifest promises.
            if crc is not None and crc != entry.crc32c:
                reason = f"crc32c {crc:08x} after upload, manifest says {entry.crc32c:08x}"
                raise CheckpointInvalid(
                    f"{local} -> gs://{self.bucket_name}/{key}: {reason}", path=str(local), reason=reason
                )

        self._parallel([functools.partial(upload_one, entry) for entry in manifest.files])
        manifest_bytes = (directory / mf.MANIFEST_NAME).read_bytes()
        manifest_key = self._key(manifest.step, mf.MANIFEST_NAME)
        # Last: until this object exists, no reader sees the step.
        self._call(
            f"committing {manifest_key}",
            deadline,
            lambda: bucket.blob(manifest_key).upload_from_string(
                manifest_bytes, content_type="application/json", timeout=self._timeout(deadline), retry=None
            ),
        )
        return self._info(manifest)

    def _upload_resumable(
        self, bucket: storage.Bucket, key: str, local: Path, size: int, deadline: float
    ) -> int | None:
        """Upload a large file in ``chunk_size`` pieces over one resumable session; returns the server's CRC32C.

        A failed piece does not restart the file: the next attempt asks the server how much it holds
        (``Content-Range: bytes */SIZE``) and goes on from there, so a 30% fault rate still converges.
        """
        where = f"gs://{self.bucket_name}/{key}"
        blob = bucket.blob(key)
        session: str = self._call(
            f"starting a resumable upload of {where}",
            deadline,
            lambda: blob.create_resumable_upload_session(size=size, timeout=self._timeout(deadline), retry=None),
        )
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
            self._call(f"uploading {local} at byte {state['offset']}", deadline, attempt)
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

        def delete_manifest() -> None:
            with contextlib.suppress(api_exceptions.NotFound):
                bucket.blob(manifest_key).delete(timeout=self._timeout(deadline), retry=None)

        self._call(f"deleting {manifest_key}", deadline, delete_manifest)
        names = self._call(
            f"listing {self._key(step)}",
            deadline,
            lambda: [
                b.name
                for b in self.client.list_blobs(
                    self.bucket_name, prefix=self._key(step) + "/", timeout=self._timeout(deadline), retry=None
                )
            ],
        )

        def delete_one(name: str) -> None:
            def attempt() -> None:
                with contextlib.suppress(api_exceptions.NotFound):
                    bucket.blob(name).delete(timeout=self._timeout(deadline), retry=None)

            self._call(f"deleting {name}", deadline, attempt)

        self._parallel([functools.partial(delete_one, name) for name in names])

    # --- reading -------------------------------------------------------------------------------------

    def _blobs(self, deadline: float, prefix: str) -> dict[str, Any]:
        return self._call(
            f"listing gs://{self.bucket_name}/{prefix}",
            deadline,
            lambda: {
                b.name: b
                for b in self.client.list_blobs(
                    self.bucket_name, prefix=prefix, timeout=self._timeout(deadline), retry=None
                )
            },
        )

    def _read_manifest(self, step: int, deadline: float) -> Manifest:
        key = self._key(step, mf.MANIFEST_NAME)
        where = f"gs://{self.bucket_name}/{key}"
        try:
            data = self._call(
                f"reading {where}",
                deadline,
                lambda: self._bucket().blob(key).download_as_bytes(timeout=self._timeout(deadline), retry=None),
            )
        except api_exceptions.NotFound as exc:
            raise SnapshotUnavailable(f"{where} does not exist: step {step} is not committed in GCS") from exc
        return mf.decode(data, where=where)

    def manifest(self, step: int, *, timeout: float = 60.0) -> Manifest:
        return self._read_manifest(step, time.monotonic() + timeout)

    def steps(self, *, timeout: float) -> list[int]:
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
        bucket = self._bucket()
        try:

            def download_one(entry: FileEntry) -> None:
                key = self._key(step, entry.path)
                local = staging / entry.path
                local.parent.mkdir(parents=True, exist_ok=True)

                def attempt() -> None:
                    bucket.blob(key).download_to_filename(
                        str(local), timeout=self._timeout(deadline), retry=None, checksum="crc32c"
                    )

                try:
                    self._call(f"downloading gs://{self.bucket_name}/{key}", deadline, attempt)
                except api_exceptions.NotFound as exc:
                    where = f"gs://{self.bucket_name}/{key}"
                    raise CheckpointInvalid(f"{where} is missing", path=where, reason="missing") from exc

            self._parallel([functools.partial(download_one, entry) for entry in manifest.files])
            try:
                tree = load_directory(staging, manifest, like, Deadline(deadline - time.monotonic(), "loading"))
            except CheckpointInvalid as exc:
                where = exc.path.replace(str(staging), self.location(step), 1)
                raise CheckpointInvalid(
                    str(exc).replace(str(staging), self.location(step)), path=where, reason=exc.reason
                ) from exc
            return snapshot_from(manifest, tree, time.monotonic() - started)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def latest(self, like: PyTree = None, timeout: float | None = 30.0) -> HostSnapshot:
        """The newest checkpoint in GCS that verifies (see :func:`storage.tier.latest_verified`)."""
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
