"""Lightning's model summary counts the sharded tables at their full size (they counted 0 before).

2 ranks, tables row- and table-wise: the summary the Trainer prints at the start of fit shows the
plain model's parameter counts (per layer and in total), and :class:`ShardedModelSummary` after
fit equals ``ModelSummary`` of the unsharded model.
"""

from __future__ import annotations

import logging

from _models import Rec, data, external_launch, trainer
from lightning.pytorch.utilities.model_summary import ModelSummary

from lightning_shardrec.testing import run_ranks


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.text: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.text.append(record.getMessage())


def fit_with_summary(rank, world):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy
    from lightning_shardrec.lightning.reports.summary import ShardedModelSummary

    external_launch(rank, world)
    kinds = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "table_wise"}
    constraints = {name: ParameterConstraints(sharding_types=[kind]) for name, kind in kinds.items()}
    lines, log = Lines(), logging.getLogger("lightning.pytorch.callbacks.model_summary")
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        model = Rec()
        t = trainer(strategy=ShardRecStrategy(constraints=constraints), devices=world, max_steps=1)
        t.enable_model_summary = True
        from lightning.pytorch.callbacks import ModelSummary as SummaryCallback

        t.callbacks.append(SummaryCallback(max_depth=1))
        t.fit(model, data(4, 1))
    finally:
        log.removeHandler(lines)
    after = ShardedModelSummary(model, 1, t.strategy.sharded)
    held = ModelSummary(model, 1)  # Lightning's own: the parameters this rank holds
    return "\n".join(lines.text), after.param_nums, after.total_parameters, held.total_parameters


def test_the_summary_counts_the_sharded_tables_in_full():
    (printed, nums, total, held), (other, *_) = run_ranks(fit_with_summary, 2)
    plain = ModelSummary(Rec(), 1)
    assert plain.total_parameters == 1360  # 120x8 + 30x12 + 3x4 table rows, 28 in the mlp
    assert held < plain.total_parameters  # what Lightning counted before
    assert (nums, total) == (plain.param_nums, plain.total_parameters)
    want = [line for line in str(plain).splitlines() if "params" in line]  # totals and the size in MB
    assert len(want) == 4 and all(line in printed for line in want), (want, printed)
    assert "| ebc  | ShardedEmbeddingBagCollection | 1.3 K  |" in printed, printed
    assert other == ""  # rank 0 prints
