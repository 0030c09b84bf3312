"""fbgemm's Adam step counter (issue 23 item 3), through a fake TBE with fbgemm's state layout
and counter behaviour (``_fake_fbgemm``): fbgemm's CPU build has no Adam. Not run here: the
real CUDA TBE (``test_real_cuda_tbe_step_ignores_eval`` runs where CUDA and fbgemm are)."""

from __future__ import annotations

import pytest
import torch
from _fake_fbgemm import installed

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.kernels import TableSpec, make_kernel
from lightning_shardrec.optim import FusedOptimizer

pytestmark = pytest.mark.needs_fbgemm

SPECS = [
    TableSpec(name="a", num_embeddings=10, embedding_dim=4),
    TableSpec(name="b", num_embeddings=7, embedding_dim=8),
]
FEATURES = [0, 1, 1]


def batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (3 * 4,), generator=g)
    rows = [10, 7, 7]
    values = torch.cat([torch.randint(0, rows[i // 4], (int(n),), generator=g) for i, n in enumerate(lengths)])
    return KeyedJaggedTensor(["f0", "f1", "f2"], values, None, lengths)


def build(backend: str, name: str, device: str = "cpu"):
    optim = FusedOptimConfig(optimizer=name, lr=0.05)  # fbgemm CPU gates weight decay (see routing tests)
    k = make_kernel(SPECS, FEATURES, optim, pooled=True, device=device, kernel=backend)
    g = torch.Generator().manual_seed(3)
    k.load_weights([torch.rand(s.num_embeddings, s.embedding_dim, generator=g) for s in SPECS])
    return k, FusedOptimizer([k], optim)


def train(kernel, steps: range, evaluate: bool) -> None:
    for i in steps:
        kernel.train()
        kernel(batch(i)).square().sum().backward()
        if evaluate:  # a validation pass between training steps must not move Adam's step
            kernel.eval()
            with torch.no_grad():
                kernel(batch(100 + i))


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_validation_forwards_do_not_move_the_step(name: str) -> None:
    with installed():
        fb, fb_opt = build("fbgemm", name)
        assert type(fb.tbe).__name__ == "FakeTBE"
        train(fb, range(4), evaluate=True)
    ref, ref_opt = build("torch", name)
    train(ref, range(4), evaluate=False)
    for a, b in zip(fb.split_weights(), ref.split_weights(), strict=True):
        torch.testing.assert_close(a, b)
    assert float(fb.split_states()[0]["step"]) == float(ref.split_states()[0]["step"]) == 4.0


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_step_is_a_scalar_and_a_loaded_step_takes_effect(name: str) -> None:
    """The state dict of the fbgemm kernel holds the torch kernel's layout (a 0-d step), loads
    into either backend, and training goes on from the loaded step on both."""
    with installed():
        fb, fb_opt = build("fbgemm", name)
        train(fb, range(3), evaluate=True)
        saved = fb_opt.state_dict()
        assert all(s["step"].dim() == 0 for s in saved["state"].values())
        ref, ref_opt = build("torch", name)
        ref_opt.load_state_dict(saved)
        ref.load_weights([w.clone() for w in fb.split_weights()])
        # a fresh fbgemm kernel whose TBE already counted (as after training): the load must win
        again, again_opt = build("fbgemm", name)
        train(again, range(50, 55), evaluate=False)
        again_opt.load_state_dict(saved)
        again.load_weights([w.clone() for w in fb.split_weights()])
        train(again, range(3, 6), evaluate=False)
        train(fb, range(3, 6), evaluate=False)
    train(ref, range(3, 6), evaluate=False)
    for a, b, c in zip(fb.split_weights(), ref.split_weights(), again.split_weights(), strict=True):
        torch.testing.assert_close(a, b)
        torch.testing.assert_close(c, b)


@pytest.mark.needs_fbgemm("cuda")
def test_real_cuda_tbe_step_ignores_eval() -> None:  # pragma: no cover - GPU only
    fb, _ = build("fbgemm", "adam", device="cuda")
    ref, _ = build("torch", "adam", device="cuda")
    for k, evaluate in ((fb, True), (ref, False)):
        for i in range(3):
            k.train()
            k(batch(i).to("cuda")).square().sum().backward()
            if evaluate:
                k.eval()
                with torch.no_grad():
                    k(batch(100 + i).to("cuda"))
    for a, b in zip(fb.split_weights(), ref.split_weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _adam_dmp(backend: str, world: int):
    from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig
    from lightning_shardrec.distributed import DistributedModelParallel
    from lightning_shardrec.planner import EmbeddingComputeKernel, ParameterSharding, ShardingPlan, ShardMetadata

    configs = [
        EmbeddingBagConfig(
            name=s.name, num_embeddings=s.num_embeddings, embedding_dim=s.embedding_dim, feature_names=[f]
        )
        for s, f in zip(SPECS, ["f0", "f1"], strict=True)
    ]
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(configs)
    plan = {}
    for c in configs:  # row-wise: the step counter sits beside row blocks of every table
        half = c.num_embeddings // 2
        shards = [
            ShardMetadata((0, 0), (half, c.embedding_dim), 0),
            ShardMetadata((half, 0), (c.num_embeddings - half, c.embedding_dim), 1 % world),
        ]
        plan[c.name] = ParameterSharding("row_wise", EmbeddingComputeKernel.FUSED, [0, 1 % world], shards)
    optim = FusedOptimConfig(optimizer="adam", lr=0.05)
    return DistributedModelParallel(
        ebc, ShardingPlan({"": plan}), device="cpu", embedding_optimizer=optim, kernel=backend, embedding_modules=False
    )


def _two_feature_batch(seed: int) -> KeyedJaggedTensor:
    kjt = batch(seed)
    f0, f1 = kjt["f0"], kjt["f1"]
    return KeyedJaggedTensor(
        ["f0", "f1"], torch.cat([f0.values(), f1.values()]), None, torch.cat([f0.lengths(), f1.lengths()])
    )


def _held(dmp) -> dict[tuple[str, tuple], tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    module = dmp.sharded[""]
    states = {(t, m.shard_offsets): s for t, v in module.local_states().items() for m, s in v}
    return {
        (t, m.shard_offsets): (w.detach().clone(), {k: v.clone() for k, v in states[(t, m.shard_offsets)].items()})
        for t, shards in module.local_shards().items()
        for m, w in shards
    }


def save_fbgemm_adam_load_torch(rank: int, world: int, path: str) -> list:
    from lightning_shardrec.checkpoint import gather_full_state, load_full_state, load_sharded, save_sharded

    with installed():
        source = _adam_dmp("fbgemm", world)
        for i in range(3):
            source.train()
            source(_two_feature_batch(10 * i + rank)).values().sum().backward()
            source.eval()
            with torch.no_grad():
                source(_two_feature_batch(99))
        save_sharded(path, source.sharded, {}, {}, rank)
        weights, states = gather_full_state(source.sharded)
        saved = _held(source)
    out = []
    for how in ("sharded", "full"):
        target = _adam_dmp("torch", world)
        if how == "sharded":
            load_sharded(path, target.sharded, {}, rank)
        else:
            load_full_state(target.sharded, weights, states)
        out += [(how, key, got, saved[key]) for key, got in _held(target).items()]
    return out


def test_fbgemm_adam_checkpoint_loads_into_the_torch_kernel(tmp_path) -> None:
    """The crash at the first checkpoint: fbgemm's ``[1]`` step was read as per-row state."""
    from lightning_shardrec.testing import run_ranks

    for per_rank in run_ranks(save_fbgemm_adam_load_torch, 2, str(tmp_path / "ckpt")):
        assert {how for how, *_ in per_rank} == {"sharded", "full"}
        for how, table, (w, state), (saved_w, saved_state) in per_rank:
            torch.testing.assert_close(w, saved_w, msg=f"{how} {table}")
            assert set(state) == set(saved_state) == {"exp_avg", "exp_avg_sq", "step"}
            for k in state:
                torch.testing.assert_close(state[k], saved_state[k], msg=f"{how} {table} {k}")
            assert float(state["step"]) == 3.0
