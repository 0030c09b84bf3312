"""Zip CRC-32s for records whose bytes were written after torch's zip writer finished the archive.

A reserved record (:meth:`~lightning_shardrec.checkpoint.StreamedFile.reserve`) is written by
torch with CRC-32 0 and filled in place later. :class:`RunningCrc` follows its bytes as they are
written; :func:`crc_of_range` reads back, in bounded chunks, one whose bytes were not written in
order; :func:`patch_crcs` writes the values where a zip reader checks them. torch's writer
(miniz) sets general-purpose bit 3 on a stored record: its local header's CRC and sizes are 0 and
a data descriptor after the data carries them (32-bit sizes, or 64-bit under zip64), with the
central directory entry holding them again (CRC at byte 16). Layout: PKWARE APPNOTE 4.3.7-4.3.12.
:func:`record_offsets` finds where a record's data starts (what torch's private
``PyTorchFileReader.get_record_offset`` would say) from the same headers.

This touches no torch internal: it edits the zip format, which is specified and stable. It is kept,
rather than a public route, because every public way to produce the file (``torch.save``, DCP's
``dcp_to_torch_save``) holds the whole checkpoint in memory, the peak the streamed save avoids.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import BinaryIO

from lightning_shardrec.errors import CheckpointError

CHUNK_BYTES = 8 << 20  #: bytes read back at a time by :func:`crc_of_range`

_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_LOCAL_SIG, _CENTRAL_SIG, _DESCRIPTOR_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory entry, 46 bytes
_DESCRIPTOR_FLAG = 0x08  # general-purpose bit 3: CRC and sizes follow the data
_UTF8_FLAG = 0x800


class RunningCrc:
    """CRC-32 of a record's ``nbytes`` bytes, followed as they are written in file order.

    :meth:`update` with each write; :attr:`value` is the record's CRC-32 once every byte was
    written exactly once from the first on, else None (read the record back instead).
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._next = 0  # the first byte not yet written in order; -1 once a write broke the order
        self._crc = 0

    def update(self, first: int, data: memoryview) -> None:
        """Bytes ``[first, first + len(data))`` of the record were written as ``data``."""
        if first == self._next:
            self._crc = zlib.crc32(data, self._crc)
            self._next += data.nbytes
        else:
            self._next = -1

    @property
    def value(self) -> int | None:
        return self._crc if self._next == self.nbytes else None


def crc_of_range(fd: int, offset: int, nbytes: int, chunk: int | None = None) -> int:
    """CRC-32 of the file's bytes ``[offset, offset + nbytes)``, read ``chunk`` (:data:`CHUNK_BYTES`) bytes at a
    time into one buffer."""
    chunk = chunk or CHUNK_BYTES
    buffer = bytearray(min(chunk, nbytes))
    view, crc, done = memoryview(buffer), 0, 0
    while done < nbytes:
        got = os.preadv(fd, [view[: min(chunk, nbytes - done)]], offset + done)
        if got <= 0:
            raise CheckpointError(f"reading back bytes [{offset + done}, {offset + nbytes}): the file ends early")
        crc = zlib.crc32(view[:got], crc)
        done += got
    return crc


def _encoded(info: zipfile.ZipInfo) -> bytes:
    return info.orig_filename.encode("utf-8" if info.flag_bits & _UTF8_FLAG else "cp437")


def _central_offsets(f: zipfile.ZipFile, raw: bytes) -> dict[str, int]:
    """Offset in the file of every record's central directory entry, walked from the directory's start."""
    found, at = {}, 0
    for info in f.infolist():  # zipfile lists the entries in directory order
        head = _CENTRAL.unpack_from(raw, at)
        name = raw[at + _CENTRAL.size : at + _CENTRAL.size + head[10]]
        if head[0] != _CENTRAL_SIG or name != _encoded(info):
            raise CheckpointError(f"zip central directory: no entry for {info.orig_filename!r} at byte {at}")
        found[info.filename] = f.start_dir + at  # type: ignore[attr-defined]
        at += _CENTRAL.size + head[10] + head[11] + head[12]
    return found


def _crc_field(fh: BinaryIO, info: zipfile.ZipInfo) -> int:
    """Offset of the record's other CRC-32 field: in its data descriptor, or in its local header if it has none."""
    fh.seek(info.header_offset)
    fields = _LOCAL.unpack(fh.read(_LOCAL.size))
    if fields[0] != _LOCAL_SIG or fh.read(fields[9]) != _encoded(info):
        raise CheckpointError(f"zip record {info.orig_filename!r}: no local header at byte {info.header_offset}")
    if not fields[2] & _DESCRIPTOR_FLAG:
        return info.header_offset + 14
    end = info.header_offset + _LOCAL.size + fields[9] + fields[10] + info.compress_size
    fh.seek(end)
    tail = fh.read(24)
    start = 4 if tail[:4] == struct.pack("<I", _DESCRIPTOR_SIG) else 0  # the signature is optional
    size = info.compress_size
    small = size <= 0xFFFFFFFF and tail[start + 4 : start + 12] == struct.pack("<II", size, size)
    if not small and tail[start + 4 : start + 20] != struct.pack("<QQ", size, size):  # zip64: 64-bit sizes
        raise CheckpointError(f"zip record {info.orig_filename!r}: no data descriptor of {size} bytes at byte {end}")
    return end + start


def record_offsets(path: Path, names: list[str]) -> dict[str, int]:
    """Where the data of each record ``names`` (inside the archive, e.g. ``data/0``) starts in the zip at ``path``:
    after its local header, name and extra field (torch pads the extra field to align the data)."""
    out: dict[str, int] = {}
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as f:
        by_name = {info.filename.split("/", 1)[-1]: info for info in f.infolist()}  # without the archive's folder
        missing = sorted(set(names) - set(by_name))
        if missing:
            raise CheckpointError(f"zip archive {path}: no record {missing}")
        for name in names:
            info = by_name[name]
            fh.seek(info.header_offset)
            fields = _LOCAL.unpack(fh.read(_LOCAL.size))
            if fields[0] != _LOCAL_SIG:
                raise CheckpointError(
                    f"zip record {info.orig_filename!r}: no local header at byte {info.header_offset}"
                )
            out[name] = info.header_offset + _LOCAL.size + fields[9] + fields[10]
    return out


def patch_crcs(path: Path, crcs: Mapping[str, int]) -> None:
    """Write ``crcs`` (record name inside the archive, e.g. ``data/0``, to CRC-32) into the finished zip at ``path``.

    Each record's CRC goes into its central directory entry and into its data descriptor (or its
    local header, for a record written without one). Every place is checked (signature, name,
    sizes) before anything is written; a mismatch raises :class:`CheckpointError`.
    """
    if not crcs:
        return
    at: list[tuple[int, int]] = []  # (file offset, crc)
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as f:
        by_name = {info.filename.split("/", 1)[-1]: info for info in f.infolist()}  # without the archive's folder
        missing = sorted(set(crcs) - set(by_name))
        if missing:
            raise CheckpointError(f"zip archive {path}: no record {missing} to write the CRC-32 of")
        fh.seek(f.start_dir)  # type: ignore[attr-defined]
        central = _central_offsets(f, fh.read())  # the directory and the end records: ~100 bytes a record
        for name, crc in crcs.items():
            info = by_name[name]
            at += [(_crc_field(fh, info), crc), (central[info.filename] + 16, crc)]
    fd = os.open(path, os.O_WRONLY)
    try:
        for offset, crc in at:
            os.pwrite(fd, struct.pack("<I", crc), offset)
    finally:
        os.close(fd)
