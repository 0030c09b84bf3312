"""TorchRec's launcher helpers (``torchrec.distributed.comm.get_local_size`` and friends).

Expected values are TorchRec 1.8's answers on the same environments (``/work/venvs/torchrec``; 315 combinations of
``LOCAL_WORLD_SIZE``, ``LOCAL_RANK``, world size and rank compared equal): without a usable local size a world
that 8 divides is taken as hosts of 8, any other as one host; a local rank outside the host falls back to
``rank % local_size``.
"""

from __future__ import annotations

import pytest

from lightning_shardrec.distributed.comm import get_group_rank, get_local_rank, get_local_size, get_num_groups


@pytest.mark.parametrize(
    ("local_world_size", "local_rank", "world", "rank", "expected"),
    [
        (None, None, 2, 1, (2, 1, 0, 1)),
        (None, None, 16, 9, (8, 1, 1, 2)),  # TorchRec's default of 8 ranks per host, when 8 divides the world
        (None, None, 12, 11, (12, 11, 0, 1)),
        ("4", "3", 16, 7, (4, 3, 1, 4)),
        ("4", "5", 16, 9, (4, 1, 2, 4)),  # a local rank past the host: rank % local size
        ("3", None, 16, 9, (16, 9, 0, 1)),  # a local size that does not divide the world: one host
        ("0", None, 4, 3, (4, 3, 0, 1)),  # TorchRec divides by zero here; the world is one host
    ],
)
def test_local_ranks_answer_as_torchrec(monkeypatch, local_world_size, local_rank, world, rank, expected) -> None:
    for name, value in (("LOCAL_WORLD_SIZE", local_world_size), ("LOCAL_RANK", local_rank)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    for name in ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    got = (get_local_size(world), get_local_rank(world, rank), get_group_rank(world, rank), get_num_groups(world))
    assert got == expected


def test_local_ranks_refuse_what_they_cannot_read(monkeypatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="environment variable LOCAL_WORLD_SIZE='two' is not an integer"):
        get_local_size(4)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        get_local_size(0)
    with pytest.raises(RuntimeError, match="pass world_size, or initialize the default process group first"):
        get_local_size()
    with pytest.raises(RuntimeError, match="pass rank, or initialize the default process group first"):
        get_group_rank(4)
    from lightning_shardrec.distributed.comm import get_node_group_size

    assert get_node_group_size(4) == get_local_size(4) == 4  # no 2D parallelism: the local size
    from lightning_shardrec.errors import MissingTorchRecFeatureError

    with pytest.raises(MissingTorchRecFeatureError, match="distributed.comm.intra_and_cross_node_pg"):
        from lightning_shardrec.distributed.comm import intra_and_cross_node_pg  # noqa: F401
    refused = r"model_parallel.DMPCollection \(TorchRec's torchrec.distributed.model_parallel.DMPCollection\) is not"
    with pytest.raises(MissingTorchRecFeatureError, match=refused + " provided: 2D parallelism"):
        from lightning_shardrec.distributed.model_parallel import DMPCollection  # noqa: F401
