"""``torch.fx.symbolic_trace`` of the collections with a KJT input, as TorchRec 1.8 supports it (issue 43).

TorchRec 1.8 (``/work/venvs/torchrec``) traces ``EmbeddingBagCollection``, ``EmbeddingCollection`` and a module
holding one with plain ``torch.fx.symbolic_trace`` and with ``torchrec.fx.symbolic_trace`` / ``Tracer``, and the
graph module's output equals eager. Its ``torch.jit.script`` of the collections is not offered here: a named error.
"""

from __future__ import annotations

import pytest
import torch

from lightning_shardrec import fx as shardrec_fx
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.modules import EmbeddingBagCollection, EmbeddingCollection
from lightning_shardrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from lightning_shardrec.sparse import KeyedJaggedTensor

KJT = KeyedJaggedTensor(
    keys=["f2", "f1", "f3"],  # not the collections' order: the graph reads features by name
    values=torch.tensor([1, 2, 3, 4, 5, 6, 7, 0, 9]),
    lengths=torch.tensor([1, 2, 0, 3, 1, 2]),
    weights=torch.tensor([0.5, 1.0, 2.0, -1.0, 0.25, 3.0, 1.5, 1.0, 2.0]),
)


def _ebc(weighted: bool) -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(
                name="t2", embedding_dim=3, num_embeddings=10, feature_names=["f2", "f3"],
                pooling=PoolingType.MEAN if not weighted else PoolingType.SUM,
            ),
        ],
        is_weighted=weighted,
    )  # fmt: skip


def _ec(need_indices: bool) -> EmbeddingCollection:
    torch.manual_seed(0)
    return EmbeddingCollection(
        tables=[
            EmbeddingConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingConfig(name="t2", embedding_dim=4, num_embeddings=10, feature_names=["f2", "f3"]),
        ],
        need_indices=need_indices,
    )


class Holder(torch.nn.Module):
    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        out = self.inner(kjt)
        if isinstance(out, dict):
            return torch.cat([out[k].values() for k in sorted(out)], dim=0)
        return out.values() * 2.0


TRACES = [
    torch.fx.symbolic_trace,
    shardrec_fx.symbolic_trace,
    lambda m: torch.fx.GraphModule(m, shardrec_fx.Tracer().trace(m)),
]


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("weighted", [False, True])
def test_a_traced_embedding_bag_collection_equals_eager(trace, weighted: bool) -> None:
    ebc = _ebc(weighted)
    gm = trace(ebc)
    assert isinstance(gm, torch.fx.GraphModule)
    weights = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
    assert weights == {"embedding_bags.t1.weight", "embedding_bags.t2.weight"}
    got, want = gm(KJT), ebc(KJT)
    assert got.keys() == want.keys() == ["f1", "f3@t1", "f2", "f3@t2"]
    assert got.length_per_key() == want.length_per_key()
    torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=1e-6)
    held = trace(Holder(ebc))
    torch.testing.assert_close(held(KJT), Holder(ebc)(KJT), rtol=0, atol=1e-6)


@pytest.mark.parametrize("trace", TRACES)
@pytest.mark.parametrize("need_indices", [False, True])
def test_a_traced_embedding_collection_equals_eager(trace, need_indices: bool) -> None:
    ec = _ec(need_indices)
    got, want = trace(ec)(KJT), ec(KJT)
    assert sorted(got) == sorted(want) == ["f1", "f2", "f3@t1", "f3@t2"]
    for k in want:
        assert torch.equal(got[k].values(), want[k].values())
        assert torch.equal(got[k].lengths(), want[k].lengths())
        assert (got[k].weights_or_none() is None) == (not need_indices)
        if need_indices:
            assert torch.equal(got[k].weights(), want[k].weights())
    torch.testing.assert_close(trace(Holder(ec))(KJT), Holder(ec)(KJT), rtol=0, atol=0)


def test_torchrecs_leaf_modules_stay_one_node() -> None:
    gm = shardrec_fx.symbolic_trace(Holder(_ebc(False)), leaf_modules=["EmbeddingBagCollection"])
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["inner"]
    torch.testing.assert_close(gm(KJT), Holder(_ebc(False))(KJT), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("make", "name"), [(lambda: _ebc(False), "EmbeddingBagCollection"), (lambda: _ec(False), "EmbeddingCollection")]
)
def test_torchscript_of_a_collection_is_refused_by_name(make, name: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=f"torch.jit.script of {name} is not supported: the sparse types"):
        torch.jit.script(make())


def test_sparse_types_built_from_traced_tensors_are_graph_nodes() -> None:
    # TorchRec's types are fx-proxyable: built from Proxies inside a trace, each is one call_function node
    from lightning_shardrec.sparse import JaggedTensor, KeyedTensor

    class Build(torch.nn.Module):
        def forward(self, values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
            jt = JaggedTensor(values=values * 2, lengths=lengths)
            kt = KeyedTensor(["a", "b"], [1, 1], torch.stack([jt.values()[:2], jt.values()[2:4]], dim=1))
            return jt.to_padded_dense(3).sum() + kt["b"].sum()

    gm = torch.fx.symbolic_trace(Build())
    assert {n.target for n in gm.graph.nodes if n.op == "call_function"} >= {JaggedTensor, KeyedTensor}
    values, lengths = torch.arange(5.0), torch.tensor([2, 0, 3])
    assert torch.equal(gm(values, lengths), Build()(values, lengths))


def _fx_concat_list(ks: list[KeyedJaggedTensor]) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.concat(ks)


def _fx_concat_pair(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.concat([a, b])


def _fx_empty_like(a: KeyedJaggedTensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.empty_like(a)


def _fx_from_jt_dict(d: dict) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_jt_dict(d)


def _fx_kjt_is_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    from lightning_shardrec.sparse.jagged_tensor import kjt_is_equal  # a user's import, not the defining module

    return kjt_is_equal(a, b)


def _fx_jt_is_equal(a: KeyedJaggedTensor, b: KeyedJaggedTensor) -> bool:
    from lightning_shardrec.sparse.jagged_tensor import jt_is_equal

    return jt_is_equal(a["f1"], b["f1"])


def _fx_from_dense(a: torch.Tensor, b: torch.Tensor) -> KeyedJaggedTensor:
    from lightning_shardrec.sparse import JaggedTensor

    return KeyedJaggedTensor.from_jt_dict({"f": JaggedTensor.from_dense([a, b])})


_OTHER = KeyedJaggedTensor(keys=["g"], values=torch.tensor([4, 5]), lengths=torch.tensor([0, 2]), weights=torch.ones(2))


@pytest.mark.parametrize(
    ("fn", "args", "op"),
    [
        (_fx_concat_list, lambda: ([KJT, _OTHER],), "concat"),
        (_fx_concat_pair, lambda: (KJT, _OTHER), "concat"),
        (_fx_empty_like, lambda: (KJT,), "empty_like"),
        (_fx_from_jt_dict, lambda: (KJT.to_dict(),), "from_jt_dict"),
        (_fx_kjt_is_equal, lambda: (KJT, _OTHER), "kjt_is_equal"),
        (_fx_jt_is_equal, lambda: (KJT, KJT), "jt_is_equal"),
        (_fx_from_dense, lambda: (torch.tensor([1, 2]), torch.tensor([3])), "from_dense"),
    ],
)
def test_static_constructors_and_comparisons_of_traced_kjts_are_one_node(fn, args, op: str) -> None:
    # TorchRec fx-wraps concat, empty_like and the comparisons: their bodies read keys and strides, which a trace
    # only has as proxies (before: AttributeError / TraceError, or a comparison frozen into the graph as a constant)
    from lightning_shardrec.sparse.jagged_tensor import kjt_is_equal

    class One(torch.nn.Module):
        def forward(self, a):  # type: ignore[no-untyped-def]
            return fn(a)

    class Two(torch.nn.Module):
        def forward(self, a, b):  # type: ignore[no-untyped-def]
            return fn(a, b)

    M = One if len(args()) == 1 else Two
    gm = torch.fx.symbolic_trace(M())
    called = [n.target.__name__ for n in gm.graph.nodes if n.op == "call_function"]
    assert [c for c in called if c != "getitem"] == ([op, "from_jt_dict"] if op == "from_dense" else [op])
    out, ref = gm(*args()), M()(*args())
    if isinstance(ref, bool):
        assert out is ref
    else:
        assert kjt_is_equal(out, ref) and out.keys() == ref.keys()
    if op == "kjt_is_equal":  # compares what it is given at run time, not what it saw while tracing
        assert gm(KJT, KJT) is True and gm(KJT, _OTHER) is False


def test_a_lazy_awaitable_built_in_a_trace_is_one_node_and_waits_at_use() -> None:
    # TorchRec's tracer test: a module returning a LazyAwaitable; torch ops on it wait for it
    from lightning_shardrec.distributed.types import LazyAwaitable

    class PlusThree(LazyAwaitable[torch.Tensor]):
        def __init__(self, obj: torch.Tensor) -> None:
            super().__init__()
            self._obj = obj

        def _wait_impl(self) -> torch.Tensor:
            return self._obj + 3

    class Sparse(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> LazyAwaitable[torch.Tensor]:
            return PlusThree(x + 2)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sparse = Sparse()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.add(self.sparse(x), x * 10)

    gm = shardrec_fx.symbolic_trace(Model())
    assert PlusThree in {n.target for n in gm.graph.nodes if n.op == "call_function"}
    x = torch.randn(3, 4)
    assert torch.equal(gm(x), Model()(x))
    torch.testing.assert_close(gm(x), (x + 2 + 3) + x * 10, rtol=0, atol=0)


def test_building_sparse_types_outside_a_trace_logs_nothing() -> None:
    # torch's ProxyableClassMeta asks is_fx_tracing() on each construction, which logs a warning once per
    # process; the types here look for a Proxy among the arguments instead
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "import torch\nfrom lightning_shardrec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor\n"
        "kjt = KeyedJaggedTensor(keys=['a'], values=torch.tensor([1]), lengths=torch.tensor([1]))\n"
        "JaggedTensor(torch.ones(2), lengths=torch.tensor([2])); KeyedTensor(['a'], [1], torch.ones(1, 1))\n"
        "print('built', type(kjt).__name__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "built KeyedJaggedTensor"
    assert "is_fx_tracing" not in run.stderr


def test_a_quantized_collection_traces_as_one_node_and_refuses_the_rest_by_name() -> None:
    # the intro tutorial's compilation cells: torchrec.fx.Tracer over the quantized collection, then jit.script
    from torch import quantization as quant

    from lightning_shardrec.modules.embedding_configs import QuantConfig
    from lightning_shardrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t1", embedding_dim=4, num_embeddings=10, feature_names=["f1", "f3"]),
            EmbeddingBagConfig(name="t2", embedding_dim=2, num_embeddings=10, feature_names=["f2"]),
        ]
    )
    ebc.qconfig = QuantConfig(  # type: ignore[assignment]
        activation=quant.PlaceholderObserver.with_args(dtype=torch.float),
        weight=quant.PlaceholderObserver.with_args(dtype=torch.qint8),
    )
    qebc = QuantEBC.from_float(ebc)
    held = Holder(qebc)
    gm = shardrec_fx.symbolic_trace(held)
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["inner"]
    assert torch.equal(gm(KJT), held(KJT))
    with pytest.raises(UnsupportedFeatureError, match="torch.fx tracing of a QuantEmbeddingBagCollection as the root"):
        shardrec_fx.Tracer(leaf_modules=["IntNBitTableBatchedEmbeddingBagsCodegen"]).trace(qebc)
    refused = "torch.jit.script of QuantEmbeddingBagCollection is not supported"
    with pytest.raises(UnsupportedFeatureError, match=refused):
        torch.jit.script(gm)
