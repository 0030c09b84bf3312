"""Sharded save and resume in bounded pieces (issue 29 item 2), through the Trainer.

``save_checkpoint`` writes each rank's shards from where they lie (before: DCP cloned every
shard, a view into a kernel's flat buffer, and kept the clones until the file closed: a
second copy of the share), and every shard is cut into row pieces of at most
``PIECE_BYTES``, so a resume on another world size stages one piece at a time (before: a
whole saved shard, two at once). Results are identical with pieces of any size.

A full-format save reserves each tensor's room in the file, then gathers its rows on rank 0 in
bands written in place: rank 0 holds its share and one band, the other ranks nothing more.

Loads that stream: ``load_from_checkpoint(Model, sharded_dir)`` in one process copies each weight
from the files into the model a piece at a time (peak: the model, not twice the model), and a
resume on 2 ranks from a plain ``torch.save`` file memory-maps it, each rank copying only its rows
(peak: the share, not the share and the whole file). Each test measures the old path beside the new.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from _memory import Big, MiB, batches, held_bytes, peak, reset_peak, rss
from _models import external_launch, trainer
from test_strategy_checkpoint import GLOBAL_BATCH, STEPS, TOL, fit

from lightning_shardrec.checkpoint import read_full, read_metadata
from lightning_shardrec.testing import run_ranks

ROWS, TABLES = 2_000_000, 2  # T = 244 MiB; with Adagrad state a 2-rank share is 244 MiB, a 3-rank one 163 MiB
T = ROWS * 16 * 4 * TABLES
PIECE = 8 * MiB  # test pieces: a 61 MiB shard is written as 8 pieces
# Lightning, gloo, a row-wise step's buffers (~25 MiB) and the pieces in flight (~20 MiB). 64 MiB until
# 2026-12-04: the 3-rank resume then measured held + 64.9 MiB at 0dbd29a itself (AMD EPYC, torch 2.13.0).
ALLOWANCE = 72 * MiB


@contextmanager
def pieces_of(piece_bytes: int) -> Iterator[None]:
    """``sharded_state.PIECE_BYTES`` set inside the block, restored after it: the rank processes serve later cases
    (left behind, 64-byte pieces made the next full-state gather on those ranks move 2 rows a collective)."""
    from lightning_shardrec.checkpoint import sharded_state

    default, sharded_state.PIECE_BYTES = sharded_state.PIECE_BYTES, piece_bytes
    try:
        yield
    finally:
        sharded_state.PIECE_BYTES = default


def fit_in_pieces(rank, world, piece_bytes, *args):
    with pieces_of(piece_bytes):
        return fit(rank, world, *args)


def test_pieces_of_any_size_resume_the_identical_run(tmp_path):
    straight = run_ranks(fit, 2, STEPS, None, None, "row_wise")[0]
    half = str(tmp_path / "half")
    run_ranks(fit_in_pieces, 2, 100, STEPS // 2, None, half, "row_wise")  # t_big: 3 rows (96 bytes) a piece
    chunks = read_metadata(half).state_dict_metadata["state_dict.ebc.embedding_bags.t_big.weight"].chunks
    assert len(chunks) == 40 and max(c.sizes[0] for c in chunks) == 3, [tuple(c.sizes) for c in chunks]
    for world, kind, piece in [(3, "column_wise", 10**9), (2, "row_wise", 64)]:  # other pieces on resume too
        resumed = run_ranks(fit_in_pieces, world, piece, STEPS, half, None, kind)[0]
        for k in straight:
            torch.testing.assert_close(resumed[k], straight[k], **TOL, msg=f"resume at W={world} ({kind}): {k}")
    assert GLOBAL_BATCH % 3 == 0


def fit_in_bands_never_reading_back(rank, world, *args):
    """:func:`fit_in_pieces`, failing the save if a table's zip CRC-32 is read back from the file instead of
    followed as its bands are written (restored afterwards: the ranks are reused)."""
    from lightning_shardrec.checkpoint import streamed_file

    def refuse(fd, offset, nbytes):
        raise AssertionError(f"a record of {nbytes} bytes was read back for its CRC-32")

    chosen, streamed_file.crc_of_range = streamed_file.crc_of_range, refuse
    try:
        return fit_in_pieces(rank, world, *args)
    finally:
        streamed_file.crc_of_range = chosen


@pytest.mark.parametrize(("world", "kind", "optim"), [(1, "table_wise", None), (3, "column_wise", "rowwise_adagrad")])
def test_full_file_written_in_small_bands_holds_the_gathered_state(tmp_path, valid_zip, world, kind, optim):
    """Bands of 64 bytes (2 rows of t_big; on 3 ranks pinned column pieces land in strided places) on 1 and 3
    ranks: the file holds exactly what every rank gathers as objects (``full_state_dict``), and is a sound zip
    whose tables' CRC-32s were computed band by band."""
    path = str(tmp_path / "full.ckpt")
    out = run_ranks(fit_in_bands_never_reading_back, world, 64, STEPS // 2, None, path, kind, optim, "full")[0]
    state, pieces = out if optim else (out, None)
    assert pieces is None or (pieces["t_big"], pieces["t_mid"]) == (2, 2), pieces  # column pieces
    saved = torch.load(path, weights_only=True, mmap=True)["state_dict"]
    assert sorted(saved) == sorted(state)
    for k, v in state.items():
        assert torch.equal(saved[k], v), k
    valid_zip(path)


def fit_one_file_per_item(rank, world, *args):
    """:func:`fit` with the sharded save's writer as on GPUs (one file per item), restored afterwards."""
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shardrec.checkpoint import sharded_state

    chosen = sharded_state.storage_writer
    sharded_state.storage_writer = lambda path, state: FileSystemWriter(path, single_file_per_rank=False)
    try:
        return fit(rank, world, *args)
    finally:
        sharded_state.storage_writer = chosen


def test_one_file_per_item_resumes_the_identical_run(tmp_path):
    straight = run_ranks(fit, 2, STEPS, None, None, "row_wise")[0]
    half = str(tmp_path / "half")
    run_ranks(fit_one_file_per_item, 2, STEPS // 2, None, half, "row_wise")
    files = sorted(p.name for p in Path(half).glob("*.distcp"))
    assert len(files) > 2, files  # the layout a GPU save writes: one file per piece
    resumed = run_ranks(fit, 3, STEPS, half, None, "column_wise")[0]
    for k in straight:
        torch.testing.assert_close(resumed[k], straight[k], **TOL, msg=f"resume at W=3 from one file per item: {k}")


def save_or_resume(rank: int, world: int, path: str, resume: bool) -> dict[str, int]:
    with pieces_of(PIECE):
        return _save_or_resume(rank, world, path, resume)


def _save_or_resume(rank: int, world: int, path: str, resume: bool) -> dict[str, int]:
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    reset_peak()
    base = rss()
    rows = ParameterConstraints(sharding_types=["row_wise"])  # every rank a share (a shard per table)
    strategy = ShardRecStrategy(constraints={f"t{i}": rows for i in range(TABLES)})
    t = trainer(strategy=strategy, devices=world, max_steps=3 if resume else 2, use_distributed_sampler=False)
    with t.init_module():
        model = Big(ROWS, TABLES)
    t.fit(model, batches(ROWS, TABLES, 3, rank), ckpt_path=path if resume else None)
    out = {"held": held_bytes(strategy), "after_fit": rss() - base, "peak_fit": peak() - base}
    if not resume:
        reset_peak()
        before = rss()
        t.save_checkpoint(path)
        out["save_peak_over_fit"] = peak() - before
    del t, model, strategy
    return out


def _message(what: str, rank: int, f: dict[str, int]) -> str:
    figures = ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in f.items())
    return f"{what}, rank {rank}: {figures} (T {T / MiB:.0f} MiB)"


@pytest.mark.slow
def test_save_and_resume_on_another_world_size_stay_near_the_share(tmp_path):
    path = str(tmp_path / "ckpt")
    for rank, f in enumerate(run_ranks(save_or_resume, 2, path, False, timeout=600)):
        msg = _message("save on 2 ranks", rank, f)
        assert f["held"] > 0.45 * T and f["peak_fit"] < f["held"] + ALLOWANCE, msg
        assert f["save_peak_over_fit"] < ALLOWANCE, msg  # before: + the share (every shard cloned)
    reset_peak()
    before = rss()
    weights = read_full(path)["state_dict"]  # what load_from_checkpoint(Model, path) reads in one process
    read = peak() - before
    assert sum(v.numel() * v.element_size() for v in weights.values()) >= T
    del weights
    assert read < 1.25 * T, f"reading the weights peaked at {read / MiB:.0f} MiB for T {T / MiB:.0f} MiB (before: 2T)"
    for rank, f in enumerate(run_ranks(save_or_resume, 3, path, True, timeout=600)):
        msg = _message("resume on 3 ranks", rank, f)
        assert f["held"] > 0.3 * T and f["peak_fit"] < f["held"] + ALLOWANCE, msg  # before: + 2 saved shards


TENSOR = ROWS * 16 * 4  # the largest single tensor a full save writes: one table's weight (or its Adagrad sum)
BAND = 32 * MiB  # a full save gathers and writes rows in bands of at most this (sharded_state.PIECE_BYTES)
FULL_ALLOWANCE = 16 * MiB  # measured: 0.2 MiB (the pickled dense state and stand-ins; pieces land in place)


def save_full(rank: int, world: int, path: str) -> dict[str, object]:
    """Fit, then ``save_checkpoint`` in the full format: each rank's peak over fit, and what was saved."""
    with pieces_of(BAND):
        return _save_full(rank, world, path)


def _save_full(rank: int, world: int, path: str) -> dict[str, object]:
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    rows = ParameterConstraints(sharding_types=["row_wise"])
    strategy = ShardRecStrategy(constraints={f"t{i}": rows for i in range(TABLES)}, checkpoint_format="full")
    t = trainer(strategy=strategy, devices=world, max_steps=2, use_distributed_sampler=False)
    with t.init_module():
        model = Big(ROWS, TABLES)
    t.fit(model, batches(ROWS, TABLES, 3, rank))
    reset_peak()
    before = rss()
    t.save_checkpoint(path)
    return {"held": held_bytes(strategy), "save_peak_over_fit": peak() - before}


def resume_full(rank: int, world: int, path: str) -> list[str]:
    """Resume from the full file (no step runs: it was saved at ``max_steps``); on rank 0, what differs from it."""
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.checkpoint import gather_full_state, plain_table_states

    external_launch(rank, world)
    kind = "table_wise" if world == 1 else "column_wise"  # another plan than the save's (row-wise)
    strategy = ShardRecStrategy(
        constraints={f"t{i}": ParameterConstraints(sharding_types=[kind]) for i in range(TABLES)}
    )
    t = trainer(strategy=strategy, devices=world, max_steps=2, use_distributed_sampler=False)
    with t.init_module():
        model = Big(ROWS, TABLES, lr=0.3)  # other initial values and lr: all must come from the file
    t.fit(model, batches(ROWS, TABLES, 3, rank), ckpt_path=path)
    weights, states = gather_full_state(strategy.sharded, dst=0)
    if rank != 0:
        return []
    saved = torch.load(path, weights_only=True, mmap=True)
    fused = saved["shardrec_fused_optimizer"]
    differ = [k for k, v in weights.items() if not torch.equal(saved["state_dict"][k], v)]
    top = model.top.state_dict()  # the dense layers, restored by Lightning
    differ += [f"top.{k}" for k, v in top.items() if not torch.equal(saved["state_dict"][f"top.{k}"], v)]
    saved_states = plain_table_states(saved["optimizer_states"], fused["positions"])  # the plain layout
    for k, named in states.items():
        differ += [f"{k}/{n}" for n, v in named.items() if not torch.equal(saved_states[k][n], v)]
    if set(weights) != {"ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"} or set(states) != set(weights):
        differ.append(f"gathered {sorted(weights)}, states of {sorted(states)}")
    if strategy.fused_optimizer.param_groups[0]["lr"] != fused["param_group"]["lr"]:
        differ.append("fused lr")
    return differ


@pytest.mark.slow
def test_full_format_save_peaks_at_one_band_and_resumes_exactly(tmp_path, valid_zip):
    path = str(tmp_path / "full.ckpt")
    f0, f1 = run_ranks(save_full, 2, path, timeout=600)
    msg = (
        f"full save, peak over fit: rank 0 {f0['save_peak_over_fit'] / MiB:.1f} MiB, rank 1 "
        f"{f1['save_peak_over_fit'] / MiB:.1f} MiB; bands of {BAND / MiB:.0f} MiB, largest tensor "
        f"{TENSOR / MiB:.0f} MiB, share {f0['held'] / MiB:.0f} MiB"
    )
    # measured: rank 0 32.2 MiB (a band), rank 1 0.0 MiB. Before: 366.1 MiB on rank 0 (a table's weight and state
    # gathered together, 244 MiB, and the previous table's last state, 122 MiB, still referenced); gathered and
    # written one tensor at a time: 122.2 MiB
    assert f0["held"] > 0.45 * T, msg
    assert f0["save_peak_over_fit"] < BAND + FULL_ALLOWANCE, msg
    assert f1["save_peak_over_fit"] < FULL_ALLOWANCE, msg
    valid_zip(path)  # the zip CRC-32s, followed band by band, cost no memory
    for world in (1, 3):  # the file loads exactly into another world size and plan
        differ = run_ranks(resume_full, world, path, timeout=600)[0]
        assert differ == [], f"resume on {world} rank(s) from the full file: {differ}"


PIECES, PIECE_MIB = 6, 40  # a flat buffer of 240 MiB handed to DCP as 6 views (each mmapped by glibc: > 32 MiB)


def dcp_save_of_views(rank: int, world: int, path: str, per_item: bool | None) -> dict[str, object]:
    """DCP-save 6 views into one flat buffer (what DCP copies to the host, as it does GPU pieces): peak over
    the save and whether the saved values load back; ``per_item=None``: the writer :func:`storage_writer` picks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shardrec.checkpoint.dcp_writer import copied_by_dcp, storage_writer

    n = PIECE_MIB * MiB // 4
    flat = torch.arange(PIECES * n, dtype=torch.float32)
    state = {f"p{i}": flat[i * n : (i + 1) * n] for i in range(PIECES)}
    writer = (
        storage_writer(path, state) if per_item is None else FileSystemWriter(path, single_file_per_rank=not per_item)
    )
    reset_peak()
    before = rss()
    dcp.save(state, storage_writer=writer)
    out: dict[str, object] = {"peak": peak() - before, "per_item": not writer.single_file_per_rank}
    loaded = {k: torch.zeros(n) for k in state}
    dcp.load(loaded, checkpoint_id=path)
    out["exact"] = all(torch.equal(loaded[k], v) for k, v in state.items())
    out["copied"] = [copied_by_dcp(v) for v in state.values()] + [copied_by_dcp(flat)]
    return out


def test_dcp_host_copies_stay_one_piece_with_one_file_per_item(tmp_path):
    """DCP keeps every host copy it wrote (``tensor_dict`` in ``_write_files_from_queue``) until the rank's file
    closes; the writer the sharded save picks for pieces DCP copies (GPU pieces; here CPU views, which DCP
    clones) writes one file per item, so one copy is alive at a time."""
    whole = PIECES * PIECE_MIB * MiB
    default = run_ranks(dcp_save_of_views, 1, str(tmp_path / "one_file"), False)[0]
    ours = run_ranks(dcp_save_of_views, 1, str(tmp_path / "ours"), None)[0]
    msg = (
        f"save peak: one file per rank {default['peak'] / MiB:.0f} MiB, the sharded save's writer "
        f"{ours['peak'] / MiB:.0f} MiB; pieces of {PIECE_MIB} MiB, {whole / MiB:.0f} MiB in all"
    )
    assert ours["per_item"] and ours["copied"] == [True] * PIECES + [False], ours["copied"]
    assert default["exact"] and ours["exact"], msg
    assert default["peak"] > 0.75 * whole, msg  # the behaviour this works around (a copy of everything)
    # measured: 80 MiB, two pieces: one copy and the bytes DCP's torch.save hands its file stream (one file per
    # rank: 242 MiB, a copy of every piece)
    assert ours["peak"] < 3 * PIECE_MIB * MiB, msg


def load_into_the_plain_model(rank: int, world: int, path: str) -> dict[str, object]:
    """``load_from_checkpoint(Big, path)`` in a process of its own, streamed (today) then with every weight
    read first (before): peaks over the process's baseline (imports paid), and whether the weights equal
    the checkpoint's read whole (after measuring)."""
    from lightning_shardrec.checkpoint import sharded_state
    from lightning_shardrec.lightning import load_from_checkpoint

    out: dict[str, object] = {}
    default = sharded_state.LAZY_BYTES
    try:
        for how, lazy_bytes in (("streamed", default), ("read whole", 2**62)):
            sharded_state.LAZY_BYTES = lazy_bytes
            reset_peak()
            base = rss()
            model = load_from_checkpoint(Big, path, rows=ROWS, tables=TABLES)
            out[f"peak {how}"], out["model"] = peak() - base, sum(p.nbytes for p in model.parameters())
            if how == "streamed":
                want = read_full(path)["state_dict"]
                out["mismatched"] = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, want[k]))
                out["keys"] = sorted(want)
                del want
            del model
    finally:  # the rank process serves later cases
        sharded_state.LAZY_BYTES = default
    return out


@pytest.mark.slow
def test_load_from_checkpoint_of_a_sharded_directory_streams_table_by_table(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(save_or_resume, 2, path, False, timeout=600)
    (f,) = run_ranks(load_into_the_plain_model, 1, path, timeout=600)
    model = f["model"]
    msg = (
        f"load_from_checkpoint: peak {f['peak streamed'] / MiB:.0f} MiB streamed, {f['peak read whole'] / MiB:.0f} "
        f"MiB read whole, over baseline; model {model / MiB:.0f} MiB"
    )
    assert f["mismatched"] == [] and len(f["keys"]) == TABLES + 2, f
    assert model > T and f["peak read whole"] > 1.8 * model, msg  # before: every weight read, then copied
    assert f["peak streamed"] < model + ALLOWANCE, msg  # measured: +281 MiB for 244 (read whole: +502)


def _digests(t, strategy) -> dict[str, str]:
    """SHA-1 of every tensor this rank holds after a resume: table shards, their fused state, the dense
    weights and the dense optimizer state (hashed in place: no copy of the share)."""
    import hashlib

    def sha(x: torch.Tensor) -> str:
        return hashlib.sha1(memoryview(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy())).hexdigest()

    out = {}
    for path, coll in strategy.sharded.items():
        for table, shards in coll.local_shards().items():
            out.update({f"{path}.{table}@{m.shard_offsets}": sha(w) for m, w in shards})
        for table, states in coll.local_states().items():
            out.update({f"{path}.{table}@{m.shard_offsets}/{n}": sha(s) for m, st in states for n, s in st.items()})
    out.update({k: sha(v) for k, v in t.lightning_module.top.state_dict().items()})
    for i, state in t.optimizers[0].state_dict()["state"].items():
        out.update({f"optimizer {i}/{n}": sha(v) for n, v in state.items() if isinstance(v, torch.Tensor)})
    return out


def resume_plain(rank: int, world: int, path: str) -> dict[str, object]:
    """Resume ``Trainer(strategy="shardrec")`` from a plain checkpoint file and train a step, twice: the file
    memory-mapped (today), then read whole by Lightning's loader (before); peaks and the state both reach."""
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.checkpoint import mapped_file
    from lightning_shardrec.lightning.checkpoints import checkpointing

    external_launch(rank, world)
    out: dict[str, object] = {}
    defaults = mapped_file.PIECE_BYTES, checkpointing.mappable
    mapped_file.PIECE_BYTES = PIECE
    try:
        for how in ("mapped", "read whole"):
            if how == "read whole":
                checkpointing.mappable = lambda path: False
            reset_peak()
            base = rss()
            rows = ParameterConstraints(sharding_types=["row_wise"])
            strategy = ShardRecStrategy(constraints={f"t{i}": rows for i in range(TABLES)})
            t = trainer(strategy=strategy, devices=world, max_steps=2, use_distributed_sampler=False)
            with t.init_module():
                model = Big(ROWS, TABLES)
            t.fit(model, batches(ROWS, TABLES, 3, rank), ckpt_path=path)
            out[f"peak {how}"], out["held"] = peak() - base, held_bytes(strategy)
            out[f"state {how}"] = _digests(t, strategy)
            del t, model, strategy
    finally:  # the rank processes serve later cases
        mapped_file.PIECE_BYTES, checkpointing.mappable = defaults
    return out


def write_plain(rank: int, world: int, path: str) -> None:
    """One step without the strategy (devices=1), saved: the tables' Adagrad state sits in the user's optimizer."""
    t = trainer(devices=1, max_steps=1)
    t.fit(Big(ROWS, TABLES), batches(ROWS, TABLES, 1, 0))
    t.save_checkpoint(path)


@pytest.mark.slow
def test_resume_from_a_plain_file_reads_only_each_ranks_rows(tmp_path):
    path = str(tmp_path / "plain.ckpt")
    run_ranks(write_plain, 1, path, timeout=600)
    whole = 2 * T  # the file: tables and their Adagrad state
    for rank, f in enumerate(run_ranks(resume_plain, 2, path, timeout=600)):
        share = f["held"]
        msg = (
            f"resume from a plain file, rank {rank}: peak {f['peak mapped'] / MiB:.0f} MiB memory-mapped, "
            f"{f['peak read whole'] / MiB:.0f} MiB read whole; share {share / MiB:.0f}, file {whole / MiB:.0f} MiB"
        )
        assert f["state mapped"] == f["state read whole"], msg  # bit for bit: shards, fused and dense state
        assert len(f["state mapped"]) == 2 + 2 + 2 + 4, f["state mapped"].keys()  # + step and sum of top.*
        assert f["peak read whole"] > share + 0.9 * whole, msg  # the old path: the whole file on every rank
        assert f["peak mapped"] < share + ALLOWANCE, msg  # measured: +258 MiB for a 244 MiB share
