"""Host syncs per training step, counted on every rank of 2- and 3-rank gloo fits through the Trainer.

The counter (:class:`~lightning_shardrec.gpu_check.syncs.SyncOps`) counts the calls that would
read a device tensor back to the host on CUDA, each at its line of this package; the dynamic
tables run their tensor-op path (the one a GPU takes). Bounds per rank and step: 2 with static
tables, 4 with a dynamic one; a failure lists every sync by line.
"""

from __future__ import annotations

import lightning as L
import pytest
from _models import Rec, data, external_launch, trainer
from test_strategy_dynamic import DynamicRec
from test_strategy_dynamic import data as dynamic_data

from lightning_shardrec.testing import run_ranks

BOUND = {"static": 2, "dynamic": 4}
STEPS = 6
#: the SIGTERM flag's read (every few steps) is the control path's (#42 item 4), on a host tensor
CONTROL = ("lightning_shardrec/lightning/failures/sigterm.py",)


class CountSyncs(L.Callback):
    """One :class:`SyncOps` over the whole fit; the sites counted between two batch starts are one step's."""

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._stack = None
        self._count = None
        self._seen: dict[str, int] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        from contextlib import ExitStack

        from lightning_shardrec.gpu_check.env import gpu_code_path
        from lightning_shardrec.gpu_check.syncs import SyncOps

        self._stack = ExitStack()
        self._stack.enter_context(gpu_code_path())
        self._count = self._stack.enter_context(SyncOps())

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._cut()

    def on_train_end(self, trainer, pl_module) -> None:
        self._cut()
        self._stack.close()

    def _cut(self) -> None:
        sites = {s: n for s, n in self._count.sites.items() if s.startswith("lightning_shardrec/")}
        step = {s: n - self._seen.get(s, 0) for s, n in sites.items() if n > self._seen.get(s, 0)}
        self._seen = sites
        self.steps.append(step)


def fit(rank: int, world: int, kind: str, pipeline: bool) -> list[dict[str, int]]:
    """Static: ``big`` row-wise, ``mid`` and ``tiny`` table-wise (two sharding groups); dynamic: the dynamic
    table row-wise on 3 ranks (its buckets split: the most syncs), table-wise on 2."""
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    counter = CountSyncs()
    if kind == "static":
        kinds = {"big": "row_wise", "mid": "table_wise", "tiny": "table_wise"}
        tables = {f"t_{f}": ParameterConstraints(sharding_types=[k]) for f, k in kinds.items()}
        model, dm = Rec("adagrad"), data(4, STEPS + 1)
    else:
        sharding = "row_wise" if world == 3 else "table_wise"
        tables = {"t_user": ParameterConstraints(sharding_types=[sharding])}
        model, dm = DynamicRec(), dynamic_data(6)
    strategy = ShardRecStrategy(constraints=tables, pipeline=pipeline)
    fit_trainer = trainer(
        strategy=strategy, devices=world, max_steps=STEPS, callbacks=[counter], use_distributed_sampler=False
    )
    fit_trainer.fit(model, train_dataloaders=_made(dm, rank, world))
    return counter.steps[2:-1]  # [0]: before the first batch; [1]: the first step (one-time set-up); [-1]: the end


def _identity(x):
    return x


def _made(dm, rank: int, world: int):
    """The datamodule's batches for this rank, made before the fit: making them is host work."""
    from torch.utils.data import DataLoader

    from lightning_shardrec.data.synthetic import SyntheticRecDataset, SyntheticRecGenerator

    made = SyntheticRecDataset(
        dm.spec,
        batch_size=dm.batch_size,
        num_batches=STEPS + 1,
        rank=rank,
        world_size=world,
        generator=SyntheticRecGenerator(dm.spec),
    )
    return DataLoader([made.batch(i) for i in range(STEPS + 1)], batch_size=None, collate_fn=_identity)


PORTABLE_KERNEL = "lightning_shardrec/kernels/row_updates.py"


def _listing(steps: list[dict[str, int]]) -> str:
    return "; ".join(", ".join(f"{s} x{n}" for s, n in sorted(step.items())) or "none" for step in steps)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("pipeline", [False, True])
@pytest.mark.parametrize("kind", ["static", "dynamic"])
def test_host_syncs_per_step_on_every_rank(kind: str, pipeline: bool, world: int) -> None:
    per_rank = run_ranks(fit, world, kind, pipeline)
    for rank, steps in enumerate(per_rank):
        assert steps, "no steady-state step counted"
        for step in steps:
            counted = {s: n for s, n in step.items() if not s.startswith(CONTROL)}
            # The portable kernel's backward (where it runs: no fbgemm, or `auto` chose it) reads the number
            # of distinct rows back once per table group (`unique_consecutive`), docs/operations.md; at most
            # one per group of this model (2), and counted apart from the library's bound.
            portable = {s: n for s, n in counted.items() if s.startswith(PORTABLE_KERNEL)}
            assert sum(portable.values()) <= 2, f"{kind}, rank {rank}: portable kernel syncs {_listing([portable])}"
            counted = {s: n for s, n in counted.items() if s not in portable}
            assert sum(counted.values()) <= BOUND[kind], (
                f"{kind} tables, pipeline={pipeline}, rank {rank} of {world}: "
                f"{sum(counted.values())} host syncs in a step (bound {BOUND[kind]}): {_listing([counted])}"
            )
