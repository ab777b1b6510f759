"""The event log: every event the bus dispatched, one JSON object a line, in dispatch order.

The log is the ground truth of a run: tests assert on it and summaries are computed from it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, Union

import msgspec

from elastic_runtime.core.errors import EventLogError
from elastic_runtime.core.events import Event, event_types

_encoder = msgspec.json.Encoder()


@functools.cache
def _decoder(types: tuple[type[Event], ...]) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(Union[types])  # noqa: UP007 - a runtime-built union needs Union[...]


def encode_event(event: Event) -> bytes:
    """Encode one event as JSON (the tag ``type`` names its class)."""
    return _encoder.encode(event)


def decode_event(line: bytes | str) -> Event:
    """Decode one JSON event. Raises ``msgspec.ValidationError`` or ``msgspec.DecodeError`` on bad input."""
    event: Event = _decoder(event_types()).decode(line)
    return event


class EventLog:
    """Appends events to a JSON-lines file.

    Lines are buffered and written out by :meth:`flush`, which the bus calls whenever its queue runs empty:
    a crash loses at most the burst being dispatched, and a burst costs one write instead of one per event.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_torn_line(self.path)
        self._file: IO[bytes] | None = self.path.open("ab")

    def append(self, event: Event) -> None:
        if self._file is None:
            raise EventLogError(f"event log {self.path} is closed")
        self._file.write(_encoder.encode(event) + b"\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _drop_torn_line(path: Path) -> None:
    """A process killed mid-write (a controller's ``kill -9``) can leave half a line at the end of its log;
    a resumed run appends to the same log, so that half line goes, or it would sit mid-file, unreadable."""
    try:
        with path.open("r+b") as file:
            size = file.seek(0, os.SEEK_END)
            if size == 0:
                return
            file.seek(max(0, size - (1 << 20)))
            tail = file.read()
            if tail.endswith(b"\n"):
                return
            cut = tail.rfind(b"\n")
            file.truncate(size - len(tail) + cut + 1 if cut >= 0 else max(0, size - len(tail)))
    except FileNotFoundError:
        return


def iter_events(path: str | os.PathLike[str]) -> Iterator[Event]:
    """Yield the events of a log in order.

    Raises:
        EventLogError: a line is not a valid event; the message names the file and line number.
    """
    with Path(path).open("rb") as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                yield decode_event(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise EventLogError(f"{path}:{number}: not a valid event: {exc}") from exc


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """All events of a log, in order. Raises :class:`EventLogError` naming the first bad line."""
    return list(iter_events(path))
