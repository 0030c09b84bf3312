"""TorchRec's quantized-inference names (issue 43, item 3): ``QuantConfig``, ``quantize_embeddings``,
``quant_prep_enable_register_tbes``, ``quant.embedding_modules.EmbeddingBagCollection.from_float``.

TorchRec facts used: ``dtype_to_data_type`` maps ``torch.quint8``/``torch.qint8``/``torch.int8`` to INT8,
``torch.quint4x2`` to INT4 and ``torch.float16`` to FP16; ``per_table_weight_dtype`` overrides the
weight dtype per table; ``from_float`` requires the float module's ``qconfig``; ``quantize_embeddings``
builds ``QuantConfig(activation=PlaceholderObserver(output_dtype), weight=PlaceholderObserver(dtype))``.
"""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import PlaceholderObserver, quantize_dynamic

from lightning_shardrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from lightning_shardrec.errors import UnsupportedFeatureError
from lightning_shardrec.inference import QuantDType
from lightning_shardrec.inference.modules import quantize_embeddings
from lightning_shardrec.modules.embedding_configs import QuantConfig
from lightning_shardrec.quant.embedding_modules import (
    MODULE_ATTR_REGISTER_TBES_BOOL,
    quant_prep_enable_register_tbes,
)
from lightning_shardrec.quant.embedding_modules import (
    EmbeddingBagCollection as QuantEBC,
)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(name="a", embedding_dim=8, num_embeddings=20, feature_names=["fa"]),
                EmbeddingBagConfig(name="b", embedding_dim=8, num_embeddings=20, feature_names=["fb"]),
            ]
        )
        self.top = torch.nn.Linear(16, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.top(self.ebc(kjt).values())


def _qconfig(weight: torch.dtype, out: torch.dtype = torch.float, per_table=None) -> QuantConfig:
    return QuantConfig(
        activation=PlaceholderObserver.with_args(dtype=out),
        weight=PlaceholderObserver.with_args(dtype=weight),
        per_table_weight_dtype=per_table,
    )


@pytest.mark.parametrize(
    ("dtype", "want"),
    [
        (torch.qint8, QuantDType.INT8),
        (torch.quint8, QuantDType.INT8),
        (torch.int8, QuantDType.INT8),
        (torch.quint4x2, QuantDType.INT4),
        (torch.float16, QuantDType.FP16),
    ],
)
def test_quantize_embeddings_maps_torchrecs_dtypes_to_the_tables(dtype, want):
    model = Model()
    q = quantize_embeddings(model, dtype=dtype, inplace=False)
    assert type(q.ebc) is QuantEBC and q.ebc._dtype is want and type(model.ebc) is EmbeddingBagCollection
    assert q.top is not model.top and isinstance(q.top, torch.nn.Linear)  # only the collections are swapped
    kjt = KeyedJaggedTensor(keys=["fa", "fb"], values=torch.tensor([1, 2, 3]), lengths=torch.tensor([2, 0, 1, 0]))
    torch.testing.assert_close(q(kjt), model(kjt), atol=0.05, rtol=0.05)


def test_quantize_dynamic_with_a_per_table_override_of_the_same_type():
    q = quantize_dynamic(
        Model(),
        qconfig_spec={EmbeddingBagCollection: _qconfig(torch.quint8, per_table={"b": torch.qint8})},
        mapping={EmbeddingBagCollection: QuantEBC},
        inplace=True,
    )
    assert type(q.ebc) is QuantEBC and q.ebc._dtype is QuantDType.INT8


@pytest.mark.parametrize(
    ("qconfig", "match"),
    [
        (_qconfig(torch.float32), r"table 'a' asks for weight dtype torch.float32; supported: torch.qint8"),
        (_qconfig(torch.qint8, out=torch.float16), r"output dtype torch.float16 is not supported"),
        (
            _qconfig(torch.qint8, per_table={"b": torch.quint4x2}),
            r"would be stored as \['int4', 'int8'\] \(a: int8, b: int4\); one storage type per collection",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(qconfig, match):
    with pytest.raises(UnsupportedFeatureError, match=match):
        quantize_dynamic(
            Model(), qconfig_spec={EmbeddingBagCollection: qconfig}, mapping={EmbeddingBagCollection: QuantEBC}
        )


def test_from_float_needs_the_qconfig_and_register_tbes_only_marks():
    model = Model()
    with pytest.raises(ValueError, match="the float EmbeddingBagCollection has no qconfig"):
        QuantEBC.from_float(model.ebc)
    quant_prep_enable_register_tbes(model, [EmbeddingBagCollection])
    assert getattr(model.ebc, MODULE_ATTR_REGISTER_TBES_BOOL) is True
    assert not hasattr(model.top, MODULE_ATTR_REGISTER_TBES_BOOL)
    import lightning_shardrec.inference as trec_infer

    assert trec_infer.modules.quantize_embeddings is quantize_embeddings  # TorchRec's attribute path


class Both(torch.nn.Module):
    """A pooled and a sequence collection, as TorchRec's inference models hold them."""

    def __init__(self) -> None:
        super().__init__()
        from lightning_shardrec import EmbeddingCollection, EmbeddingConfig

        torch.manual_seed(0)
        self.ebc = Model().ebc
        self.ec = EmbeddingCollection(
            tables=[EmbeddingConfig(name="s", embedding_dim=8, num_embeddings=20, feature_names=["fs"])]
        )

    def forward(self, kjt: KeyedJaggedTensor) -> list[torch.Tensor]:
        return [self.ebc(kjt).values(), self.ec(kjt)["fs"].values()]


def test_quantize_inference_model_swaps_both_collections_as_torchrec():
    from lightning_shardrec.inference import QuantEmbeddingCollection
    from lightning_shardrec.inference.modules import DEFAULT_QUANT_MAPPING, quantize_inference_model
    from lightning_shardrec.quant.embedding_modules import EmbeddingCollection as QuantEC

    kjt = KeyedJaggedTensor(["fa", "fb", "fs"], torch.tensor([1, 2, 3, 4, 5]), lengths=torch.tensor([2, 0, 1, 0, 2, 0]))
    model = Both()
    want = model(kjt)
    q = quantize_inference_model(model, per_table_weight_dtype={"s": torch.float16})
    assert q is model and type(q.ebc) is QuantEBC and type(q.ec) is QuantEC
    assert isinstance(q.ec, QuantEmbeddingCollection) and q.ec.dtype is QuantDType.FP16
    assert q.ebc._dtype is QuantDType.INT8
    for got, w in zip(q(kjt), want, strict=True):
        torch.testing.assert_close(got, w, atol=0.02, rtol=0.02)
    assert set(DEFAULT_QUANT_MAPPING.values()) == {QuantEBC, QuantEC}
    # a mapping names types by torch.typename, TorchRec's module path included
    only_ec = Both()
    quantize_inference_model(only_ec, {"lightning_shardrec.modules.embedding_modules.EmbeddingCollection": QuantEC})
    assert type(only_ec.ec) is QuantEC and type(only_ec.ebc) is QuantEBC  # quantize_embeddings always maps the EBC
    with pytest.raises(ValueError, match=r"quantization_mapping names 'my.Missing', which is no class"):
        quantize_inference_model(Both(), {"my.Missing": QuantEC})


def test_quantize_dynamic_onto_the_sequence_collection():
    from lightning_shardrec import EmbeddingCollection
    from lightning_shardrec.quant.embedding_modules import EmbeddingCollection as QuantEC

    model = Both()
    q = quantize_dynamic(model, qconfig_spec={EmbeddingCollection: _qconfig(torch.quint4x2)},
                         mapping={EmbeddingCollection: QuantEC}, inplace=False)  # fmt: skip
    assert type(q.ec) is QuantEC and q.ec.dtype is QuantDType.INT4 and type(q.ebc) is EmbeddingBagCollection
    with pytest.raises(ValueError, match="the float EmbeddingCollection has no qconfig"):
        QuantEC.from_float(model.ec)
