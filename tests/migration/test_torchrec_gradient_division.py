"""Embedding gradients are divided by the world size, as TorchRec 1.8 does by default
(``GRADIENT_DIVISION = True`` in ``torchrec/distributed/comm_ops.py``; docs/migrating.md, 'Gradient scaling').

TorchRec fact (2 gloo ranks, ``/work/venvs/torchrec``): one table of 8x4 rows planned ``table_wise``,
``apply_optimizer_in_backward(SGD, lr=1.0)``, rank r looks up row r once and backpropagates ``out.sum()``;
rows 0 and 1 each move by exactly -0.5 (= -lr / world size) in every column.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec.testing import run_ranks


def _one_row_per_rank(rank: int, world: int, kind: str) -> torch.Tensor:
    import lightning_shardrec as lsr
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from lightning_shardrec.optim import apply_optimizer_in_backward

    ebc = lsr.EmbeddingBagCollection(
        device="meta",
        tables=[lsr.EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])],
    )
    apply_optimizer_in_backward(torch.optim.SGD, ebc.parameters(), {"lr": 1.0})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"),
        constraints={"t": ParameterConstraints(sharding_types=[kind])},
    )
    model = DistributedModelParallel(ebc, device=torch.device("cpu"), plan=planner.collective_plan(ebc))
    before = model.full_state_dict()["embedding_bags.t.weight"]
    kjt = lsr.KeyedJaggedTensor(keys=["f"], values=torch.tensor([rank]), lengths=torch.tensor([1]))
    model(kjt).wait().values().sum().backward()
    return model.full_state_dict()["embedding_bags.t.weight"] - before


@pytest.mark.parametrize("kind", ["table_wise", "row_wise"])
def test_a_row_looked_up_once_per_rank_moves_by_lr_over_world_size_as_in_torchrec(kind):
    moved = run_ranks(_one_row_per_rank, 2, kind)[0]
    torch.testing.assert_close(moved[:2], torch.full((2, 4), -0.5), rtol=0, atol=1e-6)
    assert torch.equal(moved[2:], torch.zeros(6, 4))
