"""Sharded save and resume in bounded pieces (issue 29 item 2), through the Trainer.

``save_checkpoint`` writes each rank's shards from where they lie (before: DCP cloned every
shard, a view into a kernel's flat buffer, and kept the clones until the file closed: a
second copy of the share), and every shard is cut into row pieces of at most
``PIECE_BYTES``, so a resume on another world size stages one piece at a time (before: a
whole saved shard, two at once). Results are identical with pieces of any size.

A full-format save gathers the tables on rank 0 one at a time, each written into the file as it
arrives: rank 0 holds its share and about one table, the other ranks nothing more.

Loads that stream: ``Model.load_from_checkpoint(sharded_dir)`` in one process copies each weight
from the files into the model a piece at a time (peak: the model, not twice the model), and a
resume on 2 ranks from a plain ``torch.save`` file memory-maps it, each rank copying only its rows
(peak: the share, not the share and the whole file). Each test measures the old path beside the new.
"""

from __future__ import annotations

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
ALLOWANCE = 64 * MiB  # Lightning, gloo, a row-wise step's buffers (~25 MiB) and the pieces in flight (~20 MiB)


def fit_in_pieces(rank, world, piece_bytes, *args):
    from lightning_shardrec.checkpoint import sharded_state

    sharded_state.PIECE_BYTES = piece_bytes
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


def save_or_resume(rank: int, world: int, path: str, resume: bool) -> dict[str, int]:
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.checkpoint import sharded_state

    sharded_state.PIECE_BYTES = PIECE
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
    weights = read_full(path)["state_dict"]  # what Model.load_from_checkpoint(path) reads in one process
    read = peak() - before
    assert sum(v.numel() * v.element_size() for v in weights.values()) >= T
    del weights
    assert read < 1.25 * T, f"reading the weights peaked at {read / MiB:.0f} MiB for T {T / MiB:.0f} MiB (before: 2T)"
    for rank, f in enumerate(run_ranks(save_or_resume, 3, path, True, timeout=600)):
        msg = _message("resume on 3 ranks", rank, f)
        assert f["held"] > 0.3 * T and f["peak_fit"] < f["held"] + ALLOWANCE, msg  # before: + 2 saved shards


def save_full(rank: int, world: int, path: str) -> dict[str, object]:
    """Fit, then ``save_checkpoint`` in the full format: rank 0's peak over fit, and the file against
    what the gathered state was before (every table and its fused state, as one dict)."""
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.checkpoint import gather_full_state

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
    out: dict[str, object] = {"held": held_bytes(strategy), "save_peak_over_fit": peak() - before}
    weights, states = gather_full_state(strategy.sharded, dst=0)  # today's gathered dict, one table at a time
    if rank == 0:
        saved = torch.load(path, weights_only=True, mmap=True)
        mismatched = [k for k, v in weights.items() if not torch.equal(saved["state_dict"][k], v)]
        fused = saved["shardrec_fused_optimizer"]["states"]
        for k, named in states.items():
            mismatched += [f"{k}/{n}" for n, v in named.items() if not torch.equal(fused[k][n], v)]
        out["mismatched"], out["keys"] = mismatched, sorted(saved["state_dict"])
    return out


@pytest.mark.slow
def test_full_format_save_gathers_one_table_at_a_time(tmp_path):
    path = str(tmp_path / "full.ckpt")
    table = ROWS * 16 * 4 * 2  # one table with its Adagrad state: 244 MiB
    f0, f1 = run_ranks(save_full, 2, path, timeout=600)
    msg = (
        f"full save, peak over fit: rank 0 {f0['save_peak_over_fit'] / MiB:.0f} MiB, rank 1 "
        f"{f1['save_peak_over_fit'] / MiB:.0f} MiB; one table and its state {table / MiB:.0f} MiB"
    )
    assert f0["mismatched"] == [] and {"ebc.embedding_bags.t0.weight", "ebc.embedding_bags.t1.weight"} <= set(
        f0["keys"]
    )
    # measured: rank 0 366 MiB (one table and its state, plus 122 MiB), rank 1 0 MiB; with every table
    # gathered before the file was written (gather_object and torch.save): 2075 and 488 MiB
    assert f0["save_peak_over_fit"] < 1.5 * table + ALLOWANCE, msg
    assert f1["save_peak_over_fit"] < ALLOWANCE, msg


def load_into_the_plain_model(rank: int, world: int, path: str) -> dict[str, object]:
    """``Big.load_from_checkpoint(path)`` in a process of its own, streamed (today) then with every weight
    read first (before): peaks over the process's baseline (imports paid), and whether the weights equal
    the checkpoint's read whole (after measuring)."""
    import lightning_shardrec.lightning  # noqa: F401  (installs the loader)
    from lightning_shardrec.checkpoint import sharded_state

    out: dict[str, object] = {}
    default = sharded_state.LAZY_BYTES
    try:
        for how, lazy_bytes in (("streamed", default), ("read whole", 2**62)):
            sharded_state.LAZY_BYTES = lazy_bytes
            reset_peak()
            base = rss()
            model = Big.load_from_checkpoint(path, rows=ROWS, tables=TABLES)
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
    from lightning_shardrec.lightning import checkpointing

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
