"""Splitting a byte stream into lines, sans-IO: the wire's framing (one JSON object a line) apart from any socket.

Bytes arrive in whatever pieces the kernel hands over: half a line, or several lines at once. ``LineBuffer``
keeps what is not a whole line yet and gives the whole ones back one at a time, each without its newline. A
line longer than the buffer's ``max_line`` is refused (:class:`LineTooLong`) as soon as that many bytes are
buffered without a newline, so a peer can make the buffer hold at most ``max_line`` bytes plus one read.
"""

from __future__ import annotations

__all__ = ["LineBuffer", "LineTooLong"]


class LineTooLong(ValueError):
    """A peer sent more than ``max_line`` bytes without a newline."""


class LineBuffer:
    """What a connection has received and not yet taken as lines.

    Args:
        max_line: the longest line accepted, newline not counted; may be changed between lines (the handshake's
            lines are shorter than the messages after it).
    """

    def __init__(self, max_line: int) -> None:
        self.max_line = max_line
        self._buffer = bytearray()
        self._scanned = 0  # bytes at the start of the buffer known to hold no newline

    def feed(self, data: bytes) -> None:
        """Add what arrived."""
        self._buffer += data

    def next_line(self) -> bytes | None:
        """The next whole line (without its newline), or None until more arrives.

        Raises:
            LineTooLong: the next line is longer than ``max_line``; the buffer is then of no further use.
        """
        end = self._buffer.find(b"\n", self._scanned)
        if end < 0:
            self._scanned = len(self._buffer)
            if self._scanned > self.max_line:
                raise LineTooLong(f"a line longer than {self.max_line} bytes")
            return None
        if end > self.max_line:
            raise LineTooLong(f"a line longer than {self.max_line} bytes")
        line = bytes(self._buffer[:end])
        del self._buffer[: end + 1]  # from the front of a bytearray: no copy of the rest
        self._scanned = 0
        return line

    def __len__(self) -> int:
        """Bytes held."""
        return len(self._buffer)
