"""Collectives per training step on the process group, counted on every rank of a 2-rank gloo fit.

Every ``torch.distributed`` collective a step calls is counted at the line of this package that
called it (the innermost frame under ``lightning_shardrec/`` past the ``comm`` wrappers). DDP's dense
all-reduce runs inside its C++ reducer and is not a ``torch.distributed`` call; the SIGTERM flag's
broadcast (every few steps, on a gloo group) is control, counted apart. A step's data path:

- ``static``: two sharding groups (``big`` row-wise; ``mid``, ``tiny`` table-wise): the batch header
  (sizes), ONE all-to-all carrying both groups' lengths and ids, the table-wise pooled rows and their
  gradients, the row-wise reduce-scatter and its gradients' all-gather: 6 (9 before issue 42).
- ``dynamic``: a dynamic and a static table, both table-wise (two groups of the all-to-all kind): the
  header, one all-to-all of ids, ONE of both groups' pooled rows, one of their gradients: 4 (9 before).
"""

from __future__ import annotations

import traceback
from collections import Counter

import lightning as L
import pytest
from _models import Rec, data, external_launch, trainer
from test_step_syncs import _made
from test_strategy_dynamic import DynamicRec
from test_strategy_dynamic import data as dynamic_data

from lightning_shardrec.testing import run_ranks

#: per rank and step, the data path's collectives (module docstring); one more fails the test
BOUND = {"static": 6, "dynamic": 4}
STEPS = 6
COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_gather_single",
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "send",
    "recv",
    "isend",
    "irecv",
)
#: the SIGTERM flag's lagged all-reduce: the control path (#42 item 4)
CONTROL = ("lightning_shardrec/lightning/failures/sigterm.py",)


def _site() -> str:
    """``path:line`` of the innermost frame of this package that led to the call (past the ``comm`` wrappers)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        at = frame.filename.replace("\\", "/")
        if "/lightning_shardrec/" in at and not at.endswith(("/distributed/comm/collectives.py", "/testing.py")):
            return f"lightning_shardrec/{at.rsplit('/lightning_shardrec/', 1)[1]}:{frame.lineno}"
    return "elsewhere"


class CountCollectives(L.Callback):
    """Wraps ``torch.distributed``'s collectives for the fit; the calls between two batch starts are one step's."""

    def __init__(self) -> None:
        self.steps: list[Counter[str]] = []
        self._now: Counter[str] = Counter()
        self._saved: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        import torch.distributed as dist

        for name in COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is None:
                continue
            self._saved[name] = orig

            def counted(*args, _orig=orig, _name=name, **kw):
                self._now[f"{_name} @ {_site()}"] += 1
                return _orig(*args, **kw)

            setattr(dist, name, counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.steps.append(self._now)
        self._now = Counter()

    def on_train_end(self, trainer, pl_module) -> None:
        self.restore()

    def restore(self) -> None:
        import torch.distributed as dist

        for name, orig in self._saved.items():
            setattr(dist, name, orig)
        self._saved = {}


def fit(rank: int, world: int, kind: str, pipeline: bool) -> list[dict[str, int]]:
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    counter = CountCollectives()
    if kind == "static":
        kinds = {"t_big": "row_wise", "t_mid": "table_wise", "t_tiny": "table_wise"}
        model, dm = Rec("adagrad"), data(4, STEPS + 1)
    else:
        kinds = {"t_user": "table_wise", "t_item": "table_wise"}
        model, dm = DynamicRec(), dynamic_data(6)
    tables = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds.items()}
    strategy = ShardRecStrategy(constraints=tables, pipeline=pipeline, comm_transport="pg")
    fit_trainer = trainer(
        strategy=strategy, devices=world, max_steps=STEPS, callbacks=[counter], use_distributed_sampler=False
    )
    try:
        fit_trainer.fit(model, train_dataloaders=_made(dm, rank, world))
    finally:
        counter.restore()  # the rank processes are shared: leave torch.distributed as found
    # [0]: before the first batch; [1]: the first step (one-time set-up, the pipeline's first prefetch)
    return [dict(s) for s in counter.steps[2:]]


def _listing(step: dict[str, int]) -> str:
    return "; ".join(f"{s} x{n}" for s, n in sorted(step.items()))


@pytest.mark.parametrize(("kind", "pipeline"), [("static", False), ("static", True), ("dynamic", False)])
def test_collectives_per_step_on_the_process_group(kind: str, pipeline: bool) -> None:
    per_rank = run_ranks(fit, 2, kind, pipeline)
    for rank, steps in enumerate(per_rank):
        assert len(steps) >= 3, f"rank {rank}: {len(steps)} steady-state steps counted"
        for step in steps:
            data_path = {s: n for s, n in step.items() if CONTROL[0] not in s}
            assert sum(data_path.values()) <= BOUND[kind], (
                f"{kind}, pipeline={pipeline}, rank {rank}: {sum(data_path.values())} collectives in a step "
                f"(bound {BOUND[kind]}): {_listing(data_path)}"
            )
        # The count is real: every steady step issues the data path's collectives (none hidden elsewhere).
        assert all(sum(n for s, n in step.items() if CONTROL[0] not in s) == BOUND[kind] for step in steps), (
            f"rank {rank}: " + " | ".join(_listing(s) for s in steps)
        )
