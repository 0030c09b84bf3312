"""Dynamic tables resume exactly on another world size, through sharded (DCP) and full checkpoints.

One training stream is cut into phases, each on another world size, each resuming from
the checkpoint the one before saved (e.g. 2 ranks save DCP, 3 ranks load it and save a
full file, 2 ranks load that). After every phase the gathered state (weights, fused
optimizer state, id mappings with their per-bucket counters) equals the unsharded module
trained on the same global batches with ``torch.optim.Adagrad``; the mappings exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_shardrec.checkpoint import convert_to_full
from lightning_shardrec.testing import run_ranks
from tests.modules._dynamic_reference import stream

LR, EPS, DIM = 0.1, 1e-8, 4
TABLES = {  # name: (rows, dynamic config kwargs, sharding)
    "d": (16, {"num_buckets": 8, "eviction": "lru", "min_count": 2, "candidates_per_bucket": 1}, "row_wise"),
    "e": (12, {"num_buckets": 4, "eviction": "lfu", "ttl_steps": 3}, "table_wise"),
    "s": (10, None, "row_wise"),
}
BATCH = 12  # global samples per step (divisible by 1, 2, 3 and 4)
Phase = tuple[int, int, int, str | None]  # world size, first and last step, format saved at the end


def _ebc(tables: dict = TABLES, dims: dict[str, int] | None = None, pooled: bool = True):
    """The tables in an ``EmbeddingBagCollection`` (``pooled``) or an ``EmbeddingCollection``."""
    from lightning_shardrec import (
        DynamicConfig,
        EmbeddingBagCollection,
        EmbeddingBagConfig,
        EmbeddingCollection,
        EmbeddingConfig,
    )

    torch.manual_seed(0)
    collection, config = (
        (EmbeddingBagCollection, EmbeddingBagConfig) if pooled else (EmbeddingCollection, EmbeddingConfig)
    )
    return collection(
        [
            config(
                name=n,
                embedding_dim=(dims or {}).get(n, DIM),
                num_embeddings=rows,
                feature_names=[f"f_{n}"],
                dynamic=None if dyn is None else DynamicConfig(**dyn),
            )
            for n, (rows, dyn, _) in tables.items()
        ]
    )


def _batches() -> list[list[list[list[int]]]]:
    """Per step, per table, ``BATCH`` bags of raw ids (static table: ids in range)."""
    raw = {n: stream(12, 30, 3 * BATCH, seed=i) for i, n in enumerate(TABLES)}
    out = []
    for step in range(12):
        tables = []
        for n, (rows, dyn, _) in TABLES.items():
            ids = raw[n][step] if dyn is not None else [abs(x) % rows for x in raw[n][step]]
            tables.append([ids[3 * i : 3 * i + 1 + (i + step) % 3] for i in range(BATCH)])
        out.append(tables)
    return out


def _kjt(step_bags: list[list[list[int]]], lo: int, hi: int):
    from lightning_shardrec import KeyedJaggedTensor

    lengths = [len(bags[i]) for bags in step_bags for i in range(lo, hi)]
    values = [v for bags in step_bags for i in range(lo, hi) for v in bags[i]]
    return KeyedJaggedTensor(
        [f"f_{n}" for n in TABLES], torch.tensor(values, dtype=torch.long), lengths=torch.tensor(lengths)
    )


def _coef(lo: int, hi: int) -> torch.Tensor:
    """A per-sample, per-column loss weight, so every row gets its own gradient."""
    return torch.arange(BATCH * len(TABLES) * DIM, dtype=torch.float32).reshape(BATCH, -1)[lo:hi].sin()


def _plan(world: int, tables: dict = TABLES, dims: dict[str, int] | None = None):
    from lightning_shardrec import DynamicConfig
    from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterSharding, ShardingType, ShardMetadata

    out = {}
    for i, (name, (rows, dyn, kind)) in enumerate(tables.items()):
        dim = (dims or {}).get(name, DIM)
        if kind == "table_wise":
            shards = [ShardMetadata((0, 0), (rows, dim), (i + 1) % world)]
        else:  # contiguous row (bucket) blocks, as even as whole buckets allow
            unit = rows // DynamicConfig(**dyn).layout(rows, name)[0] if dyn else 1
            units = rows // unit
            cuts = [unit * (units * r // world) for r in range(world + 1)]
            shards = [
                ShardMetadata((a, 0), (b - a, dim), r)
                for r, (a, b) in enumerate(zip(cuts[:-1], cuts[1:], strict=True))
                if b > a
            ]
        st = ShardingType(kind)
        out[name] = ParameterSharding(st, EmbeddingComputeKernel.FUSED, [s.rank for s in shards], shards)
    return out


def _phase(
    rank: int,
    world: int,
    first: int,
    last: int,
    load: str | None,
    save: str | None,
    path: str,
    optim: str = "adagrad",
    pooled: bool = True,
):
    from lightning_shardrec.checkpoint import gather_full_state, load_full_state, load_sharded, save_sharded
    from lightning_shardrec.configs import FusedOptimConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import ShardingPlan

    dmp = DistributedModelParallel(
        _ebc(pooled=pooled),
        plan=ShardingPlan({"": _plan(world)}),
        device="cpu",
        embedding_optimizer=FusedOptimConfig(optimizer=optim, lr=LR, eps=EPS),
    )
    if load == "sharded":
        load_sharded(f"{path}/dcp", dmp.sharded, {}, rank)
    elif load == "full":
        saved = torch.load(f"{path}/full.pt", weights_only=True)
        load_full_state(dmp.sharded, saved["weights"], saved["states"])
    batches = _batches()
    lo, hi = rank * BATCH // world, (rank + 1) * BATCH // world
    for step in range(first, last):
        out = dmp(_kjt(batches[step], lo, hi))
        if pooled:
            loss = (out.values() * _coef(lo, hi)).pow(2).sum()
        else:  # a sequence lookup: per id rows
            loss = sum((jt.values() * _coef(0, 1)[:, :DIM]).pow(2).sum() for jt in out.values())
        (loss / (hi - lo)).backward()  # a mean: DMP averages over ranks
    if save == "sharded":
        save_sharded(f"{path}/dcp", dmp.sharded, {}, {}, rank)
    weights, states = gather_full_state(dmp.sharded, dst=0)
    if save == "full" and rank == 0:
        torch.save({"weights": weights, "states": states}, f"{path}/full.pt")
    return (weights, states) if rank == 0 else None


def _reference(phases: list[Phase]) -> list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]]:
    """The unsharded module after each phase: its state dict and Adagrad sums."""
    from lightning_shardrec.modules import optimizer_reset_hook

    ebc = _ebc()
    opt = torch.optim.Adagrad(ebc.parameters(), lr=LR, eps=EPS)
    ebc.register_reset_hook(optimizer_reset_hook(opt))
    batches = _batches()
    out = []
    for _, first, last, _ in phases:
        for step in range(first, last):
            pooled = ebc(_kjt(batches[step], 0, BATCH)).values()
            ((pooled * _coef(0, BATCH)).pow(2).sum() / BATCH).backward()
            opt.step()
            opt.zero_grad()
        sums = {f"embedding_bags.{n}.weight": opt.state[ebc.embedding_bags[n].weight]["sum"].clone() for n in TABLES}
        out.append(({k: v.clone() for k, v in ebc.state_dict().items()}, sums))
    return out


def _check(phases: list[Phase], path: Path) -> None:
    load = None
    state: dict[str, torch.Tensor] = {}
    for (world, first, last, save), (state, sums) in zip(phases, _reference(phases), strict=True):
        weights, states = run_ranks(_phase, world, first, last, load, save, str(path))[0]
        assert sorted(weights) == sorted(state), world
        for key, value in state.items():
            if "dynamic_tables" in key:  # the id mapping and its counters: exact
                assert torch.equal(weights[key], value), (world, key)
            else:
                torch.testing.assert_close(weights[key], value, rtol=1e-4, atol=1e-4, msg=f"{world} {key}")
        for key, value in sums.items():
            torch.testing.assert_close(states[key]["sum"], value, rtol=1e-4, atol=1e-4, msg=f"{world} {key}")
        load = save
        assert state["dynamic_tables.d.step"] == last and state["dynamic_tables.e.step"] == last
        if save == "sharded":  # convert_to_full: the gathered state, loadable into the plain module
            convert_to_full(path / "dcp", path / "converted.pt")
            converted = torch.load(path / "converted.pt", weights_only=True)["state_dict"]
            assert sorted(converted) == sorted(state) and all(torch.equal(converted[k], weights[k]) for k in state)
            _ebc().load_state_dict(converted)  # strict
    counters = state["dynamic_tables.d.counters"].sum(0).tolist() + state["dynamic_tables.e.counters"].sum(0).tolist()
    assert counters[1] > 0 and counters[5 + 1] + counters[5 + 2] > 0  # evictions / expirations happened


def test_resume_2_to_3_to_2_ranks_is_exact(tmp_path: Path) -> None:
    _check([(2, 0, 4, "sharded"), (3, 4, 7, "full"), (2, 7, 9, None)], tmp_path)


@pytest.mark.slow
def test_resume_2_to_1_to_4_to_3_ranks_is_exact(tmp_path: Path) -> None:
    _check([(2, 0, 3, "sharded"), (1, 3, 6, "full"), (4, 6, 9, "sharded"), (3, 9, 12, None)], tmp_path)


D, E, S = TABLES["d"], TABLES["e"], TABLES["s"]
CHANGES = [  # (tables, dims) of the model loading the checkpoint, and the message each format gives
    (
        {**TABLES, "d": (16, {**D[1], "num_buckets": 4}, "row_wise")},
        None,
        r"dynamic table 'd': num_buckets changed: the checkpoint has 8, the model 4; a dynamic table resumes only "
        r"with the layout it was saved with",
    ),
    (
        {**TABLES, "d": (32, D[1], "row_wise")},
        None,
        r"dynamic table 'd': capacity \(num_embeddings\) changed: the checkpoint has 16, the model 32",
    ),
    (
        {**TABLES, "e": (12, {**E[1], "min_count": 2}, "table_wise")},
        None,
        r"dynamic table 'e': candidates per bucket \(candidates_per_bucket; 0 when min_count is 1\) changed: "
        r"the checkpoint has 0, the model 3",
    ),
    (TABLES, {"e": 8}, r"dynamic table 'e': embedding_dim changed: the checkpoint has 4, the model 8"),
    (
        {**TABLES, "s": (10, {"num_buckets": 5}, "row_wise")},
        None,
        r"dynamic table 's': the checkpoint holds no id mapping for it \('dynamic_tables.s.slot_ids', ...\): it was "
        r"saved as a static table",
    ),
    (
        {**TABLES, "d": (16, None, "row_wise")},
        None,
        r"table 'd': the checkpoint holds an id mapping for it \('dynamic_tables.d.\*': saved as a dynamic table\), "
        r"the model's table is not dynamic",
    ),
]


def _refused(rank: int, world: int, path: str) -> list[str]:
    from lightning_shardrec.checkpoint import gather_full_state, load_full_state, load_sharded, save_sharded
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.errors import CheckpointError
    from lightning_shardrec.planner import ShardingPlan

    source = DistributedModelParallel(_ebc(), plan=ShardingPlan({"": _plan(world)}), device="cpu")
    save_sharded(f"{path}/dcp", source.sharded, {}, {}, rank)
    weights, states = gather_full_state(source.sharded)
    messages = []
    for tables, dims, match in CHANGES:
        plan = ShardingPlan({"": _plan(world, tables, dims)})
        target = DistributedModelParallel(_ebc(tables, dims), plan=plan, device="cpu")
        before = gather_full_state(target.sharded)[0]
        with pytest.raises(CheckpointError, match=match) as sharded:
            load_sharded(f"{path}/dcp", target.sharded, {}, rank)
        with pytest.raises(CheckpointError, match=match) as full:
            load_full_state(target.sharded, weights, states)
        after = gather_full_state(target.sharded)[0]
        assert all(torch.equal(after[k], v) for k, v in before.items())  # nothing was loaded
        messages += [str(sharded.value), str(full.value)]
    return messages


def test_a_changed_dynamic_table_is_refused_by_name(tmp_path: Path) -> None:
    messages = run_ranks(_refused, 2, str(tmp_path))[0]
    # the named line replaces the generic shape lines of that table
    assert len(messages) == 2 * len(CHANGES) and not any("checkpoint has shape" in m for m in messages), messages


@pytest.mark.parametrize(
    ("optim", "pooled"), [("rowwise_adagrad", False), pytest.param("adam", True, marks=pytest.mark.slow)]
)
def test_per_row_and_step_states_and_sequence_tables_resume_exactly(tmp_path: Path, optim: str, pooled: bool) -> None:
    """Row-wise Adagrad's per-row state, Adam's moments and shared step, an EmbeddingCollection:
    3 ranks (DCP) -> 2 ranks (full) -> 3 ranks equals 2 ranks straight through (itself equal to
    the unsharded run, see tests/distributed/test_sharded_dynamic.py)."""
    weights, states = run_ranks(_phase, 2, 0, 9, None, None, str(tmp_path / "straight"), optim, pooled)[0]
    load = None
    for world, first, last, save in [(3, 0, 3, "sharded"), (2, 3, 6, "full"), (3, 6, 9, None)]:
        got, got_states = run_ranks(_phase, world, first, last, load, save, str(tmp_path), optim, pooled)[0]
        load = save
    assert sorted(got) == sorted(weights) and sorted(got_states) == sorted(states)
    for key, value in weights.items():
        if "dynamic_tables" in key:
            assert torch.equal(got[key], value), key
        else:
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-4, msg=key)
    for key, named in states.items():
        assert sorted(got_states[key]) == sorted(named), key
        for name, value in named.items():
            torch.testing.assert_close(got_states[key][name], value, rtol=1e-4, atol=1e-4, msg=f"{key}/{name}")
    assert weights["dynamic_tables.d.counters"][:, 1].sum() > 0  # evictions happened
