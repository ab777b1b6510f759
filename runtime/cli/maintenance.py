"""``elastic-runtime listen``: print maintenance notices as they arrive, to check a sink and subscription.

Runs the same listener and parsers as a training run, on a bare event bus, and prints every notice (and
every malformed message) as one line, or as one JSON object a line with ``--json``. By default it shows
notices for every instance; ``--instance`` narrows it as a run's ``instances`` setting would.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from typing import Any, TextIO

import anyio

__all__ = ["add_parser", "listen", "render"]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "listen",
        help="print GCP maintenance and preemption notices from a Pub/Sub subscription as they arrive",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--subscription", help="projects/P/subscriptions/S")
    parser.add_argument(
        "--metadata-host", help="also watch this metadata server (metadata.google.internal on a GCE or TPU VM)"
    )
    parser.add_argument("--json", action="store_true", help="one JSON event a line (the event log's format)")
    parser.add_argument(
        "--instance", action="append", default=[], help="only this instance (name, id or glob); repeatable"
    )
    parser.add_argument("--count", type=int, default=None, help="exit after this many events")
    parser.add_argument("--timeout", type=float, default=None, help="exit after this many seconds")
    parser.set_defaults(func=_main)
    return parser


def render(event: Any, *, as_json: bool) -> str:
    """One line for ``event``: its JSON encoding, or a short human-readable summary."""
    from elastic_runtime.core.eventlog import encode_event
    from elastic_runtime.core.events import MaintenanceScheduled, MalformedNotice, Notice

    if as_json:
        return encode_event(event).decode()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(event.wall_time))
    name = type(event).__name__
    if isinstance(event, MalformedNotice):
        return f"{stamp} {name} message={event.message_id} {event.reason}"
    assert isinstance(event, Notice)
    line = f"{stamp} {name} instance={event.instance} kind={event.kind or '-'} message={event.message_id}"
    if isinstance(event, MaintenanceScheduled):
        window = [
            "?" if t is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))
            for t in (event.window_start, event.window_end)
        ]
        line += f" window={window[0]}..{window[1]} can_reschedule={str(event.can_reschedule).lower()}"
    return line


async def listen(
    subscription: str | None,
    *,
    metadata_host: str | None = None,
    instances: tuple[str, ...] = (),
    as_json: bool = False,
    count: int | None = None,
    timeout: float | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Print notices until ``count`` were printed, ``timeout`` passed, or cancelled. Returns how many."""
    from elastic_runtime.core.bus import EventBus
    from elastic_runtime.core.events import MalformedNotice, Notice
    from elastic_runtime.maintenance.intake import NoticeIntake
    from elastic_runtime.maintenance.metadata import MetadataWatcher
    from elastic_runtime.maintenance.pubsub import PubSubListener
    from elastic_runtime.maintenance.source import BusContext

    bus = EventBus()
    ctx = BusContext(bus)
    intake = NoticeIntake(instances)
    printed = 0
    enough = anyio.Event()

    async def show(event: Any, _: Any) -> None:
        nonlocal printed
        print(render(event, as_json=as_json), file=out, flush=True)
        printed += 1
        if count is not None and printed >= count:
            enough.set()

    bus.subscribe(Notice, show)
    bus.subscribe(MalformedNotice, show)
    async with anyio.create_task_group() as tg:
        tg.start_soon(bus.run)
        if subscription:
            tg.start_soon(PubSubListener(subscription, intake).run, ctx)
        if metadata_host:
            tg.start_soon(MetadataWatcher(metadata_host, intake).run, ctx)
        with anyio.move_on_after(float("inf") if timeout is None else timeout):
            await enough.wait()
        tg.cancel_scope.cancel()
    await bus.close()
    return printed


def _main(args: argparse.Namespace) -> int:
    if not args.subscription and not args.metadata_host:
        print("elastic-runtime listen: name --subscription and/or --metadata-host", file=sys.stderr)
        return 2
    from elastic_runtime.core.config import check_subscription

    try:
        if args.subscription:
            check_subscription(args.subscription)
    except ValueError as exc:
        print(f"elastic-runtime listen: --{exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        anyio.run(
            lambda: listen(
                args.subscription,
                metadata_host=args.metadata_host,
                instances=tuple(args.instance),
                as_json=args.json,
                count=args.count,
                timeout=args.timeout,
            )
        )
    return 0
