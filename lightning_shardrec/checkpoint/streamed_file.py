"""A ``torch.save`` file written one tensor at a time, so a big checkpoint never sits whole in memory.

``torch.save(obj)`` needs every tensor of ``obj`` alive until the file is written. A
:class:`StreamedFile` writes each big tensor's bytes the moment it is :meth:`~StreamedFile.put`
(the caller frees it right after) and keeps a :class:`Stored` stand-in of a few bytes; the
object itself (stand-ins, ordinary tensors, anything else ``torch.save`` takes) is pickled last,
in :meth:`~StreamedFile.close`. A tensor too big to hold whole gets its room in the archive
instead (:meth:`~StreamedFile.reserve`, no bytes), filled piece by piece once the archive is
closed (:meth:`~StreamedFile.fill`); :meth:`~StreamedFile.write_crcs` then writes their zip CRC-32s
(followed as the pieces are written, :mod:`~lightning_shardrec.checkpoint.zip_crc`), so the file
is an ordinary zip archive that ``unzip -t`` passes. The archive is torch's own (``torch.serialization``'s zip
writer, the same records and pickle as ``torch.save``), so ``torch.load`` (``weights_only``,
``mmap``) and ``LightningModule.load_from_checkpoint`` read it unchanged.

No public torch API does this: ``torch.save`` needs the whole object in memory, and DCP's
``format_utils.dcp_to_torch_save`` loads the whole checkpoint before it writes (the peak this file
exists to avoid). So torch's zip writer, its reserved records and the pickle's rebuild function come
through :mod:`lightning_shardrec._compat.torch`; a record's offset is read with :mod:`zipfile`.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import uuid
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_shardrec._compat import torch as compat
from lightning_shardrec.checkpoint.atomic import clean_stale, commit, remove_path, staging_path
from lightning_shardrec.checkpoint.zip_crc import RunningCrc, crc_of_range, patch_crcs, record_offsets

_PROTOCOL = 2  # torch.save's default pickle protocol
_CHUNK = 1 << 20  # bytes :meth:`StreamedFile.fill` writes, then sums into the CRC-32, at a time


class _StorageRef:
    """A storage already in the archive (record ``data/<key>``): pickled as torch's persistent id."""

    def __init__(self, key: str, dtype: torch.dtype, numel: int) -> None:
        self.key, self.dtype, self.numel = key, dtype, numel


class Stored:
    """Stand-in for a contiguous CPU tensor whose bytes are already written; loads as that tensor."""

    def __init__(self, key: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.ref = _StorageRef(key, dtype, _numel(shape))
        self.shape = shape

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        stride = torch.empty(self.shape, device="meta").stride()
        args: tuple[Any, ...] = (self.ref, 0, self.shape, stride, False, OrderedDict())
        return (compat.rebuild_tensor_v2(), args)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _storage_alignment() -> int:
    """The alignment ``torch.save`` pads records to (``torch.utils.serialization.config``; 64 before it existed)."""
    try:
        config = importlib.import_module("torch.utils.serialization").config
    except (ImportError, AttributeError):
        return 64
    return int(getattr(getattr(config, "save", None), "storage_alignment", 64))


class StreamedFile:
    """Write tensors into a ``torch.save`` archive as they come (:meth:`put`), the object last (:meth:`close`)."""

    def __init__(self, path: Path) -> None:
        self.name = str(path)  # the file being written (the zip writer owns it)
        self._opener = compat.open_zipfile_writer(self.name)
        self._open = True
        self._zip = self._opener.file_like
        self._count = 0  # records written
        self._keys: dict[object, str] = {}  # while pickling: storage -> record key (a shared storage is written once)
        self._reserved: dict[str, Stored] = {}  # record key -> stand-in, for reserve() / fill()
        self._offsets: dict[str, int] = {}  # record key -> its data's offset in the file (once closed)
        self._fd: int | None = None  # for fill()
        self._crcs: dict[str, RunningCrc] | None = {} if torch.serialization.get_crc32_options() else None

    def _write(self, storage: torch.UntypedStorage) -> str:
        key = str(self._count)
        self._count += 1
        if storage.device.type != "cpu":
            storage = storage.cpu()
        self._zip.write_record(f"data/{key}", storage, storage.nbytes())
        return key

    def put(self, t: Tensor) -> Stored:
        """Write ``t``'s values now; the returned stand-in takes its place in the object given to :meth:`close`."""
        t = t.detach().cpu().contiguous()
        if t.untyped_storage().nbytes() != t.numel() * t.element_size() or t.storage_offset():
            t = t.clone()  # a view: write its elements only
        key = self._write(t.untyped_storage())
        return Stored(key, t.dtype, tuple(t.shape))

    def reserve(self, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Stored:
        """Room for a tensor of ``shape`` whose values :meth:`fill` writes after :meth:`close`, in pieces.

        torch's writer writes a record from one buffer; a reserved record (``write_record_metadata``,
        what ``torch.serialization.skip_data`` saves with) takes its bytes later, so the tensor
        never needs to be whole in memory. Its zip CRC-32 is written by :meth:`write_crcs`
        (left 0 under ``torch.serialization.set_crc32_options(False)``, like torch's own records).
        """
        key = str(self._count)
        self._count += 1
        stored = Stored(key, dtype, shape)
        nbytes = stored.ref.numel * _itemsize(dtype)
        compat.reserve_record(self._zip, f"data/{key}", nbytes)
        self._reserved[key] = stored
        if self._crcs is not None:
            self._crcs[key] = RunningCrc(nbytes)
        return stored

    def fill(self, stored: Stored, first: int, values: Tensor) -> None:
        """Write ``values`` (flattened) as elements ``[first, first + values.numel())`` of a reserved tensor.

        Filled in order (each piece starting where the last ended), a record's CRC-32 is computed
        on the way; otherwise :meth:`write_crcs` reads it back.
        """
        if self._open:
            raise RuntimeError("StreamedFile.fill: the archive is still open; fill after close()")
        if self._reserved.get(stored.ref.key) is not stored:
            raise ValueError(f"StreamedFile.fill: record data/{stored.ref.key} was not reserved in this file")
        numel = stored.ref.numel
        if values.dtype != stored.ref.dtype or not 0 <= first <= first + values.numel() <= numel:
            raise ValueError(
                f"StreamedFile.fill: elements [{first}, {first + values.numel()}) of {values.dtype} do not fit "
                f"record data/{stored.ref.key} ({numel} elements of {stored.ref.dtype})"
            )
        fd = self._open_for_fill()
        raw = values.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        view, start = raw.data, first * _itemsize(values.dtype)
        running = None if self._crcs is None else self._crcs[stored.ref.key]
        at = self._offsets[stored.ref.key] + start
        while view:  # a chunk at a time: its CRC-32 read from the cache the write just filled
            written = os.pwrite(fd, view[:_CHUNK], at)
            if running is not None:
                running.update(start, view[:written])
            view, at, start = view[written:], at + written, start + written

    def write_crcs(self) -> None:
        """Write every reserved record's zip CRC-32 into the closed archive (after the last :meth:`fill`).

        A record filled in order has its CRC already; one filled out of order, or not wholly, is
        read back from the file in chunks of :data:`~lightning_shardrec.checkpoint.zip_crc.CHUNK_BYTES`.
        """
        if self._open:
            raise RuntimeError("StreamedFile.write_crcs: the archive is still open; write the CRCs after close()")
        if not self._crcs:
            return
        fd = self._open_for_fill()
        crcs = {}
        for key, running in self._crcs.items():
            crc = running.value
            crcs[f"data/{key}"] = crc_of_range(fd, self._offsets[key], running.nbytes) if crc is None else crc
        patch_crcs(Path(self.name), crcs)

    def _open_for_fill(self) -> int:
        """The closed archive, opened for :meth:`fill` and :meth:`write_crcs`, each reserved record's offset read."""
        if self._fd is None:
            offsets = record_offsets(Path(self.name), [f"data/{k}" for k in self._reserved])
            self._offsets = {k: offsets[f"data/{k}"] for k in self._reserved}
            self._fd = os.open(self.name, os.O_RDWR)
        return self._fd

    def _persistent_id(self, obj: Any) -> tuple[Any, ...] | None:
        if isinstance(obj, _StorageRef):
            return ("storage", compat.storage_type(obj.dtype), obj.key, "cpu", obj.numel)
        if not (isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)):
            return None
        if isinstance(obj, torch.storage.TypedStorage):  # what ordinary tensors reduce to, as in torch.save
            storage, kind, numel = compat.typed_storage_parts(obj)
        else:
            storage, kind, numel = obj, torch.UntypedStorage, obj.nbytes()
        location = torch.serialization.location_tag(storage)
        identity = compat.storage_key(storage)
        key = self._keys.get(identity)
        if key is None:
            key = self._keys[identity] = self._write(storage)
        return ("storage", kind, key, location, numel)

    def close(self, obj: Any) -> None:
        """Pickle ``obj`` (its ordinary tensors written as met) and finish the archive."""
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=_PROTOCOL)
        pickler.persistent_id = self._persistent_id  # type: ignore[method-assign]
        pickler.dump(obj)
        data = buffer.getvalue()
        self._zip.write_record("data.pkl", data, len(data))
        self._zip.write_record(".format_version", "1", 1)
        alignment = str(_storage_alignment())
        self._zip.write_record(".storage_alignment", alignment, len(alignment))
        self._zip.write_record("byteorder", sys.byteorder, len(sys.byteorder))
        self.finish()

    def finish(self) -> None:
        """Close the archive (after :meth:`close`, or to give up on a failed write; idempotent)."""
        if self._open:
            self._open = False
            self._opener.__exit__(None, None, None)

    def release(self) -> None:
        """Close what :meth:`fill` opened (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def save_streamed(
    path: Path, write: Callable[[StreamedFile], Any], fill: Callable[[StreamedFile], None] | None = None
) -> None:
    """``write(file)`` puts (or reserves) the big tensors and returns the object; ``fill(file)`` then fills
    the reserved ones; their zip CRC-32s are written; the file is flushed, then swapped in.

    The staging file beside ``path`` is removed on any failure, leaving ``path`` untouched.
    """
    staging = staging_path(path, uuid.uuid4().hex[:12])
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(path, keep=staging)
    try:
        stream = StreamedFile(staging)
        try:
            stream.close(write(stream))
            if fill is not None:
                fill(stream)
            stream.write_crcs()
        finally:
            stream.finish()
            stream.release()
        fd = os.open(staging, os.O_RDONLY)
        try:
            os.fsync(fd)  # on disk before the swap
        finally:
            os.close(fd)
        commit(staging, path)
    finally:
        remove_path(staging)
