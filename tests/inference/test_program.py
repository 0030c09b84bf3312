"""torch.export programs of quantized models: the aten-only serving modules equal the eager ones,
and an exported program serves in a fresh process that cannot import lightning_shardrec."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from _fresh_serve import serve_fresh
from torch import nn

from lightning_shardrec import DynamicConfig, EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor, PoolingType
from lightning_shardrec.errors import CheckpointError
from lightning_shardrec.inference import QuantDType, QuantEmbeddingBagCollection, load, quantize, quantize_dense
from lightning_shardrec.inference.dense_int8 import ExportableInt8Linear, exportable_dense
from lightning_shardrec.inference.export import export
from lightning_shardrec.inference.id_map import QuantIdMap, lookup_sorted, sorted_live
from lightning_shardrec.inference.program import export_program, plain_inputs, read_metadata
from lightning_shardrec.inference.quant_plain import QuantEmbedding, QuantEmbeddingBag
from lightning_shardrec.inference.serving_ebc import ServingEmbeddingBags
from lightning_shardrec.models import DLRM


def _tables(dynamic: bool = False) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(num_embeddings=60, embedding_dim=8, name="t_a", feature_names=["a", "shared"]),
        EmbeddingBagConfig(num_embeddings=40, embedding_dim=16, name="t_b", feature_names=["shared"],
                           pooling=PoolingType.MEAN),
        EmbeddingBagConfig(num_embeddings=16 if dynamic else 30, embedding_dim=4, name="t_c", feature_names=["c"],
                           dynamic=DynamicConfig(eviction="lru") if dynamic else None),
    ]  # fmt: skip


def _kjt(keys: list[str], batch: int, seed: int, weighted: bool = False, high: int = 30) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(keys) * batch,), generator=g)
    values = torch.randint(0, high, (int(lengths.sum()),), generator=g)
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor(keys, values, weights, lengths=lengths)


@pytest.mark.parametrize("dtype", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("weighted", [False, True])
def test_serving_bags_equal_the_quantized_collection(dtype, weighted):
    torch.manual_seed(0)
    ebc = EmbeddingBagCollection(_tables(), is_weighted=weighted)
    q = QuantEmbeddingBagCollection.from_float(ebc, dtype, backend="torch")
    serving = ServingEmbeddingBags(q)
    for seed, keys in enumerate([["a", "shared", "c"], ["c", "extra", "shared", "a"]]):  # any key order, extras
        kjt = _kjt(keys, batch=5, seed=seed, weighted=weighted)
        want, got = q(kjt), serving(kjt)
        assert got.keys() == want.keys() and got.length_per_key() == want.length_per_key()
        torch.testing.assert_close(got.values(), want.values(), rtol=0, atol=0)


def test_serving_bags_reject_missing_features_and_vbe():
    q = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(_tables()), "int8", backend="torch")
    serving = ServingEmbeddingBags(q)
    with pytest.raises(KeyError, match=r"lacks features \['c'\]; it has keys \['a', 'shared'\]"):
        serving(_kjt(["a", "shared"], 2, 0))
    vbe = KeyedJaggedTensor(["a", "shared", "c"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 1]),
                            stride_per_key_per_rank=[[1], [1], [1]])  # fmt: skip
    with pytest.raises(ValueError, match="variable-batch"):
        serving(vbe)


@pytest.mark.parametrize("live", [0, 5, 16])
def test_sorted_id_map_equals_the_bucket_lookup(live):
    id_map = QuantIdMap("t", DynamicConfig(eviction="lru"), 16)
    g = torch.Generator().manual_seed(live)
    slots = torch.randperm(16, generator=g)[:live]
    ids = torch.randint(-(2**62), 2**62, (live,), generator=g)
    id_map.set_live(ids, slots)
    queries = torch.cat([ids, torch.randint(-(2**62), 2**62, (50,), generator=g), torch.tensor([0, -1])])
    keys, rows = sorted_live(id_map)
    assert torch.equal(lookup_sorted(keys, rows, queries, 16), id_map(queries))


def _torch_reference(quant: nn.Module) -> torch.Tensor:
    from lightning_shardrec.inference.rowwise import dequantize_rows

    r = quant.rows()
    return dequantize_rows(r.dtype, r.data, r.scale, r.bias)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_quantized_embedding_bag_matches_torch_on_its_rows(mode, padding_idx):
    torch.manual_seed(0)
    bag = nn.EmbeddingBag(20, 8, mode=mode, padding_idx=padding_idx)
    q = QuantEmbeddingBag(bag, QuantDType.INT8, "bag")
    q.set_weight(bag.weight.detach())
    bag.weight.data = _torch_reference(q)  # torch's own bag on the dequantized rows
    ids = torch.tensor([3, 1, 3, 7, 0, 19, 3])
    offsets = torch.tensor([0, 2, 2, 5])
    weights = torch.rand(7) if mode == "sum" else None
    with torch.no_grad():
        torch.testing.assert_close(q(ids, offsets, weights), bag(ids, offsets, weights), rtol=0, atol=0)
        two_d = ids[:6].view(3, 2)
        torch.testing.assert_close(q(two_d), bag(two_d), rtol=0, atol=0)


class Tower(nn.Module):  # plain torch embedding modules, as people write them
    def __init__(self):
        super().__init__()
        self.user = nn.EmbeddingBag(100, 8, mode="mean")
        self.item = nn.Embedding(50, 8, padding_idx=0)
        self.top = nn.Linear(8, 1)

    def forward(self, ids, offsets, items):
        return self.top(self.user(ids, offsets) * self.item(items).mean(1)).squeeze(1)


def _tower_inputs(batch: int, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (batch,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)[:-1]])
    return torch.randint(0, 100, (int(lengths.sum()),), generator=g), offsets, torch.randint(0, 50, (batch, 3))


def test_exported_programs_serve_fresh_and_equal_eager(tmp_path):
    """A plain-module two-tower (int8), a DLRM (int4 tables) and a DLRM with int8 dense layers, exported
    and served in one fresh process that cannot import lightning_shardrec, at batch sizes 1 and up."""
    torch.manual_seed(0)
    model = Tower()
    tower = quantize(model, "int8", inplace=False)
    assert isinstance(tower.user, QuantEmbeddingBag) and isinstance(tower.item, QuantEmbedding)
    assert isinstance(model.user, nn.EmbeddingBag)  # inplace=False left it
    ep, _ = export_program(tower, _tower_inputs(6, 0))
    torch.export.save(ep, tmp_path / "tower.pt2")
    tower_batches = [_tower_inputs(b, s) for s, b in enumerate([1, 6, 33])]

    tables = [EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name=f"t{i}", feature_names=[f"f{i}"])
              for i in range(3)]  # fmt: skip
    dlrm = export(None, DLRM(EmbeddingBagCollection(tables), 4, [16, 8], [8, 1]), "int4", tmp_path / "dlrm.pt2",
                  format="pt2")  # fmt: skip
    info = read_metadata(tmp_path / "dlrm.pt2")
    assert info["inputs"][1] == {"kind": "kjt", "keys": ["f0", "f1", "f2"], "weighted": False}
    assert info["dtype"] == "int4" and info["factory"] == "lightning_shardrec.models.dlrm:DLRM"
    dlrm_batches = [(torch.randn(b, 4), _kjt(["f0", "f1", "f2"], b, seed=b)) for b in [1, 7, 64]]
    no_ids = KeyedJaggedTensor(
        ["f0", "f1", "f2"], torch.zeros(0, dtype=torch.long), lengths=torch.zeros(6, dtype=torch.long)
    )
    dlrm_batches.append((torch.randn(2, 4), no_ids))

    dense = export(None, DLRM(EmbeddingBagCollection(tables), 4, [16, 8], [8, 1]), "int8", tmp_path / "dense.pt2",
                   format="pt2", dense=True)  # fmt: skip
    assert "quantized" in type(dense.dense_arch[0]).__module__  # torch.ao's module in the eager model

    served = serve_fresh(
        [(tmp_path / "tower.pt2", "pt2", tower_batches),
         (tmp_path / "dlrm.pt2", "pt2", [plain_inputs(b) for b in dlrm_batches]),
         (tmp_path / "dense.pt2", "pt2", [plain_inputs(b) for b in dlrm_batches])],
        tmp_path,
    )  # fmt: skip
    with torch.no_grad():
        for args, got in zip(tower_batches, served[0], strict=True):
            torch.testing.assert_close(got, tower(*args), rtol=0, atol=0)
            torch.testing.assert_close(got, model(*args), rtol=0.05, atol=0.05)
        for eager, outs in ((dlrm, served[1]), (dense, served[2])):
            for args, got in zip(dlrm_batches, outs, strict=True):
                torch.testing.assert_close(got, eager(*args), rtol=1e-6, atol=1e-6)


def test_export_program_errors(tmp_path):
    model = DLRM(EmbeddingBagCollection(_tables()[:1]), 4, [8], [8, 1])
    with pytest.raises(ValueError, match=r"unknown export format 'onnx'|export format.*'onnx'"):
        export(None, model, "int8", tmp_path / "m.pt2", format="onnx")
    q = quantize(model, "int8", inplace=False)
    with pytest.raises(TypeError, match="input 1 is a list; a program takes Tensors"):
        export_program(q, (torch.randn(2, 4), [1, 2]))
    with pytest.raises(ValueError, match="no example inputs for .*--example pkg.module:fn"):
        export(None, nn.Sequential(nn.Embedding(4, 2)), "int8", tmp_path / "s.pt2", format="pt2")
    (tmp_path / "plain.zip").write_bytes(b"")
    import zipfile

    with zipfile.ZipFile(tmp_path / "plain.zip", "w") as z:
        z.writestr("x/data.bin", b"1")
    with pytest.raises(ValueError, match="has no shardrec.json"):
        read_metadata(tmp_path / "plain.zip")


@pytest.mark.parametrize("scale", [1e-4, 1e-2, 1.0, 30.0])
@pytest.mark.parametrize("shift", [-1.0, 0.0, 1.0])
def test_exportable_int8_linear_equals_torch_ao(scale, shift):
    torch.manual_seed(0)
    dense = quantize_dense(nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 5)))
    exported = exportable_dense(copy.deepcopy(dense))
    assert isinstance(exported[0], ExportableInt8Linear) and isinstance(exported[2], ExportableInt8Linear)
    for batch in (1, 9):
        x = torch.randn(batch, 64) * scale + shift * scale
        with torch.no_grad():
            torch.testing.assert_close(exported(x), dense(x), rtol=0, atol=0)
    constant = torch.zeros(3, 64)  # a zero range: ATen's scale 0.1
    torch.testing.assert_close(exported(constant), dense(constant), rtol=0, atol=0)


def test_a_kjt_input_exports_with_named_leaves():
    """The issue's failure: ``torch.export.export(module, (kjt,))`` needs the KJT's leaves named."""
    q = QuantEmbeddingBagCollection.from_float(EmbeddingBagCollection(_tables()), "int8", backend="torch")
    kjt = _kjt(["a", "shared", "c"], 3, 0)
    leaves, _ = torch.utils._pytree.tree_flatten_with_path(kjt)
    names = [".values", ".weights", ".lengths", ".offsets", ".stride_per_key_per_rank", ".inverse_indices"]
    assert [torch.utils._pytree.keystr(p) for p, _ in leaves] == names
    ep = torch.export.export(ServingEmbeddingBags(q), (kjt,))
    torch.testing.assert_close(ep.module()(kjt).values(), q(kjt).values(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["int8", "fp16"])
def test_dcn_with_weighted_shared_and_mean_features_exports(dtype):
    from lightning_shardrec.models import DCNv2

    torch.manual_seed(0)
    tables = [dataclasses.replace(t, embedding_dim=8) for t in _tables()]
    model = DCNv2(EmbeddingBagCollection(tables, is_weighted=True), 4, [16, 8], [8, 1], dcn_num_layers=2,
                  dcn_low_rank_dim=4)  # fmt: skip
    q = quantize(model, dtype, backend="torch")
    ep, specs = export_program(q, (torch.randn(3, 4), _kjt(["c", "a", "shared"], 3, 0, weighted=True)))
    assert specs[1].weighted and specs[1].keys == ("c", "a", "shared")
    for b in (1, 11):
        args = (torch.randn(b, 4), _kjt(["c", "a", "shared"], b, b, weighted=True))
        with torch.no_grad():
            torch.testing.assert_close(ep.module()(*plain_inputs(args)), q(*args), rtol=0, atol=0)


class RecWithPosition(nn.Module):  # top level: the state format records it by import path
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_tables()[:1])
        self.position = nn.Embedding(5, 8)

    def forward(self, kjt, pos):
        return self.ebc(kjt).values()[:, :8] + self.position(pos)


def test_state_artifacts_quantize_plain_modules_and_old_ones_load_as_written(tmp_path):
    torch.manual_seed(0)
    model = RecWithPosition()
    quantized = export(None, model, "int8", tmp_path / "new.pt")
    loaded = load(tmp_path / "new.pt")
    assert isinstance(quantized.position, QuantEmbedding) and isinstance(loaded.position, QuantEmbedding)
    args = (_kjt(["a", "shared"], 3, 0), torch.tensor([0, 4, 2]))
    with torch.no_grad():
        torch.testing.assert_close(loaded(*args), quantized(*args), rtol=0, atol=0)
    old = torch.load(tmp_path / "new.pt", weights_only=True)  # as written before: float plain modules
    del old["plain"]
    old["state_dict"] = {k: v for k, v in old["state_dict"].items() if not k.startswith("position.")}
    old["state_dict"]["position.weight"] = model.position.weight.detach()
    torch.save(old, tmp_path / "old.pt")
    assert type(load(tmp_path / "old.pt").position) is nn.Embedding


def test_an_id_outside_its_table_fails_the_request():
    torch.manual_seed(0)
    tables = [EmbeddingBagConfig(num_embeddings=30, embedding_dim=8, name="t0", feature_names=["f0"])]
    q = quantize(DLRM(EmbeddingBagCollection(tables), 4, [8], [8, 1]), "int8", backend="torch")
    ep, _ = export_program(q, (torch.randn(2, 4), _kjt(["f0"], 2, 0)))
    bad = KeyedJaggedTensor(["f0"], torch.tensor([3, 30]), lengths=torch.tensor([1, 1]))
    with pytest.raises(RuntimeError, match=r"table 't0': an id is outside \[0, 30\)"):
        ep.module()(*plain_inputs((torch.randn(2, 4), bad)))
    tower = quantize(Tower(), "int8")
    ep, _ = export_program(tower, _tower_inputs(4, 0))
    ids, offsets, items = _tower_inputs(4, 1)
    with pytest.raises(RuntimeError, match=r"QuantEmbedding 'item': an id is outside \[0, 50\)"):
        ep.module()(ids, offsets, items + 50)
    with pytest.raises(RuntimeError, match=r"QuantEmbeddingBag 'user': an id is outside \[0, 100\)"):
        tower(ids - 200, offsets, items)


def test_sequence_collections_quantize_export_and_serve_fresh(tmp_path):
    """quantize() swaps EmbeddingCollections too (they stayed float before); the state artifact loads them back
    and a pt2 program of the model serves in a fresh process at other batch sizes, equal to eager."""
    from _quant_models import SeqRec

    from lightning_shardrec.inference import QuantEmbeddingCollection

    torch.manual_seed(0)
    model = SeqRec()
    batches = [_kjt(["clicks", "views", "query"], b, seed=b, high=20) for b in (1, 5, 17)]
    quantized = export(None, model, "int4", tmp_path / "seq.pt")
    assert isinstance(quantized.ec, QuantEmbeddingCollection)
    loaded = load(tmp_path / "seq.pt")
    assert isinstance(loaded.ec, QuantEmbeddingCollection)
    program = export(None, SeqRec(), "int8", tmp_path / "seq.pt2", format="pt2", example_inputs=(batches[1],))
    info = read_metadata(tmp_path / "seq.pt2")
    assert list(info["sequence_collections"]) == ["ec"] and info["collections"] == {}
    served = serve_fresh([(tmp_path / "seq.pt2", "pt2", [plain_inputs((b,)) for b in batches])], tmp_path)[0]
    with torch.no_grad():
        for kjt, got in zip(batches, served, strict=True):
            torch.testing.assert_close(loaded(kjt), quantized(kjt), rtol=0, atol=0)
            torch.testing.assert_close(got, program(kjt), rtol=1e-6, atol=1e-6)
    artifact = torch.load(tmp_path / "seq.pt", weights_only=True)
    del artifact["sequence_collections"]  # as an artifact of another model would be
    torch.save(artifact, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="has an EmbeddingCollection at 'ec'; the artifact has \\[\\]"):
        load(tmp_path / "other.pt")
    artifact = torch.load(tmp_path / "seq.pt", weights_only=True)
    artifact["sequence_collections"]["ec"]["tables"][1]["feature_names"] = ["search"]
    torch.save(artifact, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match=r"reads \['clicks', 'views', 'query'\], the artifact's reads \["):
        load(tmp_path / "other.pt")
