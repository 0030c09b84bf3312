"""The same-host shared-memory transport's equivalence matrix: each family of the general suite's
multi-rank cases, run once with ``comm_transport="shm"`` (required: no silent fallback) and once on
the process group, gives the same results bit for bit on 2 ranks (there ``a + b`` is the only
summation order, so even the reduce-scatters and the dense all-reduce agree exactly). Cases that
let ``kernel="auto"`` time the backends pin one kernel: a timed choice may differ between two runs.

The general suite runs on the process group (``tests/conftest.py`` sets
``LIGHTNING_SHARDREC_TRANSPORT=pg``, the CPU stand-in for NCCL); the rank functions are the
general suite's own, imported by name, so a case added there can join the matrix in one line.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from lightning_shardrec.testing import run_ranks

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _on(rank, world, transport, target, *args):
    """``module:function(rank, world, *args)`` with ``comm_transport="auto"`` meaning ``transport``."""
    from lightning_shardrec.distributed.transport.connect import TRANSPORT_ENV

    for sub in ("distributed", "lightning", "checkpoint"):
        path = os.path.join(TESTS, sub)
        if path not in sys.path:
            sys.path.append(path)
    from lightning_shardrec.distributed.transport.shm import ShmTransport

    module, name = target.split(":")
    fn = getattr(importlib.import_module(module), name)
    saved, issue = os.environ.get(TRANSPORT_ENV), ShmTransport.all_to_all
    calls = [0]

    def counted(self, *a, **k):
        calls[0] += 1
        return issue(self, *a, **k)

    os.environ[TRANSPORT_ENV] = transport
    ShmTransport.all_to_all = counted
    try:
        return fn(rank, world, *args), calls[0]
    finally:
        ShmTransport.all_to_all = issue
        if saved is None:
            del os.environ[TRANSPORT_ENV]
        else:
            os.environ[TRANSPORT_ENV] = saved


def assert_same(got, want, where="result"):
    """Equal bit for bit, through lists, tuples, dicts and dataclass-like objects."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, where
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == want, where


def on(transport, target, *args, world=2, timeout=300):
    """Every rank's result of ``target`` on ``transport``; checks which transport carried the all-to-alls."""
    results = run_ranks(_on, world, transport, target, *args, timeout=timeout)
    for rank, (_, calls) in enumerate(results):
        assert (calls > 0) == (transport == "shm"), f"rank {rank}: {calls} all-to-alls through shared memory"
    return [r for r, _ in results]


def both(target, *args, world=2, timeout=300):
    """The rank results on shared memory and on the process group."""
    return on("shm", target, *args, world=world, timeout=timeout), on("pg", target, *args, world=world, timeout=timeout)


def _cases(module, name):
    for sub in ("distributed", "lightning"):
        if os.path.join(TESTS, sub) not in sys.path:
            sys.path.append(os.path.join(TESTS, sub))
    return getattr(importlib.import_module(module), name)


def test_pooled_every_sharding_type():
    matrix = _cases("test_sharded_ebc", "matrix")
    cases = [c for c in matrix("adagrad") if (c[1], c[2]) in (("SUM", False), ("MEAN", True))]
    cases += [(c[0], c[1], c[2], c[3], True, 11) for c in cases[:4]]  # uneven batches, a rank with none
    shm, pg = both("test_sharded_ebc:train_sharded", cases, "torch")  # one kernel, not a timed choice
    assert_same(shm, pg)


def test_sequence_every_sharding_type():
    shm, pg = both("test_sharded_ec:train_sharded", _cases("test_sharded_ec", "cases_for")(2, "adagrad"), "torch")
    assert_same(shm, pg)


def test_variable_batch_every_sharding_type():
    types = _cases("test_sharded_vbe", "TYPES")
    cases = [(kind, False) for kind in types] + [(kind, True) for kind in ("row_wise", "table_wise")]
    shm, pg = both("test_sharded_vbe:train_sharded", cases)
    assert_same(shm, pg)


def test_host_exchange():
    plans, variants = _cases("test_host_blocks", "PLANS"), _cases("test_host_blocks", "VARIANTS")
    cases = [(kind, p, w, o, False, 3 + i) for kind in plans for i, (p, w, o) in enumerate(variants[:2])]
    cases += [("subset", "SUM", True, "sgd", True, 11)]
    shm, pg = both("test_host_blocks:train_sharded", 1, cases)  # 2 hosts of one rank: the host exchange runs
    assert_same(shm, pg)


def test_dynamic_tables():
    shm, pg = both("test_sharded_dynamic:train_sharded", _cases("test_sharded_dynamic", "cases_for")(2), timeout=600)
    assert_same(shm, pg)


@pytest.mark.parametrize("kind", ["row_wise", "column_wise"])
def test_pipeline(kind):
    options = {"max_epochs": 2, "val_check_interval": 2, "limit_val_batches": 2}
    shm, pg = both("test_pipeline:fit", True, kind, options)
    assert_same([(state, steps) for state, _, steps in shm], [(state, steps) for state, _, steps in pg])
    assert all(stats.prefetched > 0 and stats.misses == 0 for _, stats, _ in shm)


def test_checkpoint_resume(tmp_path):
    """Half a run on shared memory, saved, resumed on shared memory == the straight run on the process group."""
    steps = _cases("test_strategy_checkpoint", "STEPS")
    target = "test_strategy_checkpoint:fit"
    straight = on("pg", target, steps, None, None, "row_wise")
    half = str(tmp_path / "half.ckpt")
    on("shm", target, steps // 2, None, half, "row_wise")
    resumed = on("shm", target, steps, half, None, "row_wise")
    assert_same(resumed, straight)


@pytest.mark.parametrize("pipeline", [False, True])
def test_uneven_batch_counts_stop_every_rank_on_both_transports(pipeline):
    """2 ranks with 5 and 4 batches: every rank stops with ``UnevenBatchesError`` naming them, on either
    transport (the run's timeout, not the collectives' 10 minutes, bounds the test)."""
    for transport in ("shm", "pg"):
        results = run_ranks(_on, 2, transport, "test_strategy_habits:fit_uneven", [5, 4], -1, 1, pipeline, timeout=120)
        for rank, ((message, _), _) in enumerate(results):
            assert message.startswith(
                f"rank {rank}: uneven batch counts: the training data of ranks [1] ends after 4 batches in epoch 0, "
                "while ranks [0] have more (batch 4 is next)"
            ), (transport, message)
