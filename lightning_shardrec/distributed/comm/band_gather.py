"""Full tensors put together from every rank's pieces, on one rank, in bands of rows, by tensor collectives.

Every place that gathers whole tables (the full-format checkpoint, ``full_state_dict()``,
export through them) goes through :class:`BandGather`:

1. **describe** (two collectives of small int64 tensors, no pickles): every rank encodes the
   full tensors it knows (a name, a group index that orders them, the full shape and dtype)
   and where its pieces lie in them (offsets and shape); the lengths are gathered first, then
   the padded descriptions, on rank ``dst`` only (``dst=None``: on every rank);
2. **bands**: each full tensor's rows go in bands of at most ``band_bytes``; for each band
   every rank posts non-blocking sends of the rows of its pieces that fall in it (slices of the
   pieces where they lie: nothing is copied on the host) and rank ``dst`` posts the matching
   receives straight into the band (a staging tensor per piece only where the target is not
   contiguous: a column-split table, or pieces that overlap, like a step counter every rank
   holds), then waits for them all. The band buffer is reused: rank ``dst`` holds one band at a
   time, the others hold nothing beyond their own shards. With ``dst=None`` rank 0 gathers each
   band and broadcasts it, so every rank holds one band at a time too.

Pieces overlapping each other are applied in rank order (the last rank's wins), as a copy loop
over ranks would. Under a backend that takes CUDA tensors (NCCL) pieces travel from the GPU and
bands are copied to the host; full tensors always end up in host memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import backend_uses_cuda

BAND_BYTES = 64 * 2**20  #: the default band: at most this many bytes of rows travel and are held at once

_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_HEADER, _ROW = 3, 7  # [entries, pieces, name bytes]; one int64 row per entry and per piece


@dataclass(frozen=True, kw_only=True)
class LocalTensor:
    """A full tensor as one rank knows it: its name, where it goes in the order, and this rank's pieces.

    ``shape`` is the full shape (1-D or 2-D), ``dtype`` the full tensor's; ``pieces`` are
    ``((first row, first column), tensor)``, each tensor 1-D or 2-D (a 1-D piece fills rows of
    column 0 onwards of a 1-D full tensor).
    """

    group: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: Sequence[tuple[tuple[int, int], Tensor]]


@dataclass(frozen=True, kw_only=True)
class Piece:
    """One rank's piece of a full tensor, as the gathering rank learns it from the description."""

    rank: int
    offsets: tuple[int, int]
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A full tensor as the gathering rank knows it: every rank's pieces of it, in rank order."""

    group: int
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]


def _row_numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape[1:]:
        n *= s
    return n


def band_rows(shape: tuple[int, ...], dtype: torch.dtype, band_bytes: int) -> list[tuple[int, int]]:
    """A full tensor's rows ``[a, b)`` in bands of at most ``band_bytes`` (one row at least)."""
    size = torch.empty((), dtype=dtype).element_size()
    step = max(1, band_bytes // (size * max(1, _row_numel(shape))))
    return [(a, min(a + step, shape[0])) for a in range(0, shape[0], step)]


def _overlap(band: tuple[int, int], first_row: int, rows: int) -> tuple[int, int] | None:
    """The rows of a piece starting at ``first_row`` that fall in ``band``, counted from the piece's first row."""
    lo, hi = max(band[0], first_row), min(band[1], first_row + rows)
    return (lo - first_row, hi - first_row) if lo < hi else None


def _region(full: Tensor, offsets: tuple[int, int], shape: tuple[int, ...]) -> Tensor:
    r0, c0 = offsets
    if len(shape) == 1:
        return full[r0 : r0 + shape[0]]
    return full[r0 : r0 + shape[0], c0 : c0 + shape[1]]


def _encode(local: Sequence[LocalTensor], device: torch.device) -> Tensor:
    entries, pieces, names = [], [], bytearray()
    for i, t in enumerate(local):
        name = t.name.encode()
        s = (*t.shape, 1, 1)
        entries.append([t.group, len(names), len(name), len(t.shape), s[0], s[1], _DTYPES.index(t.dtype)])
        names += name
        for (r0, c0), p in t.pieces:
            ps = (*p.shape, 1, 1)
            pieces.append([i, r0, c0, p.dim(), ps[0], ps[1], _DTYPES.index(p.dtype)])
    flat = [len(entries), len(pieces), len(names)] + [v for row in entries + pieces for v in row] + list(names)
    return torch.tensor(flat, dtype=torch.int64, device=device)


def _decode(rank: int, flat: list[int], merged: dict[tuple[int, str], Layout]) -> None:
    """Add one rank's description to ``merged``; the full dtype is the first declaration of a rank with pieces."""
    n_entries, n_pieces, _ = flat[:_HEADER]
    rows = [flat[_HEADER + _ROW * i : _HEADER + _ROW * (i + 1)] for i in range(n_entries + n_pieces)]
    text = bytes(flat[_HEADER + _ROW * (n_entries + n_pieces) :])
    keys, declared = [], []
    for group, start, length, ndim, s0, s1, code in rows[:n_entries]:
        key = (group, text[start : start + length].decode())
        keys.append(key)
        declared.append(_DTYPES[code])
        if key not in merged:
            merged[key] = Layout(group=group, name=key[1], shape=(s0, s1)[:ndim], dtype=_DTYPES[code], pieces=())
    for entry, r0, c0, ndim, p0, p1, code in rows[n_entries:]:
        old = merged[keys[entry]]
        piece = Piece(rank=rank, offsets=(r0, c0), shape=(p0, p1)[:ndim], dtype=_DTYPES[code])
        dtype = old.dtype if old.pieces else declared[entry]
        merged[keys[entry]] = Layout(
            group=old.group, name=old.name, shape=old.shape, dtype=dtype, pieces=(*old.pieces, piece)
        )


class BandGather:
    """Collective: full tensors from every rank's pieces, on rank ``dst`` (``None``: every rank), band by band.

    Constructing it exchanges the descriptions (see the module docstring); rank ``dst`` then
    knows :attr:`layouts`, every full tensor in ``(group, name)`` order (``[]`` on the other
    ranks). :meth:`bands` and :meth:`whole` are collective: every rank exhausts one of them.

    Args:
        local: this rank's full tensors and pieces (a full tensor no rank lists does not exist).
        dst: the gathering rank, in ``group``; None: every rank.
        group: the process group (default: the world).
        band_bytes: the most bytes of one band (default :data:`BAND_BYTES`).
    """

    def __init__(
        self,
        local: Sequence[LocalTensor],
        dst: int | None,
        group: dist.ProcessGroup | None = None,
        band_bytes: int | None = None,
    ) -> None:
        self.group, self.dst = group, dst
        self.band_bytes = BAND_BYTES if band_bytes is None else band_bytes
        self.distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.root = 0 if dst is None else dst  # who receives the pieces
        uses_cuda = self.distributed and backend_uses_cuda(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda else torch.device("cpu")
        self._local = sorted(local, key=lambda t: (t.group, t.name))
        self.layouts: list[Layout] = self._describe()  # collective; [] off the receiving rank(s)

    def _global(self, rank: int) -> int:
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank

    def _describe(self) -> list[Layout]:
        """Every rank's description on the receiving rank(s): the lengths, then the descriptions themselves."""
        mine = _encode(self._local, self.device)
        if not self.distributed:
            described = [mine.tolist()]
        elif self.dst is None:  # all-gather: the lengths, then the descriptions padded to the longest
            sizes = [torch.empty(1, dtype=torch.int64, device=self.device) for _ in range(self.world)]
            dist.all_gather(sizes, torch.tensor([mine.numel()], device=self.device), group=self.group)
            lengths = [int(s) for s in sizes]
            padded = torch.zeros(max(lengths), dtype=torch.int64, device=self.device)
            padded[: mine.numel()] = mine
            every = [torch.empty_like(padded) for _ in range(self.world)]
            dist.all_gather(every, padded, group=self.group)
            described = [t[:n].tolist() for t, n in zip(every, lengths, strict=True)]
        else:  # gather the lengths on dst, then each description travels to dst as it is
            size = torch.tensor([mine.numel()], dtype=torch.int64, device=self.device)
            root = self.rank == self.root
            counts = [torch.empty_like(size) for _ in range(self.world)] if root else None
            dist.gather(size, counts, dst=self._global(self.root), group=self.group)
            if not root:
                dist.send(mine, self._global(self.root), group=self.group)
                return []
            every = [
                mine if r == self.rank else torch.empty(int(n), dtype=torch.int64, device=self.device)
                for r, n in enumerate(counts or [])
            ]
            _wait_all([dist.irecv(t, self._global(r), group=self.group) for r, t in enumerate(every) if r != self.rank])
            described = [t.tolist() for t in every]
        merged: dict[tuple[int, str], Layout] = {}
        for rank, flat in enumerate(described):
            _decode(rank, flat, merged)
        return [merged[k] for k in sorted(merged)]

    # --- the values ---------------------------------------------------------------------------
    def bands(self) -> Iterator[tuple[int, int, Tensor]]:
        """Collective: ``(index into layouts, first element, rows)``, each band at most ``band_bytes``, in order.

        On rank ``dst`` (every rank with ``dst=None``) each band is a view into one reused buffer:
        use (write, copy) each before asking for the next. Other ranks send their rows and yield
        nothing. Every rank must exhaust the iterator.
        """
        mine = {(t.group, t.name): t for t in self._local}
        if self.dst is not None and self.rank != self.root:
            for t in self._local:
                if t.pieces:
                    for band in band_rows(t.shape, t.dtype, self.band_bytes):
                        self._send(band, t)
            return
        buffers: dict[torch.dtype, Tensor] = {}
        for index, layout in enumerate(self.layouts):
            local = mine.get((layout.group, layout.name))
            numel = _row_numel(layout.shape)
            bands = band_rows(layout.shape, layout.dtype, self.band_bytes)
            room = max(b - a for a, b in bands) * numel if bands else 0
            buffer = buffers.get(layout.dtype)
            if buffer is None or buffer.numel() < room:  # one band's room per dtype, reused
                buffer = buffers[layout.dtype] = torch.empty(room, dtype=layout.dtype)
            for band in bands:
                rows = buffer[: (band[1] - band[0]) * numel].view(band[1] - band[0], *layout.shape[1:])
                if self.rank == self.root:
                    self._receive(band, layout, local, rows)
                elif local is not None and local.pieces:
                    self._send(band, local)
                if self.dst is None and self.distributed:
                    self._broadcast(rows)
                yield index, band[0] * numel, rows
                del rows

    def whole(self) -> Iterator[tuple[Layout, Tensor]]:
        """Collective: each full tensor in host memory, one at a time, on rank ``dst`` (nothing elsewhere).

        A caller that drops each before the next holds one full tensor and one band at a time.
        Rows no rank holds are zeros.
        """
        bands = self.bands()
        pending = next(bands, None)  # (on the other ranks this sends everything and ends)
        for index, layout in enumerate(self.layouts):
            full = torch.zeros(layout.shape, dtype=layout.dtype)  # a tensor of no rows has no bands
            while pending is not None and pending[0] == index:
                _, first, rows = pending
                full.view(-1)[first : first + rows.numel()] = rows.reshape(-1)
                del rows
                pending = next(bands, None)
            yield layout, full
            del full

    def _send(self, band: tuple[int, int], local: LocalTensor) -> None:
        """This rank's rows of ``local`` in ``band`` to the receiving rank (non-blocking, then waited for)."""
        works, held = [], []
        for (r0, _), piece in local.pieces:
            rows = _overlap(band, r0, piece.shape[0])
            if rows is not None:
                part = piece.detach()[rows[0] : rows[1]].to(self.device).contiguous()  # a copy only if needed
                held.append(part)
                works.append(dist.isend(part, self._global(self.root), group=self.group))
        _wait_all(works)

    def _receive(self, band: tuple[int, int], layout: Layout, local: LocalTensor | None, rows: Tensor) -> None:
        """Every rank's rows of ``layout`` in ``band`` into ``rows``: received in place where they can be."""
        overlapping = sum(_numel(p.shape) for p in layout.pieces) > _numel(layout.shape)
        works, copies = [], []
        own = iter(local.pieces if local is not None else ())
        for piece in layout.pieces:
            source = next(own)[1] if piece.rank == self.rank else None
            span = _overlap(band, piece.offsets[0], piece.shape[0])
            if span is None:
                continue
            shape = (span[1] - span[0], *piece.shape[1:])
            target = _region(rows, (piece.offsets[0] + span[0] - band[0], piece.offsets[1]), shape)
            if source is not None:
                copies.append((target, source.detach()[span[0] : span[1]]))
                continue
            in_place = not overlapping and self.device.type == "cpu" and target.is_contiguous()
            if in_place and piece.dtype == layout.dtype:
                works.append(dist.irecv(target, self._global(piece.rank), group=self.group))
                continue
            staged = torch.empty(shape, dtype=piece.dtype, device=self.device)
            works.append(dist.irecv(staged, self._global(piece.rank), group=self.group))
            copies.append((target, staged))
        _wait_all(works)
        for target, value in copies:  # in rank order: of overlapping pieces the last rank's wins
            target.copy_(value)

    def _broadcast(self, rows: Tensor) -> None:
        if self.device.type == "cpu":
            dist.broadcast(rows, src=self._global(self.root), group=self.group)
            return
        moved = rows.to(self.device)
        dist.broadcast(moved, src=self._global(self.root), group=self.group)
        rows.copy_(moved)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _wait_all(works: list[dist.Work | None]) -> None:
    """Wait for every point-to-point operation (torch types them ``Work | None``: None off the group)."""
    for work in works:
        if work is not None:
            work.wait()
