"""The torch kernel's compiled CPU loops (``kernels/native_rows.c``) against their tensor-op twins."""

import warnings

import pytest
import torch

from lightning_shardrec import FusedOptimConfig, KeyedJaggedTensor
from lightning_shardrec.configs import EmbOptimType
from lightning_shardrec.kernels import TableSpec, make_kernel, native, row_updates

OPTIMIZERS = ["sgd", "adagrad", "rowwise_adagrad", "adam", "adamw"]


@pytest.fixture(autouse=True)
def _loops_built() -> None:
    if native.row_loops() is None:
        pytest.fail("the kernel's compiled loops are not built in this checkout (python setup.py build_ext --inplace)")


def tensor_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """From here on the kernel runs its tensor ops, as a package installed without the library."""
    monkeypatch.setattr(native, "row_loops", lambda: None)


def kernel(optimizer: str, weight_decay: float = 0.0):  # type: ignore[no-untyped-def]
    tables = [
        TableSpec(name="a", num_embeddings=40, embedding_dim=12),
        TableSpec(name="b", num_embeddings=7, embedding_dim=12),
    ]
    optim = FusedOptimConfig(optimizer=EmbOptimType.parse(optimizer), lr=0.05, weight_decay=weight_decay)
    k = make_kernel(tables, [0, 1, 0], optim, pooled=True, device="cpu", kernel="torch")
    g = torch.Generator().manual_seed(3)
    k.load_weights([torch.randn(40, 12, generator=g), torch.randn(7, 12, generator=g)])
    return k


def batches(weighted: bool, n: int = 4) -> list[KeyedJaggedTensor]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(n):
        lengths = torch.randint(0, 9, (3 * 16,), generator=g)  # 3 features x 16 bags, empty bags among them
        total = int(lengths.sum())
        limits = torch.tensor([40, 7, 40]).repeat_interleave(16).repeat_interleave(lengths)
        values = (torch.rand(total, generator=g) ** 3 * limits).long()  # skewed: rows repeat within a batch
        w = torch.rand(total, generator=g) if weighted else None
        out.append(KeyedJaggedTensor(["x", "y", "z"], values, lengths=lengths, weights=w))
    return out


def train(k, kjts: list[KeyedJaggedTensor]) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    outs = []
    for i, kjt in enumerate(kjts):
        out = k(kjt)
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(i)))
        outs.append(out.detach())
    return outs


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("weighted", [False, True])
def test_training_on_the_loops_matches_the_tensor_ops(monkeypatch, optimizer, weighted):
    decay = 0.01 if optimizer != "rowwise_adagrad" else 0.0
    fast = kernel(optimizer, decay)
    outs = train(fast, batches(weighted))
    tensor_ops(monkeypatch)
    twin = kernel(optimizer, decay)
    want = train(twin, batches(weighted))
    if not weighted:  # the first lookup (same rows): the same sums in the same order
        assert torch.equal(outs[0], want[0])
    for a, b in zip(outs, want, strict=True):  # then rows a rule moved, to within rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(fast.split_weights(), twin.split_weights(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for sa, sb in zip(fast.split_states(), twin.split_states(), strict=True):
        for name in sa:
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-5, atol=1e-6)


def test_the_fused_update_equals_sums_then_rule():
    """Backward's one pass (sums and rule) equals the loops' two passes (clipping takes them) bit for bit."""
    one, two = kernel("rowwise_adagrad"), kernel("rowwise_adagrad")
    two.grad_clip_value = 1e30  # never clips, but sends backward through sum_rows + apply_rule
    train(one, batches(True))
    train(two, batches(True))
    assert all(torch.equal(a, b) for a, b in zip(one.split_weights(), two.split_weights(), strict=True))
    assert all(torch.equal(a["sum"], b["sum"]) for a, b in zip(one.split_states(), two.split_states(), strict=True))


@pytest.mark.parametrize("source", [False, True])
def test_unweighted_row_sums_equal_the_tensor_ops_bit_for_bit(monkeypatch, source):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 6, (3000,), generator=g)  # many repeats per row: the order of the sum shows
    grad = torch.randn(500 if source else 3000, 8, generator=g)
    src = torch.randint(0, 500, (3000,), generator=g) if source else None
    rows, fast = row_updates.accumulate_rows(ids, grad, src, num_rows=6)
    tensor_ops(monkeypatch)
    want_rows, want = row_updates.accumulate_rows(ids, grad, src, num_rows=6)
    assert torch.equal(rows, want_rows) and torch.equal(fast, want)


def test_the_loops_check_the_ids_and_rows_they_address():
    loops = native.row_loops()
    ids = torch.tensor([0, 3, 9, 1])
    with pytest.raises(ValueError, match=r"row updates: id 9 \(index 2\) is outside the rows \[0, 5\)"):
        native.group_rows(loops, ids, 5, None, 1, 4, 0)
    with pytest.raises(ValueError, match=r"row updates: offsets must rise from 0 to the 4 ids, got \[0, 3, 2, 4\]"):
        native.group_rows(loops, ids, 10, torch.tensor([0, 3, 2, 4]), 3, 4, 0)
    weight, grad = torch.zeros(5, 4), torch.ones(2, 4)
    hp = {"lr": 0.1, "eps": 1e-8, "beta1": 0.9, "beta2": 0.999, "weight_decay": 0.0}
    with pytest.raises(ValueError, match=r"row updates: row 5 is outside the table's rows \[0, 5\)"):
        native.apply_rule(loops, "sgd", weight, torch.tensor([1, 5]), grad, {}, hp)
    assert torch.equal(weight, torch.zeros(5, 4))  # nothing written


def test_a_bad_id_fails_the_compiled_lookup_with_the_kernels_message():
    k = kernel("sgd")
    kjt = KeyedJaggedTensor(["x", "y", "z"], torch.tensor([1, 7, 2]), lengths=torch.tensor([1, 1, 1]))
    with pytest.raises(RuntimeError, match=r"kernel='torch': an id is outside its table's rows \(tables 'a' \[0, 40\)"):
        k(kjt)


def test_without_the_library_the_kernel_warns_once_and_trains(monkeypatch):
    monkeypatch.setattr(native, "library_path", lambda folder=None: None)
    native.row_loops.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            k = kernel("rowwise_adagrad")
            train(k, batches(False, 2))
        messages = [str(w.message) for w in caught if "compiled loops" in str(w.message)]
        assert len(messages) == 1 and "installed without its compiled loops (no _rows.*" in messages[0]
    finally:
        native.row_loops.cache_clear()


def test_torch_compile_traces_the_tensor_ops():
    """Under torch.compile the kernel is traced as tensor ops (no raw pointers into fake tensors)."""
    k = kernel("sgd")
    kjt = batches(False, 1)[0]
    with torch.no_grad():
        want = k(kjt)
        got = torch.compile(k.forward, backend="aot_eager", fullgraph=True)(kjt)
    torch.testing.assert_close(got, want)


def test_the_compiled_lookup_checks_its_offsets_before_reading():
    k = kernel("sgd")
    g, ids = k._groups[0], torch.tensor([1, 2, 3])
    for offsets in ([0, 2, 1, 3], [0, 1, 2, 4]):  # a bag ending before it starts; one past the 3 ids
        with pytest.raises(ValueError, match=r"kernel='torch': the offsets of 3 features x 1 bags must rise from 0"):
            k.native_forward(g, [0, 1, 2], ids, torch.tensor(offsets), None, rows_out=False)
