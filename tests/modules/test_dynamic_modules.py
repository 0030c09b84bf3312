"""Dynamic tables in the unsharded collections: training against a dict reference, resets, refusals."""

from __future__ import annotations

import random

import pytest
import torch

from lightning_shardrec import (
    DynamicConfig,
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
    KeyedJaggedTensor,
)
from lightning_shardrec.modules import EvictionPolicy, optimizer_reset_hook, reset_optimizer_rows
from lightning_shardrec.modules.dynamic.stats import saved_figures
from lightning_shardrec.modules.dynamic.tables import fresh_rows
from tests.modules._dynamic_reference import ReferenceMapper, stream


class ReferenceModel:
    """Rows keyed by slot in dicts, slots from :class:`ReferenceMapper`, updates by hand."""

    def __init__(self, table: EmbeddingBagConfig | EmbeddingConfig, optimizer: str, lr: float) -> None:
        config = table.dynamic
        buckets, slots = config.layout(table.num_embeddings, table.name)
        self.mapper = ReferenceMapper(
            buckets,
            slots,
            config.candidate_slots(slots),
            config.min_count,
            config.eviction is EvictionPolicy.LFU,
            config.ttl_steps,
        )
        self.table, self.optimizer, self.lr = table, optimizer, lr
        self.rows: dict[int, torch.Tensor] = {}
        self.sums: dict[int, torch.Tensor] = {}
        self.weight = torch.empty(table.num_embeddings, table.embedding_dim)

    def rows_of(self, ids: list[int], step: int) -> tuple[list[int], list[torch.Tensor]]:
        slots, new = self.mapper.lookup(ids, step, True)
        if new:
            fresh = fresh_rows(self.table, torch.tensor(list(new)), torch.tensor(list(new.values())), self.weight)
            for s, row in zip(new, fresh, strict=True):
                self.rows[s] = row.clone().requires_grad_(True)
                self.sums[s] = torch.zeros_like(row)
        zero = torch.zeros(self.table.embedding_dim)
        return slots, [self.rows[s] if s >= 0 else zero for s in slots]

    def update(self) -> None:
        with torch.no_grad():
            for s, row in self.rows.items():
                if row.grad is None:
                    continue
                g = row.grad
                if self.optimizer == "adagrad":
                    self.sums[s] += g * g
                    g = g / (self.sums[s].sqrt() + 1e-10)
                row -= self.lr * g
                row.grad = None


def kjt_of(batch: list[int], keys: list[str], rng: random.Random) -> KeyedJaggedTensor:
    lengths = [rng.randrange(0, 4) for _ in range(len(keys) * 3)]
    while sum(lengths) > len(batch):
        lengths[lengths.index(max(lengths))] -= 1
    values = torch.tensor(batch[: sum(lengths)])
    weights = torch.tensor([rng.uniform(0.5, 1.5) for _ in range(sum(lengths))])
    return KeyedJaggedTensor(keys, values, weights, lengths=torch.tensor(lengths))


def make_optimizer(name: str, params: list[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adagrad(params, lr=lr, eps=1e-10) if name == "adagrad" else torch.optim.SGD(params, lr=lr)


EBC_CASES = [("sgd", "SUM", False, 1), ("adagrad", "MEAN", True, 2), ("adagrad", "SUM", True, 1)]


@pytest.mark.parametrize(("optimizer", "pooling", "weighted", "min_count"), EBC_CASES)
def test_ebc_trains_like_the_reference(optimizer: str, pooling: str, weighted: bool, min_count: int) -> None:
    lr = 0.1
    dyn = EmbeddingBagConfig(
        name="d",
        embedding_dim=4,
        num_embeddings=6,
        feature_names=["a", "b"],
        pooling=pooling,
        dynamic=DynamicConfig(num_buckets=3, min_count=min_count, eviction="lfu"),
    )
    static = EmbeddingBagConfig(name="s", embedding_dim=2, num_embeddings=5, feature_names=["c"])
    ebc = EmbeddingBagCollection([dyn, static], is_weighted=weighted)
    opt = make_optimizer(optimizer, list(ebc.parameters()), lr)
    ebc.register_reset_hook(optimizer_reset_hook(opt))
    ref = ReferenceModel(dyn, optimizer, lr)
    rng = random.Random(1)
    for step, batch in enumerate(stream(12, 20, 12, seed=2)):
        kjt = kjt_of(batch, ["a", "b"], rng)
        full = KeyedJaggedTensor(
            ["a", "b", "c"],
            torch.cat([kjt.values(), torch.tensor([1, 4])]),
            torch.cat([kjt.weights(), torch.ones(2)]),
            lengths=torch.cat([kjt.lengths(), torch.tensor([1, 0, 1])]),
        )
        out = ebc(full).values()[:, :8]
        slots, rows = ref.rows_of(kjt.values().tolist(), step)
        bags, at = [], 0
        for n in kjt.lengths().tolist():
            part = [rows[at + i] * (float(kjt.weights()[at + i]) if weighted else 1.0) for i in range(n)]
            pooled = torch.stack(part).sum(0) if part else torch.zeros(4)
            bags.append(pooled / max(n, 1) if pooling == "MEAN" else pooled)
            at += n
        want = torch.stack(bags).view(2, 3, 4).transpose(0, 1).reshape(3, 8)
        torch.testing.assert_close(out, want)
        (out**2 + out).sum().backward()
        (want**2 + want).sum().backward()
        opt.step()
        opt.zero_grad()
        ref.update()
    weight = ebc.embedding_bags["d"].weight.detach()
    for s, row in ref.rows.items():
        torch.testing.assert_close(weight[s], row.detach())
    stats = ebc.dynamic_stats()["d"]
    assert {k: stats[k] for k in ref.mapper.counters()} == ref.mapper.counters()
    assert stats["evictions"] > 0 and stats["misses"] > 0


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_ec_trains_like_the_reference(optimizer: str) -> None:
    lr = 0.05
    table = EmbeddingConfig(
        name="d",
        embedding_dim=3,
        num_embeddings=4,
        feature_names=["a"],
        dynamic=DynamicConfig(num_buckets=2, min_count=2, ttl_steps=3),
    )
    ec = EmbeddingCollection([table], need_indices=True)
    opt = make_optimizer(optimizer, list(ec.parameters()), lr)
    ec.register_reset_hook(optimizer_reset_hook(opt))
    ref = ReferenceModel(table, optimizer, lr)
    for step, batch in enumerate(stream(12, 12, 6, seed=4)):
        kjt = KeyedJaggedTensor(["a"], torch.tensor(batch), lengths=torch.tensor([2, 4]))
        out = ec(kjt)["a"]
        assert out.weights().tolist() == batch
        want = torch.stack(ref.rows_of(batch, step)[1])
        torch.testing.assert_close(out.values(), want)
        (out.values() ** 2 + out.values()).sum().backward()
        (want**2 + want).sum().backward()
        opt.step()
        opt.zero_grad()
        ref.update()
    for s, row in ref.rows.items():
        torch.testing.assert_close(ec.embeddings["d"].weight[s].detach(), row.detach())
    assert ec.dynamic_stats()["d"]["misses"] > 0 and ec.dynamic_stats()["d"]["evictions"] > 0


def test_eval_and_no_grad_do_not_admit_or_evict() -> None:
    table = EmbeddingBagConfig(
        name="d", embedding_dim=2, num_embeddings=2, feature_names=["a"], dynamic=DynamicConfig(num_buckets=1)
    )
    ebc = EmbeddingBagCollection([table])
    kjt = KeyedJaggedTensor(["a"], torch.tensor([5, -3, 2**40]), lengths=torch.tensor([1, 2]))
    ebc(kjt)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    ebc.eval()
    out = ebc(KeyedJaggedTensor(["a"], torch.tensor([5, 11]), lengths=torch.tensor([1, 1])))
    ebc.train()
    with torch.no_grad():
        ebc(KeyedJaggedTensor(["a"], torch.tensor([12]), lengths=torch.tensor([1])))
    for k, v in ebc.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0)
    assert out.values()[1].abs().sum() == 0 and out.values()[0].abs().sum() > 0


def test_static_tables_still_check_ids_beside_dynamic_ones() -> None:
    ebc = EmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name="d", embedding_dim=2, num_embeddings=4, feature_names=["a"], dynamic=DynamicConfig()
            ),
            EmbeddingBagConfig(name="s", embedding_dim=2, num_embeddings=4, feature_names=["b"]),
        ]
    )
    ebc(KeyedJaggedTensor(["a", "b"], torch.tensor([-9, 3]), lengths=torch.tensor([1, 1])))
    with pytest.raises(ValueError, match=r"feature 'b' \(table 's'\): id 4 outside \[0, 4\)"):
        ebc(KeyedJaggedTensor(["a", "b"], torch.tensor([-9, 4]), lengths=torch.tensor([1, 1])))


@pytest.mark.parametrize("name", ["adam", "adagrad", "sgd"])
def test_reset_optimizer_rows(name: str) -> None:
    weight = torch.nn.Parameter(torch.ones(4, 2))
    opt = {
        "adam": lambda: torch.optim.Adam([weight], amsgrad=True),
        "adagrad": lambda: torch.optim.Adagrad([weight], initial_accumulator_value=0.5),
        "sgd": lambda: torch.optim.SGD([weight], lr=0.1, momentum=0.9),
    }[name]()
    weight.grad = torch.ones(4, 2)
    opt.step()
    reset_optimizer_rows(opt, weight, torch.tensor([1, 3]))
    rows = [v for v in opt.state[weight].values() if v.shape == weight.shape]
    assert rows
    for v in rows:
        fill = 0.5 if name == "adagrad" else 0.0
        assert (v[[1, 3]] == fill).all() and (v[[0, 2]] != fill).all()


def test_state_dict_round_trip_resumes_exactly() -> None:
    config = DynamicConfig(num_buckets=2, min_count=2, eviction="lfu")
    table = EmbeddingBagConfig(name="d", embedding_dim=2, num_embeddings=4, feature_names=["a"], dynamic=config)
    a, b = EmbeddingBagCollection([table]), EmbeddingBagCollection([table])
    batches = [KeyedJaggedTensor(["a"], torch.tensor(x), lengths=torch.tensor([len(x)])) for x in stream(8, 10, 5, 6)]
    for kjt in batches[:4]:
        a(kjt)
    b.load_state_dict(a.state_dict())
    for kjt in batches[4:]:
        torch.testing.assert_close(a(kjt).values(), b(kjt).values(), rtol=0, atol=0)
    assert saved_figures(a.dynamic_stats()) == saved_figures(b.dynamic_stats())  # the window is not saved


def test_variable_batch_kjt_is_refused_for_dynamic_tables() -> None:
    from tests.modules.test_vbe import KEYS, vbe

    table = EmbeddingBagConfig(name="d", embedding_dim=2, num_embeddings=4, feature_names=KEYS, dynamic=DynamicConfig())
    with pytest.raises(NotImplementedError, match=r"dynamic tables \['d'\] do not take a variable-batch \(VBE\)"):
        EmbeddingBagCollection([table])(vbe())
