"""TorchRec's keyed-optimizer state dicts (issue 43: its optim/tests/test_keyed.py): state objects with their own
``state_dict()``/``load_state_dict()``, nested dicts, and ``CombinedOptimizer``'s flat per-parameter layout."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_shardrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper


class _Stateful:
    """A state object that saves and loads itself (TorchRec's test's ``DummyOptimizerModule``)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.t.copy_(state["t"])


def test_state_objects_and_nested_dicts_save_and_load_in_place() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    module, nested = _Stateful(torch.tensor([9.0, 10.0])), torch.tensor([7.0, 8.0])
    state = {p: {"one": 1.0, "m": module, "nested": {"t": nested}}}
    keyed = KeyedOptimizer({"p": p}, state, [{"params": [p], "lr": 0.1}])
    saved = keyed.state_dict()
    assert saved["state"]["p"]["m"] == {"t": module.t} and not isinstance(saved["state"]["p"]["m"], _Stateful)
    saved["state"]["p"] = {
        "one": 10.0,
        "m": {"t": torch.tensor([90.0, 100.0])},
        "nested": {"t": torch.tensor([70.0, 80.0])},
    }
    keyed.load_state_dict(saved)
    assert state[p]["m"] is module and module.t.tolist() == [90.0, 100.0]  # loaded by the object itself
    assert state[p]["nested"]["t"] is nested and nested.tolist() == [70.0, 80.0]  # copied into the live tensor
    assert state[p]["one"] == 10.0


def _momentum_sgd(w: torch.nn.Parameter) -> torch.optim.SGD:
    return torch.optim.SGD([w], lr=0.5, momentum=0.9)


def test_combined_state_dict_is_flat_by_prefixed_name_and_loads_into_each_optimizer() -> None:
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    keyed = KeyedOptimizerWrapper({"w": a}, lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
    plain = _momentum_sgd(b)
    combined = CombinedOptimizer([("ko", keyed), plain])
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    combined.step()
    saved = combined.state_dict()
    assert sorted(saved) == ["param_groups", "state"] and sorted(saved["state"]) == ["ko.w", "param_0"]
    saved["state"]["ko.w"] = {"momentum_buffer": torch.full((2,), 5.0)}
    saved["state"]["param_0"] = {"momentum_buffer": torch.full((3,), 6.0)}
    saved["param_groups"][0]["lr"], saved["param_groups"][1]["lr"] = 0.25, 0.125
    live = keyed.state[a]["momentum_buffer"]
    combined.load_state_dict(saved)
    assert keyed.state[a]["momentum_buffer"] is live and live.tolist() == [5.0, 5.0]
    assert plain.state[b]["momentum_buffer"].tolist() == [6.0] * 3
    assert keyed.param_groups[0]["lr"] == 0.25 and plain.param_groups[0]["lr"] == 0.125


def test_combined_loads_state_into_an_optimizer_that_has_none_yet() -> None:
    b = torch.nn.Parameter(torch.ones(3))
    plain = _momentum_sgd(b)
    combined = CombinedOptimizer([("d", plain)])
    combined.load_state_dict({"state": {"d.param_0": {"momentum_buffer": torch.full((3,), 2.0)}}})
    b.grad = torch.zeros(3)
    plain.step()  # SGD reads the loaded buffer: v = 0.9 * 2 + 0
    assert plain.state[b]["momentum_buffer"].tolist() == pytest.approx([1.8] * 3)
