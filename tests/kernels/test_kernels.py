"""Both kernel backends against nn.EmbeddingBag / nn.Embedding + torch.optim (dense grads)."""

import pytest
import torch
import torch.nn.functional as F

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec._fbgemm import fbgemm_available
from lightning_shardrec.kernels import KernelBackend, TableSpec, choose_backend, make_kernel
from lightning_shardrec.optim import FusedOptimizer

BACKENDS = ["torch"] + (["fbgemm"] if fbgemm_available() else [])
# float32; only the order of summation differs between the paths.
TOL = {"rtol": 1e-5, "atol": 1e-6}

SPECS = [
    TableSpec(name="t0", num_embeddings=12, embedding_dim=8),
    TableSpec(name="t1", num_embeddings=6, embedding_dim=4),
]
FEATURE_TABLE = [0, 0, 1]  # f0 and f1 share t0


def random_batch(gen, batch=4, weighted=False, rows=(12, 12, 6)):
    lengths = torch.randint(0, 4, (len(rows) * batch,), generator=gen)
    lengths[1] = 0  # always an empty bag
    values = torch.cat(
        [
            torch.randint(0, r, (int(n),), generator=gen)
            for r, ls in zip(rows, lengths.view(len(rows), batch), strict=False)
            for n in ls
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) + 0.5 if weighted else None
    return KeyedJaggedTensor(["f0", "f1", "f2"], values, weights, lengths)


def reference_pooled(weights, kjt, weighted):
    outs = []
    for f, t in zip(kjt.keys(), FEATURE_TABLE, strict=False):
        jt = kjt[f]
        outs.append(
            F.embedding_bag(
                jt.values(),
                weights[t],
                jt.offsets(),
                mode="sum",
                per_sample_weights=jt.weights_or_none() if weighted else None,
                include_last_offset=True,
            )
        )
    return torch.cat(outs, 1)


def init_weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.rand(s.num_embeddings, s.embedding_dim, generator=g) - 0.5 for s in SPECS]


def kernel(backend, optim, pooled=True, specs=SPECS, feature_table=FEATURE_TABLE):
    return make_kernel(specs, feature_table, optim, pooled=pooled, device="cpu", kernel=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_matches_embedding_bag(backend, weighted):
    k = kernel(backend, FusedOptimConfig(optimizer="sgd"))
    w = init_weights()
    k.load_weights(w)
    kjt = random_batch(torch.Generator().manual_seed(1), weighted=weighted)
    torch.testing.assert_close(k(kjt), reference_pooled(w, kjt, weighted), **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["sgd", "adagrad"])
@pytest.mark.parametrize("weighted", [False, True])
def test_training_matches_torch_optim(backend, name, weighted):
    """Fused sgd/adagrad == torch.optim.SGD/Adagrad on dense gradients, step for step."""
    optim = FusedOptimConfig(optimizer=name, lr=0.1, eps=1e-10)
    k = kernel(backend, optim)
    ref = [torch.nn.Parameter(w.clone()) for w in init_weights()]
    k.load_weights([p.detach() for p in ref])
    torch_opt = torch.optim.SGD(ref, lr=0.1) if name == "sgd" else torch.optim.Adagrad(ref, lr=0.1, eps=1e-10)
    fused = FusedOptimizer([k], optim)
    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        kjt = random_batch(gen, weighted=weighted)
        target = torch.randn(kjt.stride(), 20, generator=gen)
        torch_opt.zero_grad()
        (reference_pooled(ref, kjt, weighted) * target).sum().backward()
        torch_opt.step()
        (k(kjt) * target).sum().backward()
        fused.step()
    for got, want in zip(k.split_weights(), ref, strict=False):
        torch.testing.assert_close(got, want.detach(), **TOL)
    if name == "adagrad":
        for st, p in zip(k.split_states(), ref, strict=False):
            torch.testing.assert_close(st["sum"], torch_opt.state[p]["sum"], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rowwise_adagrad_formula(backend):
    """state[row] += mean(g^2); w[row] -= lr * g / (sqrt(state[row]) + eps)."""
    optim = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.05, eps=1e-8)
    k = kernel(backend, optim)
    w = init_weights()
    k.load_weights(w)
    kjt = random_batch(torch.Generator().manual_seed(3))
    target = torch.randn(4, 20)
    params = [torch.nn.Parameter(x.clone()) for x in w]
    (reference_pooled(params, kjt, False) * target).sum().backward()
    (k(kjt) * target).sum().backward()
    for p, got, st in zip(params, k.split_weights(), k.split_states(), strict=False):
        g = p.grad
        state = g.pow(2).mean(1)
        want = p.detach() - 0.05 * g / (state.sqrt() + 1e-8).unsqueeze(1)
        torch.testing.assert_close(st["sum"], state, **TOL)
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("name,torch_cls", [("adam", torch.optim.Adam), ("adamw", torch.optim.AdamW)])
def test_adam_matches_torch_when_every_row_is_touched(name, torch_cls):
    """Lazy Adam equals dense Adam on rows that every step touches (torch backend on CPU)."""
    specs = [TableSpec(name="t", num_embeddings=5, embedding_dim=6)]
    optim = FusedOptimConfig(optimizer=name, lr=0.01, weight_decay=0.1 if name == "adamw" else 0.0)
    k = make_kernel(specs, [0], optim, pooled=True, device="cpu")
    assert k.backend is KernelBackend.TORCH
    p = torch.nn.Parameter(torch.rand(5, 6))
    k.load_weights([p.detach()])
    torch_opt = torch_cls([p], lr=0.01, weight_decay=0.1 if name == "adamw" else 0.0)
    FusedOptimizer([k], optim)
    for step in range(3):
        kjt = KeyedJaggedTensor(["f"], torch.tensor([0, 1, 2, 3, 4, step % 5]), lengths=torch.tensor([3, 3]))
        target = torch.randn(2, 6)
        torch_opt.zero_grad()
        (F.embedding_bag(kjt.values(), p, kjt.offsets(), include_last_offset=True) * target).sum().backward()
        torch_opt.step()
        (k(kjt) * target).sum().backward()
    torch.testing.assert_close(k.split_weights()[0], p.detach(), rtol=1e-5, atol=1e-6)
    assert float(k.split_states()[0]["step"]) == 3


def test_lazy_adam_leaves_untouched_rows():
    k = make_kernel(
        [TableSpec(name="t", num_embeddings=4, embedding_dim=4)],
        [0],
        FusedOptimConfig(optimizer="adam"),
        pooled=True,
        device="cpu",
    )
    with torch.no_grad():  # a kernel's rows start uninitialised (NaN is possible)
        k.split_weights()[0].copy_(torch.rand(4, 4))
    before = k.split_weights()[0].clone()
    k(KeyedJaggedTensor(["f"], torch.tensor([1]), lengths=torch.tensor([1]))).sum().backward()
    after = k.split_weights()[0]
    assert torch.equal(before[[0, 2, 3]], after[[0, 2, 3]]) and not torch.equal(before[1], after[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_kernel_matches_nn_embedding(backend):
    specs = [
        TableSpec(name="a", num_embeddings=6, embedding_dim=4),
        TableSpec(name="b", num_embeddings=3, embedding_dim=4),
    ]
    optim = FusedOptimConfig(optimizer="sgd", lr=0.5)
    k = make_kernel(specs, [0, 1], optim, pooled=False, device="cpu", kernel=backend)
    ref = [torch.nn.Parameter(torch.rand(6, 4)), torch.nn.Parameter(torch.rand(3, 4))]
    k.load_weights([p.detach() for p in ref])
    kjt = KeyedJaggedTensor(["fa", "fb"], torch.tensor([5, 5, 0, 2]), lengths=torch.tensor([2, 1, 0, 1]))
    out = k(kjt)
    want = torch.cat([F.embedding(kjt["fa"].values(), ref[0]), F.embedding(kjt["fb"].values(), ref[1])])
    torch.testing.assert_close(out, want)
    target = torch.randn_like(out)
    (out * target).sum().backward()
    (want * target).sum().backward()
    torch.optim.SGD(ref, lr=0.5).step()
    for got, p in zip(k.split_weights(), ref, strict=False):
        torch.testing.assert_close(got, p.detach(), **TOL)


def test_torch_backend_mixed_dims_keeps_feature_order():
    specs = [
        TableSpec(name="a", num_embeddings=5, embedding_dim=3),
        TableSpec(name="b", num_embeddings=5, embedding_dim=2),
    ]
    k = make_kernel(specs, [1, 0, 1], FusedOptimConfig(optimizer="sgd"), pooled=True, device="cpu", kernel="torch")
    w = [torch.rand(5, 3), torch.rand(5, 2)]
    k.load_weights(w)
    kjt = KeyedJaggedTensor(["x", "y", "z"], torch.tensor([1, 2, 3, 4]), lengths=torch.tensor([1, 0, 1, 1, 0, 1]))
    out = k(kjt)
    cols = [
        F.embedding_bag(kjt[f].values(), w[t], kjt[f].offsets(), include_last_offset=True)
        for f, t in zip("xyz", [1, 0, 1], strict=False)
    ]
    torch.testing.assert_close(out, torch.cat(cols, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lr_scheduler_reaches_kernel(backend):
    optim = FusedOptimConfig(optimizer="sgd", lr=1.0)
    k = kernel(backend, optim)
    k.load_weights(init_weights())  # a kernel's rows start uninitialised (NaN is possible)
    fused = FusedOptimizer([k], optim)
    sched = torch.optim.lr_scheduler.LambdaLR(fused, lambda step: 0.0)  # lr -> 0 from the start
    assert fused.param_groups[0]["lr"] == 0.0
    before = [w.clone() for w in k.split_weights()]
    k(random_batch(torch.Generator().manual_seed(4))).sum().backward()
    fused.step()
    sched.step()
    for b, a in zip(before, k.split_weights(), strict=False):
        assert torch.equal(b, a)


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_state_dict_round_trip(backend):
    optim = FusedOptimConfig(optimizer="adagrad", lr=0.1)
    gen = torch.Generator().manual_seed(5)
    batches = [(random_batch(gen), torch.randn(4, 20, generator=gen)) for _ in range(4)]
    a = kernel(backend, optim)
    a.load_weights(init_weights())
    opt_a = FusedOptimizer([a], optim)
    for kjt, t in batches[:2]:
        (a(kjt) * t).sum().backward()
    saved_w = [w.clone() for w in a.split_weights()]
    saved = {
        "state": {i: {n: v.clone() for n, v in s.items()} for i, s in opt_a.state_dict()["state"].items()},
        "param_groups": opt_a.state_dict()["param_groups"],
    }
    b = kernel(backend, optim)
    b.load_weights(saved_w)
    opt_b = FusedOptimizer([b], optim)
    opt_b.load_state_dict(saved)
    for kjt, t in batches[2:]:
        (a(kjt) * t).sum().backward()
        (b(kjt) * t).sum().backward()
    for x, y in zip(a.split_weights(), b.split_weights(), strict=False):
        torch.testing.assert_close(x, y)
    assert b.hparams is opt_b.param_groups[0]  # still bound after load


def test_backends_agree_after_training():
    if "fbgemm" not in BACKENDS:
        pytest.skip("fbgemm not installed")
    optim = FusedOptimConfig(optimizer="rowwise_adagrad", lr=0.1)
    ks = [kernel(b, optim) for b in ("torch", "fbgemm")]
    for k in ks:
        k.load_weights(init_weights())
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        kjt, t = random_batch(gen, weighted=True), torch.randn(4, 20, generator=gen)
        for k in ks:
            (k(kjt) * t).sum().backward()
    for x, y in zip(ks[0].split_weights(), ks[1].split_weights(), strict=False):
        torch.testing.assert_close(x, y, **TOL)


def test_choose_backend():
    cpu = torch.device("cpu")
    assert choose_backend("auto", cpu, FusedOptimConfig(optimizer="adam"), [8]) is KernelBackend.TORCH
    assert choose_backend("auto", cpu, FusedOptimConfig(optimizer="sgd"), [6]) is KernelBackend.TORCH
    # without timing (kernels.choose times them; tests/kernels/test_autotune.py): fbgemm where it runs
    expected = KernelBackend.FBGEMM if fbgemm_available() else KernelBackend.TORCH
    assert choose_backend("auto", cpu, FusedOptimConfig(optimizer="adagrad"), [8]) is expected
    assert choose_backend("auto", cpu, FusedOptimConfig(optimizer="rowwise_adagrad"), [8]) is expected
    assert choose_backend("torch", cpu, FusedOptimConfig(optimizer="sgd"), [8]) is KernelBackend.TORCH
    # YAML writes enum names
    assert choose_backend("TORCH", cpu, FusedOptimConfig(optimizer="sgd"), [8]) is KernelBackend.TORCH


def test_kernel_errors_list_choices():
    with pytest.raises(ValueError, match="unknown kernel 'cuda'; available: auto, fbgemm, torch"):
        choose_backend("cuda", torch.device("cpu"), FusedOptimConfig(), [8])
    with pytest.raises(ValueError, match=r"fbgemm on cpu trains only adagrad, rowwise_adagrad, sgd, not 'adam'"):
        kernel("fbgemm", FusedOptimConfig(optimizer="adam"))
    with pytest.raises(ValueError, match=r"a sequence kernel needs one embedding_dim"):
        kernel("torch", FusedOptimConfig(), pooled=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowwise_adagrad", "adam"])
def test_reset_rows_writes_rows_and_restarts_their_state(backend, name):
    """A dynamic table's new slot: given rows written, their optimizer state back to its
    initial value; other rows (weights and state) and Adam's shared step untouched."""
    if backend == "fbgemm" and name == "adam":
        pytest.skip("fbgemm's CPU TBE has no adam")
    k = kernel(backend, FusedOptimConfig(optimizer=name, lr=0.05))
    k.load_weights(init_weights())
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        (k(random_batch(gen)) * torch.randn(4, 20, generator=gen)).sum().backward()
    before_w = [w.clone() for w in k.split_weights()]
    before_s = [{n: t.clone() for n, t in s.items()} for s in k.split_states()]
    assert any(t.abs().sum() > 0 for s in before_s for n, t in s.items() if n != "step") or name == "sgd"
    rows, values = torch.tensor([1, 4, 7]), torch.randn(3, 8, generator=gen)
    k.reset_rows(0, rows, values)
    other = torch.tensor([r for r in range(12) if r not in rows.tolist()])
    w, s = k.split_weights(), k.split_states()
    torch.testing.assert_close(w[0][rows], values)
    torch.testing.assert_close(w[0][other], before_w[0][other])
    torch.testing.assert_close(w[1], before_w[1])
    for n, t in s[0].items():
        if n == "step":
            assert float(t) == float(before_s[0][n]) == 2.0
            continue
        assert (t[rows] == 0).all(), n
        torch.testing.assert_close(t[other], before_s[0][n][other])
    for n, t in s[1].items():
        torch.testing.assert_close(t, before_s[1][n])


def test_a_kernel_must_define_forward_and_its_views():
    from lightning_shardrec.kernels.base import BatchedEmbeddingKernel

    class Partial(BatchedEmbeddingKernel):
        def forward(self, kjt):
            return kjt.values()

    with pytest.raises(TypeError, match="abstract methods '?split_states'?, '?split_weights"):
        Partial([], [], None, pooled=True, device="cpu")
