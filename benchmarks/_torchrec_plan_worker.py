"""TorchRec 1.8's plan for the Criteo-1TB tables, as JSON on stdout (``planner_check.py --torchrec``).

Runs only in the TorchRec venv (``/work/venvs/torchrec``, ``benchmarks/setup_torchrec_venv.sh``) and
imports TorchRec and torch, never ``lightning_shardrec``. TorchRec's default planner, its defaults except
what the comparison fixes: ``world`` GPUs of 80 GiB HBM, 8 per host, ``--batch-size`` samples per rank,
tables on the meta device, fused row-wise Adagrad (TorchRec's sharder default). Prints
``{"seconds": planning CPU s, "tables": {name: {"type": ..., "shards": [[row0, col0, rows, cols, rank], ...]}}}``.

    /work/venvs/torchrec/bin/python benchmarks/_torchrec_plan_worker.py --world 128 --rows 40000000,39060,...
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torchrec  # noqa: E402
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology  # noqa: E402
from torchrec.distributed.sharding_plan import get_default_sharders  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--rows", required=True, help="comma-separated rows per table (t_cat_0, t_cat_1, ...)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16384)
    parser.add_argument("--local", type=int, default=8)
    args = parser.parse_args()
    tables = [
        torchrec.EmbeddingBagConfig(
            name=f"t_cat_{i}", embedding_dim=args.dim, num_embeddings=int(n), feature_names=[f"f{i}"]
        )
        for i, n in enumerate(args.rows.split(","))
    ]
    ebc = torchrec.EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    topo = Topology(world_size=args.world, compute_device="cuda", local_world_size=args.local, hbm_cap=80 * 1024**3)
    start = time.process_time()
    plan = EmbeddingShardingPlanner(topology=topo, batch_size=args.batch_size).plan(ebc, get_default_sharders())
    seconds = time.process_time() - start
    out: dict[str, dict] = {}
    for per_module in plan.plan.values():
        for name, ps in per_module.items():  # type: ignore[union-attr]
            shards = []
            for s in ps.sharding_spec.shards if ps.sharding_spec is not None else []:
                rank = int(str(s.placement).split("rank:")[1].split("/")[0])
                shards.append([*s.shard_offsets, *s.shard_sizes, rank])
            out[name] = {"type": ps.sharding_type, "shards": shards}
    print(json.dumps({"seconds": seconds, "tables": out}))


if __name__ == "__main__":
    main()
