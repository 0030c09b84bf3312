"""TorchRec's keyed-optimizer rules (``torchrec/optim/keyed.py`` 1.8, its tests' facts): ``OptimizerWrapper``
passes every call on; keyed optimizers pickle whole; a state key that is not a parameter is refused."""

from __future__ import annotations

import io

import pytest
import torch

from lightning_shardrec.optim import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper


def _sgd() -> KeyedOptimizerWrapper:
    w = torch.nn.Parameter(torch.ones(2, 3))
    return KeyedOptimizerWrapper({"w": w}, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))


def test_the_wrapper_passes_steps_and_state_loads_on() -> None:
    inner = _sgd()
    wrapped = OptimizerWrapper(inner)
    w = inner.params["w"]
    w.grad = torch.ones_like(w)
    wrapped.step()
    assert torch.equal(w.detach(), torch.full((2, 3), 0.5))
    saved = wrapped.state_dict()
    assert saved == inner.state_dict() and "momentum_buffer" in saved["state"]["w"]
    saved["param_groups"][0]["lr"] = 0.25
    wrapped.load_state_dict(saved)
    assert inner.param_groups[0]["lr"] == wrapped.param_groups[0]["lr"] == 0.25
    wrapped.zero_grad(set_to_none=True)
    assert w.grad is None
    with pytest.raises(NotImplementedError, match="OptimizerWrapper.add_param_group: add the group to the wrapped"):
        wrapped.add_param_group({"params": []})


def test_keyed_optimizers_pickle_whole() -> None:
    combined = CombinedOptimizer([("a", _sgd()), ("b", OptimizerWrapper(_sgd()))])
    buffer = io.BytesIO()
    torch.save(combined, buffer)
    buffer.seek(0)
    back = torch.load(buffer, weights_only=False)
    assert back.state_dict().keys() == combined.state_dict().keys()
    assert list(back.params) == ["a.w", "b.w"]


def test_a_state_key_that_is_no_parameter_is_refused() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"KeyedOptimizer: All state keys must be params. Not among params: \['x'\]"):
        KeyedOptimizer({"p": p}, {p: {}, "x": 1.0}, [{"params": [p]}])


def test_keyed_optimizers_take_no_new_groups_and_combined_steps_as_torchrec() -> None:
    for opt in (_sgd(), CombinedOptimizer([("a", _sgd())])):
        with pytest.raises(NotImplementedError, match=f"{type(opt).__name__}.add_param_group: add the group"):
            opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
    inner = _sgd()
    combined = CombinedOptimizer([("a", inner)])
    calls = []

    def closure() -> torch.Tensor:
        calls.append(1)
        inner.params["w"].grad = torch.ones(2, 3)
        return torch.tensor(3.0)

    assert combined.step(closure) is None and calls == [1]  # TorchRec's step returns None; the closure runs once
    assert torch.equal(inner.params["w"].detach(), torch.full((2, 3), 0.5))
    assert [CombinedOptimizer.prepend_opt_key(n, k) for n, k in [("w", "a"), ("w", ""), ("", "a")]] == ["a.w", "w", "a"]
