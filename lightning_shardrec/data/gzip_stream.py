"""A gzip reader that releases decompressed bytes only once they can be trusted.

Deflate has no checksum until a member's end (CRC-32 + length trailer), so when a
``.gz`` is cut short and followed by other bytes, ``gzip.open`` decodes those bytes as
more deflate data and returns whatever they decode to (even a ``\\n`` that closes a
half line) before zlib notices the stream is broken. :class:`CheckedGzip` holds back
the output of the last :data:`HOLD_BYTES` compressed bytes until later input decodes
cleanly or the member's trailer checks; on an error the held output is dropped, so
only bytes decoded from before the corruption are ever returned (for corruption found
within ``HOLD_BYTES`` of where it starts: a cut followed by junk, a truncated file).
"""

from __future__ import annotations

import io
import zlib
from pathlib import Path

HOLD_BYTES = 1024  # compressed bytes fed per step; the output of the latest step is held back


class CheckedGzip(io.RawIOBase):
    """Raw stream of the decompressed bytes of a (multi-member) gzip file at ``path``.

    Raises ``EOFError`` if the file ends inside a member and ``zlib.error`` on corrupt
    data or anything but NUL padding after a member (as ``gzip`` does), after returning
    every byte decoded from input at least ``HOLD_BYTES`` before the point of failure.
    """

    def __init__(self, path: str | Path) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 (closed by close())
        self._inflate: zlib._Decompress | None = None  # the member being read, None between members
        self._members = 0
        self._pending = b""  # compressed bytes after a member's end, not yet fed
        self._held = b""  # output of the latest step: trusted once the next step decodes
        self._ready = bytearray()  # trusted output not yet returned
        self._done = False

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
        super().close()

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._ready and not self._done:
            self._step()
        n = min(len(buffer), len(self._ready))
        buffer[:n] = self._ready[:n]
        del self._ready[:n]
        return n

    def _step(self) -> None:
        """Feed the next ``HOLD_BYTES`` compressed bytes; release the previous step's output."""
        piece = self._pending or self._file.read(HOLD_BYTES)
        self._pending = b""
        if self._inflate is None:  # between members: NUL padding may follow a member
            rest = piece.lstrip(b"\0") if self._members else piece
            if not piece:
                self._done = True
                return
            if not rest:
                return
            self._inflate, piece = zlib.decompressobj(wbits=31), rest
        if not piece:
            self._held = b""
            raise EOFError("compressed file ended before the end-of-stream marker was reached")
        try:
            out = self._inflate.decompress(piece)
        except zlib.error:
            self._held = b""
            raise
        if self._inflate.eof:  # the trailer's CRC and length checked: the whole member is good
            self._ready += self._held + out
            self._held = b""
            self._pending = self._inflate.unused_data
            self._inflate = None
            self._members += 1
        else:
            self._ready += self._held
            self._held = out
