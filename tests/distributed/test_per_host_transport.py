"""``HostTransport``: shared memory inside each host, the process group between hosts.

Four gloo ranks on this machine play several hosts: each "host" gets its own directory for
``/dev/shm`` (``shm.SHM_DIR``), so its ranks share memory only with each other, as on separate
nodes. Every all-to-all must equal gloo's bit for bit; the multi-node harness
(``tests/multinode``) runs the same code on real namespace nodes.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.testing import pretend_hosts, run_ranks


def _all_to_alls(rank, world, layout):
    import torch.distributed as dist

    from lightning_shardrec.distributed.transport.per_host import HostTransport, connect_hosts, shm_hosts

    with pretend_hosts(rank, layout):
        hosts, _, why = shm_hosts()
        transport, why = connect_hosts()
        assert isinstance(transport, HostTransport), why
        g = torch.Generator().manual_seed(3)  # the same splits on every rank
        data = torch.Generator().manual_seed(10 + rank)
        same, works, got, want = [], [], [], []
        for i, dtype in enumerate([torch.float32, torch.int64, torch.float32, torch.float16] * 2):
            splits = torch.randint(0, 5, (world, world), generator=g)  # [s][d]: rows s sends d
            shape = (int(splits[rank].sum()), *((3,) if i % 2 else ()))
            inp = (torch.randn(shape, generator=data) * 100).to(dtype)
            out_s, in_s = splits[:, rank].tolist(), splits[rank].tolist()
            ref = inp.new_empty((sum(out_s), *inp.shape[1:]))
            dist.all_to_all_single(ref, inp, out_s, in_s)
            out = inp.new_full(ref.shape, 7)
            works.append(transport.all_to_all(out, inp, out_s, in_s))  # all issued before any wait
            got.append(out)
            want.append(ref)
        for w in reversed(works):
            w.wait()
        same = [torch.equal(a, b) for a, b in zip(got, want, strict=True)]
        # bf16 on the wire: rounded alike on every path (shared memory, point to point, own chunk)
        x = torch.randn(world * 2, 3, generator=data)
        ref = torch.empty_like(x)
        dist.all_to_all_single(ref, x.bfloat16().float())
        out = torch.empty_like(x)
        transport.all_to_all(out, x, wire=torch.bfloat16).wait()
        same.append(torch.equal(out, ref))
        # the reductions: sums in rank order
        rows = [3, 1, 2, 2][:world]
        y = torch.randn(sum(rows), 4, generator=data)
        summed = transport.reduce_scatter(y, rows)
        gathered = transport.all_gather(summed, rows)
        ref_sum = y.clone()
        dist.all_reduce(ref_sum)
        transport.close()
        return hosts, same, torch.allclose(gathered, ref_sum, atol=1e-5)


@pytest.mark.parametrize(("layout", "hosts"), [("aabb", [[0, 1], [2, 3]]), ("abbc", [[0], [1, 2], [3]])])
def test_all_to_alls_equal_gloo_with_shared_memory_inside_each_host(layout, hosts):
    for found, same, reduced in run_ranks(_all_to_alls, 4, layout):
        assert found == hosts
        assert all(same), same
        assert reduced


def _attach(rank, world, layout, mode):
    import torch.distributed as dist

    from lightning_shardrec.distributed.comm.collectives import ShardingEnv
    from lightning_shardrec.distributed.transport.connect import attach
    from lightning_shardrec.distributed.transport.per_host import transport_report

    with pretend_hosts(rank, layout):
        env = ShardingEnv(rank, world, None, 2)
        try:
            env = attach(env, mode)
        except RuntimeError as e:
            dist.barrier()
            return str(e)
        report = transport_report(env)
        if env.transport is not None:
            env.transport.close()
        return type(env.transport).__name__, report


def test_auto_takes_shared_memory_per_host_and_says_so():
    results = run_ranks(_attach, 4, "aabb", "auto")
    kind, report = results[0]
    assert {r[0] for r in results} == {"HostTransport"}
    lines = report.splitlines()
    assert lines[0] == "lightning_shardrec transport: the plan assumed 2 hosts x 2 ranks; the ranks run on 2 hosts"
    assert lines[1].endswith("(ranks 0-1): shared memory")
    assert lines[2].endswith("(ranks 2-3): shared memory")
    assert lines[3] == "  between hosts: the process group (gloo)"


def test_required_shm_across_hosts_is_refused_and_pg_is_reported():
    refused = run_ranks(_attach, 4, "aabb", "shm")
    assert all(r.startswith("comm_transport='shm': the ranks cannot share memory") for r in refused), refused
    kind, report = run_ranks(_attach, 4, "aabb", "pg")[0]
    assert kind == "NoneType"
    assert "): the process group (gloo)" in report


def test_a_plan_for_other_hosts_is_pointed_out():
    kind, report = run_ranks(_attach, 4, "aaab", "auto")[0]  # 3 + 1 ranks, but the plan assumed 2 x 2
    assert kind == "HostTransport"
    assert report.splitlines()[-1] == (
        "  note: the plan's hosts (0-1, 2-3) are not the ranks' (0-2, 3); "
        "set Trainer(num_nodes=..., devices=...) to the cluster's"
    )


def test_scattered_hosts_keep_the_process_group():
    from lightning_shardrec.distributed.transport.per_host import _span

    assert run_ranks(_attach, 4, "abab", "auto")[0][0] == "NoneType"  # a host's ranks are not consecutive
    assert _span([0, 2]) == "0, 2"


def _one_rank_without_shm(rank, world):
    from lightning_shardrec.distributed.transport import shm
    from lightning_shardrec.distributed.transport.per_host import connect_hosts

    with pretend_hosts(rank, "aabb"):
        if rank == 3:
            shm.SHM_DIR = "/nonexistent/shm"
        return connect_hosts()


def test_a_host_without_shared_memory_keeps_the_process_group_everywhere():
    for transport, why in run_ranks(_one_rank_without_shm, 4):
        assert transport is None
        assert why == "rank 3: no writable /nonexistent/shm"
