"""``torchrec.distributed.types.ShardedTensor`` at its path (issue 43: TorchRec's optimizer schema test and users'
``isinstance`` checks on ``DistributedModelParallel.state_dict()`` values import it): torch's class itself."""

from __future__ import annotations

import importlib

import torch


def test_sharded_tensor_is_torchs_class() -> None:
    from lightning_shardrec.distributed.types import ShardedTensor

    torchs = importlib.import_module("torch.distributed._shard.sharded_tensor").ShardedTensor
    assert ShardedTensor is torchs and issubclass(ShardedTensor, torch.Tensor)


def test_other_missing_names_of_the_module_are_still_refused_by_name() -> None:
    import pytest

    from lightning_shardrec.errors import MissingTorchRecFeatureError

    with pytest.raises(MissingTorchRecFeatureError, match=r"distributed.types.ShardingEnv2D \(TorchRec's"):
        from lightning_shardrec.distributed.types import ShardingEnv2D  # noqa: F401
    assert not hasattr(importlib.import_module("lightning_shardrec.distributed.types"), "no_such_name")
