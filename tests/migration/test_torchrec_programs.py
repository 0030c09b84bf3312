"""Real TorchRec programs (its examples and tutorials, shrunk to CPU) run after ``s/torchrec/lightning_shardrec/``.

The program texts in ``programs/`` keep TorchRec's imports; each test replaces the text ``torchrec``
with ``lightning_shardrec`` and nothing else, then runs it on gloo ranks.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from lightning_shardrec.testing import run_ranks

PROGRAMS = Path(__file__).parent / "programs"


def load(name: str) -> types.ModuleType:
    """The program ``programs/<name>.py`` with ``torchrec`` replaced by ``lightning_shardrec``, as a module."""
    text = (PROGRAMS / f"{name}.py").read_text()
    assert "torchrec" in text
    module = types.ModuleType(f"migrated_{name}")
    exec(compile(text.replace("torchrec", "lightning_shardrec"), f"<migrated {name}>", "exec"), module.__dict__)
    return module


def _golden(rank, world, pipelined):
    program = load("golden_training_dlrm")
    if not pipelined:  # the same program with a plain loop in place of TrainPipelineSparseDist
        from lightning_shardrec.distributed.train_pipeline import train_pipelines

        class Plain:
            def __init__(self, model, optimizer, device):
                self.model, self.optimizer = model, optimizer

            def progress(self, it):
                batch = next(it)
                self.optimizer.zero_grad()
                loss, output = self.model(batch)
                loss.backward()
                self.optimizer.step()
                return output

        program.TrainPipelineSparseDist = Plain
        assert train_pipelines.TrainPipelineSparseDist is not Plain
    return program.train(num_iterations=4)


@pytest.mark.parametrize("world", [1, 2])
def test_golden_training_dlrm_runs_and_the_pipeline_matches_a_plain_loop(world):
    piped = run_ranks(_golden, world, True)
    plain = run_ranks(_golden, world, False)
    for p, q in zip(piped, plain, strict=True):
        assert len(p) == 4 and all(torch.isfinite(torch.tensor(p)))
        assert torch.allclose(torch.tensor(p), torch.tensor(q), atol=1e-6), (p, q)


def test_prediction_example_trains_as_plain_pytorch():
    losses = load("prediction").main()
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] != losses[0]  # the tables and MLPs train


def _sharding_tutorial(rank, world):
    # the intro tutorial's sharded EBC: DMP over the collection itself, output awaited with wait()
    text = """
import torch
import torchrec
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.types import ShardingEnv, ShardingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

def run(rank, world):
    ebc = torchrec.EmbeddingBagCollection(
        device="meta",
        tables=[
            torchrec.EmbeddingBagConfig(name="product_table", embedding_dim=8, num_embeddings=64,
                                        feature_names=["product"], pooling=torchrec.PoolingType.SUM),
            torchrec.EmbeddingBagConfig(name="user_table", embedding_dim=8, num_embeddings=64,
                                        feature_names=["user"], pooling=torchrec.PoolingType.SUM),
        ],
    )
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 0.02})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={"product_table": ParameterConstraints(sharding_types=[ShardingType.ROW_WISE.value])},
    )
    plan = planner.collective_plan(ebc, [EmbeddingBagCollectionSharder()])
    model = torchrec.distributed.DistributedModelParallel(
        module=ebc, env=ShardingEnv.from_local(world, rank), device=torch.device("cpu"), plan=plan,
        sharders=[EmbeddingBagCollectionSharder()],
    )
    mb = torchrec.KeyedJaggedTensor(
        keys=["product", "user"], values=torch.tensor([10, 11, 12, 13, 14, 15]), lengths=torch.tensor([3, 0, 1, 2]),
    )
    pooled = model(mb).wait()
    return plan.plan[""]["product_table"].sharding_type, tuple(pooled.values().shape), model.fused_optimizer.config.lr
"""
    module = types.ModuleType("migrated_tutorial")
    exec(compile(text.replace("torchrec", "lightning_shardrec"), "<migrated tutorial>", "exec"), module.__dict__)
    return module.run(rank, world)


def test_sharding_tutorial_program_runs_on_two_ranks():
    for kind, shape, lr in run_ranks(_sharding_tutorial, 2):
        assert str(getattr(kind, "value", kind)) == "row_wise"
        assert shape == (2, 16) and lr == 0.02


def _retrieval(rank, world):
    model, cpu = load("retrieval_two_tower").train()
    full = model.full_state_dict()  # collective
    if rank != 0:
        return None
    got = cpu.state_dict()
    return sorted(got) == sorted(full) and all(torch.equal(got[k], full[k]) for k in full), sorted(full)


@pytest.mark.parametrize("world", [1, 2])
def test_retrieval_two_tower_trains_and_gathers_its_sharded_state_to_cpu(world):
    same, keys = run_ranks(_retrieval, world)[0]
    assert (
        "two_tower.ebc.embedding_bags.t_userId.weight" in keys and "two_tower.query_proj._mlp.0._linear.weight" in keys
    )
    assert same


def _intro(rank, world):
    model, mb, pooled, printed = load("intro_tutorial").main()
    before = model.full_state_dict()  # collective: every rank gets the full tables
    ebc = {k.split(".")[-2]: v for k, v in before.items()}
    table = {"product": "product_table", "user": "user_table"}
    want = {
        f: torch.nn.functional.embedding_bag(
            mb[f].values(), ebc[t], mb[f].offsets(), mode="sum", include_last_offset=True
        )
        for f, t in table.items()
    }
    err = max(float(((pooled[f] - want[f]).abs() / want[f].abs().clamp_min(1e-3)).max()) for f in table)
    # backward: a gradient with more bits than bf16 keeps; each id is in one bag, SGD(lr=0.02) in backward
    c = torch.randn(3, 128, generator=torch.Generator().manual_seed(rank))
    out = model(mb).wait()
    (out.values() * c).sum().backward()
    after = model.full_state_dict()
    cs = [torch.randn(3, 128, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    moved = {}
    for f, t in table.items():
        ids, bags = mb[f].values(), torch.repeat_interleave(torch.arange(3), mb[f].lengths())
        cols = slice(0, 64) if f == "product" else slice(64, 128)
        got = after[f"embedding_bags.{t}.weight"][ids] - before[f"embedding_bags.{t}.weight"][ids]
        bf16 = sum(x[bags, cols].bfloat16().float() for x in cs) / world
        exact = sum(x[bags, cols] for x in cs) / world
        moved[f] = (got, -0.02 * bf16, -0.02 * exact)
    return err, moved, [line.splitlines()[0] for line in printed], model.plan.plan[""]


@pytest.mark.parametrize("world", [1, 2])
def test_intro_tutorial_runs_with_fp16_forward_and_bf16_backward_comms(world):
    for err, moved, printed, plan in run_ranks(_intro, world):
        assert printed[-2].startswith("product embeddings tensor(") and printed[-1].startswith("user embeddings")
        assert err <= 2**-11 and (err > 0) is (world > 1)  # fp16 (scaled) forward; bf16 would be 2^-9
        kinds = {str(getattr(t.sharding_type, "value", t.sharding_type)) for t in plan.values()}
        assert world == 1 or kinds - {"data_parallel"}, kinds  # on 2 ranks the pooled rows cross the wire
        for f, (got, bf16, exact) in moved.items():
            table = plan[f"{f}_table"]
            wire = world > 1 and str(getattr(table.sharding_type, "value", table.sharding_type)) != "data_parallel"
            want, other = (bf16, exact) if wire else (exact, bf16)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-8, msg=f"{f}: wire {wire}")
            assert not torch.allclose(got, other, rtol=1e-5, atol=1e-8), f"{f}: wire {wire}, other rounding"


def _transfer_learning(rank, world, sharding_type):
    strategy = torch.multiprocessing.get_sharing_strategy()
    try:  # rank 0 reads dmp.state_dict() alone while rank 1 waits in dist.barrier(): a collective there hangs
        return load("transfer_learning").main(64, 16, sharding_type)
    finally:
        torch.multiprocessing.set_sharing_strategy(strategy)


@pytest.mark.needs_fbgemm  # the program imports fbgemm's EmbOptimType itself
@pytest.mark.parametrize("sharding_type", ["row_wise", "column_wise", "table_wise"])
def test_transfer_learning_loads_a_shared_memory_table_into_the_sharded_model(sharding_type):
    got = run_ranks(_transfer_learning, 2, sharding_type, timeout=60)
    emb = got[0][0]
    offsets = []
    for table, pooled, shards in got:
        assert torch.equal(table, emb)  # rank 1 reads rank 0's tensor through shared memory
        assert torch.equal(pooled, emb)  # one id per bag: the pooled rows are the pretrained rows
        for offset, shard in shards:
            rows, cols = shard.shape
            assert torch.equal(shard, emb[offset[0] : offset[0] + rows, offset[1] : offset[1] + cols])
            offsets.append(offset)
    # TorchRec 1.8 (column_wise; its CPU sharder offers no row_wise): one shard [0, 0] on rank 0
    assert len(offsets) == (2 if sharding_type == "row_wise" else 1), offsets
