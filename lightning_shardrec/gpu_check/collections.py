"""Exactness of the sharded collections on the device, against plain PyTorch on the same device.

Each run trains a probe (one collection, a fixed projection, a squared loss) for a few
steps through :class:`~lightning_shardrec.DistributedModelParallel` on a one-rank group
(the fused optimizer updates the tables inside backward) and compares every step's
output with the plain, unsharded collection trained by the matching ``torch.optim``
optimizer: the outputs after step ``k`` depend on every update before it. Tables are
small and every batch touches every row, so row-sparse Adam/AdamW (which leave untouched
rows alone) must equal the dense ones too. ``rowwise_adagrad`` has no ``torch.optim``
twin, and dynamic tables none either: those compare the device with the same run on
CPU (the compiled loops there), bit for bit for the id -> slot mapping.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from lightning_shardrec import (
    DistributedModelParallel,
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    FusedOptimConfig,
    KeyedJaggedTensor,
)
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.gpu_check.env import Mode, one_rank_group
from lightning_shardrec.gpu_check.report import Check, Report, Status
from lightning_shardrec.lightning.parameters.optimizers import derive_fused_config
from lightning_shardrec.planner import (
    ComputeDevice,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingType,
    Topology,
)

KINDS = ("pooled", "sequence", "weighted")
TORCH_TWINS: dict[EmbOptimType, Callable[..., torch.optim.Optimizer]] = {
    EmbOptimType.SGD: lambda p: torch.optim.SGD(p, lr=0.1),
    EmbOptimType.ADAGRAD: lambda p: torch.optim.Adagrad(p, lr=0.1, eps=1e-8),
    EmbOptimType.ADAM: lambda p: torch.optim.Adam(p, lr=0.01),
    EmbOptimType.ADAMW: lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.05),
}
TOL: dict[str, Any] = {"rtol": 1e-4, "atol": 1e-5}  # fused in-backward update vs autograd + optimizer: summation order
ROWS, DIMS, POOLING = 16, (8, 16), 3


class Probe(nn.Module):
    """``kjt -> [N]``: the collection's output through a fixed projection (no dense parameters)."""

    proj: Tensor

    def __init__(self, coll: nn.Module, width: int) -> None:
        super().__init__()
        self.coll = coll
        self.register_buffer("proj", torch.linspace(-1.0, 1.0, width))

    def forward(self, kjt: KeyedJaggedTensor) -> Tensor:
        out = self.coll(kjt)
        x = out.values() if isinstance(out.values(), Tensor) else torch.cat([j.values() for j in out.values()])
        return x @ self.proj


def _collection(kind: str, dynamic: bool) -> tuple[nn.Module, list[str], int]:
    torch.manual_seed(0)
    features = [f"f{i}" for i in range(len(DIMS))]
    rows = 4 * ROWS if dynamic else ROWS
    if kind == "sequence":
        sequence = [
            EmbeddingConfig(name=f"t{i}", embedding_dim=DIMS[0], num_embeddings=rows, feature_names=[f])
            for i, f in enumerate(features)
        ]
        return EmbeddingCollection(sequence), features, DIMS[0]
    dyn = DynamicConfig(num_buckets=4) if dynamic else None
    tables = [
        EmbeddingBagConfig(name=f"t{i}", embedding_dim=d, num_embeddings=rows, feature_names=[f], dynamic=dyn)
        for i, (f, d) in enumerate(zip(features, DIMS, strict=True))
    ]
    return EmbeddingBagCollection(tables, is_weighted=kind == "weighted"), features, sum(DIMS)


def batches(features: list[str], batch: int, steps: int, weighted: bool, dynamic: bool) -> list[KeyedJaggedTensor]:
    """``steps`` KJTs of ``batch`` bags of ``POOLING`` ids per feature; every row of a static table in each."""
    g = torch.Generator().manual_seed(1)
    pool = torch.randint(-(2**62), 2**62, (6 * ROWS,), generator=g)  # raw ids of dynamic tables
    out = []
    for _ in range(steps):
        per = []
        for _ in features:
            n = batch * POOLING
            ids = torch.cat([torch.arange(ROWS), torch.randint(0, ROWS, (n - ROWS,), generator=g)])
            ids = ids[torch.randperm(n, generator=g)]
            per.append(pool[torch.randint(0, pool.numel(), (n,), generator=g)] if dynamic else ids)
        values = torch.cat(per)
        weights = torch.rand(values.numel(), generator=g) if weighted else None
        lengths = torch.full((len(features) * batch,), POOLING)
        out.append(KeyedJaggedTensor(features, values, weights, lengths=lengths))
    return out


def _run(
    model: nn.Module, data: list[KeyedJaggedTensor], device: torch.device, step: Callable[[], None]
) -> list[Tensor]:
    outs = []
    for kjt in data:
        y = model(kjt.to(device))
        outs.append(y.detach().float().cpu())
        (y.float() ** 2).mean().backward()
        step()
    with torch.no_grad():
        outs.append(model(data[0].to(device)).float().cpu())
    return outs


def train_sharded(
    kind: str, optim: FusedOptimConfig, device: torch.device, data: list[KeyedJaggedTensor], dynamic: bool = False
) -> tuple[list[Tensor], dict[str, Tensor]]:
    """Outputs of every step through DMP on ``device`` and the final state (CPU tensors)."""
    coll, features, width = _collection(kind, dynamic)
    dmp = DistributedModelParallel(
        Probe(coll, width),
        device=device,
        embedding_optimizer=optim,
        kernel="torch",
        planner=fused_planner(device, features),
    )
    outs = _run(dmp, data, device, lambda: None)
    # the sharded module's own state (shards and id maps): DMP.state_dict() refuses dynamic tables
    state = {k: v.detach().cpu().clone() for k, v in dmp.module.state_dict().items() if isinstance(v, Tensor)}
    return outs, state


def fused_planner(device: torch.device, features: list[str], batch: int = 512) -> EmbeddingShardingPlanner:
    """A one-rank planner that shards every table ``t<i>`` table-wise (tiny tables would go data-parallel,
    trained by the dense optimizer instead of the fused one)."""
    table_wise = ParameterConstraints(sharding_types=[ShardingType.TABLE_WISE])
    topology = Topology(1, compute_device=ComputeDevice(device.type))
    return EmbeddingShardingPlanner(
        topology, batch_size=batch, constraints={f"t{i}": table_wise for i in range(len(features))}
    )


def train_plain(
    kind: str, make: Callable[..., torch.optim.Optimizer], device: torch.device, data: list[KeyedJaggedTensor]
) -> list[Tensor]:
    coll, _, width = _collection(kind, False)
    model = Probe(coll, width).to(device)
    opt = make(model.parameters())

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return _run(model, data, device, step)


def _max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b, strict=True))


def _compare(report: Report, name: str, got: list[Tensor], want: list[Tensor], against: str) -> None:
    diff = _max_diff(got, want)
    ok = all(torch.allclose(x, y, rtol=TOL["rtol"], atol=TOL["atol"]) for x, y in zip(got, want, strict=True))
    status = Status.PASS if ok else Status.FAIL
    report.add(
        Check(
            "exactness",
            name,
            status,
            f"max |diff| {diff:.2e} vs {against} over {len(got)} outputs",
            {"max_abs_diff": diff, "against": against},
        )
    )


def check_collections(report: Report, mode: Mode) -> None:
    """Every collection kind x every fused optimizer, and dynamic tables (see the module docstring)."""
    s = mode.sizes
    with one_rank_group(mode):
        for kind in KINDS:
            data = batches(_collection(kind, False)[1], s.exact_batch, s.exact_steps, kind == "weighted", False)
            for opt_type, make in TORCH_TWINS.items():
                twin = make([nn.Parameter(torch.zeros(1))])
                fused = derive_fused_config(twin, twin.param_groups[0])
                got, _ = train_sharded(kind, fused, mode.device, data)
                want = train_plain(kind, make, mode.device, data)
                _compare(report, f"{kind} {opt_type.value}", got, want, f"torch.optim.{type(twin).__name__}")
            rowwise = FusedOptimConfig(optimizer=EmbOptimType.ROWWISE_ADAGRAD, lr=0.1)
            got, _ = train_sharded(kind, rowwise, mode.device, data)
            want, _ = train_sharded(kind, rowwise, torch.device("cpu"), data)
            _compare(report, f"{kind} rowwise_adagrad", got, want, "the same on CPU")
        check_dynamic(report, mode)


def check_dynamic(report: Report, mode: Mode) -> None:
    """Dynamic tables on the device (the sync-free tensor ops) vs on CPU (the compiled loops), with Adagrad
    and with Adam (whose state rows are reset when a slot is reassigned)."""
    from lightning_shardrec.gpu_check.env import gpu_code_path

    s = mode.sizes
    data = batches(_collection("pooled", True)[1], s.exact_batch, s.exact_steps + 3, False, True)
    for opt_type in (EmbOptimType.ADAGRAD, EmbOptimType.ADAM):
        optim = FusedOptimConfig(optimizer=opt_type, lr=0.1)
        want, want_state = train_sharded("pooled", optim, torch.device("cpu"), data, dynamic=True)
        with gpu_code_path() as switched:
            got, got_state = train_sharded("pooled", optim, mode.device, data, dynamic=True)
        against = "the compiled loops on CPU" if (mode.cuda or switched) else "itself (loops not switched)"
        _compare(report, f"dynamic {opt_type.value} (outputs)", got, want, against)
        ints = [k for k, v in want_state.items() if not v.is_floating_point()]
        same = [k for k in ints if k in got_state and torch.equal(got_state[k], want_state[k])]
        differ = sorted(set(ints) - set(same))
        detail = f"{len(same)}/{len(ints)} integer buffers equal to {against}"
        detail += f"; differ: {', '.join(differ[:4])}" if differ else ""
        status = Status.PASS if ints and not differ else Status.FAIL
        report.add(Check("exactness", f"dynamic {opt_type.value} id -> slot state", status, detail, {"differ": differ}))
