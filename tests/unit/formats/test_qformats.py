"""NVFP4 / FP8 / INT4 formats in pure torch: codes, packing, scales, error bounds, QuantLinear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dflash_trt.formats import qformats as qf


def test_e2m1_rounds_to_nearest_ties_to_even_and_saturates():
    x = torch.tensor([0.2, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.1, -1.3, -100.0])
    got = qf.e2m1_decode(qf.e2m1_encode(x))
    want = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -1.5, -6.0])
    assert torch.equal(got, want)


def test_fast_e2m1_round_equals_encode_then_decode():
    x = torch.linspace(-8, 8, 64001)  # includes every tie point
    assert torch.equal(qf.e2m1_round(x), qf.e2m1_decode(qf.e2m1_encode(x)))


def test_pack_puts_even_element_in_low_nibble_and_round_trips():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = qf.pack_e2m1(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(qf.unpack_e2m1(packed), codes)


def test_nvfp4_weight_layout_and_error_bound():
    torch.manual_seed(0)
    w = torch.randn(48, 64) * 0.02
    q = qf.nvfp4_quantize(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (48, 32)
    assert q.weight_scale.dtype == torch.float8_e4m3fn and q.weight_scale.shape == (48, 4)
    assert q.weight_scale_2.shape == () and torch.isclose(q.weight_scale_2, w.abs().max() / 2688)
    deq = qf.nvfp4_dequantize(q.packed, q.weight_scale, q.weight_scale_2)
    rel = (deq - w).norm() / w.norm()
    assert 0.01 < rel < 0.12  # 4-bit: clearly lossy, but bounded
    # Every block's largest value is represented within one E2M1 step of its scale.
    blocks, dblocks = w.view(48, 4, 16), deq.view(48, 4, 16)
    assert torch.all((blocks.abs().amax(-1) - dblocks.abs().amax(-1)).abs() <= blocks.abs().amax(-1) * 0.2)


def test_nvfp4_matches_modelopt_bit_for_bit():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    torch.manual_seed(1)
    w = torch.randn(32, 128) * 0.05
    amax = w.abs().max()
    ref, ref_scale, _ = qtensor.NVFP4QTensor.quantize(w.clone(), 16, weights_scaling_factor_2=amax / 2688)
    mine = qf.nvfp4_quantize(w, amax)
    assert torch.equal(ref._quantized_data, mine.packed)
    assert torch.equal(ref_scale.float(), mine.weight_scale.float())


def test_nvfp4_fake_quantize_is_idempotent_and_pads_odd_widths():
    torch.manual_seed(2)
    x = torch.randn(3, 5, 40)  # 40 is not a multiple of 16
    gs = qf.nvfp4_global_scale(x.abs().max())
    once = qf.nvfp4_fake_quantize(x, gs)
    assert once.shape == x.shape
    assert torch.equal(qf.nvfp4_fake_quantize(once, gs), once)
    assert 0.01 < (once - x).norm() / x.norm() < 0.15


def test_fp8_round_trip_error_bound():
    torch.manual_seed(3)
    w = torch.randn(16, 32)
    q, scale = qf.fp8_quantize(w)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == ()
    rel = (qf.fp8_dequantize(q, scale) - w).norm() / w.norm()
    assert 0.0 < rel < 0.04
    x = torch.randn(4, 32) * 3
    fq = qf.fp8_fake_quantize(x, qf.fp8_scale(x.abs().max()))
    assert torch.equal(qf.fp8_fake_quantize(fq, qf.fp8_scale(x.abs().max())), fq)


def test_int4_awq_dequantize_unpacks_row_pairs_signed():
    # rows 0/1 packed in one byte: low nibble row 0 (=-1 -> 0xF), high nibble row 1 (=3)
    packed = torch.tensor([[0x3F, 0x70]], dtype=torch.uint8)  # in=2 columns
    scale = torch.tensor([[0.5], [2.0]])  # [out=2, in/group=1]
    w = qf.int4_awq_dequantize(packed, scale)
    assert w.tolist() == [[-0.5, 0.0], [6.0, 14.0]]


def test_quant_linear_quantizes_its_input():
    torch.manual_seed(4)
    w, x = torch.randn(8, 32), torch.randn(2, 32)
    scale = qf.nvfp4_global_scale(x.abs().max())
    layer = qf.QuantLinear(w, act_format="nvfp4", input_scale=scale)
    assert torch.allclose(layer(x), F.linear(qf.nvfp4_fake_quantize(x, scale), w))
    assert not torch.allclose(layer(x), F.linear(x, w), atol=1e-4)
    with pytest.raises(ValueError):
        qf.QuantLinear(w, act_format="fp8")
