"""A plain (unsharded) run's optimizer state, split for a sharded resume.

A checkpoint written without the strategy holds the tables' optimizer state (Adagrad's
``sum``, Adam's ``exp_avg``...) inside the user's ``torch.optim`` state, indexed by each
parameter's position in its param group. Under the strategy those tables left the
dense optimizer for the fused one, so the saved state is split: the dense part
re-indexed for the optimizers as they are now, the tables' part as full fused states
(``weight key -> {name: tensor}``, the form :func:`~lightning_shardrec.checkpoint.load_full_state` takes).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from lightning_shardrec.errors import CheckpointError

#: a parameter as :func:`param_layout` records it: the parameter itself (dense, alive in the model
#: anyway) or, for an embedding table, its state-dict key (the full weight is freed once sharded);
#: ``""``: a table parameter without a key (a fused kernel's own, from an earlier setup)
Slot = nn.Parameter | str


def param_layout(optimizers: Sequence[Any], table_keys: Mapping[int, str]) -> list[list[list[Slot]]]:
    """Per optimizer, per param group: each parameter, tables replaced by their key (``table_keys``:
    ``id(weight) -> key``, ``""`` for no key), so keeping the layout keeps no table alive."""
    return [[[table_keys.get(id(p), p) for p in g["params"]] for g in opt.param_groups] for opt in optimizers]


def split_plain_optimizer_states(
    saved: Sequence[Mapping[str, Any]],
    groups_before: Sequence[Sequence[Sequence[Slot]]],
    groups_now: Sequence[Sequence[Sequence[nn.Parameter]]],
    replicated: Mapping[int, str],
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Tensor]]]:
    """``(dense optimizer states, fused table states)`` from a plain run's ``optimizer_states``.

    ``groups_before``: per optimizer, per param group, its parameters as ``configure_optimizers``
    built them (:func:`param_layout`: tables as their state-dict keys); ``groups_now``: as they are
    now (fused tables out, data-parallel tables moved); ``replicated``: ``id(parameter) -> key`` of
    the data-parallel tables' new parameters (dense-trained).
    """
    if len(saved) != len(groups_before):
        raise CheckpointError(
            f"the checkpoint has {len(saved)} optimizer states, configure_optimizers returned {len(groups_before)}"
        )
    found: dict[int | str, Any] = {}  # id(dense parameter) or table key -> its saved state
    tables: list[str] = []
    for i, (opt_state, groups) in enumerate(zip(saved, groups_before, strict=True)):
        sizes = [len(g["params"]) for g in opt_state["param_groups"]]
        if sizes != [len(g) for g in groups]:
            raise CheckpointError(
                f"optimizer {i}: the checkpoint's param groups hold {sizes} parameters, "
                f"configure_optimizers' hold {[len(g) for g in groups]}"
            )
        for saved_group, params in zip(opt_state["param_groups"], groups, strict=True):
            for index, p in zip(saved_group["params"], params, strict=True):
                tables += [p] if isinstance(p, str) and p else []
                if index in opt_state["state"] and p != "":
                    found[p if isinstance(p, str) else id(p)] = opt_state["state"][index]
    found.update({pid: found[key] for pid, key in replicated.items() if key in found})
    dense: list[dict[str, Any]] = []
    for opt_state, groups in zip(saved, groups_now, strict=True):
        state: dict[int, Any] = {}
        new_groups = []
        position = 0
        for saved_group, params in zip(opt_state["param_groups"], groups, strict=True):
            indices = []
            for p in params:
                if id(p) in found:
                    state[position] = found[id(p)]
                indices.append(position)
                position += 1
            new_groups.append({**saved_group, "params": indices})
        dense.append({"state": state, "param_groups": new_groups})
    dp = set(replicated.values())
    fused = {
        key: {n: t for n, t in found.get(key, {}).items() if isinstance(t, Tensor)} for key in tables if key not in dp
    }
    return dense, fused


def replicated_keys(sharded: Mapping[str, Any]) -> dict[int, str]:
    """``id(parameter) -> state-dict key`` of the data-parallel tables of sharded collections."""
    keys: dict[int, str] = {}
    for path, module in sharded.items():
        for group in module.groups:
            if not group.fused:  # a data-parallel group: one parameter per table, in ``tables`` order
                for table, weight in zip(group.tables, group.weights, strict=True):
                    name = table.config.name
                    key = module.state_key(name)
                    keys[id(weight)] = f"{path}.{key}" if path else key
    return keys


def table_parameter_keys(collections: Mapping[str, nn.Module], sharded: Mapping[str, Any]) -> dict[int, str]:
    """``id(table weight) -> its state-dict key`` for the unsharded ``collections`` (module path -> collection)."""
    keys: dict[int, str] = {}
    for path, coll in collections.items():
        tables = coll.get_submodule("embedding_bags" if hasattr(coll, "embedding_bags") else "embeddings")
        for name, module in tables.named_children():
            key = sharded[path].state_key(name)
            keys[id(module.weight)] = f"{path}.{key}" if path else key
    return keys


def plain_layout_possible(groups_before: Sequence[Sequence[Sequence[Slot]]], fused: Mapping[str, Any]) -> bool:
    """Whether the fused tables' states fit the user's optimizers as ``configure_optimizers`` built them:
    every fused table was a parameter there (by key) and no state is per row (``name@column``)."""
    keys = {p for groups in groups_before for g in groups for p in g if isinstance(p, str)}
    if "" in keys:
        return False
    return all(key in keys and not any("@" in n for n in states) for key, states in fused.items())


def merge_plain_optimizer_states(
    dense: Sequence[Mapping[str, Any]],
    fused: Mapping[str, Mapping[str, Any]],
    groups_before: Sequence[Sequence[Sequence[Slot]]],
    groups_now: Sequence[Sequence[Sequence[nn.Parameter]]],
    replicated: Mapping[int, str],
) -> tuple[list[dict[str, Any]], dict[str, tuple[int, int]]]:
    """The inverse of :func:`split_plain_optimizer_states`: the ``optimizer_states`` a plain run would save,
    and where each table sits in them (``key -> (optimizer, state index)``, for :func:`plain_table_states`).

    ``dense``: the optimizers' state dicts now (fused tables out, data-parallel tables moved);
    ``fused``: the fused tables' full states (``weight key -> {name: tensor}``, the names torch's
    optimizer uses: ``sum``, ``exp_avg``, ``step``...). Each table's state goes to its place in the
    param groups as ``configure_optimizers`` built them, the dense parameters' with it. A scalar
    state the fused kernel does not keep (torch's ``step``) is taken from the optimizer's other
    parameters (in a plain run every parameter of the step counts the same steps).
    """
    found: dict[int | str, Any] = {}  # id(parameter) or table key -> its state
    for opt_state, groups in zip(dense, groups_now, strict=True):
        for saved_group, params in zip(opt_state["param_groups"], groups, strict=True):
            for index, p in zip(saved_group["params"], params, strict=True):
                if index in opt_state["state"]:
                    found[replicated.get(id(p), id(p))] = opt_state["state"][index]
    found.update(fused)
    out: list[dict[str, Any]] = []
    positions: dict[str, tuple[int, int]] = {}
    for i, (opt_state, slot_groups) in enumerate(zip(dense, groups_before, strict=True)):
        state: dict[int, Any] = {}
        new_groups, position = [], 0
        for saved_group, slots in zip(opt_state["param_groups"], slot_groups, strict=True):
            indices = []
            for slot in slots:
                key = slot if isinstance(slot, str) else id(slot)
                if isinstance(key, str):
                    positions[key] = (i, position)
                if key in found:
                    state[position] = dict(found[key])
                indices.append(position)
                position += 1
            new_groups.append({**saved_group, "params": indices})
        scalars = {n: t for st in state.values() for n, t in st.items() if isinstance(t, Tensor) and t.dim() == 0}
        for st in state.values():
            st.update({n: t.clone() for n, t in scalars.items() if n not in st})
        out.append({"state": state, "param_groups": new_groups})
    return out, positions


def plain_table_states(
    optimizer_states: Sequence[Mapping[str, Any]], positions: Mapping[str, Sequence[int]]
) -> dict[str, dict[str, Any]]:
    """Each table's optimizer state in a full checkpoint of the plain layout (``weight key -> {name: tensor}``)."""
    out: dict[str, dict[str, Any]] = {}
    for key, (i, index) in positions.items():
        state = optimizer_states[i]["state"].get(index)
        if state is not None:
            out[key] = dict(state)
    return out
