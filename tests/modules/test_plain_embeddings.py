"""Plain nn.EmbeddingBag / nn.Embedding swapped for one-table collections: same call, same results."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.modules.plain_embeddings import (
    PlainEmbedding,
    PlainEmbeddingBag,
    PlainMaxEmbeddingBag,
    find_embedding_modules,
    swap_embedding_modules,
)


def bag_inputs(g: torch.Generator, rows: int, batch: int = 6, two_d: bool = False):
    if two_d:
        return torch.randint(0, rows, (batch, 3), generator=g), None
    lengths = torch.randint(0, 4, (batch,), generator=g)
    lengths[1] = 0  # an empty bag
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.randint(0, rows, (int(lengths.sum()),), generator=g), offsets


def same_after_steps(plain: nn.Module, call, steps: int = 3) -> None:
    """``plain`` and its swapped copy give the same outputs and weights over ``steps`` SGD steps."""
    swapped = copy.deepcopy(plain)
    holder = nn.ModuleDict({"m": swapped})
    swap_embedding_modules(holder)
    adapter = holder["m"]
    assert type(adapter) is not type(plain)
    opt_a = torch.optim.Adagrad(plain.parameters(), lr=0.1)
    opt_b = torch.optim.Adagrad(adapter.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        args = call(g)
        out_a, out_b = plain(*args), adapter(*args)
        assert out_a.shape == out_b.shape
        torch.testing.assert_close(out_b, out_a)
        for out, opt in ((out_a, opt_a), (out_b, opt_b)):
            opt.zero_grad()
            (out.sin().sum()).backward()
            opt.step()
    torch.testing.assert_close(adapter.state_dict()[next(iter(adapter.state_dict()))], plain.weight)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("padding_idx", [None, 2])
def test_embedding_bag_modes_and_inputs(mode, two_d, padding_idx):
    torch.manual_seed(0)
    plain = nn.EmbeddingBag(7, 4, mode=mode, padding_idx=padding_idx)
    same_after_steps(plain, lambda g: bag_inputs(g, 7, two_d=two_d))


@pytest.mark.parametrize("two_d", [False, True])
def test_per_sample_weights_and_include_last_offset(two_d):
    torch.manual_seed(0)
    plain = nn.EmbeddingBag(7, 4, mode="sum", include_last_offset=not two_d)

    def call(g):
        ids, offsets = bag_inputs(g, 7, two_d=two_d)
        if offsets is not None:
            offsets = torch.cat([offsets, torch.tensor([ids.numel()])])  # include_last_offset
        return ids, offsets, torch.rand(ids.shape, generator=g)

    same_after_steps(plain, call)


@pytest.mark.parametrize("shape", [(5,), (4, 3), (2, 3, 2)])
@pytest.mark.parametrize("padding_idx", [None, 0])
def test_embedding_any_input_shape(shape, padding_idx):
    torch.manual_seed(0)
    plain = nn.Embedding(6, 4, padding_idx=padding_idx)
    same_after_steps(plain, lambda g: (torch.randint(0, 6, shape, generator=g),))


def test_swap_keeps_the_users_parameter_and_finds_nested_modules():
    torch.manual_seed(0)
    model = nn.Module()
    model.tower = nn.Module()
    model.tower.user = nn.EmbeddingBag(10, 4, mode="mean")
    model.item = nn.Embedding(8, 4)
    model.hist = nn.EmbeddingBag(9, 4, mode="max")
    model.ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])]
    )
    weights = {p: m.weight for p, m in find_embedding_modules(model).items()}
    assert sorted(weights) == ["hist", "item", "tower.user"]  # not the EBC's own tables
    swapped = swap_embedding_modules(model)
    assert isinstance(model.tower.user, PlainEmbeddingBag)
    assert isinstance(model.item, PlainEmbedding)
    assert isinstance(model.hist, PlainMaxEmbeddingBag)
    for path, adapter in swapped.items():
        assert next(adapter.parameters()) is weights[path]
    assert swap_embedding_modules(model) == {}  # idempotent
    assert swap_embedding_modules(model, ["item"]) == {}  # already swapped: skipped


def test_a_collection_as_the_root_keeps_its_tables():
    ebc = EmbeddingBagCollection([EmbeddingBagConfig(num_embeddings=5, embedding_dim=4, name="t", feature_names=["f"])])
    assert find_embedding_modules(ebc) == {} and swap_embedding_modules(ebc) == {}
    assert type(ebc.embedding_bags["t"]) is nn.EmbeddingBag


def test_which_and_min_rows():
    model = nn.Module()
    model.small = nn.Embedding(3, 2)
    model.big = nn.Embedding(300, 2)
    assert list(swap_embedding_modules(copy.deepcopy(model), min_rows=100)) == ["big"]
    assert list(swap_embedding_modules(copy.deepcopy(model), ["small"])) == ["small"]
    assert swap_embedding_modules(model, False) == {}
    with pytest.raises(ValueError, match=r"names \['nope'\], which are not nn.Embedding.*\['big', 'small'\]"):
        swap_embedding_modules(model, ["nope"])
    with pytest.raises(ValueError, match="embedding_min_rows must be an int >= 0, got -1"):
        swap_embedding_modules(model, True, -1)


@pytest.mark.parametrize(
    "module, option",
    [
        (nn.Embedding(5, 2, max_norm=1.0), "max_norm=1.0"),
        (nn.EmbeddingBag(5, 2, scale_grad_by_freq=True), "scale_grad"),
    ],
)
def test_unsupported_options_are_refused_by_path(module, option):
    model = nn.Module()
    model.emb = module
    with pytest.raises(ValueError, match=rf"'emb': {option}.*cannot be sharded.*embedding_modules"):
        swap_embedding_modules(model)


def test_shared_and_tied_modules_are_refused():
    model = nn.Module()
    model.a = nn.Embedding(5, 2)
    model.b = model.a
    with pytest.raises(ValueError, match=r"'a' is reachable as \['a', 'b'\]"):
        swap_embedding_modules(model)
    tied = nn.Module()
    tied.emb = nn.Embedding(5, 2)
    tied.out = nn.Linear(2, 5, bias=False)
    tied.out.weight = tied.emb.weight
    with pytest.raises(ValueError, match=r"'emb': its weight is also \['out.weight'\] \(tied weights\)"):
        swap_embedding_modules(tied)


def test_bad_calls_name_the_module():
    model = nn.Module()
    model.bag = nn.EmbeddingBag(5, 2, mode="mean")
    model.emb = nn.Embedding(5, 2)
    swap_embedding_modules(model)
    with pytest.raises(ValueError, match=r"EmbeddingBag 'bag': per_sample_weights is only supported for mode='sum'"):
        model.bag(torch.tensor([[1, 2]]), None, torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"EmbeddingBag 'bag': 1-D input needs 1-D offsets"):
        model.bag(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"EmbeddingBag 'bag': offsets must be None when input is 2-D"):
        model.bag(torch.tensor([[1, 2]]), torch.tensor([0]))
    with pytest.raises(TypeError, match=r"Embedding 'emb': input must hold integer ids"):
        model.emb(torch.tensor([1.0]))
    with pytest.raises(ValueError, match=r"feature 'emb' \(table 'emb'\): id 9 outside \[0, 5\)"):
        model.emb(torch.tensor([9]))


def test_plain_optimizer_state_splits_by_parameter():
    from lightning_shardrec.checkpoint import param_layout, split_plain_optimizer_states
    from lightning_shardrec.errors import CheckpointError

    table, dense, replicated_new, replicated_old = (nn.Parameter(torch.zeros(2)) for _ in range(4))
    saved = [
        {
            "state": {0: {"sum": torch.ones(1)}, 1: {"sum": torch.full((1,), 2.0)}, 2: {"sum": torch.full((1,), 3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
        }
    ]
    keys = {id(table): "emb.weight", id(replicated_old): "small.weight"}
    before = param_layout([torch.optim.SGD([table, dense, replicated_old], lr=0.1)], keys)
    assert before == [[["emb.weight", dense, "small.weight"]]]  # tables kept as keys, never as tensors
    now = [[[dense, replicated_new]]]
    out, fused = split_plain_optimizer_states(saved, before, now, {id(replicated_new): "small.weight"})
    assert out == [
        {
            "state": {0: {"sum": torch.full((1,), 2.0)}, 1: {"sum": torch.full((1,), 3.0)}},
            "param_groups": [{"lr": 0.1, "params": [0, 1]}],
        }
    ]
    assert list(fused) == ["emb.weight"] and torch.equal(fused["emb.weight"]["sum"], torch.ones(1))
    with pytest.raises(
        CheckpointError,
        match=r"optimizer 0: the checkpoint's param groups hold \[3\] parameters, "
        r"configure_optimizers' hold \[2\]",
    ):
        split_plain_optimizer_states(saved, [[["emb.weight", dense]]], now, {})
    with pytest.raises(CheckpointError, match="the checkpoint has 1 optimizer states, configure_optimizers returned 2"):
        split_plain_optimizer_states(saved, before * 2, now, {})
