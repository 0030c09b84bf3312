"""``comm_precision``: pooled outputs and their gradients on the wire in bf16 / fp16.

fp32 (the default) stays bit-exact. Reduced precision stays within the tolerances
``docs/operations.md`` states after ``STEPS`` training steps, for every sharding type.
"""

from __future__ import annotations

import pytest
import torch
from _plans import kjt_of, splits
from test_sharded_ebc import LR, MIXED, TYPES, Rec, loss_fn, make_data, make_optimizers, plan_for

from lightning_shardrec.configs import FusedOptimConfig, PoolingType
from lightning_shardrec.distributed.comm.qcomm import (
    FP16_TARGET,
    CommPrecision,
    WirePrecision,
    decode,
    directions,
    encode,
    fp16_exponent,
    parse_wire,
)
from lightning_shardrec.planner import ShardingPlan
from lightning_shardrec.testing import run_ranks

# After STEPS steps of the EBC exactness model (lr 0.1), reduced-precision comms vs fp32 comms:
TOLERANCE = {
    "bf16": {"rtol": 2e-2, "atol": 2e-3},  # 8-bit mantissa: 2^-9 relative per value and direction
    "fp16": {"rtol": 2e-3, "atol": 2e-4},  # 11-bit mantissa, scaled per sender: 2^-12
}
PRECISIONS = ["default", "fp32", "bf16", "fp16"]
# TorchRec's intro tutorial (forward FP16, backward BF16), and fp32 one way only
MIXED_WIRE = (
    WirePrecision(CommPrecision.FP16, CommPrecision.BF16),
    WirePrecision(CommPrecision.FP32, CommPrecision.FP16),
)


def test_fp16_scale_cannot_overflow_and_keeps_small_gradients():
    x = torch.tensor([3.0e4, -7.5e4, 1.0e-3, 0.0, 2.5e5])  # beyond fp16's 65504 unscaled
    wire, wire_splits = encode(x, [2, 0, 3], CommPrecision.FP16)
    assert wire.dtype == torch.float16 and wire_splits == [3, 1, 4]
    assert torch.isfinite(wire).all() and wire.abs().max() <= FP16_TARGET
    torch.testing.assert_close(decode(wire, wire_splits, CommPrecision.FP16), x, rtol=2**-11, atol=0)
    tiny = torch.tensor([3e-9, -1e-10, 4e-9])  # below fp16's smallest subnormal (6e-8) unscaled
    got = decode(*encode(tiny, [3], CommPrecision.FP16), CommPrecision.FP16)
    torch.testing.assert_close(got, tiny, rtol=2**-11, atol=0)
    assert fp16_exponent(torch.zeros(4)) == 0 and fp16_exponent(torch.tensor([float("inf")])) == 0
    assert fp16_exponent(torch.empty(0)) == 0


def test_bf16_and_fp32_wire():
    x = torch.randn(10)
    wire, s = encode(x, [4, 6], CommPrecision.FP32)
    assert wire is x and s == [4, 6]
    wire, s = encode(x, [4, 6], CommPrecision.BF16)
    assert wire.dtype == torch.float16 and s == [4, 6]  # bf16 bits
    torch.testing.assert_close(decode(wire, s, CommPrecision.BF16), x, rtol=2**-8, atol=0)


def test_unknown_precision_lists_the_choices():
    assert CommPrecision.parse("BF16") is CommPrecision.BF16
    with pytest.raises(ValueError, match="unknown comm_precision 'int8'; available: fp32, bf16, fp16"):
        CommPrecision.parse("int8")


def test_wire_precision_per_direction_parses_and_names_bad_values():
    assert parse_wire("FP16/bf16") == WirePrecision(CommPrecision.FP16, CommPrecision.BF16)
    assert parse_wire("fp16/bf16").value == "fp16/bf16"
    assert parse_wire("bf16/bf16") is CommPrecision.BF16  # one precision when both directions agree
    assert parse_wire(WirePrecision(CommPrecision.FP16, CommPrecision.FP16)) is CommPrecision.FP16
    assert directions("fp16") == (CommPrecision.FP16, CommPrecision.FP16)
    with pytest.raises(
        ValueError, match=r"unknown comm_precision 'fp16/int8'; available: fp32, bf16, fp16, <forward>/"
    ):
        parse_wire("fp16/int8")
    with pytest.raises(ValueError, match=r"unknown comm_precision 'fp16/bf16/fp32'"):
        parse_wire("fp16/bf16/fp32")


def _mixed_all_to_all(rank, world):
    """all_to_all_grad and all_to_all_pooled with a WirePrecision vs the wire format of each direction."""
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, all_to_all_grad
    from lightning_shardrec.distributed.comm.pooled_all_to_all import ColumnBlocks, all_to_all_pooled

    env = ShardingEnv.from_process_group()
    rows = [[2, 3], [1, 4]]  # rows[s][d]: rows source s sends destination d (uneven: one scale per sender)
    xs = [torch.randn(sum(rows[s]), 3, generator=torch.Generator().manual_seed(s)) * 10.0 ** (2 * s) for s in range(2)]
    ups = [
        torch.randn(rows[0][d] + rows[1][d], 3, generator=torch.Generator().manual_seed(9 + d)) * 1e-3 for d in range(2)
    ]
    same = []
    for precision in MIXED_WIRE:
        fwd, bwd = directions(precision)
        x = xs[rank].clone().requires_grad_()
        out = all_to_all_grad(x, [rows[0][rank], rows[1][rank]], rows[rank], env, precision)
        out.backward(ups[rank])
        sent = [decode(*encode(xs[s].reshape(-1), [n * 3 for n in rows[s]], fwd), fwd) for s in range(2)]
        want = torch.cat([sent[s].split([n * 3 for n in rows[s]])[rank] for s in range(2)]).view(-1, 3)
        back = [
            decode(*encode(ups[d].reshape(-1), [rows[0][d] * 3, rows[1][d] * 3], bwd), bwd).split(
                [rows[0][d] * 3, rows[1][d] * 3]
            )[rank]
            for d in range(2)
        ]
        same.append(("a2a", precision.value, torch.equal(out, want), torch.equal(x.grad.reshape(-1), torch.cat(back))))
        # pooled: every source sends each destination its [B_d, 2] columns; columns side by side
        layout = ColumnBlocks.from_columns(list(range(4)), [2, 2])
        batch = [2, 3]
        p = (xs[rank][: sum(batch), :2] * 1.0).clone().requires_grad_()
        pooled = all_to_all_pooled(p, batch, layout, 1.0, env, precision)
        up = torch.randn(batch[rank], 4, generator=torch.Generator().manual_seed(20 + rank))
        pooled.backward(up)
        recv = [
            decode(*encode(xs[s][: sum(batch), :2].reshape(-1), [b * 2 for b in batch], fwd), fwd) for s in range(2)
        ]
        want_p = torch.cat([recv[s].split([b * 2 for b in batch])[rank].view(-1, 2) for s in range(2)], dim=1)
        ups_p = [torch.randn(batch[d], 4, generator=torch.Generator().manual_seed(20 + d)) for d in range(2)]
        grads = [
            decode(*encode(ups_p[d].view(-1, 2, 2).transpose(0, 1).reshape(-1), [batch[d] * 2] * 2, bwd), bwd)
            for d in range(2)
        ]
        want_g = torch.cat([grads[d].split([batch[d] * 2] * 2)[rank] for d in range(2)]).view(-1, 2)
        same.append(("pooled", precision.value, torch.equal(pooled, want_p), torch.equal(p.grad, want_g)))
    return same


def test_each_direction_travels_in_its_own_precision():
    for rank, same in enumerate(run_ranks(_mixed_all_to_all, 2)):
        for what, precision, same_out, same_grad in same:
            assert same_out, f"rank {rank} {what} {precision}: forward differs from its wire format"
            assert same_grad, f"rank {rank} {what} {precision}: gradient differs from its wire format"


def _train(rank, world, kinds, precisions=PRECISIONS):
    from lightning_shardrec.distributed import DistributedModelParallel

    results = {}
    for kind in kinds:
        for precision in precisions:
            model = Rec(PoolingType.MEAN, True)
            extra = {} if precision == "default" else {"comm_precision": precision}
            dmp = DistributedModelParallel(
                model,
                plan=ShardingPlan({"ebc": plan_for(kind, world)}),
                embedding_optimizer=FusedOptimConfig(optimizer="adagrad", lr=LR, eps=1e-8),
                kernel="torch",
                **extra,
            )
            dense_opt = make_optimizers(list(dmp.dense_parameters()), "adagrad")
            sizes = splits(world, False)
            lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
            first = None
            for bags, wts, dense, label in make_data(5, True):
                logits, pooled = dmp(dense[lo:hi], kjt_of(bags, wts, lo, hi))
                first = pooled.detach().clone() if first is None else first
                dense_opt.zero_grad()
                loss_fn(logits, label[lo:hi], world).backward()
                dense_opt.step()
            shards = {k: [w.detach().clone() for _, w in v] for k, v in dmp.local_shards().items()}
            top = {k: v.detach().clone() for k, v in dmp.module.top.state_dict().items()}
            results[kind, precision] = (first, shards, top)
    return results


def _flat(result) -> list[torch.Tensor]:
    first, shards, top = result
    return [first, *(w for k in sorted(shards) for w in shards[k]), *(top[k] for k in sorted(top))]


def test_reduced_precision_comms_stay_close_for_every_sharding_type():
    kinds = [*TYPES, *MIXED]
    per_rank = run_ranks(_train, 2, kinds)
    for res in per_rank:
        for kind in kinds:
            exact = _flat(res[kind, "fp32"])
            for a, b in zip(_flat(res[kind, "default"]), exact, strict=True):
                assert torch.equal(a, b), f"{kind}: comm_precision='fp32' must be today's exact path"
            for precision, tol in TOLERANCE.items():
                low = _flat(res[kind, precision])
                for a, b in zip(low, exact, strict=True):
                    torch.testing.assert_close(a, b, **tol, msg=f"{kind} {precision}")
                moved = any(not torch.equal(a, b) for a, b in zip(low, exact, strict=True))
                # data-parallel tables send no pooled output: nothing to round
                assert moved is (kind != "data_parallel"), f"{kind} {precision}: comms not in {precision}"


def _train_sequence(rank, world, kinds):
    import test_sharded_ec as ec

    from lightning_shardrec.distributed import DistributedModelParallel

    proj = ec.projections()
    results = {}
    for kind in kinds:
        for precision in ("fp32", "bf16"):
            dmp = DistributedModelParallel(
                ec.Seq(),
                plan=ShardingPlan({"ec": ec.plan_for(kind, world)}),
                embedding_optimizer=FusedOptimConfig(optimizer="sgd", lr=ec.LR),
                kernel="torch",
                comm_precision=precision,
            )
            dense = list(dmp.dense_parameters())
            dense_opt = torch.optim.SGD(dense, lr=ec.LR) if dense else None
            sizes = splits(world, False)
            lo, hi = sum(sizes[:rank]), sum(sizes[: rank + 1])
            first = None
            for bags in ec.make_data(5):
                out = dmp(ec.kjt_of(bags, lo, hi))
                first = [out[f].values().detach() for f in ec.FEATURES] if first is None else first
                if dense_opt is not None:
                    dense_opt.zero_grad()
                (ec.seq_loss(out, proj) * world / ec.GLOBAL_BATCH).backward()
                if dense_opt is not None:
                    dense_opt.step()
            shards = [w.detach().clone() for k in sorted(dmp.local_shards()) for _, w in dmp.local_shards()[k]]
            results[kind, precision] = [*first, *shards]
    return results


def test_sequence_outputs_follow_comm_precision():
    import test_sharded_ec as ec

    per_rank = run_ranks(_train_sequence, 2, ec.TYPES)
    for res in per_rank:
        for kind in ec.TYPES:
            exact, low = res[kind, "fp32"], res[kind, "bf16"]
            for a, b in zip(low, exact, strict=True):
                torch.testing.assert_close(a, b, **TOLERANCE["bf16"], msg=f"sequence {kind}")
            moved = any(not torch.equal(a, b) for a, b in zip(low, exact, strict=True))
            assert moved is (kind != "data_parallel"), f"sequence {kind}: rows not sent in bf16"


def _quantized_reduce_scatter(rank, world, layouts):
    """reduce_scatter_rows in bf16/fp16 vs the per-sender wire format applied block by block."""
    from lightning_shardrec.distributed.comm.collectives import ShardingEnv, reduce_scatter_rows

    env = ShardingEnv.from_process_group()
    same = []
    for rows in layouts:
        # every rank's input and upstream gradient; senders differ in magnitude (fp16 scales per sender)
        xs = [
            torch.randn(sum(rows), 2, 3, generator=torch.Generator().manual_seed(s)) * 10.0 ** (3 * s - 3)
            for s in range(world)
        ]
        ups = [
            torch.randn(rows[s], 2, 3, generator=torch.Generator().manual_seed(50 + s)) * 10.0 ** (2 - 2 * s)
            for s in range(world)
        ]
        for precision in (CommPrecision.BF16, CommPrecision.FP16, *MIXED_WIRE):
            fwd, bwd = directions(precision)
            x = xs[rank].clone().requires_grad_()
            out = reduce_scatter_rows(x, rows, env, precision)
            out.backward(ups[rank])
            blocks = [r * 6 for r in rows]
            sent = [decode(*encode(xs[s].reshape(-1), blocks, fwd), fwd).split(blocks)[rank] for s in range(world)]
            want_out = torch.stack(sent).sum(0).view(rows[rank], 2, 3)  # summed in fp32 after the exchange
            want_grad = torch.cat([decode(*encode(u.reshape(-1), [u.numel()], bwd), bwd) for u in ups])
            same.append((rows, precision.value, torch.equal(out, want_out), torch.equal(x.grad.reshape(-1), want_grad)))
    return same


@pytest.mark.parametrize(("world", "layouts"), [(2, [[3, 3], [1, 4]]), (3, [[2, 0, 4], [2, 2, 2]])])
def test_quantized_reduce_scatter_is_the_wire_format_block_by_block(world, layouts):
    for rank, same in enumerate(run_ranks(_quantized_reduce_scatter, world, layouts)):
        for rows, precision, same_out, same_grad in same:
            assert same_out, f"rank {rank} rows {rows} {precision}: forward differs"
            assert same_grad, f"rank {rank} rows {rows} {precision}: gradient differs"
