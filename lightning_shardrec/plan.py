"""Plan on paper: ``python -m lightning_shardrec.plan --tables tables.yaml --world-size 512``.

Sizes a cluster you do not have: no process group, no GPU. ``tables.yaml``::

    modules:                       # module path -> tables (or a top-level `tables:` list)
      sparse.ebc:
        - name: user_id
          num_embeddings: 40000000
          embedding_dim: 128
          feature_names: [user_id]   # default: [name]
          data_type: FP16            # default FP32
          kind: bag                  # bag (EmbeddingBagConfig) or sequence (EmbeddingConfig)
          pooling_factors: [20.0]    # constraints, all optional (ParameterConstraints fields)
          sharding_types: [row_wise, table_wise]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
)
from lightning_shardrec.errors import PlannerError, unknown_name
from lightning_shardrec.planner import (
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    Topology,
)

CONFIG_KEYS = ("name", "num_embeddings", "embedding_dim", "feature_names", "data_type")
CONSTRAINT_KEYS = (
    "sharding_types",
    "compute_kernels",
    "pooling_factors",
    "num_poolings",
    "min_partition",
    "ranks",
)
KINDS = {"bag": EmbeddingBagConfig, "sequence": EmbeddingConfig}
GiB = 1024**3


def _table(entry: Any, where: str) -> tuple[BaseEmbeddingConfig, ParameterConstraints | None]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each table is a mapping of fields, got {entry!r}")
    extra = sorted(set(entry) - set(CONFIG_KEYS) - set(CONSTRAINT_KEYS) - {"kind"})
    if extra:
        raise ValueError(
            f"{where}: unknown table field(s) {extra}; available: {', '.join((*CONFIG_KEYS, 'kind', *CONSTRAINT_KEYS))}"
        )
    kind = str(entry.get("kind", "bag"))
    if kind not in KINDS:
        raise unknown_name(f"table kind in {where}", kind, list(KINDS))
    fields = {k: entry[k] for k in CONFIG_KEYS if k in entry}
    fields.setdefault("feature_names", [fields.get("name", "")])
    if "data_type" in fields:
        value = str(fields["data_type"]).upper()
        if value not in DataType.__members__:
            raise unknown_name(
                f"data_type in {where}", fields["data_type"], list(DataType.__members__)
            )
        fields["data_type"] = DataType[value]
    config = KINDS[kind](**fields)
    cons = {k: entry[k] for k in CONSTRAINT_KEYS if k in entry}
    return config, ParameterConstraints(**cons) if cons else None


def load_tables(
    path: str | Path,
) -> tuple[dict[str, list[BaseEmbeddingConfig]], dict[str, ParameterConstraints]]:
    """Tables (module path -> configs) and constraints (table name -> constraints) from YAML."""
    data = yaml.safe_load(Path(path).read_text())
    if isinstance(data, dict) and "modules" in data:
        modules = data["modules"]
    elif isinstance(data, dict) and "tables" in data:
        modules = {"": data["tables"]}
    else:
        raise ValueError(f"{path}: expected a top-level 'modules' mapping or 'tables' list")
    if not isinstance(modules, dict):
        raise ValueError(f"{path}: 'modules' maps module paths to lists of tables")
    tables: dict[str, list[BaseEmbeddingConfig]] = {}
    constraints: dict[str, ParameterConstraints] = {}
    for module, entries in modules.items():
        if not isinstance(entries, list):
            raise ValueError(f"{path}: module '{module}' needs a list of tables, got {entries!r}")
        for i, entry in enumerate(entries):
            config, cons = _table(entry, f"{path}: module '{module}' table #{i}")
            tables.setdefault(str(module or ""), []).append(config)
            if cons is not None:
                constraints[config.name] = cons
    return tables, constraints


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_shardrec.plan", description="Plan embedding sharding on paper."
    )
    p.add_argument("--tables", required=True, help="YAML file of tables (see module docstring)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--local-world-size", type=int, default=None, help="ranks per host (default: one host)"
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--batch-size", type=int, required=True, help="per rank")
    p.add_argument(
        "--memory-gib", type=float, default=None, help="table memory per rank (default: per device)"
    )
    p.add_argument("--optimizer", default="adagrad", choices=[o.value for o in EmbOptimType])
    p.add_argument("--fixed", default=None, help="JSON plan whose tables are kept as given")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tables, constraints = load_tables(args.tables)
        cap = (
            {}
            if args.memory_gib is None
            else {("hbm_cap" if args.device == "cuda" else "ddr_cap"): int(args.memory_gib * GiB)}
        )
        topo = Topology(
            args.world_size,
            compute_device=args.device,
            local_world_size=args.local_world_size,
            **cap,
        )
        planner = EmbeddingShardingPlanner(
            topo, batch_size=args.batch_size, constraints=constraints, optimizer=args.optimizer
        )
        fixed = ShardingPlan.from_json(Path(args.fixed).read_text()) if args.fixed else None
        plan = planner.plan(tables, fixed=fixed)
    except (PlannerError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan)
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nplan written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
