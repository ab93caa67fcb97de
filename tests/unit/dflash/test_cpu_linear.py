"""dflash.cpu_linear: oneDNN packed linears compute what the layers they replace compute."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_trt.dflash import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no oneDNN in this torch")


@pytest.mark.parametrize("rows", [1, 3, 8, 17])
def test_packed_linear_equals_the_layer_at_any_row_count(rows):
    torch.manual_seed(0)
    layer = nn.Linear(64, 96, bias=True)
    x = torch.randn(2, rows, 64)
    packed = cpu_linear.PackedLinear(layer)
    assert torch.allclose(packed(x), layer(x), atol=1e-5, rtol=1e-5)
    assert packed.weight is layer.weight and packed.bias is layer.bias


def test_a_quantized_layer_keeps_its_input_transform():
    from dflash_trt.formats.qformats import QuantLinear

    torch.manual_seed(1)
    weight = torch.randn(32, 64)
    layer = QuantLinear(weight, pre_quant_scale=torch.rand(64) + 0.5)
    x = torch.randn(5, 64)
    assert torch.allclose(cpu_linear.PackedLinear(layer)(x), layer(x), atol=1e-5, rtol=1e-5)
    assert not cpu_linear.is_plain(cpu_linear.PackedLinear(layer))


def test_pack_linears_swaps_float32_cpu_linears_only():
    model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(),
                          nn.Sequential(nn.Linear(8, 4)), nn.Linear(4, 4).double())
    x = torch.randn(3, 8)
    before = model[:3](x)
    assert cpu_linear.pack_linears(model) == 2
    assert isinstance(model[0], cpu_linear.PackedLinear) and type(model[3]) is nn.Linear
    assert cpu_linear.is_plain(model[0]) and not cpu_linear.is_plain(model[2][0])
    assert torch.allclose(model[:3](x), before, atol=1e-6)


def test_the_torch_engine_packs_float32_targets_and_stays_lossless(tmp_path):
    from dflash_fixtures import write_tiny_checkpoint

    from dflash_trt.engines.base import SamplingParams, collect
    from dflash_trt.engines.torch_engine import TorchEngine

    target = write_tiny_checkpoint(tmp_path / "target")
    engine = TorchEngine.load(target, None, max_seq_len=128)
    packed = [m for m in engine.model.modules() if isinstance(m, cpu_linear.PackedLinear)]
    assert len(packed) == 4 * 7 + 1  # every projection of the 4 layers, and the LM head
    reference = TorchEngine.load(target, None, dtype="float64", max_seq_len=128)
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in reference.model.modules())
    ids = engine.tokenize("hello there", chat=True)
    params = SamplingParams(max_new_tokens=30)
    assert collect(engine.stream(ids, params)).token_ids \
        == collect(reference.stream(ids, params)).token_ids
