"""Each rank holds its share, on every path users take through the Trainer (issue 29 item 1).

Measured from outside, as a user would (each rank's resident memory, ``VmRSS``/``VmHWM``),
with tables of ``T`` = 256 MiB: after sharding no rank keeps a full table (tables built on
CPU in ``__init__``, on ``meta`` under ``init_module``, library collections and plain
``nn.EmbeddingBag``), whether the model was sharded by fit, by validate/predict before fit,
by a second fit, or resumed from a checkpoint written without the strategy; and the
user's Adagrad never allocates state for the whole tables before they are sharded.
Before the fix every rank ended holding its whole copy (``+T``) and CPU-built models
peaked at ``3T`` (tables + Adagrad state for them + the shards).
"""

from __future__ import annotations

import re

import pytest
from _memory import Big, MiB, batches, held_bytes, peak, reset_peak, rss
from _models import external_launch, trainer

from lightning_shardrec.testing import run_ranks

ROWS, TABLES = 2_000_000, 2  # T = 2 x 2M x 16 x 4 bytes = 256 MiB
T = ROWS * 16 * 4 * TABLES
ALLOWANCE = 48 * MiB  # Lightning's loops, gloo buffers, a step's activations and gradients: measured ~10-25 MiB
_WARM: list[bool] = []


def _warm_up(world: int) -> None:
    """Imports, Lightning's and gloo's first-use costs, paid once per rank process (not the model's)."""
    if _WARM:
        return
    from lightning_shardrec import ShardRecStrategy

    model = Big(rows=1000)
    t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=2, use_distributed_sampler=False)
    t.fit(model, batches(1000, TABLES, 2, 0))
    t.validate(model, batches(1000, TABLES, 1, 0), verbose=False)
    t.predict(model, batches(1000, TABLES, 1, 0))
    _WARM.append(True)


def figures(rank: int, world: int, path: str, ckpt: str | None = None) -> dict[str, int]:
    """Run ``path`` through the Trainer; bytes over this rank's baseline at each point."""
    from lightning_shardrec import ShardRecStrategy

    external_launch(rank, world)
    _warm_up(world)
    reset_peak()
    base = rss()
    out: dict[str, int] = {}
    strategy = ShardRecStrategy()
    t = trainer(strategy=strategy, devices=world, max_steps=3, use_distributed_sampler=False)
    if path == "meta":
        with t.init_module():
            model = Big(ROWS, TABLES)
    else:
        model = Big(ROWS, TABLES, plain=path == "plain")
    out["built"] = rss() - base
    data = batches(ROWS, TABLES, 3, rank)
    if path == "validate_first":
        t.validate(model, batches(ROWS, TABLES, 1, rank), verbose=False)
        out["after_validate"] = rss() - base
        out["held_validate"] = held_bytes(strategy)
    if path == "plain_resume":
        t.fit(model, data, ckpt_path=ckpt)
    else:
        t.fit(model, data)
    out["after_fit"] = rss() - base
    out["peak"] = peak() - base
    out["held"] = held_bytes(strategy)
    if path == "fit_twice":
        t.fit_loop.epoch_loop.max_steps = 6
        t.fit(model, batches(ROWS, TABLES, 3, rank + 10))
        out["after_second_fit"] = rss() - base
        t.predict(model, batches(ROWS, TABLES, 1, rank))
        out["after_predict"] = rss() - base
    del t, model, strategy, data
    return out


def _message(path: str, rank: int, f: dict[str, int]) -> str:
    return (
        f"{path}, rank {rank}: " + ", ".join(f"{k} {v / MiB:.0f} MiB" for k, v in f.items()) + f" (T {T / MiB:.0f} MiB)"
    )


@pytest.mark.parametrize(
    ("path", "world"), [("cpu", 2), ("cpu", 3), ("meta", 2), ("plain", 2), ("validate_first", 2), ("fit_twice", 2)]
)
def test_each_rank_ends_with_its_share(path: str, world: int) -> None:
    results = run_ranks(figures, world, path, timeout=600)
    assert 1.9 * T < sum(f["held"] for f in results) < 2.1 * T  # each row once: T weights + T Adagrad state
    for rank, f in enumerate(results):
        msg = _message(f"{path} on {world} ranks", rank, f)
        share = f["held"]  # its tables' shards + the fused Adagrad state for them
        assert share <= 1.05 * T, msg  # at most one of the two tables (T/2) and its state (T/2)
        assert f["after_fit"] < share + ALLOWANCE, msg  # before the fix: + T (every rank kept its full copy)
        if path == "meta":  # never a full table on any rank, at any moment
            assert f["built"] < ALLOWANCE and f["peak"] < share + ALLOWANCE, msg
        else:  # the full tables, then the shards; never the user's Adagrad state for the full tables (+T)
            assert f["built"] > 0.9 * T and f["peak"] < T + share + ALLOWANCE, msg
        if path == "validate_first":
            assert f["after_validate"] < f["held_validate"] + ALLOWANCE, msg
        if path == "fit_twice":
            assert f["after_second_fit"] < share + ALLOWANCE and f["after_predict"] < share + ALLOWANCE, msg


def write_plain_checkpoint(path: str) -> None:
    """One step without the strategy (devices=1), saved: the tables' Adagrad state sits in the user's optimizer."""
    model = Big(ROWS, TABLES)
    t = trainer(devices=1, max_steps=1)
    t.fit(model, batches(ROWS, TABLES, 1, 0))
    t.save_checkpoint(path)


@pytest.mark.slow
def test_resume_from_a_plain_checkpoint_keeps_only_the_share(tmp_path) -> None:
    ckpt = str(tmp_path / "plain.ckpt")
    write_plain_checkpoint(ckpt)
    for rank, f in enumerate(run_ranks(figures, 2, "plain_resume", ckpt, timeout=600)):
        msg = _message("plain_resume", rank, f)
        # the loaded checkpoint (tables + their Adagrad state, 2T) is gone once restored; before: + T kept
        assert f["after_fit"] < f["held"] + ALLOWANCE, msg


def refused(rank: int, world: int) -> tuple[str, int]:
    from lightning_shardrec import ShardRecStrategy
    from lightning_shardrec.errors import PlannerError
    from lightning_shardrec.planner.machine import memory, topology

    external_launch(rank, world)
    _warm_up(world)
    topology.host_memory = lambda: 2 * 2**30  # this host: 2 GiB for its 2 ranks
    base = rss()
    t = trainer(strategy=ShardRecStrategy(), devices=world, max_steps=1, use_distributed_sampler=False)
    try:
        with t.init_module():
            model = Big(50_000_000, TABLES)  # 2 x 3 GiB of weights, as much again of Adagrad state
        t.fit(model, batches(1000, TABLES, 1, rank))
    except PlannerError as e:
        return str(e), rss() - base
    finally:
        topology.host_memory = memory.host_memory
    return "fitted", rss() - base


def test_a_plan_that_cannot_fit_the_host_is_refused_before_anything_is_allocated() -> None:
    for message, grown in run_ranks(refused, 2, timeout=600):
        assert "no sharding plan fits in memory" in message, message
        assert re.search(r"fullest rank \d: \d+ bytes \([\d.]+ GiB\) of tables, optimizer state and buffers", message)
        assert "capacity 1073741824 bytes (1.00 GiB)" in message, message  # the host's 2 GiB over 2 ranks
        assert grown < ALLOWANCE, f"grew {grown / MiB:.0f} MiB before the refusal"
