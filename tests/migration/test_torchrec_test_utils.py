"""What TorchRec users' tests import: ``TestSparseNN`` / ``ModelInput`` and ``MultiProcessTestBase`` (issue 43).

TorchRec facts (1.8, ``torchrec/distributed/test_utils/test_model.py``): the dense arch is ``Linear(F, 8)``, the
over arch ``Linear(8 + sum of embedding widths, 16)`` then ``Linear(16, 16)``; parameters are named
``dense.linear``, ``sparse.ebc.embedding_bags.<table>``, ``sparse.weighted_ebc...``, ``over.dhn_arch.linear0/1``;
training returns ``(BCE-with-logits(pred, label), pred)`` with ``pred = sigmoid(mean(over)) + 1``, eval ``pred``.
``MultiProcessTestBase._run_multi_process_test(callable=f, world_size=W, **kw)`` calls
``f(rank=r, world_size=W, **kw)`` on each rank; ``f`` enters ``MultiProcessContext(rank, world_size, backend)``.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lightning_shardrec import EmbeddingBagConfig, EmbeddingConfig
from lightning_shardrec.distributed.test_utils.multi_process import MultiProcessContext, MultiProcessTestBase
from lightning_shardrec.distributed.test_utils.test_model import ModelInput, TestSparseNN
from lightning_shardrec.errors import UnsupportedFeatureError

TABLES = [
    EmbeddingBagConfig(name=f"table_{i}", embedding_dim=8 * (i + 1), num_embeddings=40, feature_names=[f"feature_{i}"])
    for i in range(2)
]
WEIGHTED = [EmbeddingBagConfig(name="weighted_table_0", embedding_dim=8, num_embeddings=30, feature_names=["wf_0"])]


def _model() -> TestSparseNN:
    torch.manual_seed(0)
    return TestSparseNN(tables=TABLES, num_float_features=10, weighted_tables=WEIGHTED)


def test_test_sparse_nn_has_torchrecs_layers_and_outputs():
    model = _model()
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["dense.linear.weight"] == (8, 10) and shapes["over.dhn_arch.linear0.weight"] == (16, 8 + 8 + 16 + 8)
    assert shapes["over.dhn_arch.linear1.weight"] == (16, 16)
    assert {
        "sparse.ebc.embedding_bags.table_1.weight",
        "sparse.weighted_ebc.embedding_bags.weighted_table_0.weight",
    } <= set(shapes)
    torch.manual_seed(1)
    glob, local = ModelInput.generate(
        batch_size=3, world_size=2, num_float_features=10, tables=TABLES, weighted_tables=WEIGHTED
    )
    assert glob.float_features.shape == (6, 10) and len(local) == 2 and glob.idscore_features.weights().numel() > 0
    loss, pred = model(glob)
    assert pred.shape == (6,) and bool(((pred > 1) & (pred < 2)).all())
    torch.testing.assert_close(loss, torch.nn.functional.binary_cross_entropy_with_logits(pred, glob.label))
    assert model.eval()(glob).shape == (6,)
    seq_tables = [EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=40, feature_names=["feature_0"])]
    ec = TestSparseNN(tables=seq_tables, num_float_features=10)
    seq, _ = ModelInput.generate(batch_size=2, world_size=1, num_float_features=10, tables=seq_tables)
    assert ec.eval()(seq).shape == (2,)
    with pytest.raises(UnsupportedFeatureError, match=r"TestSparseNN\(zch_kwargs=...\) is not supported here"):
        TestSparseNN(tables=TABLES, zch_kwargs={})


def _sharded_matches_unsharded(rank: int, world_size: int, backend: str, batch_size: int) -> None:
    from lightning_shardrec.distributed import DistributedModelParallel

    with MultiProcessContext(rank, world_size, backend) as ctx:
        model = _model()
        torch.manual_seed(1)
        glob, local = ModelInput.generate(batch_size, world_size, 10, TABLES, WEIGHTED)
        want_loss, want_pred = model(glob)
        dmp = DistributedModelParallel(copy.deepcopy(model), device=ctx.device)
        loss, pred = dmp(local[rank])
        rows = slice(rank * batch_size, (rank + 1) * batch_size)
        torch.testing.assert_close(pred, want_pred[rows])
        torch.testing.assert_close(
            loss, torch.nn.functional.binary_cross_entropy_with_logits(want_pred[rows], glob.label[rows])
        )


class TorchRecStyleTest(MultiProcessTestBase):
    def test_sharded_test_sparse_nn_equals_the_one_process_model(self) -> None:
        self._run_multi_process_test(callable=_sharded_matches_unsharded, world_size=2, backend="gloo", batch_size=4)

    def test_a_failing_rank_fails_the_test(self) -> None:
        with pytest.raises(RuntimeError, match="rank 1"):
            self._run_multi_process_test_per_rank(
                callable=_fails_on_rank_1, world_size=2, kwargs_per_rank=[{"value": 0}, {"value": 1}]
            )


def _fails_on_rank_1(rank: int, world_size: int, value: int) -> None:
    assert value == rank
    if rank == 1:
        raise ValueError(f"rank {rank} fails")
