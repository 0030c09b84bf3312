"""Routing a rank's KJT to the ranks that own its tables (the input distribution).

A rank cuts its local KJT (keys = one sharding group's features, batch ``B_r``)
into one piece per destination, sends lengths and ids with uneven all-to-alls,
and receives, from every source ``s``, lengths ``[K_d, B_s]`` and ids. ``regroup``
turns that (source, key, sample) layout into the key-major KJT the kernel reads::

    received  [s0: k0 k1] [s1: k0 k1]   ->   KJT keys [k0, k1], stride B_0 + B_1
                                              bags of k0: s0's, then s1's
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_shardrec.distributed.comm.collectives import ShardingEnv, Waitable, all_to_all_async, all_to_all_single
from lightning_shardrec.modules.dynamic.hashing import bucket_of
from lightning_shardrec.sparse import KeyedJaggedTensor
from lightning_shardrec.sparse.ops import complete_cumsum, gather_index, permute_2d, segment_ids


@dataclass
class Routed:
    """What one rank sends for one sharding group, concatenated in destination order."""

    lengths: Tensor
    values: Tensor
    weights: Tensor | None
    length_splits: list[int]  # per destination
    #: ids per destination; row-wise: known on the host only once the header is read (see ``value_counts``)
    value_splits: list[int]
    #: row-wise only: ``values[i]`` is the local KJT's id ``order[i]`` (ids sorted by
    #: destination); sequence outputs use its inverse to put rows back in id order
    order: Tensor | None = None
    #: row-wise only: ids per destination ``[W]`` on the device; it rides in the batch header and
    #: ``value_splits`` is filled from the header's one read (no read of its own)
    value_counts: Tensor | None = None


def route_by_key(kjt: KeyedJaggedTensor, keys_per_dest: list[list[int]]) -> Routed:
    """Send key ``k`` (all its bags) to every destination listing it (table/column-wise)."""
    perm = [k for keys in keys_per_dest for k in keys]
    sent = kjt if perm == list(range(len(kjt.keys()))) else kjt.permute(perm)
    lpk = sent.length_per_key()
    value_splits, start = [], 0
    for keys in keys_per_dest:
        value_splits.append(sum(lpk[start : start + len(keys)]))
        start += len(keys)
    return Routed(
        sent.lengths(),
        sent.values(),
        sent.weights_or_none(),
        [len(keys) * kjt.stride() for keys in keys_per_dest],
        value_splits,
    )


@dataclass(frozen=True)
class RowBlocks:
    """Row blocks of a group's tables, flattened: block ``i`` starts at global row ``starts[i]``.

    Tables are stacked (table ``t`` begins at ``table_base[t]``), so ``starts`` is
    increasing and one ``searchsorted`` finds every id's block.
    """

    table_base: Tensor  # [T]
    starts: Tensor  # [num_blocks], global rows
    row_start: Tensor  # [num_blocks], row of the block inside its table
    rank: Tensor  # [num_blocks]
    #: every table is one block (table-wise, or one rank): an id's block is its table's
    whole_tables: bool = False


@dataclass(frozen=True)
class BucketRows:
    """Dynamic tables' buckets, per table of :class:`RowBlocks`: ``num_buckets [T]``, ``slots [T]`` per bucket."""

    num_buckets: Tensor
    slots: Tensor


def route_by_row(
    kjt: KeyedJaggedTensor, feature_table: Tensor, blocks: RowBlocks, world_size: int, buckets: BucketRows | None = None
) -> Routed:
    """Bucketize ids by row block: each id goes to its block's rank, rebased to the block.

    Every destination gets lengths for all ``K * B`` bags (zero where it owns none of
    a bag's ids); ids keep their (key, bag) order within a destination. With ``buckets``
    (dynamic tables) an id's row is the first slot of its bucket, ``bucket_of(id) * slots``,
    and the raw id is sent (the owner's id mapper turns it into a slot).
    """
    values = kjt.values()
    num_bags = kjt.lengths().numel()
    weights = kjt.weights_or_none()
    if world_size == 1 and blocks.whole_tables:  # every id stays, at its own row: nothing to sort
        n = values.numel()
        order = torch.arange(n, device=values.device)
        return Routed(kjt.lengths(), values.long(), weights, [num_bags], [n], order)
    bag = segment_ids(kjt.lengths(), total=values.numel())
    table = feature_table[torch.div(bag, max(kjt.stride(), 1), rounding_mode="floor")]
    if buckets is None:
        global_row = blocks.table_base[table] + values.long()
    elif blocks.whole_tables:  # the table's one block holds every bucket: no need to hash
        global_row = blocks.table_base[table]
    else:
        bucket = bucket_of(values, buckets.num_buckets[table])
        global_row = blocks.table_base[table] + bucket * buckets.slots[table]
    block = torch.searchsorted(blocks.starts, global_row, right=True) - 1
    dest = blocks.rank[block]
    order, counts = _by_destination(dest, world_size)
    sent = values.long() if buckets is not None else values.long() - blocks.row_start[block]
    local = sent.index_select(0, order)
    lengths = _count(dest * num_bags + bag, world_size * num_bags)
    return Routed(
        lengths.to(kjt.lengths().dtype),
        local,
        None if weights is None else weights.index_select(0, order),
        [num_bags] * world_size,
        [],  # filled from the batch header (``counts`` ride in it)
        order,
        counts,
    )


def _count(index: Tensor, size: int) -> Tensor:
    """``bincount(index, minlength=size)`` of known length: no read of the largest index (no host sync)."""
    return torch.zeros(size, dtype=torch.long, device=index.device).index_add_(0, index, torch.ones_like(index))


def _by_destination(dest: Tensor, world_size: int) -> tuple[Tensor, Tensor]:
    """Positions of ``dest [N]`` sorted by destination, stably, and the count per destination ``[W]``.

    No host sync on any device: for a few ranks a counting sort (each id's place = its
    destination's start + how many earlier ids share it), beyond 8 a stable sort.
    """
    if world_size > 8:
        return torch.sort(dest, stable=True).indices, _count(dest, world_size)
    hit = dest.unsqueeze(1) == torch.arange(world_size, device=dest.device)  # [N, W]
    before = hit.long().cumsum(0)  # [N, W]: ids up to this one per destination
    counts = before[-1] if dest.numel() else torch.zeros(world_size, dtype=torch.long, device=dest.device)
    place = (before.gather(1, dest.unsqueeze(1)).squeeze(1) - 1) + (counts.cumsum(0) - counts)[dest]
    order = torch.empty_like(place).scatter_(0, place, torch.arange(dest.numel(), device=dest.device))
    return order, counts


def exchange(
    routed: Routed, recv_values: list[int], num_keys: int, batch_per_source: list[int], env: ShardingEnv
) -> KeyedJaggedTensor:
    """The all-to-alls for one group, then :func:`regroup` into a key-major KJT.

    Issued back to back (async) and waited for together: the process group's thread moves on to
    the ids as soon as the lengths are through, with no round trip to this thread in between.
    """
    return exchange_async(routed, recv_values, num_keys, batch_per_source, env).wait()


@dataclass
class PendingExchange:
    """:func:`exchange` issued with async collectives; :meth:`wait` gives the same KJT."""

    lengths: Tensor
    values: Tensor
    weights: Tensor | None
    works: list[Waitable]
    num_keys: int
    batch_per_source: list[int]

    def wait(self) -> KeyedJaggedTensor:
        for w in self.works:
            w.wait()
        self.works = []
        return regroup(self.lengths, self.values, self.weights, self.num_keys, self.batch_per_source)


def exchange_async(
    routed: Routed, recv_values: list[int], num_keys: int, batch_per_source: list[int], env: ShardingEnv
) -> PendingExchange:
    """:func:`exchange`'s all-to-alls (lengths, ids, weights: that order on every rank), not waited for."""
    recv_lengths = [num_keys * b for b in batch_per_source]
    lengths, w0 = all_to_all_async(routed.lengths, recv_lengths, routed.length_splits, env)
    values, w1 = all_to_all_async(routed.values, recv_values, routed.value_splits, env)
    weights, w2 = None, None
    if routed.weights is not None:
        weights, w2 = all_to_all_async(routed.weights, recv_values, routed.value_splits, env)
    works = [w for w in (w0, w1, w2) if w is not None]
    return PendingExchange(lengths, values, weights, works, num_keys, batch_per_source)


@dataclass
class PackedExchange:
    """Every routing group's lengths, ids and weights in ONE all-to-all, issued async.

    Per destination the send buffer holds, group after group, the group's lengths, ids and
    weights for it as raw bytes (any dtype, nothing widened); the receiver cuts each source's
    bytes back into the same tensors, so :meth:`wait` gives what per-group :func:`exchange`
    calls give, bit for bit, with one collective per step instead of two or three per group::

        send to d:  [g0 lengths | g0 ids | g0 weights | g1 lengths | g1 ids]   (bytes)
        recv from s: the same, s's pieces for this rank
    """

    recv: Tensor  # uint8, source-major
    works: list[Waitable]
    #: per source, per group, per tensor (lengths, ids, weights): bytes
    sizes: list[list[list[int]]]
    #: per group: the received tensors' dtypes (lengths, ids, weights) and the group's regroup arguments
    dtypes: list[list[torch.dtype]]
    num_keys: list[int]
    batch_per_source: list[int]

    def drain(self) -> None:
        """Wait for the collective (its result unused or read later)."""
        for w in self.works:
            w.wait()
        self.works = []

    def wait(self) -> list[KeyedJaggedTensor]:
        """Each routing group's regrouped KJT, in the order the groups were given."""
        self.drain()
        flat = [n for per_source in self.sizes for per_group in per_source for n in per_group]
        pieces = iter(self.recv.split(flat))
        by_group: list[list[list[Tensor]]] = [[[] for _ in d] for d in self.dtypes]
        for per_source in self.sizes:
            for g, per_group in enumerate(per_source):
                for j in range(len(per_group)):
                    by_group[g][j].append(next(pieces))
        out = []
        for g, parts in enumerate(by_group):
            lengths, values, *weights = [torch.cat(p).view(dt) for p, dt in zip(parts, self.dtypes[g], strict=True)]
            weight = weights[0] if weights else None
            out.append(regroup(lengths, values, weight, self.num_keys[g], self.batch_per_source))
        return out


def _bytes(t: Tensor) -> Tensor:
    """A 1-D tensor's bytes (a view)."""
    return t.contiguous().view(torch.uint8)


def exchange_packed_async(
    routed: list[Routed],
    recv_values: list[list[int]],
    num_keys: list[int],
    batch_per_source: list[int],
    env: ShardingEnv,
) -> PackedExchange:
    """:func:`exchange_async` for several groups at once: their lengths, ids and weights in one all-to-all."""
    world = env.world_size
    sends: list[list[Tensor]] = [[] for _ in range(world)]  # per destination
    sizes: list[list[list[int]]] = [[] for _ in range(world)]  # per source: what this rank receives
    dtypes: list[list[torch.dtype]] = []
    for r, v, k in zip(routed, recv_values, num_keys, strict=True):
        tensors = [(r.lengths, r.length_splits, [k * b for b in batch_per_source]), (r.values, r.value_splits, v)]
        if r.weights is not None:
            tensors.append((r.weights, r.value_splits, v))
        dtypes.append([t.dtype for t, _, _ in tensors])
        for s in range(world):
            sizes[s].append([counts[s] * t.element_size() for t, _, counts in tensors])
        for t, splits, _ in tensors:
            for d, part in enumerate(t.split(splits)):
                sends[d].append(_bytes(part))
    send_splits = [sum(p.numel() for p in parts) for parts in sends]
    recv_splits = [sum(n for per_group in per_source for n in per_group) for per_source in sizes]
    flat_send = [p for parts in sends for p in parts]
    buf = torch.cat(flat_send) if flat_send else torch.empty(0, dtype=torch.uint8)
    if world == 1:  # what this rank sends is what it receives
        return PackedExchange(buf, [], sizes, dtypes, num_keys, batch_per_source)
    recv = buf.new_empty(sum(recv_splits))
    work = all_to_all_single(recv, buf, recv_splits, send_splits, env, async_op=True)
    return PackedExchange(recv, [] if work is None else [work], sizes, dtypes, num_keys, batch_per_source)


def regroup(
    lengths: Tensor, values: Tensor, weights: Tensor | None, num_keys: int, batch_per_source: list[int]
) -> KeyedJaggedTensor:
    """(source, key, sample) -> key-major (key, source, sample); keys are named by index."""
    keys = [str(k) for k in range(num_keys)]
    total_batch = sum(batch_per_source)
    sources = len(batch_per_source)
    if sources == 1 or num_keys <= 1:  # one key: its ids are all the values (sizes carried, not read back)
        per_key = [values.numel()] if num_keys == 1 else None
        return KeyedJaggedTensor._trusted(keys, values, weights, lengths, total_batch, per_key)
    device = lengths.device
    batch = batch_per_source[0]
    if batch > 0 and batch_per_source.count(batch) == sources:  # one batch size: [S * K, B] rows, reordered in one op
        new_lengths, new_values, new_weights = permute_2d(
            _key_major_rows(sources, num_keys, device),
            lengths.view(sources * num_keys, batch),
            values,
            weights,
            permuted_values_numel=values.numel(),
        )
        return KeyedJaggedTensor._trusted(keys, new_values, new_weights, new_lengths.view(-1), total_batch)
    seg_len = _on_device(tuple(batch_per_source), device).repeat_interleave(num_keys, output_size=sources * num_keys)
    seg_start = complete_cumsum(seg_len)
    order = torch.arange(sources * num_keys, device=device).view(sources, num_keys).t().reshape(-1)
    new_lengths = lengths.index_select(0, gather_index(seg_start[:-1][order], seg_len[order], total=lengths.numel()))
    offsets = complete_cumsum(lengths)
    val_start = offsets.index_select(0, seg_start[:-1])
    val_len = offsets.index_select(0, seg_start[1:]) - val_start
    index = gather_index(val_start[order], val_len[order], total=values.numel())
    new_values = values.index_select(0, index)
    new_weights = None if weights is None else weights.index_select(0, index)
    return KeyedJaggedTensor._trusted(keys, new_values, new_weights, new_lengths, total_batch)


@functools.lru_cache(maxsize=64)
def _key_major_rows(sources: int, num_keys: int, device: torch.device) -> Tensor:
    """Row order taking ``[S * K, B]`` (source, key) rows to (key, source): ``[K * S]`` int32."""
    return torch.arange(sources * num_keys, dtype=torch.int32, device=device).view(sources, num_keys).t().reshape(-1)


@functools.lru_cache(maxsize=64)
def _on_device(ints: tuple[int, ...], device: torch.device) -> Tensor:
    """``ints`` as an int64 tensor on ``device``, made once per value (a per-batch copy from pageable
    memory would wait for the device)."""
    return torch.tensor(ints, dtype=torch.long).to(device)


def source_major(
    lengths: Tensor, num_keys: int, batch_per_source: list[int], total: int | None = None
) -> Tensor | None:
    """Index taking a regrouped KJT's values from (key, source, sample) to (source, key, sample).

    The inverse of :func:`regroup`'s value reorder: a sequence kernel returns one row
    per received id, and this index makes each source's rows one contiguous block, in
    the order that source sent its ids. ``lengths`` is the regrouped ``[K * sum(B_s)]``,
    ``total`` its sum when known (saves a host sync).
    None when the order is already source-major (one source or at most one key)::

        rows  [k0: s0 s1] [k1: s0 s1]   ->   [s0: k0 k1] [s1: k0 k1]
    """
    sources = len(batch_per_source)
    if sources == 1 or num_keys <= 1:
        return None
    device = lengths.device
    total_batch = sum(batch_per_source)
    offsets = complete_cumsum(lengths)
    # first bag of segment (key k, source s), laid out [K, S]
    source_start = complete_cumsum(_on_device(tuple(batch_per_source), device))
    bag_start = (torch.arange(num_keys, device=device) * total_batch).unsqueeze(1) + source_start.unsqueeze(0)
    val_start = offsets.index_select(0, bag_start[:, :-1].reshape(-1)).view(num_keys, sources)
    val_len = offsets.index_select(0, bag_start[:, 1:].reshape(-1)).view(num_keys, sources) - val_start
    total = int(offsets[-1]) if total is None else total
    return gather_index(val_start.t().reshape(-1), val_len.t().reshape(-1), total=total)
