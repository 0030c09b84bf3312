"""DynamicTableMonitor: dynamic-table figures logged through the Trainer's loggers every N steps."""

from __future__ import annotations

import csv
import re

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, SyntheticRecDataModule
from lightning_shardrec.errors import DynamicTableFullWarning
from lightning_shardrec.lightning import DynamicTableMonitor
from lightning_shardrec.lightning.reports.dynamic_monitor import add_dynamic_monitor
from lightning_shardrec.modules.dynamic.mapper import WINDOW_FIELDS
from lightning_shardrec.modules.dynamic.stats import DERIVED, FIELDS
from lightning_shardrec.testing import run_ranks


class DynRec(L.LightningModule):
    """'user' is dynamic (24 slots for 120 ids: rows get evicted), 'item' static."""

    def __init__(self, dynamic: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = DynamicConfig(eviction="lru", min_count=2) if dynamic else None
        self.ebc = EmbeddingBagCollection([
            EmbeddingBagConfig(num_embeddings=24, embedding_dim=4, name="t_user", feature_names=["user"], dynamic=cfg),
            EmbeddingBagConfig(num_embeddings=30, embedding_dim=4, name="t_item", feature_names=["item"]),
        ])
        self.mlp = torch.nn.Linear(3 + 8, 1)

    def forward(self, batch):
        return self.mlp(torch.cat([batch.dense, self.ebc(batch.sparse).values()], 1)).squeeze(1)

    def training_step(self, batch, i):
        return F.binary_cross_entropy_with_logits(self(batch), batch.labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> SyntheticRecDataModule:
    tables = [{"name": "user", "num_embeddings": 120}, {"name": "item", "num_embeddings": 30}]
    return SyntheticRecDataModule(num_dense=3, tables=tables, batch_size=16, num_batches=8, val_batches=0, seed=1)


def _trainer(tmp_path, callbacks, **kwargs) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="", version=""),
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, **kwargs)


def _cumulative(figures: dict) -> dict:
    """The figures that do not restart with each window."""
    window = (*WINDOW_FIELDS, *DERIVED)
    return {k: v for k, v in figures.items() if not k.endswith(window)}


def _logged(tmp_path, prefix: str = "dynamic/") -> dict[int, dict[str, float]]:
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    out: dict[int, dict[str, float]] = {}
    for row in rows:
        values = {k: float(v) for k, v in row.items() if k.startswith(prefix) and v != ""}
        if values:
            out.setdefault(int(row["step"]), {}).update(values)
    return out


def test_figures_logged_every_n_steps_match_the_module(tmp_path):
    model = DynRec()
    monitor = DynamicTableMonitor(every_n_steps=2)
    _trainer(tmp_path, [monitor], max_steps=6, log_every_n_steps=50).fit(model, _data())
    logged = _logged(tmp_path)
    assert sorted(logged) == [2, 4, 6]
    final = model.ebc.dynamic_stats()["t_user"]
    assert list(final) == [*FIELDS, *DERIVED]
    assert logged[6] == monitor.last
    assert _cumulative(monitor.last) == {f"dynamic/t_user/{k}": float(v) for k, v in _cumulative(final).items()}
    assert final["window_lookups"] == final["miss_rate"] == 0  # logging at step 6 started a new window
    windows = [logged[s] for s in (2, 4, 6)]  # the windows split the run: their misses add up to the total
    assert sum(w["dynamic/t_user/window_misses"] for w in windows) == final["misses"]
    assert all(0 < w["dynamic/t_user/window_misses"] <= w["dynamic/t_user/window_lookups"] for w in windows)
    assert final["evictions"] > 0 and final["misses"] > 0 and final["occupancy"] == final["capacity"] == 24
    assert logged[2]["dynamic/t_user/admissions"] <= logged[4]["dynamic/t_user/admissions"] <= final["admissions"]
    assert not any("t_item" in k for k in monitor.last)  # static tables have no figures


def test_default_interval_is_log_every_n_steps_and_errors(tmp_path):
    _trainer(tmp_path, [DynamicTableMonitor(prefix="dyn")], max_steps=6, log_every_n_steps=3).fit(DynRec(), _data())
    logged = _logged(tmp_path, "dyn/")
    assert sorted(logged) == [3, 6] and "dyn/t_user/occupancy" in logged[3]
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match=r"DynamicTableMonitor: every_n_steps must be an int >= 1 or None .*got"):
            DynamicTableMonitor(every_n_steps=bad)


def test_a_full_table_warns_once_per_window_through_the_trainer(tmp_path):
    """'t_user' holds 24 of 120 ids (min_count 2): every window misses far more than 10% of its lookups."""
    monitor = DynamicTableMonitor(every_n_steps=2)
    with pytest.warns(DynamicTableFullWarning) as record:
        _trainer(tmp_path, [monitor], max_steps=6).fit(DynRec(), _data())
    logged = _logged(tmp_path)
    messages = [str(w.message) for w in record if w.category is DynamicTableFullWarning]
    assert len(messages) == 3  # steps 2, 4, 6: one per window, naming the table
    for step, message in zip((2, 4, 6), messages, strict=True):
        figures = {k.split("/")[-1]: v for k, v in logged[step].items() if k.startswith("dynamic/t_user/")}
        assert figures["miss_rate"] > 0.1 and figures["suggested_capacity"] > 24
        assert re.fullmatch(
            rf"dynamic table 't_user' is full: {int(figures['window_misses'])} of its "
            rf"{int(figures['window_lookups'])} lookups over the last 2 steps missed \(miss rate "
            rf"{100 * figures['miss_rate']:.1f}%, threshold 10%\); capacity 24, occupancy 24 \(100%\)\. The window "
            rf"saw about {int(figures['window_ids'])} distinct ids: "
            rf"num_embeddings={int(figures['suggested_capacity'])} would have held them "
            r"\(docs/dynamic-tables\.md, 'A full table'\)",
            message,
        )
    assert monitor.warned == messages[-1:]


def test_no_warning_under_the_threshold_or_when_off(tmp_path, recwarn):
    for i, limit in enumerate((1.0, None)):  # a miss rate is never above 100%
        monitor = DynamicTableMonitor(every_n_steps=2, miss_rate_warning=limit)
        _trainer(tmp_path / str(i), [monitor], max_steps=4).fit(DynRec(), _data())
        assert monitor.last["dynamic/t_user/miss_rate"] > 0.1 and monitor.warned == []
    assert not [w for w in recwarn if w.category is DynamicTableFullWarning]
    for bad in (0, 1.5, -0.1, True, "10%"):
        with pytest.raises(ValueError, match=r"DynamicTableMonitor: miss_rate_warning must be a share of lookups in "
                                             r"\(0, 1\] or None \(never warn\), got"):
            DynamicTableMonitor(miss_rate_warning=bad)


def test_add_dynamic_monitor_only_for_dynamic_models_and_once(tmp_path):
    trainer = _trainer(tmp_path, [])
    assert add_dynamic_monitor(trainer, DynRec(dynamic=False)) is None
    added = add_dynamic_monitor(trainer, DynRec())
    assert isinstance(added, DynamicTableMonitor) and added in trainer.callbacks
    assert add_dynamic_monitor(trainer, DynRec()) is None
    assert sum(isinstance(c, DynamicTableMonitor) for c in trainer.callbacks) == 1


def _data_for(batch_size: int) -> SyntheticRecDataModule:
    tables = [{"name": "user", "num_embeddings": 120}, {"name": "item", "num_embeddings": 30}]
    return SyntheticRecDataModule(num_dense=3, tables=tables, batch_size=batch_size, num_batches=6, val_batches=0,
                                  seed=1)


def fit_sharded(rank, world, tmp):
    from _models import external_launch

    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    out = []
    for log_stats, steps in ((True, 6), (False, 1)):
        trainer = L.Trainer(accelerator="cpu", devices=world, logger=CSVLogger(tmp, name="", version=str(log_stats)),
                            strategy=ShardRecStrategy(log_dynamic_stats=log_stats, heartbeat_timeout=None),
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            max_steps=steps, log_every_n_steps=3)
        trainer.fit(DynRec(), _data_for(8))
        monitors = [c for c in trainer.callbacks if isinstance(c, DynamicTableMonitor)]
        out.append(([m.last for m in monitors], trainer.strategy.sharded["ebc"].dynamic_stats()))
    return out


def test_sharded_figures_are_sums_over_ranks_and_match_one_process(tmp_path):
    """2 ranks (the strategy adds the monitor) log what one process logs; log_dynamic_stats=False adds none."""
    plain = DynRec()
    _trainer(tmp_path / "plain", [DynamicTableMonitor()], max_steps=6, log_every_n_steps=3).fit(plain, _data_for(16))
    want = plain.ebc.dynamic_stats()
    assert want["t_user"]["evictions"] > 0
    rank0, rank1 = run_ranks(fit_sharded, 2, str(tmp_path / "two"))
    (last0, stats0), (last1, stats1) = rank0[0], rank1[0]
    assert stats0 == stats1 == want  # after fit: every rank gets the sums
    assert last0 == last1
    want_last = {f"dynamic/t_user/{k}": float(v) for k, v in _cumulative(want["t_user"]).items()}
    assert [_cumulative(x) for x in last0] == [want_last]
    assert _logged(tmp_path / "two" / "True") == _logged(tmp_path / "plain")  # the same figures at steps 3 and 6
    assert rank0[1][0] == rank1[1][0] == []  # log_dynamic_stats=False: no monitor
