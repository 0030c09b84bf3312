"""A ``checkpoint_format="full"`` file resumes in a plain ``Trainer(devices=1).fit(ckpt_path=...)``.

The file holds the full tables and, in the plain layout, their optimizer state (Adagrad's ``sum``
and ``step`` where the user's Adagrad keeps them): the plain Trainer restores the tables and the
tables' optimizer state exactly as the sharded run had them (2 ranks, row- and table-wise), and
trains on. The strategy resumes the same file (test_strategy_checkpoint.py's full format).
"""

from __future__ import annotations

import lightning as L
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

KINDS = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "data_parallel"}


def fit_and_save(rank, world, path):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.checkpoint import gather_full_state

    external_launch(rank, world)
    constraints = {name: ParameterConstraints(sharding_types=[kind]) for name, kind in KINDS.items()}
    t = trainer(
        strategy=ShardRecStrategy(constraints=constraints, checkpoint_format="full"), devices=world, max_steps=2
    )
    t.fit(Rec(), data(4, 4))
    t.save_checkpoint(path)
    full = {k: v.clone() for k, v in t.strategy.full_state_dict().items()}
    _, states = gather_full_state(t.strategy.sharded)
    return full, states


class Restored(L.Callback):
    def on_train_start(self, trainer, module):
        opt = trainer.optimizers[0]
        self.step = trainer.global_step
        self.weights = {k: v.clone() for k, v in module.state_dict().items()}
        names = {id(p): n for n, p in module.named_parameters()}
        self.states = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


def test_a_full_file_resumes_in_a_plain_trainer(tmp_path):
    path = str(tmp_path / "full.ckpt")
    (full, states), _ = run_ranks(fit_and_save, 2, path)
    restored, model = Restored(), Rec()
    plain = trainer(devices=1, max_steps=4, callbacks=[restored])  # no strategy
    plain.fit(model, data(8, 4), ckpt_path=path)
    assert restored.step == 2 and plain.global_step == 4
    for k, v in full.items():
        torch.testing.assert_close(restored.weights[k], v, rtol=0, atol=0, msg=k)
    tables = [k for k in full if k.startswith("ebc.")]
    assert len(tables) == 3
    for key in tables:
        want = states.get(key)
        if want is None:  # the data-parallel table: its state came from the dense optimizer
            want = {"sum": restored.states[key]["sum"]}
        torch.testing.assert_close(restored.states[key]["sum"], want["sum"], rtol=0, atol=0, msg=key)
        assert float(restored.states[key]["step"]) == 2.0, key
        assert restored.states[key]["sum"].abs().sum() > 0, key  # trained: not a fresh state
