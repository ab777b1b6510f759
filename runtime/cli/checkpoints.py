"""``elastic-runtime checkpoints list|verify LOCATION``: inspect the checkpoints of a directory or GCS prefix.

``list`` shows the committed checkpoints (those with a manifest), newest first. ``verify`` checks every file of
every committed checkpoint (or of ``--step``) against its manifest's size and CRC32C and exits 1 naming each bad
file; for GCS it compares the sizes and CRC32Cs the server reports, and ``--deep`` downloads and re-hashes
every byte. Exit status 2 means the location could not be read at all.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_runtime.storage.tier import CheckpointTier


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "checkpoints", help="list and verify checkpoints in a directory or gs://bucket/prefix", description=__doc__
    )
    commands = parser.add_subparsers(dest="checkpoints_command", required=True, metavar="ACTION")
    listing = commands.add_parser("list", help="committed checkpoints, newest first")
    listing.add_argument("location", help="a checkpoint directory or gs://BUCKET[/PREFIX]")
    listing.add_argument("--json", action="store_true", help="one JSON object per checkpoint")
    listing.add_argument("--timeout", type=float, default=120.0, help="seconds (default %(default)s)")
    listing.set_defaults(func=list_command)
    verify = commands.add_parser("verify", help="check every file against its manifest; exit 1 if any is bad")
    verify.add_argument("location", help="a checkpoint directory or gs://BUCKET[/PREFIX]")
    verify.add_argument("--step", type=int, default=None, help="only this step")
    verify.add_argument("--deep", action="store_true", help="GCS: download and re-hash every byte")
    verify.add_argument("--timeout", type=float, default=600.0, help="seconds per checkpoint (default %(default)s)")
    verify.set_defaults(func=verify_command)
    return parser


def open_tier(location: str) -> CheckpointTier:
    """The tier that reads ``location``: GCS for ``gs://``, else a local directory.

    Raises:
        StorageError: a local ``location`` that is not a directory (nothing is created to look into it).
    """
    if location.startswith("gs://"):
        from elastic_runtime.storage.gcs import GcsTier

        return GcsTier(location)
    from elastic_runtime.core.errors import StorageError
    from elastic_runtime.storage.disk import DiskTier

    if not Path(location).is_dir():
        raise StorageError(f"{location}: no such directory")
    return DiskTier(location)


def list_command(args: argparse.Namespace) -> int:
    from elastic_runtime.core.errors import StorageError

    try:
        tier = open_tier(args.location)
        infos = tier.list(timeout=args.timeout)
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        for info in infos:
            print(json.dumps(info.__dict__))
        return 0
    if not infos:
        print(f"no committed checkpoints in {args.location}")
        return 0
    print(f"{'step':>10}  {'bytes':>14}  {'files':>5}  {'data_pos':>8}  {'committed (UTC)':<19}  location")
    for info in infos:
        when = datetime.datetime.fromtimestamp(info.created, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
        size = "unreadable" if info.nbytes < 0 else str(info.nbytes)
        print(f"{info.step:>10}  {size:>14}  {info.files:>5}  {info.data_position:>8}  {when:<19}  {info.location}")
    return 0


def verify_command(args: argparse.Namespace) -> int:
    from elastic_runtime.core.errors import CheckpointInvalid, SnapshotUnavailable, StorageError

    try:
        tier = open_tier(args.location)
        steps = [args.step] if args.step is not None else [i.step for i in tier.list(timeout=args.timeout)]
    except StorageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not steps:
        print(f"no committed checkpoints in {args.location}")
        return 1
    bad = 0
    for step in steps:
        try:
            if args.deep and args.location.startswith("gs://"):
                tier.restore(step, None, timeout=args.timeout)
                info = tier.verify(step, timeout=args.timeout)
            else:
                info = tier.verify(step, timeout=args.timeout)
        except CheckpointInvalid as exc:
            bad += 1
            print(f"BAD  step {step}: {exc.path}: {exc.reason}")
            continue
        except (SnapshotUnavailable, StorageError) as exc:
            bad += 1
            print(f"BAD  step {step}: {exc}")
            continue
        print(f"ok   step {step}: {info.files} files, {info.nbytes} bytes verified")
    if bad:
        print(f"{bad} of {len(steps)} checkpoints failed verification", file=sys.stderr)
        return 1
    return 0
