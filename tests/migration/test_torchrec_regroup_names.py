"""TorchRec's other regroup names at ``torchrec.sparse.jagged_tensor``, its ``sparse.tests.utils`` helpers, and
``torch.fx`` tracing of ``KeyedTensor.regroup`` / ``regroup_as_dict`` (issue 43: TorchRec's test_keyed_tensor.py).
"""

from __future__ import annotations

import random

import pytest
import torch

from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.sparse import equality
from lightning_shardrec.sparse.jagged_tensor import (
    KeyedTensor,
    _fbgemm_permute_pooled_embs,
    _kt_regroup_arguments,
    _regroup_keyed_tensors,
    permute_multi_embedding,
    regroup_kts,
)
from lightning_shardrec.sparse.tests.utils import build_groups, build_kts


def _kts() -> list[KeyedTensor]:
    torch.manual_seed(0)
    return build_kts(dense_features=3, sparse_features=4, dim_dense=2, dim_sparse=5, batch_size=6,
                     device=torch.device("cpu"), run_backward=True)  # fmt: skip


def test_build_kts_makes_a_dense_and_a_sparse_keyed_tensor() -> None:
    dense, sparse = _kts()
    assert dense.keys() == ["dense_0", "dense_1", "dense_2"] and dense.length_per_key() == [2, 2, 2]
    assert sparse.keys() == [f"sparse_{i}" for i in range(4)] and sparse.length_per_key() == [5] * 4
    assert dense.values().shape == (6, 6) and sparse.values().shape == (6, 20)


def test_build_groups_deals_every_key_once_then_skips_and_duplicates() -> None:
    kts = _kts()
    keys = [*kts[0].keys(), *kts[1].keys()]
    random.seed(1)
    groups = build_groups(kts, num_groups=3)
    assert len(groups) == 3 and sorted(k for g in groups for k in g) == sorted(keys)
    random.seed(1)
    skipped = build_groups(kts, num_groups=3, skips=True, duplicates=True)
    for full, short in zip(groups, skipped, strict=True):
        dropped = 1 if len(full) > 1 else 0
        assert len(short) == len(full) - dropped + 1 and short[-1] in keys
    with pytest.raises(ValueError, match="build_groups: num_groups must be >= 1, got 0"):
        build_groups(kts, num_groups=0)


@pytest.mark.parametrize("fn", [_regroup_keyed_tensors, permute_multi_embedding, _fbgemm_permute_pooled_embs])
def test_torchrecs_other_regroup_names_give_regroup_kts_values_and_gradients(fn: object) -> None:
    groups = [["dense_0", "sparse_1", "dense_2"], ["sparse_3", "dense_0"], ["sparse_0"]]
    kts = _kts()
    weights = [torch.randn(6, n) for n in (9, 7, 5)]  # a different weight per output column
    got = fn(kts, groups)  # type: ignore[operator]
    got_grads = torch.autograd.grad(
        sum((g * w).sum() for g, w in zip(got, weights, strict=True)), [kt.values() for kt in kts]
    )
    want = regroup_kts(kts, groups)
    want_grads = torch.autograd.grad(
        sum((g * w).sum() for g, w in zip(want, weights, strict=True)), [kt.values() for kt in kts]
    )
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    assert torch.equal(got[0][:, 2:7], kts[1].to_dict()["sparse_1"])
    assert torch.equal(got_grads[0][:, 0:2], weights[0][:, 0:2] + weights[1][:, 5:7])  # dense_0 is in two groups


@pytest.mark.skipif(not fbgemm_available(), reason="fbgemm's operators do not load here")
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_the_fbgemm_argument_builder_gives_torchrecs_layout(device: str) -> None:
    """Rows ``[input tensor, output tensor, input start, output start, length, jump]``, one per grouped key."""
    keys, lengths, groups = [["f1", "f2"], ["f3"]], [[3, 4], [5]], [["f1", "f3"], ["f2"]]
    permutes, in_shapes, out_shapes, out_lengths = _kt_regroup_arguments(
        torch.empty(2, 7, device=device), keys, lengths, groups
    )
    assert out_lengths == [8, 4] and permutes.shape == (3, 6) and permutes.device.type == device
    if device == "cpu":
        assert permutes.tolist() == [[0, 0, 0, 0, 3, 0], [1, 0, 0, 3, 5, 0], [0, 1, 3, 0, 4, 0]]
        assert in_shapes.tolist() == [7, 5] and out_shapes.tolist() == [8, 4]
        kts = [KeyedTensor.from_tensor_list(["f1", "f2"], [torch.randn(2, 3), torch.randn(2, 4)]),
               KeyedTensor.from_tensor_list(["f3"], [torch.randn(2, 5)])]  # fmt: skip
        got = torch.ops.fbgemm.permute_multi_embedding(
            [kt.values() for kt in kts], permutes, in_shapes, out_shapes, out_lengths
        )
        assert all(torch.equal(a, b) for a, b in zip(got, regroup_kts(kts, groups), strict=True))


def test_the_fbgemm_argument_builder_is_refused_by_name_without_fbgemm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(equality, "fbgemm_available", lambda: False)
    with pytest.raises(NotImplementedError, match=r"_kt_regroup_arguments \(TorchRec's index tensors for fbgemm"):
        _kt_regroup_arguments(torch.empty(0), [["a"]], [[1]], [["a"]])


class _Regroup(torch.nn.Module):
    def forward(self, inputs: list[KeyedTensor], groups: list[list[str]]) -> list[torch.Tensor]:
        return KeyedTensor.regroup(inputs, groups)


class _RegroupAsDict(torch.nn.Module):
    def forward(self, inputs: list[KeyedTensor]) -> dict[str, torch.Tensor]:
        return KeyedTensor.regroup_as_dict(inputs, [["dense_1", "sparse_0"], ["sparse_2"]], ["a", "b"])


def test_fx_traces_regroup_as_one_node_that_equals_eager() -> None:
    kts, groups = _kts(), [["dense_0", "sparse_1"], ["dense_2"]]
    gm = torch.fx.symbolic_trace(_Regroup())
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [KeyedTensor.regroup]
    got, want = gm(kts, groups), _Regroup()(kts, groups)
    assert len(got) == 2 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fx_traces_regroup_as_dict_as_one_node_that_equals_eager() -> None:
    kts = _kts()
    gm = torch.fx.symbolic_trace(_RegroupAsDict())
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [KeyedTensor.regroup_as_dict]
    got, want = gm(kts), _RegroupAsDict()(kts)
    assert got.keys() == want.keys() == {"a", "b"}
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_kt_regroup_as_dict_module_equals_regroup_as_dict_values_and_gradients() -> None:
    # TorchRec's modules.regroup.KTRegroupAsDict (its test_regroup.py): the module form of regroup_as_dict,
    # with emb_dtype casting the outputs; torchrec.types and data_type_to_dtype at their paths
    from lightning_shardrec.modules.embedding_configs import data_type_to_dtype
    from lightning_shardrec.modules.regroup import KTRegroupAsDict
    from lightning_shardrec.sparse.jagged_tensor import _all_keys_used_once
    from lightning_shardrec.types import CacheMixin, DataType, ModuleNoCopyMixin

    kts = _kts()
    groups = build_groups(kts=kts, num_groups=2, skips=True, duplicates=True)
    assert _all_keys_used_once(kts, groups) is False
    assert _all_keys_used_once(kts, [list(kts[0].keys()), list(kts[1].keys())]) is True
    module = KTRegroupAsDict(groups=groups, keys=["user", "object"])
    out, ref = module(kts), KeyedTensor.regroup_as_dict(kts, groups, ["user", "object"])
    assert list(out) == ["user", "object"] and all(torch.equal(out[k], ref[k]) for k in ref)
    grads = torch.autograd.grad(out["user"].sum() * 2 + out["object"].sum(), [kts[0].values(), kts[1].values()])
    refs = torch.autograd.grad(ref["user"].sum() * 2 + ref["object"].sum(), [kts[0].values(), kts[1].values()])
    assert all(torch.equal(g, r) for g, r in zip(grads, refs, strict=True))
    half = KTRegroupAsDict(groups=groups, keys=["user", "object"], emb_dtype=DataType.FP16)(kts)
    assert half["user"].dtype == torch.float16 and torch.equal(half["user"], ref["user"].half())
    assert data_type_to_dtype(DataType.BF16) is torch.bfloat16 and data_type_to_dtype(DataType.INT4) is torch.quint4x2
    with pytest.raises(ValueError, match="KTRegroupAsDict: 2 groups but 1 keys"):
        KTRegroupAsDict(groups=groups, keys=["user"])
    with pytest.raises(ValueError, match="DataType FP64 cannot be converted to dtype"):
        data_type_to_dtype("FP64")  # type: ignore[arg-type]
    gm = torch.fx.symbolic_trace(module)
    assert all(torch.equal(gm(kts)[k], ref[k]) for k in ref)
    assert ModuleNoCopyMixin().copy(torch.device("cpu")) is not None and hasattr(CacheMixin, "clear_cache")
