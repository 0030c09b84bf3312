"""Plan on paper: ``python -m lightning_shardrec.plan --tables tables.yaml --world-size 512``.

Sizes a cluster you do not have: no process group, no GPU. It prints every assumption
(hosts: 8 GPUs per host by default on cuda; memory per rank: the visible GPU's, else a
named default; the reserve kept free for what is not a table; bandwidths; optimizer
state), the plan, the estimated embedding step (ms/step and samples/s; lookups, their
update and their communication only) and a verdict line (max rank GiB / capacity /
headroom). ``tables.yaml``::

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
          dynamic: {min_count: 2}    # a dynamic table (DynamicConfig fields; `dynamic: true` for defaults)
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from lightning_shardrec.configs import (
    BaseEmbeddingConfig,
    DataType,
    DynamicConfig,
    EmbeddingBagConfig,
    EmbeddingConfig,
    EmbOptimType,
)
from lightning_shardrec.errors import PlannerError, unknown_name
from lightning_shardrec.planner import (
    DEVICE_DEFAULTS,
    ComputeDevice,
    EmbeddingShardingPlanner,
    ParameterConstraints,
    ShardingPlan,
    Topology,
)
from lightning_shardrec.planner.costs.storage import id_map_bytes, resident_bytes
from lightning_shardrec.planner.machine.memory import (
    DEFAULT_RESERVE,
    RESERVED_FOR,
    cuda_capacity,
    host_memory,
    peak_line,
    size_text,
)
from lightning_shardrec.planner.plans.tables import TRAIN_WEIGHT_BYTES, table_specs

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
GPUS_PER_HOST = 8  # cuda default: real GPU machines have 8 per host


def _table(entry: Any, where: str) -> tuple[BaseEmbeddingConfig, ParameterConstraints | None]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each table is a mapping of fields, got {entry!r}")
    extra = sorted(set(entry) - set(CONFIG_KEYS) - set(CONSTRAINT_KEYS) - {"kind", "dynamic"})
    if extra:
        raise ValueError(
            f"{where}: unknown table field(s) {extra}; available: "
            f"{', '.join((*CONFIG_KEYS, 'kind', 'dynamic', *CONSTRAINT_KEYS))}"
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
    if entry.get("dynamic") not in (None, False):
        fields["dynamic"] = _dynamic(entry["dynamic"], where)
    config = KINDS[kind](**fields)
    cons = {k: entry[k] for k in CONSTRAINT_KEYS if k in entry}
    return config, ParameterConstraints(**cons) if cons else None


def _dynamic(value: Any, where: str) -> DynamicConfig:
    """``dynamic: true`` or a mapping of ``DynamicConfig`` fields."""
    names = [f.name for f in dataclasses.fields(DynamicConfig)]
    if value is True:
        return DynamicConfig()
    unknown = sorted(set(value) - set(names)) if isinstance(value, dict) else None
    if unknown is None or unknown:
        raise ValueError(
            f"{where}: dynamic must be true or a mapping of DynamicConfig fields ({', '.join(names)}), got {value!r}"
        )
    return DynamicConfig(**value)


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
        prog="python -m lightning_shardrec.plan",
        description="Plan embedding sharding on paper. Prints every assumption, the plan, the "
        "estimated embedding step time and a memory verdict.",
    )
    p.add_argument("--tables", required=True, help="YAML file of tables (see module docstring)")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument(
        "--local-world-size",
        type=int,
        default=None,
        help=f"ranks per host (default: {GPUS_PER_HOST} for cuda, as on 8-GPU machines; one host for cpu)",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--batch-size", type=int, required=True, help="per rank")
    p.add_argument(
        "--memory-gib",
        type=float,
        default=None,
        help="memory per rank (default: the visible GPU's total memory on cuda; on cpu this host's memory "
        "shared by the ranks per host, see --host-memory-gib)",
    )
    p.add_argument(
        "--host-memory-gib",
        type=float,
        default=None,
        help="cpu: memory of each host, shared by its ranks (default: this machine's, from /proc/meminfo "
        "and the cgroup limit)",
    )
    p.add_argument(
        "--reserve",
        type=float,
        default=DEFAULT_RESERVE,
        help=f"fraction of each rank's memory kept free for {RESERVED_FOR} (default {DEFAULT_RESERVE})",
    )
    p.add_argument("--optimizer", default="adagrad", choices=[o.value for o in EmbOptimType])
    p.add_argument("--fixed", default=None, help="JSON plan whose tables are kept as given")
    p.add_argument("--json", default=None, help="write the plan as JSON here")
    return p


def hosts(world_size: int, device: str, local_world_size: int | None) -> tuple[int, str]:
    """Ranks per host and where that number comes from."""
    if local_world_size is not None:
        return local_world_size, "--local-world-size"
    if device == "cpu":
        return world_size, "default for cpu: one host"
    if world_size <= GPUS_PER_HOST:
        return world_size, f"default for cuda: one host of up to {GPUS_PER_HOST} GPUs"
    if world_size % GPUS_PER_HOST:
        raise ValueError(
            f"--world-size {world_size} is not a multiple of the default {GPUS_PER_HOST} GPUs per host; "
            "give --local-world-size (ranks per host)"
        )
    return GPUS_PER_HOST, f"default for cuda: {GPUS_PER_HOST} GPUs per host"


def capacity(
    device: str, memory_gib: float | None, host_memory_gib: float | None = None, local: int = 1
) -> tuple[dict[str, Any], str]:
    """Topology overrides for the per-rank memory and where the figure comes from.

    On cpu the ranks of a host share its memory: ``host / local`` per rank (the stated
    ``host_memory_gib``, else this machine's), unless ``memory_gib`` gives the per-rank figure.
    """
    key = "hbm_cap" if device == "cuda" else "ddr_cap"
    if memory_gib is not None:
        return {key: int(memory_gib * GiB)}, "--memory-gib"
    if device == "cuda":
        found = cuda_capacity(0)
        if found is not None:
            return {key: found[0]}, f"total memory of the visible {found[1]}"
    else:
        host, where = (int(host_memory_gib * GiB), "--host-memory-gib") if host_memory_gib else (host_memory(), "")
        if host is not None:
            where = where or "this machine's memory (/proc/meminfo, cgroup limit)"
            return {key: host // local}, f"{where} {size_text(host)} shared by {local} rank(s) per host"
    defaults = DEVICE_DEFAULTS[ComputeDevice(device)]
    return {}, f"default for {defaults.label}; set --memory-gib for yours"


def _state_text(optimizer: EmbOptimType) -> str:
    per_row = {
        EmbOptimType.SGD: "none",
        EmbOptimType.ADAGRAD: "dim fp32 values per row (4 x dim bytes)",
        EmbOptimType.ROWWISE_ADAGRAD: "1 fp32 value per row (4 bytes)",
        EmbOptimType.ADAM: "2 x dim fp32 values per row (8 x dim bytes)",
        EmbOptimType.ADAMW: "2 x dim fp32 values per row (8 x dim bytes)",
    }[optimizer]
    return f"{optimizer.value}, state {per_row}"


def assumptions(
    planner: EmbeddingShardingPlanner,
    tables: dict[str, list[BaseEmbeddingConfig]],
    hosts_from: str,
    memory_from: str,
) -> list[str]:
    """Every number the estimate rests on, one per line."""
    topo, work = planner.topology, planner.work
    gpu = topo.compute_device is ComputeDevice.CUDA
    unit = "GPU" if gpu else "rank"
    mem = "HBM" if gpu else "DDR"
    specs = table_specs(tables, planner.constraints, topo.world_size)
    weights = state = 0
    for spec in specs:
        w, st = resident_bytes(spec, work)
        weights, state = weights + w, state + st
    id_maps = sum(id_map_bytes(spec) for spec in specs)
    lines = [
        "assumptions:",
        f"  ranks: {topo.world_size} = {topo.num_hosts} host(s) x {topo.local_world_size} {unit}(s) per host "
        f"({hosts_from})",
        f"  memory per rank: {mem} {topo.memory_cap / GiB:.2f} GiB ({memory_from}); "
        f"{planner.budget.describe()} (--reserve)",
        f"  bandwidths: {mem} {_bw(topo.memory_bw)}, inside a host {_bw(topo.intra_host_bw)}, "
        f"between hosts {_bw(topo.inter_host_bw)} per {unit}",
        f"  batch: {work.batch_size} per rank, {work.global_batch} global",
        f"  optimizer: {_state_text(work.optimizer)}",
        f"  tables: {len(specs)}, weights {size_text(weights)} (fp32 rows, {TRAIN_WEIGHT_BYTES} bytes per "
        f"element, as the training kernels allocate them) + optimizer state {size_text(state)}"
        + (f" + dynamic tables' id maps {size_text(id_maps)}" if id_maps else ""),
    ]
    narrow = sorted(c.name for cs in tables.values() for c in cs if c.data_type is not DataType.FP32)
    if narrow:
        lines.append(
            f"  note: {narrow} declare a data_type other than FP32; training keeps fp32 rows, "
            "so they are planned at 4 bytes per element"
        )
    lines.append(
        "  the estimate covers embedding lookups, their fused optimizer update and their "
        "communication only (not the dense model, data loading or framework overhead)"
    )
    return lines


def _bw(value: float | None) -> str:
    return f"{float(value or 0.0) / 1e9:g} GB/s"


def estimate_line(plan: ShardingPlan, global_batch: int) -> str:
    """Slowest rank's ms/step and the samples/s it allows."""
    assert plan.stats is not None
    seconds = plan.stats.max_cost
    rate = f"{global_batch / seconds:,.0f} samples/s" if seconds > 0 else "no estimate"
    return (
        f"estimated embedding step: {seconds * 1e3:.4f} ms/step (slowest rank) = {rate} "
        f"at a global batch of {global_batch}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        tables, constraints = load_tables(args.tables)
        local, hosts_from = hosts(args.world_size, args.device, args.local_world_size)
        if args.host_memory_gib is not None and not args.host_memory_gib > 0:
            raise ValueError(f"--host-memory-gib must be > 0, got {args.host_memory_gib}")
        cap, memory_from = capacity(args.device, args.memory_gib, args.host_memory_gib, local)
        topo = Topology(args.world_size, compute_device=args.device, local_world_size=local, **cap)
        planner = EmbeddingShardingPlanner(
            topo,
            batch_size=args.batch_size,
            constraints=constraints,
            optimizer=args.optimizer,
            reserve=args.reserve,
        )
        print("\n".join(assumptions(planner, tables, hosts_from, memory_from)), end="\n\n")
        fixed = ShardingPlan.from_json(Path(args.fixed).read_text()) if args.fixed else None
        plan = planner.plan(tables, fixed=fixed)
    except (PlannerError, ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(plan)
    print(estimate_line(plan, planner.work.global_batch))
    assert plan.stats is not None
    print(peak_line(plan.stats.max_storage, plan.stats.storage_cap))
    if plan.stats.tight:
        print(f"warning: {plan.stats.verdict()}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(plan.to_json())
        print(f"\nplan written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
