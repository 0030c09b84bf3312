"""Accumulation and global-norm clipping with fused tables (issue 31): the table updates wait for the
optimizer step, and ``Trainer(strategy="shardrec", devices=W)`` ends with the weights of
``Trainer(devices=1)`` (no strategy) on the same global batches, with the same
``accumulate_grad_batches`` / ``gradient_clip_val`` / precision.

Adam and row-wise Adagrad are row-sparse rules: their reference is one process that trains the
fused tables with the same rule (``RowSparseAdam``, ``RowwiseAdagrad`` below) and the rest with
torch's optimizer, inside one optimizer (so Lightning clips them together).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _models import Rec, data, external_launch, trainer

from lightning_shardrec import EmbeddingCollection, EmbeddingConfig
from lightning_shardrec.testing import run_ranks

BATCH = 6  # per rank
BATCHES = 6  # one epoch: k=2 -> 3 steps, k=4 -> 2 steps (the last window is 2 batches)
TOL = {"rtol": 1e-5, "atol": 1e-6}
LR, EPS = 0.1, 1e-12  # SparseAdam adds eps before the bias correction, Adam after: keep it tiny
FUSED = ("t_big", "t_mid")  # t_tiny is data-parallel in the "mixed" plan


def kinds_of(sharding: str) -> dict[str, str]:
    if sharding == "mixed":  # one plan with three kinds: fused row- and column-wise, data-parallel
        return {"t_big": "row_wise", "t_mid": "column_wise", "t_tiny": "data_parallel"}
    return dict.fromkeys(("t_big", "t_mid", "t_tiny"), sharding)


# --- the one-process row-sparse rules (references) ----------------------------------------------------
class RowSparseAdam(torch.optim.SparseAdam):
    """SparseAdam on the rows a step touched (the fused row-sparse rule), from dense gradients."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad = p.grad.to_sparse(1)
        return super().step()


class RowwiseAdagrad(torch.optim.Optimizer):
    """One Adagrad sum per row (the mean of its squared gradient), on the rows a step touched."""

    def __init__(self, params, lr, eps):
        super().__init__(params, {"lr": lr, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    s = self.state[p].setdefault("sum", torch.zeros(p.shape[0]))
                    s += p.grad.pow(2).mean(1)
                    p -= group["lr"] * p.grad / (s.sqrt() + group["eps"]).unsqueeze(1)


class OneProcess(torch.optim.Optimizer):
    """``dense`` params with torch's ``dense_cls``, ``tables`` with a row-sparse ``table_opt``: one optimizer."""

    def __init__(self, dense, tables, dense_cls, table_cls):
        super().__init__([{"params": dense}, {"params": tables}], {"lr": LR})
        self.inner = [dense_cls(dense, lr=LR, eps=EPS, weight_decay=0.0), table_cls(tables, lr=LR, eps=EPS)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.inner:
            opt.step()
        return loss


class RuleRec(Rec):
    """``Rec`` trained by ``rule`` (adam, adamw, rowwise_adagrad); ``reference``: the one-process form."""

    def __init__(self, rule: str, reference: bool, **kwargs):
        super().__init__(**kwargs)
        self.rule, self.reference = rule, reference

    def configure_optimizers(self):
        dense_cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "rowwise_adagrad": torch.optim.Adagrad}
        if not self.reference:  # rowwise_adagrad: ShardRecStrategy(embedding_optimizer=...) picks the rule
            return dense_cls[self.rule](self.parameters(), lr=LR, eps=EPS, weight_decay=0.0)
        tables = [p for n, p in self.named_parameters() if any(f".{t}." in n for t in FUSED)]
        dense = [p for p in self.parameters() if all(p is not t for t in tables)]
        table_cls = RowwiseAdagrad if self.rule == "rowwise_adagrad" else RowSparseAdam
        return OneProcess(dense, tables, dense_cls[self.rule], table_cls)


class SeqRec(Rec):
    """Sequence tables (``EmbeddingCollection``): each id's row, weighted by its position, summed per sample."""

    def build(self) -> None:
        torch.manual_seed(0)
        self.ebc = EmbeddingCollection(
            [
                EmbeddingConfig(num_embeddings=n, embedding_dim=4, name=f"t_{f}", feature_names=[f])
                for f, n in (("big", 120), ("mid", 30), ("tiny", 3))
            ]
        )
        self.mlp = torch.nn.Linear(3 + 12, 1)

    def forward(self, batch):
        pooled = []
        for f in ("big", "mid", "tiny"):
            jt = self.ebc(batch.sparse)[f]
            lengths = jt.lengths().long()
            sample = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
            pos = torch.arange(jt.values().shape[0]) - torch.repeat_interleave(jt.offsets()[:-1].long(), lengths)
            rows = jt.values() * (1.0 + pos.unsqueeze(1)).reciprocal()
            pooled.append(torch.zeros(lengths.numel(), 4).index_add_(0, sample, torch.tanh(rows)))
        return self.mlp(torch.cat([batch.dense, *pooled], 1)).squeeze(1)


class LoudRec(Rec):
    """``Rec`` with its loss times 50: gradient norms above 1 (so ``gradient_clip_val=1.0`` engages)."""

    def training_step(self, batch, i):
        return 50.0 * F.binary_cross_entropy_with_logits(self(batch), batch.labels)


class ManualClip(Rec):
    """Manual optimization: clip by norm between ``manual_backward`` and ``step`` (optionally accumulating 2)."""

    def __init__(self, clip: float, every: int = 1):
        super().__init__("sgd", lr=LR, manual=True)
        self.clip, self.every = clip, every

    def training_step(self, batch, i):
        opt = self.optimizers()
        self.manual_backward(F.binary_cross_entropy_with_logits(self(batch), batch.labels) / self.every)
        if (i + 1) % self.every == 0:
            self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()


class TwoOptimizers(Rec):
    """Manual optimization, the MLP in SGD and the tables in Adagrad; only the tables' optimizer is clipped."""

    def __init__(self):
        super().__init__("adagrad", lr=LR, manual=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.mlp.parameters(), lr=LR), torch.optim.Adagrad(self.ebc.parameters(), lr=LR)

    def training_step(self, batch, i):
        dense, tables = self.optimizers()
        dense.zero_grad()
        tables.zero_grad()
        self.manual_backward(F.binary_cross_entropy_with_logits(self(batch), batch.labels))
        dense.step()  # the tables have not moved yet: they step with their own optimizer
        self.clip_gradients(tables, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        tables.step()


def make_model(model: str, optimizer: str, reference: bool):
    if model == "seq":
        return SeqRec(optimizer, lr=LR)
    if model == "loud":
        return LoudRec(optimizer, lr=0.01)
    if model == "two_optimizers":
        return TwoOptimizers()
    if model.startswith("manual"):
        return ManualClip(0.05, every=2 if model == "manual_acc" else 1)
    if optimizer in ("adam", "adamw", "rowwise_adagrad"):
        return RuleRec(optimizer, reference, lr=LR)
    return Rec(optimizer, lr=LR)


def trainer_options(options: dict) -> dict:
    options = {k: v for k, v in options.items() if k not in ("pipeline", "model")}
    if options.get("precision") == "16-mixed":  # Lightning's CPU GradScaler (see test_strategy_precision)
        from lightning.pytorch.plugins.precision import MixedPrecision

        options["plugins"] = [MixedPrecision("16-mixed", "cpu")]
        del options["precision"]
    return options


def fit_sharded(rank, world, sharding, optimizer, options):
    from lightning_shardrec import FusedOptimConfig, ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds_of(sharding).items()}
    given = FusedOptimConfig(optimizer="rowwise_adagrad", lr=LR, eps=EPS) if optimizer == "rowwise_adagrad" else None
    strategy = ShardRecStrategy(
        constraints=constraints, pipeline=options.get("pipeline", False), embedding_optimizer=given
    )
    t = trainer(strategy=strategy, devices=world, max_epochs=1, **trainer_options(options))
    t.fit(make_model(options.get("model", "rec"), optimizer, False), data(BATCH, BATCHES))
    kernels = {type(k).__name__ for s in strategy.sharded.values() for k in s.kernels()}
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}, kernels, t.global_step


def fit_reference(world, optimizer, options):
    model = make_model(options.get("model", "rec"), optimizer, True)
    t = trainer(devices=1, max_epochs=1, **trainer_options(options))
    t.fit(model, data(BATCH * world, BATCHES))
    return model.state_dict(), t.global_step


def assert_same(got, want, what, tol=TOL):
    assert set(got) == set(want), what
    for k in want:
        assert torch.isfinite(got[k]).all(), f"{what}: {k}"
        torch.testing.assert_close(got[k], want[k], **tol, msg=f"{what}: {k}")


ACC2, ACC4 = {"accumulate_grad_batches": 2}, {"accumulate_grad_batches": 4}
CLIP1 = {"gradient_clip_val": 1.0, "model": "loud"}  # Lightning's default algorithm: by norm
CLIP005 = {"gradient_clip_val": 0.05}
# bf16 autocast rounds the MLP's batch sums on 6 rows per rank vs 12 in one process: the plain bf16-mixed
# fit (no accumulation, no clipping) is 1.3e-4 away on mlp.weight already; measured here: 4.5e-5
BF16_TOL = {"rtol": 0.0, "atol": 1e-4}
FP16_TOL = {"rtol": 1e-5, "atol": 1e-5}  # fp16 autocast: measured 1.7e-6 on mlp.weight
# Adam divides each row's gradient by its own magnitude: the rounding of a near-zero row (summed in
# another order) is amplified. Measured: 4.0e-6 on t_big with clip 0.05, 4.9e-7 without clipping;
# 6.0e-5 on a column-wise t_mid over a 4-batch AdamW window once tables are seeded without moving the
# global RNG (#43: the data and dense init changed). A logic error moves rows by about lr (1e-2).
ADAM_TOL = {"rtol": 1e-5, "atol": 1e-4}

FAST = [
    (2, "mixed", "adagrad", ACC2),
    (2, "mixed", "sgd", CLIP005),
    (2, "table_wise", "adagrad", CLIP1),
    (3, "table_row_wise", "adagrad", {**ACC2, **CLIP005}),
    (2, "row_wise", "sgd", {**ACC4, "pipeline": True}),
    (2, "mixed", "adam", {**ACC2, **CLIP005}),
    (2, "row_wise", "adagrad", {**ACC2, **CLIP005, "model": "seq"}),
    (2, "mixed", "sgd", {"model": "manual"}),
    (2, "mixed", "sgd", {**ACC2, **CLIP005, "precision": "16-mixed"}),  # measured: 1.7e-6
]
EXTRA = [  # the long tail (slow)
    (3, "mixed", "adagrad", {**ACC2, "gradient_clip_val": 0.004, "gradient_clip_algorithm": "value"}),
    (2, "mixed", "rowwise_adagrad", {**ACC2, **CLIP005}),
    (2, "mixed", "adamw", ACC4),
    (3, "row_wise", "sgd", {"model": "manual_acc"}),
    (2, "mixed", "adagrad", {"model": "two_optimizers"}),
    (2, "mixed", "sgd", {**ACC2, **CLIP005, "precision": "bf16-mixed"}),
    (3, "mixed", "sgd", {**CLIP005, "precision": "16-mixed"}),
]
TYPES = ("table_wise", "row_wise", "column_wise", "table_row_wise", "data_parallel")
SLOW = [  # every sharding type on 2 and 3 ranks, pipeline off and on
    c
    for s in TYPES
    for c in ((2, s, "adagrad", {**ACC2, **CLIP005}), (3, s, "sgd", {**ACC4, **CLIP1, "pipeline": True}))
]
SEQ_SLOW = [(2 + i % 2, s, "adagrad", {**ACC2, **CLIP005, "model": "seq"}) for i, s in enumerate(TYPES)]


def _id(case) -> str:
    w, s, o, opts = case
    return f"W{w}-{s}-{o}-" + "-".join(f"{k}={v}" for k, v in opts.items())


def check(world, sharding, optimizer, options):
    want, steps = fit_reference(world, optimizer, options)
    tol = {"bf16-mixed": BF16_TOL, "16-mixed": FP16_TOL}.get(
        options.get("precision"), ADAM_TOL if "adam" in optimizer else TOL
    )
    for rank, (got, kernels, got_steps) in enumerate(run_ranks(fit_sharded, world, sharding, optimizer, options)):
        assert got_steps == steps
        assert kernels <= {"TorchBatchedEmbedding"}  # deferred updates run on the torch kernel
        assert_same(got, want, f"{_id((world, sharding, optimizer, options))} rank {rank}", tol)


@pytest.mark.parametrize("case", FAST, ids=_id)
def test_matches_one_process(case):
    check(*case)


def test_clipping_engages():
    """The clipped references differ from the unclipped ones: the cases above test clipping."""
    for clip in (CLIP1, CLIP005, {"gradient_clip_val": 0.004, "gradient_clip_algorithm": "value"}):
        plain = fit_reference(2, "sgd", {"model": clip.get("model", "rec")})[0]["ebc.embedding_bags.t_big.weight"]
        clipped = fit_reference(2, "sgd", clip)[0]["ebc.embedding_bags.t_big.weight"]
        assert (clipped - plain).abs().max() > 1e-4, clip


@pytest.mark.slow
@pytest.mark.parametrize("case", EXTRA + [c for c in SLOW + SEQ_SLOW if c not in FAST], ids=_id)
def test_every_sharding_type_matches_one_process(case):
    check(*case)


# --- dynamic tables: rows admitted and evicted inside an accumulation window -----------------------------
def fit_dynamic(rank, world, options):
    from test_strategy_dynamic import DynamicRec
    from test_strategy_dynamic import data as dynamic_data

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    row_wise = {"t_user": ParameterConstraints(sharding_types=["row_wise"])}
    strategy = ShardRecStrategy(constraints=row_wise, pipeline=options.get("pipeline", False))
    t = trainer(strategy=strategy, devices=world, max_epochs=1, **trainer_options(options))
    t.fit(DynamicRec(), dynamic_data(BATCH))
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


@pytest.mark.parametrize(
    "options", [{**ACC2, **CLIP005}, pytest.param({**ACC2, "pipeline": True}, marks=pytest.mark.slow)], ids=str
)
def test_dynamic_tables_evicting_inside_the_window_match_one_process(options):
    """A slot evicted and given to another id between two micro-batches keeps the window's gradient
    sum, as the ``.grad`` of one process does (its weight and state reset at admission, in forward)."""
    from test_strategy_dynamic import DynamicRec
    from test_strategy_dynamic import data as dynamic_data

    model = DynamicRec()
    trainer(devices=1, max_epochs=1, **trainer_options(options)).fit(model, dynamic_data(2 * BATCH))
    want = model.state_dict()
    assert model.ebc.dynamic_stats()["t_user"]["evictions"] > 0
    keys = ("ebc.embedding_bags.t_user.weight", "ebc.embedding_bags.t_item.weight", "mlp.weight", "mlp.bias")
    for rank, got in enumerate(run_ranks(fit_dynamic, 2, options)):
        for k in keys:
            torch.testing.assert_close(got[k], want[k], **TOL, msg=f"dynamic {options} rank {rank}: {k}")


# --- no cost when off --------------------------------------------------------------------------------------
def fit_plain(rank, world, options):
    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    constraints = {t: ParameterConstraints(sharding_types=[k]) for t, k in kinds_of("mixed").items()}
    strategy = ShardRecStrategy(constraints=constraints)
    seen = []
    t = trainer(strategy=strategy, devices=world, max_steps=2, **options)
    model = Rec("sgd")
    model.on_train_batch_start = lambda *a: seen.append(
        sorted({str(k.row_sink is not None) for s in strategy.sharded.values() for k in s.kernels()})
    )
    t.fit(model, data(BATCH, 2))
    return seen, strategy._deferred_glue is not None


def test_without_accumulation_or_norm_clipping_the_updates_stay_in_backward():
    """Plain fits and value clipping keep the fused in-backward path (no sink, no glue)."""

    def sinks(results):
        assert any(x for seen, _ in results for x in seen)  # some rank holds fused kernels
        return {x for seen, _ in results for step in seen for x in step}, {glued for _, glued in results}

    for options in ({}, {"gradient_clip_val": 0.1, "gradient_clip_algorithm": "value"}):
        assert sinks(run_ranks(fit_plain, 2, options)) == ({"False"}, {False}), options
    assert sinks(run_ranks(fit_plain, 2, ACC2)) == ({"True"}, {True})


# --- what the plan printout and the fit-start line say -------------------------------------------------------
class ClipsItself(Rec):
    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        self.clip_gradients(optimizer, 0.5, "norm")


def test_the_plan_printout_and_the_fit_start_line_say_why_updates_wait(capsys):
    from types import SimpleNamespace

    from lightning_shardrec.lightning.reports.plan_report import print_plan
    from lightning_shardrec.lightning.training.deferred import deferral_line, deferral_reason
    from lightning_shardrec.planner import EmbeddingShardingPlanner, Topology

    def fit(k=1, clip=None, algorithm=None):
        return SimpleNamespace(accumulate_grad_batches=k, gradient_clip_val=clip, gradient_clip_algorithm=algorithm)

    assert deferral_reason(fit(), Rec()) is None
    assert deferral_reason(fit(clip=0.1, algorithm="value"), Rec()) is None  # clamped inside the fused update
    reason = deferral_reason(fit(k=2, clip=0.05), Rec())
    assert reason == (
        "accumulate_grad_batches=2: the tables' row gradients of 2 micro-batches are summed; "
        "gradient_clip_val=0.05 by norm: the norm counts the tables' gradients"
    )
    assert deferral_reason(fit(), ClipsItself()) == (
        "configure_gradient_clipping is overridden: it may clip the tables' gradients"
    )
    assert deferral_reason(fit(), Rec(manual=True)).startswith(
        "manual optimization: the tables step in optimizer.step()"
    )
    plan = EmbeddingShardingPlanner(Topology(2, compute_device="cpu")).plan(Rec())
    print_plan(plan, {}, reason)
    out = capsys.readouterr().out
    assert out.startswith("lightning_shardrec sharding plan:\n")
    assert out.rstrip("\n").endswith(deferral_line(reason))
    from lightning_shardrec import _fbgemm

    assert f"\nkernels: {_fbgemm.describe()}\n" in out  # the fbgemm build and the backend chosen (#40)
    assert deferral_line(reason).startswith(
        "ShardRecStrategy: table updates are deferred to the optimizer step (accumulate_grad_batches=2: "
    )
    assert "each rank keeps the window's unique rows x dim of gradient until the step" in deferral_line(reason)


# --- plain nn.EmbeddingBag / nn.Embedding (padding_idx) modules, sharded in place ------------------------------
def fit_plain_modules(rank, world, options):
    from test_plain_modules import GLOBAL, TwoTower, loader
    from test_plain_modules import trainer as plain_trainer

    from lightning_shardrec import ParameterConstraints, ShardRecStrategy

    external_launch(rank, world)
    lo, hi = rank * GLOBAL // world, (rank + 1) * GLOBAL // world
    strategy = ShardRecStrategy(constraints={"user": ParameterConstraints(sharding_types=["row_wise"])})
    t = plain_trainer(strategy=strategy, devices=world, use_distributed_sampler=False, enable_checkpointing=False,
                      **options)  # fmt: skip
    t.fit(TwoTower("adagrad", "mean"), loader(lo, hi))
    return {k: v.clone() for k, v in strategy.full_state_dict().items()}


@pytest.mark.slow
def test_plain_embedding_modules_accumulate_and_clip_like_one_process():
    from test_plain_modules import GLOBAL, TwoTower, loader
    from test_plain_modules import trainer as plain_trainer

    options = {**ACC2, **CLIP005}
    model = TwoTower("adagrad", "mean")
    plain_trainer(devices=1, enable_checkpointing=False, **options).fit(model, loader(0, GLOBAL))
    for rank, got in enumerate(run_ranks(fit_plain_modules, 2, options)):
        assert_same(got, model.state_dict(), f"plain modules rank {rank}")


# --- the program users run: DLRMTask, strategy="shardrec" with every default -------------------------------------
def dlrm_task():
    from lightning_shardrec.models import DLRMTask

    sizes = {"dense_arch_layer_sizes": [8, 4], "over_arch_layer_sizes": [8, 1]}
    return DLRMTask(embedding_dim=4, num_dense=3, arch="dlrm", lr=0.1, **sizes)


def dlrm_data(batch_size: int):
    from lightning_shardrec import SyntheticRecDataModule

    tables = [{"name": "a", "num_embeddings": 50_000}, {"name": "b", "num_embeddings": 9}]
    return SyntheticRecDataModule(num_dense=3, tables=tables, batch_size=batch_size, num_batches=BATCHES,
                                  pooling_factor=2.0, seed=3)  # fmt: skip


def fit_task(rank, world, options):
    external_launch(rank, world)
    t = trainer(strategy="shardrec", devices=world, max_epochs=1, **options)
    t.fit(dlrm_task(), dlrm_data(BATCH))
    fused = sum(g.fused for s in t.strategy.sharded.values() for g in s._groups())
    return {k: v.clone() for k, v in t.strategy.full_state_dict().items()}, fused


@pytest.mark.parametrize("options", [ACC2, {"gradient_clip_val": 1.0}, CLIP005, {**ACC2, **CLIP005}], ids=str)
def test_dlrm_task_with_every_default_matches_one_process(options):
    """``Trainer(strategy="shardrec", devices=2, accumulate_grad_batches=2 / gradient_clip_val=...)`` on the
    library's own DLRM task (default plan and kernel) ends with the weights of ``devices=1``."""
    want = dlrm_task()
    trainer(devices=1, max_epochs=1, **options).fit(want, dlrm_data(2 * BATCH))
    results = run_ranks(fit_task, 2, options)
    assert sum(fused for _, fused in results) > 0  # the default plan fuses some table: the updates were deferred
    for rank, (got, _) in enumerate(results):
        for k, v in want.state_dict().items():
            torch.testing.assert_close(got[k], v, **TOL, msg=f"DLRMTask {options} rank {rank}: {k}")
