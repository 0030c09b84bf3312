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


def split_plain_optimizer_states(
    saved: Sequence[Mapping[str, Any]],
    groups_before: Sequence[Sequence[Sequence[nn.Parameter]]],
    groups_now: Sequence[Sequence[Sequence[nn.Parameter]]],
    table_keys: Mapping[int, str],
    replicated: Mapping[int, str],
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Tensor]]]:
    """``(dense optimizer states, fused table states)`` from a plain run's ``optimizer_states``.

    ``groups_before`` / ``groups_now``: per optimizer, per param group, its parameters as
    ``configure_optimizers`` built them and as they are now (fused tables out, data-parallel
    tables moved); ``table_keys``: ``id(table parameter) -> its state-dict key``;
    ``replicated``: the same for the data-parallel tables' new parameters (dense-trained).
    """
    if len(saved) != len(groups_before):
        raise CheckpointError(
            f"the checkpoint has {len(saved)} optimizer states, configure_optimizers returned {len(groups_before)}"
        )
    found: dict[int, Any] = {}  # id(parameter) -> its saved state
    for i, (opt_state, groups) in enumerate(zip(saved, groups_before, strict=True)):
        sizes = [len(g["params"]) for g in opt_state["param_groups"]]
        if sizes != [len(g) for g in groups]:
            raise CheckpointError(
                f"optimizer {i}: the checkpoint's param groups hold {sizes} parameters, "
                f"configure_optimizers' hold {[len(g) for g in groups]}"
            )
        for saved_group, params in zip(opt_state["param_groups"], groups, strict=True):
            for index, p in zip(saved_group["params"], params, strict=True):
                if index in opt_state["state"]:
                    found[id(p)] = opt_state["state"][index]
    by_key = {key: found[pid] for pid, key in table_keys.items() if pid in found}
    found.update({pid: by_key[key] for pid, key in replicated.items() if key in by_key})
    dense: list[dict[str, Any]] = []
    kept = {pid for pid, key in table_keys.items() if key in replicated.values()}
    for opt_state, groups in zip(saved, groups_now, strict=True):
        state: dict[int, Any] = {}
        new_groups = []
        position = 0
        for saved_group, params in zip(opt_state["param_groups"], groups, strict=True):
            indices = []
            for p in params:
                kept.add(id(p))
                if id(p) in found:
                    state[position] = found[id(p)]
                indices.append(position)
                position += 1
            new_groups.append({**saved_group, "params": indices})
        dense.append({"state": state, "param_groups": new_groups})
    fused = {
        key: {n: t for n, t in found.get(pid, {}).items() if isinstance(t, Tensor)}
        for pid, key in table_keys.items()
        if pid not in kept
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
        tables = coll.embedding_bags if hasattr(coll, "embedding_bags") else coll.embeddings
        for name, module in tables.items():
            key = sharded[path].state_key(name)
            keys[id(module.weight)] = f"{path}.{key}" if path else key
    return keys
