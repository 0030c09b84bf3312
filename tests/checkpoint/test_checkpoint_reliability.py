"""Checkpoint faults, injected: a save that fails or dies half-way, corrupt and foreign
checkpoints, pickles that would run code. Without Lightning (``save_sharded``/``load_sharded``
on a ``DistributedModelParallel``, 2 gloo ranks) and in one process."""

from __future__ import annotations

import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from lightning_shardrec.checkpoint import atomic, convert_to_full, load_file, read_metadata
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.testing import run_ranks

TABLES = {"a": (20, 8), "b": (10, 4), "c": (6, 4)}


def make(world: int, tables: dict[str, tuple[int, int]]):
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=n, feature_names=[t])
            for t, (n, d) in tables.items()
        ]
    )
    row_wise = {t: ParameterConstraints(sharding_types=["row_wise"]) for t in tables}
    planner = EmbeddingShardingPlanner(Topology(world, compute_device="cpu"), batch_size=8, constraints=row_wise)
    return DistributedModelParallel(ebc, planner=planner, device="cpu", embedding_optimizer="adagrad").sharded


def fill(sharded, value: float) -> None:
    with torch.no_grad():
        for module in sharded.values():
            for shards in module.local_shards().values():
                for _, w in shards:
                    w.fill_(value)
            for shards in module.local_states().values():
                for _, state in shards:
                    for t in state.values():
                        t.fill_(value)


def values(sharded) -> set[float]:
    """Every value this rank's shards and optimizer states hold."""
    out: set[float] = set()
    for module in sharded.values():
        out |= {v for shards in module.local_shards().values() for _, w in shards for v in w.unique().tolist()}
        states = module.local_states().values()
        out |= {v for shards in states for _, s in shards for t in s.values() for v in t.unique().tolist()}
    return out


def failed_save_keeps_previous(rank, world, root):
    from torch.distributed.checkpoint import FileSystemWriter

    from lightning_shardrec.checkpoint import load_sharded, save_sharded

    path = Path(root) / "step.ckpt"
    sharded = make(world, TABLES)
    fill(sharded, 1.0)
    save_sharded(path, sharded, {}, {"step": 1}, rank)
    fill(sharded, 2.0)
    write = FileSystemWriter.write_data

    def write_then_fail(self, plan, planner):  # this rank's shard file is written, then the disk "fills up"
        future = write(self, plan, planner)
        if rank == 1:
            raise OSError("injected: no space left on device")
        return future

    FileSystemWriter.write_data = write_then_fail
    try:
        save_sharded(path, sharded, {}, {"step": 2}, rank)
        message = None
    except CheckpointError as e:
        message = str(e)
    finally:
        FileSystemWriter.write_data = write
    left = sorted(os.listdir(root))
    fill(sharded, 0.0)
    meta = load_sharded(path, sharded, {}, rank)
    after_failure = (meta, values(sharded))
    fill(sharded, 3.0)
    save_sharded(path, sharded, {}, {"step": 3}, rank)  # replaces the directory in place
    fill(sharded, 0.0)
    return message, left, after_failure, (load_sharded(path, sharded, {}, rank), values(sharded))


def test_failed_save_leaves_previous_checkpoint(tmp_path):
    for message, left, (meta, held), (meta3, held3) in run_ranks(failed_save_keeps_previous, 2, str(tmp_path)):
        assert message is not None and "saving checkpoint" in message and "untouched" in message
        assert "rank 1" in message and "injected: no space left on device" in message
        assert left == ["step.ckpt"]  # no staging directory left behind
        assert meta == {"step": 1} and held == {1.0}  # the step-1 checkpoint, whole
        assert meta3 == {"step": 3} and held3 == {3.0}
    assert sorted(os.listdir(tmp_path)) == ["step.ckpt"]


def drop_a_chunk(ckpt: Path) -> None:
    """Metadata whose chunks of table a cover only its first 10 rows (as if a rank's save were lost)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    metadata = read_metadata(ckpt)
    md = metadata.state_dict_metadata["state_dict.embedding_bags.a.weight"]
    md.chunks = [ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([10, 8]))]
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))


def load_variants(rank, world, root):
    from lightning_shardrec.checkpoint import load_sharded, save_sharded

    root = Path(root)
    saved = make(world, TABLES)
    fill(saved, 1.0)
    save_sharded(root / "good", saved, {}, {"step": 1}, rank)
    variants = {
        "dims": ({**TABLES, "a": (20, 6)}, "good"),
        "rows": ({**TABLES, "b": (12, 4)}, "good"),
        "tables": ({"a": (20, 8), "b": (10, 4), "d": (5, 4)}, "good"),
        "truncated": (TABLES, "truncated"),
        "deleted": (TABLES, "deleted"),
        "no_meta": (TABLES, "no_meta"),
        "no_metadata": (TABLES, "no_metadata"),
        "lost_shard": (TABLES, "lost_shard"),
        "garbled": (TABLES, "garbled"),
    }
    if rank == 0:
        for name, fault in [
            ("truncated", lambda d: os.truncate(d / "__1_0.distcp", 100)),
            ("deleted", lambda d: (d / "__0_0.distcp").unlink()),
            ("no_meta", lambda d: (d / "meta.pt").unlink()),
            ("no_metadata", lambda d: (d / ".metadata").unlink()),
            ("lost_shard", drop_a_chunk),
            ("garbled", lambda d: (d / "__1_0.distcp").write_bytes(bytes((d / "__1_0.distcp").stat().st_size))),
        ]:
            shutil.copytree(root / "good", root / name)
            fault(root / name)
    torch.distributed.barrier()
    out = {}
    for name, (tables, ckpt) in variants.items():
        model = make(world, tables)
        fill(model, 5.0)
        try:
            load_sharded(root / ckpt, model, {}, rank)
            out[name] = ("loaded", values(model))
        except CheckpointError as e:
            out[name] = (str(e), values(model))
    return out


def test_corrupt_or_foreign_checkpoint_raises_before_loading_anything(tmp_path):
    per_rank = run_ranks(load_variants, 2, str(tmp_path))
    assert per_rank[0] == {k: (v[0], per_rank[0][k][1]) for k, v in per_rank[1].items()}  # same error everywhere
    out = per_rank[0]
    message, _ = out.pop("garbled")  # passes every check, fails while reading: says so
    assert "failed although its metadata matches the model; the model is partly loaded" in message
    assert "__1_0.distcp' is corrupt: its entry at byte 0 does not decode" in message
    for name, (message, held) in out.items():
        assert held == {5.0}, f"{name}: the model was partly loaded"
        assert "nothing was loaded" in message, name
    assert "'embedding_bags.a.weight': checkpoint holds 80 of its 160 values (shards missing)" in out["lost_shard"][0]
    assert "'embedding_bags.a.weight': checkpoint has shape (20, 8), model expects (20, 6)" in out["dims"][0]
    assert "optimizer state 'embedding_bags.a.weight/sum': checkpoint has shape (20, 8)" in out["dims"][0]
    assert "'embedding_bags.b.weight': checkpoint has shape (10, 4), model expects (12, 4)" in out["rows"][0]
    assert "'embedding_bags.d.weight': in the model, missing from the checkpoint" in out["tables"][0]
    assert "'embedding_bags.c.weight': in the checkpoint, not in the model" in out["tables"][0]
    assert "shard file" in out["truncated"][0] and "__1_0.distcp' is truncated: 100 bytes" in out["truncated"][0]
    assert "__0_0.distcp' is missing" in out["deleted"][0]
    assert "meta.pt" in out["no_meta"][0] and "is missing" in out["no_meta"][0]
    assert "has no .metadata" in out["no_metadata"][0]


# --- crashes inside one process: the on-disk protocol ----------------------------------------------


def test_crash_between_renames_is_recovered(tmp_path, monkeypatch):
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / "meta.pt").write_text("old")
    staging = atomic.staging_path(path, "tok")
    staging.mkdir()
    (staging / "meta.pt").write_text("new")
    replace = os.replace
    calls = []

    def die_on_second(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError("injected: killed between the renames")
        replace(src, dst)

    monkeypatch.setattr(atomic.os, "replace", die_on_second)
    with pytest.raises(OSError, match="between the renames"):
        atomic.commit(staging, path)
    monkeypatch.setattr(atomic.os, "replace", replace)
    assert not path.exists()  # the window the recovery is for
    assert atomic.recover_interrupted(path)
    assert (path / "meta.pt").read_text() == "old"
    atomic.clean_stale(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_crash_while_writing_a_file_keeps_the_old_one(tmp_path, monkeypatch):
    path = tmp_path / "full.ckpt"
    atomic.save_file({"step": torch.tensor(1)}, path)
    save = torch.save

    def half_then_fail(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a zip")
        raise OSError("injected: write failed")

    monkeypatch.setattr(atomic.torch, "save", half_then_fail)
    with pytest.raises(OSError, match="injected"):
        atomic.save_file({"step": torch.tensor(2)}, path)
    monkeypatch.setattr(atomic.torch, "save", save)
    assert torch.load(path, weights_only=True)["step"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.ckpt"]


def test_discard_removes_a_directory_a_file_and_a_link(tmp_path):
    (tmp_path / "d.ckpt").mkdir()
    (tmp_path / "d.ckpt" / "x").write_text("x")
    (tmp_path / "f.ckpt").write_text("f")
    (tmp_path / "last.ckpt").symlink_to("d.ckpt")
    atomic.discard(tmp_path / "last.ckpt")
    assert (tmp_path / "d.ckpt" / "x").exists()  # a link goes, not what it points at
    atomic.discard(tmp_path / "d.ckpt")
    atomic.discard(tmp_path / "f.ckpt")
    assert list(tmp_path.iterdir()) == []


# --- pickles that would run code -------------------------------------------------------------------


class Payload:
    """Unpickling this creates ``marker``: stands for any code a stranger's checkpoint could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _good_dcp(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "ckpt"
    dcp.save({"state_dict": {"w": torch.ones(3)}}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"step": 1}, ckpt / "meta.pt")
    return ckpt


def test_malicious_dcp_metadata_runs_no_code(tmp_path):
    ckpt = _good_dcp(tmp_path)
    assert read_metadata(ckpt).state_dict_metadata["state_dict.w"].size == (3,)  # real metadata passes
    marker = tmp_path / "pwned"
    evil = pickle.dumps(Payload(marker))
    pickle.loads(evil)  # the payload is live: plain unpickling (what DCP does) runs it
    assert marker.exists()
    marker.unlink()
    (ckpt / ".metadata").write_bytes(evil)
    with pytest.raises(CheckpointError, match=r"global 'io.open' is not a DCP metadata class; refusing"):
        read_metadata(ckpt)
    with pytest.raises(CheckpointError, match="refusing to unpickle"):
        convert_to_full(ckpt, tmp_path / "full.ckpt")
    assert not marker.exists()


def test_malicious_non_tensor_entry_runs_no_code(tmp_path):
    """DCP stores non-tensors as pickles and reads them with ``weights_only=False``; we do not."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    dcp.save({"state_dict": {"w": torch.ones(3), "extra": Payload(marker)}}, checkpoint_id=ckpt, no_dist=True)
    torch.save({"step": 1}, ckpt / "meta.pt")
    assert not marker.exists()
    with pytest.raises(CheckpointError, match=r"entry 'state_dict.extra' holds objects other than tensors"):
        convert_to_full(ckpt, tmp_path / "full.ckpt")
    assert not marker.exists()


def test_malicious_meta_file_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"step": 1, "x": Payload(marker)}, tmp_path / "meta.pt")
    with pytest.raises(CheckpointError, match=r"holds objects other than tensors .* refusing to load it"):
        load_file(tmp_path / "meta.pt", "checkpoint file")
    assert not marker.exists()
    (tmp_path / "meta.pt").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(CheckpointError, match="is truncated or corrupt"):
        load_file(tmp_path / "meta.pt", "checkpoint file")


def unshared_save(rank, world, root):
    """Each rank sees its own directory, as ranks on hosts without a shared file system would."""
    from lightning_shardrec.checkpoint import save_sharded

    sharded = make(world, {"t": (8, 4)})
    path = Path(root) / f"host{rank}" / "ckpt"
    try:
        save_sharded(path, sharded, {}, {"step": 1}, rank)
    except CheckpointError as e:
        return str(e), path.exists()
    return None, path.exists()


def test_sharded_save_refuses_a_directory_the_ranks_do_not_share(tmp_path):
    for message, exists in run_ranks(unshared_save, 2, str(tmp_path)):
        assert message is not None and not exists
        assert "rank 1 does not see" in message
        assert "must be on a file system every rank shares" in message
