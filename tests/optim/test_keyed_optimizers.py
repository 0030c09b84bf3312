"""TorchRec's optimizer API: KeyedOptimizer(Wrapper), CombinedOptimizer, RowWiseAdagrad, the in-backward filter."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_shardrec.optim import (
    CombinedOptimizer,
    KeyedOptimizer,
    KeyedOptimizerWrapper,
    RowWiseAdagrad,
    apply_optimizer_in_backward,
    in_backward_optimizer_filter,
)


def _step(opt, lin):
    opt.zero_grad()
    lin(torch.ones(3, 2)).sum().backward()
    opt.step()


def test_keyed_wrapper_trains_as_its_optimizer_and_keys_state_by_name():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    b.load_state_dict(a.state_dict())
    keyed = KeyedOptimizerWrapper(dict(a.named_parameters()), lambda p: torch.optim.Adam(p, lr=0.1))
    plain = torch.optim.Adam(b.parameters(), lr=0.1)
    for _ in range(2):
        _step(keyed, a)
        _step(plain, b)
    assert torch.equal(a.weight, b.weight)
    saved = keyed.state_dict()
    assert sorted(saved["state"]) == ["bias", "weight"] and saved["param_groups"][0]["params"] == ["weight", "bias"]
    keyed.state["weight" and a.weight]["exp_avg"].zero_()
    keyed.load_state_dict(saved)
    with pytest.raises(KeyError, match=re.escape("unknown parameter names ['w']; known: ['bias', 'weight']")):
        keyed.load_state_dict({"state": {"w": {}}, "param_groups": []})
    keyed.save_param_groups(True)
    assert keyed.defaults["_save_param_groups"] is True


def test_combined_optimizer_steps_each_and_schedulers_reach_them():
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    ka = KeyedOptimizerWrapper(dict(a.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1))
    sb = torch.optim.SGD(b.parameters(), lr=0.2)
    combined = CombinedOptimizer([("a", ka), sb])
    assert list(combined.params) == ["a.weight", "a.bias", "param_0", "param_1"]
    assert combined.optimizers[1] == ("", sb) and CombinedOptimizer.prepend_opt_key("w", "") == "w"
    before = (a.weight.detach().clone(), b.weight.detach().clone())
    combined.zero_grad()
    (a(torch.ones(1, 2)) + b(torch.ones(1, 2))).sum().backward()
    combined.step()
    assert torch.allclose(a.weight, before[0] - 0.1) and torch.allclose(b.weight, before[1] - 0.2)
    torch.optim.lr_scheduler.StepLR(combined, 1, 0.5).step()
    assert ka.param_groups[0]["lr"] == 0.05 and sb.param_groups[0]["lr"] == 0.1
    saved = combined.state_dict()  # TorchRec's flat layout over the prefixed names
    assert [g["params"] for g in saved["param_groups"]] == [["a.weight", "a.bias"], ["param_0", "param_1"]]
    saved["param_groups"][1]["lr"] = 0.3
    combined.load_state_dict(saved)
    assert sb.param_groups[0]["lr"] == 0.3 and ka.param_groups[0]["lr"] == 0.05
    with pytest.raises(KeyError, match=re.escape("unknown parameter names ['a']; known: ['a.bias', 'a.weight',")):
        combined.load_state_dict({"state": {"a": {}}})
    with pytest.raises(TypeError, match="CombinedOptimizer: item 0 is Linear, not a torch.optim.Optimizer"):
        CombinedOptimizer([a])
    with pytest.raises(NotImplementedError, match="KeyedOptimizer.step: use KeyedOptimizerWrapper"):
        KeyedOptimizer(dict(a.named_parameters()), {}, []).step()


def test_init_state_creates_the_state_without_moving_adagrad():
    lin = torch.nn.Linear(2, 1)
    keyed = KeyedOptimizerWrapper(dict(lin.named_parameters()), lambda p: torch.optim.Adagrad(p, lr=0.1))
    before = lin.weight.detach().clone()
    keyed.init_state()
    assert "sum" in keyed.state[lin.weight] and torch.equal(lin.weight, before)


def test_rowwise_adagrad_keeps_one_sum_per_row():
    w = torch.nn.Parameter(torch.ones(3, 2))
    opt = RowWiseAdagrad([w], lr=0.1, eps=0.0)
    w.grad = torch.tensor([[1.0, 3.0], [0.0, 0.0], [2.0, 2.0]])
    opt.step()
    assert opt.state[w]["sum"].tolist() == [5.0, 0.0, 4.0]  # mean of squares per row
    expected = torch.ones(3, 2) - 0.1 * w.grad / torch.tensor([[5.0**0.5], [1.0], [2.0]])
    expected[1] = 1.0  # zero gradient: 0 / (0 + eps) is nan in the formula; the row did not move
    assert torch.allclose(w[[0, 2]], expected[[0, 2]])
    with pytest.raises(ValueError, match="RowWiseAdagrad: lr must be >= 0, got -1"):
        RowWiseAdagrad([w], lr=-1)
    with pytest.raises(TypeError, match=re.escape("RowWiseAdagrad got unexpected arguments ['momentum']")):
        RowWiseAdagrad([w], momentum=0.9)


def test_in_backward_optimizer_filter():
    lin, emb = torch.nn.Linear(2, 1), torch.nn.Embedding(4, 2)
    apply_optimizer_in_backward(torch.optim.SGD, emb.parameters(), {"lr": 0.1})
    model = torch.nn.ModuleDict({"lin": lin, "emb": emb})
    assert [n for n, _ in in_backward_optimizer_filter(model.named_parameters())] == ["lin.weight", "lin.bias"]
    assert [n for n, _ in in_backward_optimizer_filter(model.named_parameters(), include=True)] == ["emb.weight"]


def test_keyed_optimizers_are_built_by_optimizer_init_so_step_hooks_fire():
    """KeyedOptimizer goes through ``torch.optim.Optimizer.__init__`` (hooks, step profiling), not a copy of it."""
    a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    keyed = KeyedOptimizerWrapper(dict(a.named_parameters()), lambda p: torch.optim.SGD(p, lr=0.1))
    combined = CombinedOptimizer([("a", keyed), ("b", torch.optim.SGD(b.parameters(), lr=0.1))])
    seen: list[str] = []
    keyed.register_step_pre_hook(lambda opt, args, kwargs: seen.append("keyed pre"))
    combined.register_step_post_hook(lambda opt, args, kwargs: seen.append("combined post"))
    combined.zero_grad()
    (a(torch.ones(3, 2)).sum() + b(torch.ones(3, 2)).sum()).backward()
    combined.step()
    assert seen == ["keyed pre", "combined post"]
    assert combined.param_groups == [*keyed.param_groups, *combined.optimizers[1][1].param_groups]
