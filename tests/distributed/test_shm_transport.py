"""``ShmTransport``: same-host all-to-alls through shared memory, equal to gloo's bit for bit.

Every case runs the same ops on gloo and on the transport and compares the received tensors.
The general suite runs on the process group (the default); ``test_transport_matrix.py`` runs
its multi-rank cases on the transport too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from lightning_shardrec.testing import run_ranks


def _ops(rank, world, seed, count, rows_max, dtypes):
    """``count`` random uneven all-to-alls: ``(inp, out_splits, in_splits)`` for this rank."""
    g = torch.Generator().manual_seed(seed)  # the same splits on every rank
    data = torch.Generator().manual_seed(seed + rank)
    out = []
    for i in range(count):
        splits = torch.randint(0, rows_max, (world, world), generator=g)  # [s][d]: rows s sends d
        dtype = dtypes[i % len(dtypes)]
        shape = (int(splits[rank].sum()), *((3,) if i % 2 else ()))
        inp = (torch.randn(shape, generator=data) * 100).to(dtype)
        out.append((inp, splits[:, rank].tolist(), splits[rank].tolist()))
    return out


def _compare(rank, world, slot_bytes, count, rows_max):
    import torch.distributed as dist

    from lightning_shardrec.distributed.transport.connect import connect

    transport, why = connect(None, slot_bytes=slot_bytes)
    assert transport is not None, why
    ops = _ops(rank, world, 5, count, rows_max, [torch.float32, torch.int64, torch.float16])
    ref = []
    for inp, out_s, in_s in ops:
        out = inp.new_empty((sum(out_s), *inp.shape[1:]))
        dist.all_to_all_single(out, inp, out_s, in_s)
        ref.append(out)
    got, works = [], []
    for inp, out_s, in_s in ops:  # all issued before any is waited for: more ops in flight than slots
        out = inp.new_full((sum(out_s), *inp.shape[1:]), 7)
        works.append(transport.all_to_all(out, inp, out_s, in_s))
        got.append(out)
    for w in reversed(works):  # waiting for a later op completes the earlier ones first
        w.wait()
    assert all(w.is_completed() for w in works)
    same = [torch.equal(a, b) for a, b in zip(got, ref, strict=True)]
    # again, one op at a time (the slots are reused many times over)
    for i, (inp, out_s, in_s) in enumerate(ops):
        out = torch.empty_like(ref[i])
        transport.all_to_all(out, inp, out_s, in_s).wait()
        same.append(torch.equal(out, ref[i]))
    transport.close()
    return same


@pytest.mark.parametrize("world", [2, 3])
def test_uneven_all_to_alls_equal_gloo(world):
    for same in run_ranks(_compare, world, 1 << 20, 12, 40):
        assert all(same)


def test_chunks_larger_than_a_slot_go_point_to_point():
    # 4 KiB slots: chunks of up to 300 rows x 3 x 8 bytes exceed them, the small ones do not
    for same in run_ranks(_compare, 2, 4096, 9, 300):
        assert all(same)


def _bf16_wire(rank, world):
    from lightning_shardrec.distributed.transport.connect import connect

    transport, _ = connect(None)
    g = torch.Generator().manual_seed(rank)
    inp = torch.randn(world * 5, 4, generator=g)
    out = torch.empty_like(inp)
    transport.all_to_all(out, inp, wire=torch.bfloat16).wait()
    transport.close()
    return inp, out


def test_the_wire_dtype_is_cast_inside_the_copies():
    got = run_ranks(_bf16_wire, 2)
    for r, (_, out) in enumerate(got):
        sent = [inp[5 * r : 5 * r + 5] for inp, _ in got]  # what every source sends rank r
        assert torch.equal(out, torch.cat(sent).to(torch.bfloat16).float())


def _timeouts(rank, world):
    import datetime

    import torch.distributed as dist

    from lightning_shardrec.distributed.transport.connect import connect

    group = dist.new_group(timeout=datetime.timedelta(seconds=17))
    own, default, given = connect(group)[0], connect(None)[0], connect(None, 5.0)[0]
    return own.timeout, default.timeout, given.timeout


def test_a_transport_waits_as_long_as_its_group():
    assert run_ranks(_timeouts, 2) == [(17.0, 60.0, 5.0)] * 2  # the test pool's default group: 60 s


def _fallback(rank, world, bad_ranks, mode):
    mode = mode[rank] if isinstance(mode, list) else mode
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv
    from lightning_shardrec.distributed.transport import connect as shm_connect
    from lightning_shardrec.distributed.transport import shm as shm_transport

    saved = shm_transport.SHM_DIR
    if rank in bad_ranks:
        shm_transport.SHM_DIR = "/nonexistent-shm"
    try:
        env = shm_connect.attach(ShardingEnv.from_process_group(), mode)
        return env.transport is not None
    except (RuntimeError, ValueError) as e:
        return str(e)
    finally:
        shm_transport.SHM_DIR = saved


def test_every_rank_falls_back_when_one_rank_cannot_share_memory():
    assert run_ranks(_fallback, 2, [], "auto") == [True, True]
    assert run_ranks(_fallback, 2, [], "pg") == [False, False]
    assert run_ranks(_fallback, 3, [2], "auto") == [False, False, False]
    for message in run_ranks(_fallback, 2, [1], "shm"):
        assert message == (
            "comm_transport='shm': the ranks cannot share memory (rank 1: no writable /nonexistent-shm); "
            "use comm_transport='auto' to fall back to the process group"
        )
    for message in run_ranks(_fallback, 2, [], ["auto", "pg"]):  # every rank says so; none hangs in connect()
        assert message == (
            "comm_transport differs between ranks (rank 0: 'auto', rank 1: 'pg'); "
            "give every rank the same comm_transport and LIGHTNING_SHARDREC_TRANSPORT"
        )


def test_an_unknown_transport_lists_the_choices(monkeypatch):
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv
    from lightning_shardrec.distributed.transport.connect import TRANSPORT_ENV, attach

    with pytest.raises(ValueError, match="unknown comm_transport 'tcp'; available: auto, shm, pg"):
        ShardRecStrategy(comm_transport="tcp")
    monkeypatch.setenv(TRANSPORT_ENV, "nvlink")
    with pytest.raises(ValueError, match="unknown LIGHTNING_SHARDREC_TRANSPORT 'nvlink'; available: auto, shm, pg"):
        attach(ShardingEnv(rank=0, world_size=2), "auto")


def _forked_child_closes(rank, world):
    from lightning_shardrec.distributed.transport.connect import connect

    transport, _ = connect(None)
    pid = os.fork()
    if pid == 0:  # a DataLoader worker, say: it must not keep the rank's FIFO ends open
        os._exit(0 if transport.closed else 1)
    _, status = os.waitpid(pid, 0)
    x = torch.arange(4.0) + rank
    out = torch.empty(4)
    transport.all_to_all(out, x).wait()  # the parent's transport still works
    transport.close()
    return os.waitstatus_to_exitcode(status), out.tolist()


def test_a_forked_child_drops_the_transport():
    got = run_ranks(_forked_child_closes, 2)
    assert got == [(0, [0.0, 1.0, 1.0, 2.0]), (0, [2.0, 3.0, 3.0, 4.0])]


_DYING_PEER = textwrap.dedent(
    """
    import os, sys, torch, torch.distributed as dist
    from lightning_shardrec.distributed.transport.connect import connect
    rank = int(sys.argv[1])
    dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
    transport, _ = connect(None, 120.0)
    x = torch.zeros(8)
    transport.all_to_all(torch.empty(8), x).wait()
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed rank
    try:
        transport.all_to_all(torch.empty(8), x).wait()
    except RuntimeError as e:
        print(e)
    """
)


def test_a_rank_that_dies_is_named_at_once(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(_DYING_PEER)
    store = tmp_path / "store"
    procs = [
        subprocess.Popen([sys.executable, str(script), str(r), str(store)], stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    # not the 120 s timeout: the FIFO from rank 1 reached end of file when its process went away
    assert "ShmTransport: connection closed by peer (rank 1 of the group exited)" in outs[0]


def _train(rank, world, transport, precision):
    from test_comm_precision import _flat
    from test_comm_precision import _train as train

    from lightning_shardrec.distributed.transport.connect import TRANSPORT_ENV

    os.environ[TRANSPORT_ENV] = transport
    try:
        got = train(rank, world, ["table_wise", "column_wise", "row_wise", "grid_and_rows"], [precision])
        return {k: _flat(v) for k, v in got.items()}
    finally:
        del os.environ[TRANSPORT_ENV]


@pytest.mark.parametrize(("world", "precision"), [(2, "fp32"), (3, "fp32"), (2, "bf16"), (2, "fp16")])
def test_training_on_shared_memory_equals_the_process_group(world, precision):
    """Bit for bit on 2 ranks. On 3 the dense all-reduce adds in rank order where gloo's ring adds in
    another, so the dense layers (and through them everything) may differ in the last bits."""
    shm, pg = run_ranks(_train, world, "shm", precision), run_ranks(_train, world, "pg", precision)
    for a, b in zip(shm, pg, strict=True):
        for case in a:
            for x, y in zip(a[case], b[case], strict=True):
                if world == 2:
                    assert torch.equal(x, y), case
                else:
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=str(case))


def _reductions(rank, world, n):
    import torch.distributed as dist

    from lightning_shardrec.distributed.transport.connect import connect

    transport, _ = connect(None)
    x = torch.randn(n, 3, generator=torch.Generator().manual_seed(rank))
    everyone = [torch.empty(n, 3) for _ in range(world)]
    dist.all_gather(everyone, x)
    in_rank_order = everyone[0].clone()
    for other in everyone[1:]:
        in_rank_order += other
    gloo = x.clone()
    dist.all_reduce(gloo)
    mine = x.clone()
    transport.all_reduce(mine)
    rows = [n // world + (1 if r == 0 else 0) for r in range(world)]  # uneven blocks
    rows[-1] = n - sum(rows[:-1])
    scattered = transport.reduce_scatter(x, rows)
    gathered = transport.all_gather(x[: rows[rank]], rows)
    transport.close()
    lo = sum(rows[:rank])
    want_gathered = torch.cat([e[: rows[r]] for r, e in enumerate(everyone)])
    return (
        torch.equal(mine, in_rank_order),
        torch.equal(scattered, in_rank_order[lo : lo + rows[rank]]),
        torch.equal(gathered, want_gathered),
        torch.equal(mine, gloo),
        mine,
    )


@pytest.mark.parametrize("world", [2, 3])
def test_reductions_sum_in_rank_order_the_same_bits_everywhere(world):
    got = run_ranks(_reductions, world, 1001)  # not a multiple of the world size
    for all_reduced, scattered, gathered, as_gloo, mine in got:
        assert all_reduced and scattered and gathered and torch.equal(mine, got[0][4])
        if world == 2:
            assert as_gloo  # a + b either way
