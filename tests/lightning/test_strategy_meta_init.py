"""Tables built under the strategy's ``tensor_init_context`` (``trainer.init_module()``,
``configure_model``) are created on ``meta``: no rank ever holds a full table, each builds
only its shards from the tables' seeds, and the fit still ends with the weights of
``devices=1`` without the strategy (same seed, same global batches)."""

from __future__ import annotations

import warnings

import pytest
import torch
from _models import TABLES, LateRec, Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

STEPS = 3
BATCH = 6  # per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}


def devices_of(model: Rec) -> dict[str, set[str]]:
    return {
        "tables": {p.device.type for p in model.ebc.parameters()},
        "dense": {p.device.type for p in model.mlp.parameters()},
    }


class SpyLateRec(LateRec):
    """Records where its layers are right after ``configure_model`` built them (before the strategy's setup)."""

    def configure_model(self) -> None:
        super().configure_model()
        self.seen = devices_of(self)


def fit_meta(rank: int, world: int, how: str, sharding_type: str) -> dict:
    import lightning_shardrec  # noqa: F401
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {f"t_{f}": ParameterConstraints(sharding_types=[sharding_type]) for f in ("big", "mid", "tiny")}
    strategy = ShardRecStrategy(constraints=constraints)
    t = trainer(strategy=strategy, devices=world, max_steps=STEPS)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if how == "init_module":
            with t.init_module():
                model = Rec()
            model.seen = devices_of(model)
        else:
            model = SpyLateRec()
    t.fit(model, data(BATCH, STEPS))
    seen = {**model.seen, "warnings": [str(w.message) for w in caught]}
    held = sum(w.numel() for s in strategy.sharded["ebc"].local_shards().values() for _, w in s)
    plan = strategy.plan.get_plan_for_module("ebc")
    mine = sum(s.shard_sizes[0] * s.shard_sizes[1] for p in plan.values() for s in p.shards if s.rank == rank)
    state = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return {"state": state, "held": held, "planned": mine, **seen}


def fit_reference(world: int) -> dict[str, torch.Tensor]:
    model = Rec()
    trainer(devices=1, max_steps=STEPS).fit(model, data(BATCH * world, STEPS))
    return model.state_dict()


@pytest.mark.parametrize(
    ("how", "sharding_type"),
    [("init_module", "row_wise"), ("configure_model", "column_wise"), ("configure_model", "data_parallel")],
)
def test_tables_built_on_meta_match_single_device(how: str, sharding_type: str) -> None:
    results = run_ranks(fit_meta, 2, how, sharding_type)
    want = fit_reference(2)
    if sharding_type != "data_parallel":
        assert sum(r["held"] for r in results) == sum(n * d for _, n, d, _ in TABLES)  # each element on one rank
    for r in results:
        assert r["tables"] == {"meta"} and r["dense"] == {"cpu"}, (how, r["tables"], r["dense"])
        assert r["held"] == r["planned"]  # each rank built its own shards and nothing else
        assert not [w for w in r["warnings"] if "model_sharded_context" in w or "init_module" in w]
        assert set(r["state"]) == set(want)
        for k in want:
            torch.testing.assert_close(r["state"][k], want[k], **TOL, msg=f"{how}/{sharding_type}: {k}")
