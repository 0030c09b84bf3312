"""``Fabric(strategy="shardrec")``: the Trainer strategy's sharding, planner and checkpoints under Fabric.

Exactness as everywhere: 2 ranks of Fabric end with the weights of one process without the strategy
on the same global batches; a checkpoint saved by ``fabric.save`` loads back bit for bit (sharded and
full), and a run resumed from it ends where the uninterrupted run does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _models import TABLES, data, external_launch

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
from lightning_shardrec.testing import run_ranks

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4
BATCH = 6  # per rank
TOL = {"rtol": 1e-5, "atol": 1e-6}


class Net(torch.nn.Module):
    """``_models.Rec`` as a plain module."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.ebc = EmbeddingBagCollection(
            [
                EmbeddingBagConfig(num_embeddings=n, embedding_dim=d, name=f"t_{f}", feature_names=[f], pooling=p)
                for f, n, d, p in TABLES
            ]
        )
        self.mlp = torch.nn.Linear(3 + sum(d for _, _, d, _ in TABLES), 1)

    def forward(self, batch):
        return self.mlp(torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)).squeeze(1)


def batches(rank: int, world: int, batch: int) -> list:
    dm = data(batch, STEPS)
    dm.rank_and_world_size = lambda: (rank, world)
    dm.setup("fit")
    return list(dm.train_dataloader())


def loss_of(model, batch):
    return F.binary_cross_entropy_with_logits(model(batch), batch.labels)


def reference(world: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """One process, no strategy, the global batches."""
    model = Net()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    for batch in batches(0, 1, BATCH * world)[:steps]:
        opt.zero_grad()
        loss_of(model, batch).backward()
        opt.step()
    return model.state_dict()


def fabric_run(rank, world, first, last, save=None, load=None, options=None):
    """Fabric on ``world`` ranks: (``load``) restore, train on global batches ``first``..``last - 1``, (``save``)
    save; the full state, the dense optimizer's state, the restored step and the plan's sharding types."""
    import lightning as L

    from lightning_shardrec.lightning import ShardRecFabricStrategy

    external_launch(rank, world)
    strategy = ShardRecFabricStrategy(**(options or {})) if options else "shardrec"
    fabric = L.Fabric(strategy=strategy, accelerator="cpu", devices=world)
    fabric.launch()
    model = Net()
    opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
    model, opt = fabric.setup(model, opt)
    state = {"model": model, "optimizer": opt, "step": 0}
    if load is not None:
        fabric.load(load, state)
    for batch in batches(rank, world, BATCH)[first:last]:
        batch = fabric.to_device(batch)
        opt.zero_grad()
        fabric.backward(loss_of(model, batch))
        opt.step()
        state["step"] += 1
    if save is not None:
        fabric.save(save, state)
    full = {k: v.clone() for k, v in fabric.strategy.full_state_dict().items()}
    types = sorted({p.sharding_type.value for p in fabric.strategy.tables.plan.get_plan_for_module("ebc").values()})
    dense_state = opt.optimizer.state_dict()["state"]
    fabric.strategy.teardown()
    return full, dense_state, state["step"], types


def test_importing_the_package_registers_shardrec_with_fabric_too():
    code = """
import json
from lightning.fabric.strategies import STRATEGY_REGISTRY
before = "shardrec" in STRATEGY_REGISTRY
import lightning_shardrec
import lightning as L
f = L.Fabric(strategy="shardrec", accelerator="cpu", devices=1)
print(json.dumps([before, type(f.strategy).__name__]))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [False, "ShardRecFabricStrategy"]


@pytest.mark.parametrize("options", [None, {"constraints": "row_wise"}])
def test_two_ranks_of_fabric_match_one_process(options):
    if options is not None:
        from lightning_shardrec import ParameterConstraints

        kind = options["constraints"]
        options = {"constraints": {f"t_{f}": ParameterConstraints(sharding_types=[kind]) for f, *_ in TABLES}}
    want = reference(2)
    for full, _, steps, types in run_ranks(fabric_run, 2, 0, STEPS, None, None, options):
        assert steps == STEPS
        if options is not None:
            assert types == ["row_wise"]
        assert set(full) == set(want)
        for k in want:
            torch.testing.assert_close(full[k], want[k], **TOL, msg=k)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_save_and_load_round_trip(tmp_path, fmt):
    path = str(tmp_path / "ckpt")
    options = {"checkpoint_format": fmt}
    saved = run_ranks(fabric_run, 2, 0, 2, path, None, options)
    assert Path(path).is_dir() == (fmt == "sharded")
    loaded = run_ranks(fabric_run, 2, 0, 0, None, path, options)  # load, no step
    for (full, dense, step, _), (full2, dense2, step2, _) in zip(saved, loaded, strict=True):
        assert step2 == step == 2
        for k in full:
            torch.testing.assert_close(full2[k], full[k], rtol=0, atol=0, msg=k)
        for i in dense:
            for name, t in dense[i].items():
                torch.testing.assert_close(dense2[i][name], t, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["sharded", "full"])
def test_a_resumed_run_ends_where_the_uninterrupted_one_does(tmp_path, fmt):
    """Adagrad: the tables' summed squares (the fused state) and the dense optimizer's come back too."""
    path = str(tmp_path / "ckpt")
    options = {"checkpoint_format": fmt}
    run_ranks(fabric_run, 2, 0, 2, path, None, options)
    want = reference(2)
    for full, _, step, _ in run_ranks(fabric_run, 2, 2, STEPS, None, path, options):
        assert step == STEPS
        for k in want:
            torch.testing.assert_close(full[k], want[k], **TOL, msg=k)


def test_options_of_the_trainer_loop_and_unknown_ones_are_refused():
    from lightning_shardrec.lightning import ShardRecFabricStrategy

    with pytest.raises(ValueError, match=r"\['pipeline'\] act on the Trainer's loop"):
        ShardRecFabricStrategy(pipeline=True)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['kernal'\]; valid: \['embedding_optimizer'"):
        ShardRecFabricStrategy(kernal="torch")


def twice_in_a_step(rank, world):
    import lightning as L

    from lightning_shardrec import ParameterConstraints
    from lightning_shardrec.errors import RepeatedLookupError
    from lightning_shardrec.lightning import ShardRecFabricStrategy

    external_launch(rank, world)
    row_wise = {f"t_{f}": ParameterConstraints(sharding_types=["row_wise"]) for f, *_ in TABLES}  # fused tables
    fabric = L.Fabric(strategy=ShardRecFabricStrategy(constraints=row_wise), accelerator="cpu", devices=world)
    fabric.launch()
    net = Net()
    model, opt = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    batch = batches(rank, world, BATCH)[0]
    try:
        model(batch)
        model(batch)  # positives, then negatives, before one step
    except RepeatedLookupError as e:
        return str(e)
    finally:
        fabric.strategy.teardown()
    return None


def test_a_table_looked_up_twice_before_a_step_is_refused_by_name():
    for message in run_ranks(twice_in_a_step, 2):
        assert message is not None and "ShardRecFabricStrategy: tables ['t_big', 't_mid', 't_tiny']" in message
        assert "looked up a second time before optimizer.step()" in message


def plain_modules_run(rank, world):
    """``test_plain_modules.TwoTower`` (plain ``nn.EmbeddingBag`` / ``nn.Embedding``) trained by Fabric."""
    import lightning as L
    from test_plain_modules import GLOBAL
    from test_plain_modules import batches as plain_batches

    external_launch(rank, world)
    fabric = L.Fabric(strategy="shardrec", accelerator="cpu", devices=world)
    fabric.launch()
    model, opt = two_tower()
    model, opt = fabric.setup(model, opt)
    share = GLOBAL // world
    for ids, offsets, items, y in plain_batches(rank * share, (rank + 1) * share):
        opt.zero_grad()
        fabric.backward(F.binary_cross_entropy_with_logits(model(ids, offsets, items), y))
        opt.step()
    full = {k: v.clone() for k, v in fabric.strategy.full_state_dict().items()}
    fabric.strategy.teardown()
    return full


def two_tower():
    from test_plain_modules import TwoTower

    model = TwoTower()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1)


def test_plain_embedding_modules_under_fabric_match_one_process():
    from test_plain_modules import GLOBAL
    from test_plain_modules import batches as plain_batches

    model, opt = two_tower()
    for ids, offsets, items, y in plain_batches(0, GLOBAL):
        opt.zero_grad()
        F.binary_cross_entropy_with_logits(model(ids, offsets, items), y).backward()
        opt.step()
    want = model.state_dict()
    for full in run_ranks(plain_modules_run, 2):
        assert set(full) == set(want)
        for k in want:
            torch.testing.assert_close(full[k], want[k], **TOL, msg=k)


def refusals(rank, world, path):
    import lightning as L

    external_launch(rank, world)
    fabric = L.Fabric(strategy="shardrec", accelerator="cpu", devices=world)
    fabric.launch()
    net = Net()
    model, opt = fabric.setup(net, torch.optim.Adagrad(net.parameters(), lr=0.05))
    seen = []
    try:
        fabric.save(path, {"model": model}, filter={"model": lambda k, v: "mlp" in k})
    except ValueError as e:
        seen.append(str(e))
    fabric.save(path, {"model": model, "optimizer": opt})
    try:
        fabric.load(path, {"model": model, "optimizer": opt, "step": 0})
    except KeyError as e:
        seen.append(str(e))
    rest = fabric.load(path, {"model": model, "optimizer": opt, "step": 0}, strict=False)
    try:
        fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    except RuntimeError as e:
        seen.append(str(e))
    fabric.strategy.teardown()
    return seen, sorted(rest)


def test_a_filter_on_the_sharded_model_a_missing_entry_and_a_second_setup_are_refused_by_name(tmp_path):
    for (filtered, missing, again), rest in run_ranks(refusals, 2, str(tmp_path / "ckpt")):
        assert "a filter on the sharded model 'model' is not supported" in filtered
        assert "has no ['step'], which the state to restore holds (pass strict=False" in missing
        assert rest == []
        assert "the model's tables were sharded by an earlier fabric.setup; set a model up once" in again


EXIT_SCRIPT = """
import atexit
import torch
import torch.distributed as dist

made = []


def after_the_library():  # registered before the library's exit hook, so it runs after it
    from lightning_shardrec.distributed.comm.groups import live_group
    print("groups live at exit:", [live_group(g) for g in made], flush=True)


atexit.register(after_the_library)
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the script's own default group
import lightning as L
from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig

fabric = L.Fabric(strategy="shardrec", accelerator="cpu", devices=1)
fabric.launch()
tables = [EmbeddingBagConfig(num_embeddings=8, embedding_dim=4, name="t", feature_names=["f"])]
model = torch.nn.ModuleDict({"ebc": EmbeddingBagCollection(tables), "mlp": torch.nn.Linear(4, 1)})
model, optimizer = fabric.setup(model, torch.optim.Adagrad(model.parameters(), lr=0.05))
made.extend(fabric.strategy.dense.groups)
print("groups made:", len(made), flush=True)
# the script ends without fabric.strategy.teardown(): fabric, model and optimizer stay referenced
"""


def test_a_fabric_script_that_never_tears_down_has_its_groups_destroyed_at_exit(tmp_path):
    """Fabric calls no ``teardown``: the exit hook destroys the groups the strategy made (here the dense layers'
    DDP group) as the Trainer's teardown does, also where the script made the default group itself (then the hook
    does not destroy every group); a group left to torch's registry is freed after the interpreter is gone."""
    script = tmp_path / "fabric_no_teardown.py"
    script.write_text(EXIT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "terminate called" not in out.stderr, out.stderr[-3000:]
    assert "groups made: 1" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    assert "groups live at exit: [False]" in out.stdout, out.stdout[-2000:]
