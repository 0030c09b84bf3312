"""The fused tables follow every LR scheduler exactly (issue 44, item 3).

At every step the tables' lr is ``base x group['lr'] / group['initial_lr']``: ``base`` is
``embedding_lr`` (else the tables' param group's lr as configured), ``group`` the tables' param
group, live (``initial_lr``: what schedulers record; without one, the configured lr). Each case
fits through the ``Trainer`` with the strategy, records the lr the kernels read at each step
and compares it with the trace computed here by stepping the same scheduler on a bare optimizer.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from _models import external_launch
from torch import nn
from torch.optim import lr_scheduler as S

from lightning_shardrec import ParameterConstraints
from lightning_shardrec.testing import run_ranks

GLOBAL, ROWS, STEPS = 12, 600, 12
DENSE_LR, TABLE_LR = 0.05, 0.2  # the two groups' lrs in the "groups" case
PLATEAU = [1.0, 0.9, 0.9, 0.9, 0.8, 0.8, 0.8, 0.8, 0.7, 0.7, 0.7, 0.7]  # the metric ReduceLROnPlateau watches

# case -> (scheduler factory, interval, embedding_lr)
CASES = {
    "linear_warmup": (lambda o: S.LinearLR(o, start_factor=0.01, total_iters=10), "step", 0.1),
    "lambda_from_0": (lambda o: S.LambdaLR(o, lambda s: min(1.0, s / 4)), "step", 0.1),
    "lambda_from_0_no_embedding_lr": (lambda o: S.LambdaLR(o, lambda s: min(1.0, s / 4)), "step", None),
    "one_cycle": (lambda o: S.OneCycleLR(o, max_lr=0.2, total_steps=STEPS, cycle_momentum=False), "step", 0.1),
    "cosine": (lambda o: S.CosineAnnealingLR(o, T_max=6, eta_min=0.001), "step", 0.1),
    "warm_restarts": (lambda o: S.CosineAnnealingWarmRestarts(o, T_0=4), "step", None),
    "step": (lambda o: S.StepLR(o, step_size=2, gamma=0.5), "step", 0.1),
    "plateau": (lambda o: S.ReduceLROnPlateau(o, factor=0.5, patience=1), "step", 0.1),
    "sequential": (
        lambda o: S.SequentialLR(o, [S.LambdaLR(o, lambda s: s / 3), S.ExponentialLR(o, gamma=0.8)], milestones=[3]),
        "step",
        0.1,
    ),
    "chained": (
        lambda o: S.ChainedScheduler([S.ConstantLR(o, factor=0.5, total_iters=3), S.ExponentialLR(o, gamma=0.9)]),
        "step",
        0.1,
    ),
    "groups": (lambda o: S.LambdaLR(o, [lambda s: 1.0 - s / 20, lambda s: 0.5**s]), "step", None),
    "epoch": (lambda o: S.StepLR(o, step_size=1, gamma=0.5), "epoch", 0.1),
}
BATCHES_PER_EPOCH = 3  # the "epoch" case: 4 epochs of 3 batches


class Sched(L.LightningModule):
    """A plain ``nn.EmbeddingBag`` model whose optimizer is SGD with one of :data:`CASES`' schedulers."""

    def __init__(self, case: str, two_groups: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = nn.EmbeddingBag(ROWS, 8, mode="sum")
        self.top = nn.Linear(8, 1)
        self.case, self.two_groups = case, two_groups or case == "groups"
        self.seen: list[tuple[float, float | None]] = []  # per step: (tables' group lr, tables' fused lr)

    def training_step(self, batch, i):
        ids, offsets, y = batch
        loss = F.binary_cross_entropy_with_logits(self.top(self.user(ids, offsets)).squeeze(1), y)
        self.log("metric", PLATEAU[self.global_step % len(PLATEAU)])
        return loss

    def on_before_optimizer_step(self, optimizer):
        fused = getattr(self.trainer.strategy, "fused_optimizer", None)
        kernels = [] if fused is None else fused.kernels
        group = optimizer.param_groups[-1]  # the tables' group
        self.seen.append((group["lr"], kernels[0].hparams["lr"] if kernels else None))

    def configure_optimizers(self):
        factory, interval, _ = CASES[self.case]
        opt = torch.optim.SGD(self.param_groups(), lr=DENSE_LR)
        scheduler = {"scheduler": factory(opt), "interval": interval}
        if self.case == "plateau":
            scheduler["monitor"] = "metric"
        return {"optimizer": opt, "lr_scheduler": scheduler}

    def param_groups(self):
        if not self.two_groups:
            return [{"params": list(self.parameters())}]
        return [{"params": list(self.top.parameters())}, {"params": list(self.user.parameters()), "lr": TABLE_LR}]


def batches(lo: int, hi: int, steps: int = STEPS) -> list:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 4, (GLOBAL,), generator=g)
        ids = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
        y = torch.rand(GLOBAL, generator=g).round()
        start, end = int(lengths[:lo].sum()), int(lengths[:hi].sum())
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths[lo:hi].cumsum(0)[:-1]])
        out.append((ids[start:end], offsets, y[lo:hi]))
    return out


def loader(rank: int, world: int, steps: int = STEPS):
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    return torch.utils.data.DataLoader(batches(lo, hi, steps), batch_size=None)


def trainer(**kw) -> L.Trainer:
    base = dict(
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    return L.Trainer(**{**base, **kw})


def strategy_for(embedding_lr: float | None):
    from lightning_shardrec import ShardRecStrategy

    row_wise = {"user": ParameterConstraints(sharding_types=["row_wise"])}  # every rank holds rows
    return ShardRecStrategy(embedding_lr=embedding_lr, constraints=row_wise, kernel="torch")


def fit_cases(rank, world, cases):
    external_launch(rank, world)
    out = {}
    for case in cases:
        _, interval, embedding_lr = CASES[case]
        model = Sched(case)
        if interval == "epoch":
            t = trainer(strategy=strategy_for(embedding_lr), devices=world, max_epochs=STEPS // BATCHES_PER_EPOCH)
            t.fit(model, loader(rank, world, BATCHES_PER_EPOCH))
        else:
            t = trainer(strategy=strategy_for(embedding_lr), devices=world, max_steps=STEPS)
            t.fit(model, loader(rank, world))
        out[case] = model.seen
    return out


def expected(case: str) -> tuple[list[float], list[float]]:
    """(the tables' group lr, the tables' lr) at each step, from the scheduler on a bare optimizer."""
    factory, interval, embedding_lr = CASES[case]
    groups = [{"params": [torch.zeros(1)]}]
    if case == "groups":
        groups = [{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)], "lr": TABLE_LR}]
    opt = torch.optim.SGD(groups, lr=DENSE_LR)
    scheduler = factory(opt)
    group = opt.param_groups[-1]
    configured = group.get("initial_lr", group["lr"])
    base = configured if embedding_lr is None else embedding_lr
    dense, tables = [], []
    for step in range(STEPS):
        dense.append(group["lr"])
        tables.append(base * group["lr"] / group.get("initial_lr", configured))
        opt.step()  # (no gradients: nothing moves; the scheduler's order check is satisfied)
        if case == "plateau":
            scheduler.step(PLATEAU[step])
        elif interval == "step" or (step + 1) % BATCHES_PER_EPOCH == 0:
            scheduler.step()
    return dense, tables


def check(case: str, seen: list[tuple[float, float | None]], steps: range = range(STEPS)) -> None:
    dense, tables = expected(case)
    assert [s[0] for s in seen] == pytest.approx([dense[i] for i in steps], rel=1e-9), f"{case}: dense lr"
    assert [s[1] for s in seen] == pytest.approx([tables[i] for i in steps], rel=1e-9), f"{case}: tables' lr"


def test_the_expected_traces_move():
    """The traces the tests compare against change over the steps (warm-ups from 0 included), and
    embedding_lr is not the dense lr: a test that ignored the scheduler or embedding_lr would fail."""
    for case in CASES:
        dense, tables = expected(case)
        assert len(set(tables)) > 2, case
        if CASES[case][2] is not None:
            assert not all(math.isclose(d, t) for d, t in zip(dense, tables, strict=True)), case
    assert expected("lambda_from_0")[1][0] == 0.0 and expected("linear_warmup")[1][10] == pytest.approx(0.1)


FAST = ["linear_warmup", "lambda_from_0", "one_cycle", "plateau", "groups", "epoch"]


def test_the_tables_follow_each_scheduler_on_two_ranks():
    results = run_ranks(fit_cases, 2, FAST, timeout=600)
    for rank_result in results:
        for case in FAST:
            check(case, rank_result[case])


def test_the_tables_follow_every_other_scheduler_on_one_rank():
    cases = [c for c in CASES if c not in FAST]
    (result,) = run_ranks(fit_cases, 1, cases, timeout=600)
    for case in cases:
        check(case, result[case])


# --- resume: fit(ckpt_path=...) at step 6 of StepLR(step_size=2, gamma=0.5), same and other world size ----------
def fit_then_save(rank, world, path):
    external_launch(rank, world)
    t = trainer(strategy=strategy_for(0.1), devices=world, max_steps=6)
    t.fit(Sched("step"), loader(rank, world))
    t.save_checkpoint(path)


def resume(rank, world, path):
    external_launch(rank, world)
    model = Sched("step")
    t = trainer(strategy=strategy_for(0.1), devices=world, max_steps=STEPS)
    t.fit(model, loader(rank, world), ckpt_path=path)
    return model.seen


@pytest.mark.parametrize("resume_world", [2, 1])
def test_the_tables_follow_the_scheduler_after_a_resume(tmp_path, resume_world):
    path = str(tmp_path / "step6.ckpt")
    run_ranks(fit_then_save, 2, path, timeout=600)
    for seen in run_ranks(resume, resume_world, path, timeout=600):
        check("step", seen, range(6, STEPS))  # the dense lr halves on: 0.0125, 0.0125, 0.00625, ...


# --- the weights: SGD tables with a warm-up and embedding_lr equal one process without the strategy --------------
def fit_weights(rank, world):
    external_launch(rank, world)
    model = Sched("linear_warmup")
    strategy = strategy_for(0.1)
    trainer(strategy=strategy, devices=world, max_steps=STEPS).fit(model, loader(rank, world))
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


class TwoGroupReference(Sched):
    """One process: the tables in their own group at lr 0.1 (= embedding_lr), the same scheduler on both."""

    def param_groups(self):
        return [{"params": list(self.top.parameters())}, {"params": list(self.user.parameters()), "lr": 0.1}]


def test_sgd_tables_under_a_warm_up_equal_one_process():
    reference = TwoGroupReference("linear_warmup")
    trainer(devices=1, max_steps=STEPS).fit(reference, loader(0, 1))
    want = reference.state_dict()
    for got in run_ranks(fit_weights, 2, timeout=600):
        assert set(got) == set(want)
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
    moved = (want["user.weight"] - Sched("step").user.weight).abs().max()
    assert moved > 1e-3  # the tables trained
