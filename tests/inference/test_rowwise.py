"""Row-wise quantization: fbgemm's bytes from torch, the documented per-element bound."""

import pytest
import torch

from lightning_shardrec.inference import QuantDType, dequantize_rows, quantize, quantize_rows, row_error_bound
from lightning_shardrec.inference.rowwise import pack, unpack

needs_fbgemm = pytest.mark.needs_fbgemm("inference")


def _table() -> torch.Tensor:
    w = torch.randn(600, 16) * torch.logspace(-4, 1, 600).unsqueeze(1)  # magnitudes 1e-4..10 (fp16 subnormal scales)
    w[0] = 0.25  # constant row: range 0
    w[1, :8] = 0.0
    return w


@needs_fbgemm
@pytest.mark.parametrize("dtype", [QuantDType.INT8, QuantDType.INT4])
def test_torch_quantizer_matches_fbgemm_bit_for_bit(dtype):
    w = _table()
    a = quantize_rows(w, dtype, use_fbgemm=False)
    b = quantize_rows(w, dtype, use_fbgemm=True)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale) and torch.equal(a.bias, b.bias)


@pytest.mark.parametrize("dtype", list(QuantDType))
def test_per_element_error_within_documented_bound(dtype):
    w = _table()
    rows = quantize_rows(w, dtype, use_fbgemm=False)
    err = (dequantize_rows(dtype, rows.data, rows.scale, rows.bias) - w).abs().amax(dim=1)
    bound = row_error_bound(rows, w)
    assert bool((err <= bound).all()), float((err / bound).max())
    if dtype is not QuantDType.FP16:  # the bound is about half a step: not loose
        assert float((err / (rows.scale.float().squeeze(1) / 2)).max()) > 0.9


def test_docstring_example_and_pack_roundtrip():
    rows = quantize_rows(torch.tensor([[-0.30, 0.00, 0.50, 0.20]]), QuantDType.INT4, use_fbgemm=False)
    assert rows.data.tolist() == [[0x60, 0x9F]]
    assert unpack(rows.data, 4).tolist() == [[0, 6, 15, 9]]
    q = torch.randint(0, 16, (5, 12), dtype=torch.uint8)
    assert torch.equal(unpack(pack(q, 4), 4), q)


def test_bad_dtype_lists_the_choices():
    with pytest.raises(ValueError, match=r"unknown quantized dtype 'int3'; available: int8, int4, fp16"):
        QuantDType.parse("int3")
    with pytest.raises(ValueError, match=r"unknown quantized dtype 'bf16'; available: int8, int4, fp16"):
        quantize(torch.nn.Linear(2, 2), dtype="bf16")
