"""Determinism on CPU: two ``Trainer(strategy="shardrec", devices=2)`` fits with the same seed end
with bit-identical weights (tables and dense) and fused optimizer state; another seed differs.

Each rank runs seed A, seed B, then seed A again in the same worker processes, so state left
behind by an earlier fit (RNG streams, cached permutations, kernel buffers) would show up as a
difference between the two A runs. fbgemm's CPU kernels have no Adam, so Adam runs on the
torch kernel only (``tests/kernels`` checks that fbgemm refuses it by name).
"""

from __future__ import annotations

import pytest
import torch
from _models import Rec, data, external_launch, trainer

from lightning_shardrec.testing import run_ranks

STEPS = 4
BATCH = 6  # per rank
SEED_A, SEED_B = 3, 4

# the planner would make tables this small data_parallel: force the fused kernels and the
# row/column/table-wise collectives (reduce-scatter, all-to-all, all-gather) into play
REC_SHARDING = {"t_big": "row_wise", "t_mid": "column_wise", "t_tiny": "table_wise"}
DLRM_SHARDING = {"t_a": "row_wise", "t_b": "table_wise"}

State = dict[str, torch.Tensor]


def _constraints(types: dict[str, str]) -> dict[str, object]:
    from lightning_shardrec import ParameterConstraints

    return {table: ParameterConstraints(sharding_types=[st]) for table, st in types.items()}


def _fused_state(strategy: object) -> State:
    """This rank's fused optimizer state (its shards' adagrad sums, adam moments), as ``"<table>.<name>"``."""
    fused = strategy.fused_optimizer  # type: ignore[attr-defined]
    states = [s for k in fused.kernels for s in k.split_states()]
    return {f"{t}.{name}": v.clone() for t, s in zip(fused.table_names, states, strict=True) for name, v in s.items()}


def _fit_rec(rank: int, world: int, seed: int, kernel: str, optimizer: str) -> tuple[State, State]:
    """One fit of the small ``Rec`` model: (full state, this rank's fused optimizer state)."""
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    strategy = ShardRecStrategy(kernel=kernel, constraints=_constraints(REC_SHARDING))
    model = Rec("adagrad")
    torch.manual_seed(seed)  # Rec seeds 0 itself: redraw every weight from this run's seed
    model.ebc.reset_parameters()
    model.mlp.reset_parameters()
    if optimizer == "adam":
        model.configure_optimizers = lambda: torch.optim.Adam(model.parameters(), lr=0.02)  # type: ignore[method-assign]
    init = {k: v.clone() for k, v in model.state_dict().items()}
    trainer(strategy=strategy, devices=world, max_steps=STEPS).fit(model, data(BATCH, STEPS, seed=seed))
    full = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    still = [k for k in init if torch.equal(init[k], full[k])]
    assert not still, f"training left {still} at their initial values"  # else equal runs prove nothing
    return full, _fused_state(strategy)


def _fit_dlrm(rank: int, world: int, seed: int, kernel: str) -> tuple[State, State]:
    """One fit of the DLRM task (dot interaction) on synthetic data."""
    from lightning_shardrec import ShardRecStrategy, SyntheticRecDataModule
    from lightning_shardrec.models import DLRMTask

    external_launch(rank, world)
    strategy = ShardRecStrategy(constraints=_constraints(DLRM_SHARDING), kernel=kernel)
    task = DLRMTask(
        embedding_dim=4, num_dense=3, dense_arch_layer_sizes=[8, 4], over_arch_layer_sizes=[8, 1], seed=seed
    )
    dm = SyntheticRecDataModule(
        num_dense=3,
        tables=[{"name": "a", "num_embeddings": 50}, {"name": "b", "num_embeddings": 7}],
        batch_size=BATCH,
        num_batches=STEPS,
        pooling_factor=2.0,
        seed=seed,
    )
    trainer(strategy=strategy, devices=world, max_steps=STEPS).fit(task, dm)
    full = {k: v.clone() for k, v in strategy.full_state_dict().items()}
    return full, _fused_state(strategy)


def fit_a_b_a(rank: int, world: int, model: str, kernel: str, optimizer: str) -> list[tuple[State, State]]:
    """Seeds A, B, A in a row on this rank."""
    if model == "dlrm":
        return [_fit_dlrm(rank, world, seed, kernel) for seed in (SEED_A, SEED_B, SEED_A)]
    return [_fit_rec(rank, world, seed, kernel, optimizer) for seed in (SEED_A, SEED_B, SEED_A)]


def assert_bit_identical(a: State, b: State, what: str) -> None:
    assert set(a) == set(b), what
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"{what}: not bit-identical: {differ}"


@pytest.mark.parametrize(
    ("model", "kernel", "optimizer"),
    [
        pytest.param("rec", "fbgemm", "adagrad", marks=pytest.mark.needs_fbgemm),
        ("rec", "torch", "adagrad"),
        ("rec", "torch", "adam"),
        # a pinned kernel: kernel="auto" times the backends, and a re-timed rank may pick the other
        pytest.param("dlrm", "fbgemm", "adagrad", marks=pytest.mark.needs_fbgemm),
    ],
)
def test_same_seed_same_bits_other_seed_differs(model: str, kernel: str, optimizer: str) -> None:
    per_rank = run_ranks(fit_a_b_a, 2, model, kernel, optimizer)
    for rank, ((full_a, fused_a), (full_b, _), (full_a2, fused_a2)) in enumerate(per_rank):
        what = f"{model}/{kernel}/{optimizer} rank {rank}"
        assert any(".embedding_bags." in k for k in full_a), sorted(full_a)  # the tables are in it
        assert_bit_identical(full_a, full_a2, f"{what} weights")
        assert_bit_identical(fused_a, fused_a2, f"{what} fused optimizer state")
        changed = [k for k in full_a if not torch.equal(full_a[k], full_b[k])]
        assert set(changed) == set(full_a), f"{what}: seed {SEED_B} left {set(full_a) - set(changed)} unchanged"
    held = {k.split("[")[0].split(".")[0] for (_, fused), _, _ in per_rank for k in fused}
    want = set(REC_SHARDING if model == "rec" else DLRM_SHARDING)
    assert held == want, f"fused optimizer state for {held}, expected every table {want}"
    # every rank ends with the same full model
    assert_bit_identical(per_rank[0][0][0], per_rank[1][0][0], f"{model}/{kernel}/{optimizer} rank 0 vs rank 1")
