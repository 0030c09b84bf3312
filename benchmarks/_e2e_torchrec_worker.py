"""``torchrec_dmp`` worker of ``e2e_bench.py``: TorchRec 1.8.0's DMP on the same workload.

Runs only in ``benchmarks/.venv-torchrec`` (``benchmarks/setup_torchrec_venv.sh``),
started by ``e2e_bench.py`` once per rank with ``RANK``/``WORLD_SIZE``/``MASTER_*`` set.
Imports TorchRec and torch, never ``lightning_shardrec``. TorchRec's way to train
tables: ``apply_optimizer_in_backward(RowWiseAdagrad, ...)`` before sharding (its
sharder turns that into fbgemm's fused ``exact_row_wise_adagrad``), then a dense
Adagrad over the parameters that have no in-backward optimizer. Plan: TorchRec's
default planner (``DistributedModelParallel(plan=None)``), for a CPU topology of 2.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torchrec  # noqa: E402
from _e2e_common import (  # noqa: E402
    DIM,
    EPS,
    LR,
    RankResult,
    feature_names,
    load_batches,
    make_dense_arch,
    peak_rss_mib,
    rss_mib,
    table_rows,
    train_timed,
    worker_env,
)
from torch import nn  # noqa: E402
from torchrec.distributed.model_parallel import DistributedModelParallel  # noqa: E402
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward  # noqa: E402
from torchrec.optim.keyed import KeyedOptimizerWrapper  # noqa: E402
from torchrec.optim.optimizers import in_backward_optimizer_filter  # noqa: E402
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

IMPORT_RSS = rss_mib()


class TorchRecBench(nn.Module):
    def __init__(self, shrink: int) -> None:
        super().__init__()
        tables = [
            torchrec.EmbeddingBagConfig(
                name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"],
                pooling=torchrec.PoolingType.SUM,
            )
            for i, n in enumerate(table_rows(shrink))
        ]  # fmt: skip
        self.ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense_arch = make_dense_arch()

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense_arch(dense, self.ebc(kjt).values())


def plan_summary(plan: object) -> str:
    kinds: dict[str, list[str]] = {}
    for tables in plan.plan.values():  # type: ignore[attr-defined]
        for name, ps in tables.items():
            kinds.setdefault(f"{ps.sharding_type}/{ps.compute_kernel}", []).append(name)
    return "; ".join(f"{k}: {','.join(sorted(v))}" for k, v in sorted(kinds.items()))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker")
    p.add_argument("--data", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--warmup", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--shrink", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=1024)
    p.add_argument("--profile", type=Path, default=None)
    a = p.parse_args()
    rank, world = worker_env()
    dist.init_process_group("gloo")
    keys = feature_names()
    raw = load_batches(a.data / f"rank{rank}.pt")[: a.warmup + a.steps]
    batches = [
        (b["dense"], KeyedJaggedTensor(keys=keys, values=b["values"], lengths=b["lengths"]), b["labels"]) for b in raw
    ]
    model = TorchRecBench(a.shrink)
    apply_optimizer_in_backward(RowWiseAdagrad, model.ebc.parameters(), {"lr": LR, "eps": EPS})
    dmp = DistributedModelParallel(module=model, device=torch.device("cpu"))
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(dmp.named_parameters())), lambda ps: torch.optim.Adagrad(ps, lr=LR)
    )
    seconds, losses, cpu = train_timed(batches, dmp, dense_opt, a.warmup)
    RankResult(
        "torchrec_dmp", rank, world, int(batches[0][0].shape[0]), seconds, IMPORT_RSS, peak_rss_mib(), losses,
        plan_summary(dmp.plan), cpu_ms=cpu,
    ).write(a.out)  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
