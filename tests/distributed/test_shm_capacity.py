"""``ShmTransport`` never turns a working run into a failure: pages reserved at connect (or the
process group on every rank), a full ``/dev/shm`` spills chunks point to point, records checked,
nothing left in ``/dev/shm``."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_shardrec.testing import run_ranks

MIB = 1 << 20


def _in_private_dir(rank, fn, *args):
    """``fn(*args)`` with the transport's files in a directory of this test (other runs share /dev/shm)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    from lightning_shardrec.distributed.transport import shm

    name = [tempfile.mkdtemp(prefix="shardrec-test-", dir="/dev/shm") if rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    saved, shm.SHM_DIR = shm.SHM_DIR, name[0]
    try:
        return fn(*args), name[0]
    finally:
        shm.SHM_DIR = saved
        dist.barrier()
        if rank == 0:
            shutil.rmtree(name[0], ignore_errors=True)


def _spill(rank, world, room, rows):
    import torch.distributed as dist

    from lightning_shardrec.distributed.transport import records
    from lightning_shardrec.distributed.transport.connect import connect

    os.environ[records.LIMIT_ENV] = str(records._reserved + room)  # room beyond what this worker holds already
    try:
        transport, why = connect(None, slot_bytes=8 * MIB)  # reserves 4 slots x 1 MiB per peer
        assert transport is not None, why
        results = []
        for i, n in enumerate(rows):  # n rows of 1024 floats (4 KiB) to every rank: 4 MiB at n = 1024
            inp = torch.randn(world * n, 1024, generator=torch.Generator().manual_seed(10 * rank + i))
            want, got = torch.empty_like(inp), torch.full_like(inp, 7.0)
            dist.all_to_all_single(want, inp)
            transport.all_to_all(got, inp).wait()
            results.append(torch.equal(got, want))
        spilled = transport.spilled
        transport.close()
        return results, spilled
    finally:
        del os.environ[records.LIMIT_ENV]


def test_chunks_without_room_for_their_pages_go_point_to_point():
    # 4 MiB may be reserved (connect takes all of it): 512 KiB chunks fit the reserved pages,
    # 2 MiB ones cannot grow a slot and spill, every op equals gloo's
    for results, spilled in run_ranks(_spill, 2, 4 * MIB, [128, 512, 512, 128, 512, 256, 512, 128]):
        assert all(results) and spilled == 4
    for results, spilled in run_ranks(_spill, 2, 64 * MIB, [128, 512, 512]):  # room: the slots grow
        assert all(results) and spilled == 0


def _too_small(rank, world, room):
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv
    from lightning_shardrec.distributed.transport import records, shm
    from lightning_shardrec.distributed.transport.connect import attach

    if room[rank] is not None:
        os.environ[records.LIMIT_ENV] = str(records._reserved + room[rank])
    try:
        env = attach(ShardingEnv.from_process_group(), "auto")
        try:
            attach(ShardingEnv.from_process_group(), "shm")
        except RuntimeError as e:
            torch.distributed.barrier()  # every rank has cleaned up
            return env.transport is None, str(e), os.listdir(shm.SHM_DIR)
    finally:
        os.environ.pop(records.LIMIT_ENV, None)


def _too_small_in_dir(rank, world, room):
    return _in_private_dir(rank, _too_small, rank, world, room)


def test_a_shm_without_room_for_the_first_pages_keeps_the_process_group_on_every_rank():
    for (fell_back, message, left), where in run_ranks(_too_small_in_dir, 2, [None, 1 * MIB]):
        assert fell_back
        assert (
            "comm_transport='shm': the ranks cannot share memory (rank 1: cannot create files or reserve 4 x "
            in message
        )
        assert (
            f"1048576 bytes in {where}: [Errno 28] " in message
            and "bytes would exceed LIGHTNING_SHARDREC_SHM_BYTES=" in message
        )
        assert left == []  # every file unlinked


def test_a_bad_limit_is_named():
    from lightning_shardrec.distributed.transport.records import LIMIT_ENV, limit

    os.environ[LIMIT_ENV] = "lots"
    try:
        with pytest.raises(ValueError, match="LIGHTNING_SHARDREC_SHM_BYTES must be a number of bytes >= 0, got 'lots'"):
            limit()
    finally:
        del os.environ[LIMIT_ENV]


def _disagree(rank, world):
    from lightning_shardrec.distributed.transport.connect import connect

    transport, _ = connect(None)
    inp = torch.arange(6.0) + 10 * rank
    out = torch.empty(6)
    try:  # rank 0 sends rank 1 three rows, rank 1 expects two from it (and one more from itself)
        if rank == 0:
            transport.all_to_all(out, inp, [3, 3], [3, 3]).wait()
        else:
            transport.all_to_all(out, inp, [2, 4], [3, 3]).wait()
        return "completed"
    except RuntimeError as e:
        return str(e)
    finally:
        transport.close()


def test_ranks_whose_splits_disagree_fail_naming_both():
    got = run_ranks(_disagree, 2)
    assert got[0] == "completed"  # what rank 0 expects from rank 1 is what rank 1 sent
    assert got[1] == (
        "ShmTransport: op 0: rank 0 sent rank 1 12 bytes of torch.float32 through its slot, while rank 1 expects "
        "8 bytes of torch.float32 through its slot: the ranks issued different all-to-alls (their splits or dtypes "
        "disagree)"
    )


def _indivisible(rank, world):
    from lightning_shardrec.distributed.transport.connect import connect

    transport, _ = connect(None)
    try:
        transport.all_to_all(torch.empty(4), torch.arange(5.0))
    except ValueError as e:
        return str(e)
    finally:
        transport.close()


def test_default_splits_that_do_not_divide_are_refused():
    for rank, message in enumerate(run_ranks(_indivisible, 2)):
        assert message == (
            f"ShmTransport.all_to_all on rank {rank}: inp has 5 rows, not a multiple of the 2 ranks; "
            "pass explicit splits"
        )


def _peer_dies_in_setup(rank, world):
    from lightning_shardrec.distributed.transport import connect as shm_connect

    calls = []
    gather = shm_connect._gather

    def failing(info, pg, w):
        calls.append(1)
        if len(calls) == 2:  # after every rank created its files: as a collective failing on a lost peer
            gather(info, pg, w)
            raise RuntimeError("Connection closed by peer")
        return gather(info, pg, w)

    shm_connect._gather = failing
    try:
        shm_connect.connect(None)
    except RuntimeError as e:
        torch.distributed.barrier()  # every rank has cleaned up
        return str(e), os.listdir(shm_connect.shm.SHM_DIR)
    finally:
        shm_connect._gather = gather


def _peer_dies_in_private_dir(rank, world):
    return _in_private_dir(rank, _peer_dies_in_setup, rank, world)


def test_files_are_unlinked_when_setup_fails_midway():
    for (message, left), _ in run_ranks(_peer_dies_in_private_dir, 2):
        assert message == "Connection closed by peer" and left == []


def test_a_record_out_of_order_or_of_another_size_is_refused():
    from lightning_shardrec.distributed.transport.records import BIG, SLOT, SPILL, Record, check, code_of

    fp32 = code_of(torch.float32, SLOT)
    check(Record(3, 16, fp32), 3, 1, 0, 16, torch.float32, big=False)  # as expected
    check(Record(3, 16, code_of(torch.float32, SPILL)), 3, 1, 0, 16, torch.float32, big=False)  # spilled: fine
    with pytest.raises(RuntimeError, match=r"ShmTransport: rank 0 expected op 3 from rank 1 and got op 4: ops must be"):
        check(Record(4, 16, fp32), 3, 1, 0, 16, torch.float32, big=False)
    with pytest.raises(RuntimeError, match=r"op 3: rank 1 sent rank 0 16 bytes of torch.bfloat16 through its slot, wh"):
        check(Record(3, 16, code_of(torch.bfloat16, SLOT)), 3, 1, 0, 16, torch.float32, big=False)
    with pytest.raises(RuntimeError, match=r"through point to point \(larger than a slot\), while rank 0 expects 16"):
        check(Record(3, 16, code_of(torch.float32, BIG)), 3, 1, 0, 16, torch.float32, big=False)
