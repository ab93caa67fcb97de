"""dflash.cpu_fp16: NVFP4 weights as float16 (bfloat16 for AMX) compute x @ W.T to float32
accuracy, each row the same whatever rows share the call, and the torch engine running them stays
lossless. Each kernel this CPU runs is tested, not only the one `load()` picks."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from dflash_fixtures import write_tiny_checkpoint, write_tiny_drafter

from dflash_trt.dflash import cpu_fp16, cpu_linear
from dflash_trt.formats import qformats as qf

pytestmark = pytest.mark.skipif(cpu_fp16.load() is None or not cpu_linear.available(),
                                reason="no AVX2/F16C CPU or no C++ compiler, or no oneDNN")


def nvfp4(out: int, inp: int, seed: int) -> qf.NVFP4Weight:
    torch.manual_seed(seed)
    return qf.nvfp4_quantize(torch.randn(out, inp) * 0.05)


KERNELS = ["avx2", "avx512", "amx"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Each kernel this CPU runs, made the one cpu_fp16 uses."""
    found = cpu_fp16.kernels()
    if request.param not in found:
        pytest.skip(f"this CPU cannot run the {request.param} kernel")
    monkeypatch.setattr(cpu_fp16, "_kernel", found[request.param])
    return request.param


def unblocked(w: torch.Tensor, inp: int) -> torch.Tensor:
    """A kernel's layout back to [out, in] (without AMX's padding)."""
    return cpu_fp16.unblocked(w)[:, :inp]


@pytest.mark.parametrize("isa", KERNELS)
def test_a_weight_that_16_bits_cannot_hold_is_refused(isa):
    with pytest.raises(ValueError, match="not exact in torch.b?float16"):
        cpu_fp16.blocked(torch.full((16, 16), 1 / 3), isa)


@pytest.mark.parametrize("isa", KERNELS)
def test_16_bits_hold_the_nvfp4_weight_exactly(isa):
    w = nvfp4(32, 64, seed=0)
    w16 = unblocked(cpu_fp16.blocked(w.unscaled(), isa), 64).double()
    values = qf.e2m1_decode(qf.unpack_e2m1(w.packed), torch.float64).reshape(32, -1, 16)
    exact = values * w.weight_scale.double().unsqueeze(-1)  # E2M1 x E4M3, no rounding in float64
    assert torch.equal(w16, exact.reshape(32, 64))
    dense = qf.nvfp4_dequantize(w.packed, w.weight_scale, w.weight_scale_2).double()
    assert torch.allclose(w16 * float(w.weight_scale_2), dense, rtol=2**-23, atol=0)


@pytest.mark.parametrize("out,inp", [(16, 16), (48, 80), (192, 576)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 16, 17, 32, 64, 128, 512])
def test_kernel_matches_float64(out, inp, rows, kernel):
    w = nvfp4(out, inp, seed=rows)
    w16 = cpu_fp16.blocked(w.unscaled())
    g = float(w.weight_scale_2)
    x = torch.randn(rows, inp)
    dense = unblocked(w16, inp).double() * g
    exact = x.double() @ dense.T
    # one float32 sum of `inp` exact products (FMA), then one product by g: |error| <= gamma *
    # sum |x||w| with gamma = n u / (1 - n u), n = inp + 1 roundings of u = 2^-24 each. AMX sums
    # 3 exact products per weight (x's three bfloat16 parts, each with x's sign, summing to x) in
    # two sums, then adds them: n = 3 inp + 2.
    n, u = (3 * inp + 2 if kernel == "amx" else inp + 1), 2.0**-24
    bound = (x.double().abs() @ dense.abs().T) * (n * u / (1 - n * u))
    got = cpu_fp16.linear(x, w16, g)
    assert got.dtype == torch.float32 and got.shape == (rows, out)
    assert ((got.double() - exact).abs() <= bound).all()


def test_a_weight_in_another_kernels_layout_is_refused(kernel):
    w = nvfp4(32, 64, seed=2)
    other = "avx512" if kernel == "amx" else "amx"
    with pytest.raises(ValueError, match="blocked for another kernel"):
        cpu_fp16.linear(torch.randn(2, 64), cpu_fp16.blocked(w.unscaled(), other), 1.0)


def test_a_kernel_without_scratch_raises_memory_error(monkeypatch):
    """The AMX kernel returns -1 where aligned_alloc fails; linear says so, it returns nothing.
    A stand-in with the kernel's name returns it here (the real one needs an AMX CPU)."""
    calls = []

    def bf16_linear_amx(*args):
        calls.append(args)
        return -1

    monkeypatch.setattr(cpu_fp16, "_kernel", bf16_linear_amx)
    w = cpu_fp16.blocked(nvfp4(32, 64, seed=4).unscaled(), "amx")
    with pytest.raises(MemoryError, match="amx kernel could not allocate its scratch for 3 rows "
                                          "x 64 inputs"):
        cpu_fp16.linear(torch.randn(3, 64), w, 1.0)
    assert len(calls) == 1 and calls[0][4:7] == (3, 64, 32)  # rows, inputs, outputs


@pytest.mark.parametrize("rows", [17, 40])
def test_a_rows_result_does_not_depend_on_the_other_rows(rows, kernel):
    w = nvfp4(80, 96, seed=3)  # 5 panels: AMX's last pair has one
    w16, g = cpu_fp16.blocked(w.unscaled()), float(w.weight_scale_2)
    x = torch.randn(rows, 96)
    together = cpu_fp16.linear(x, w16, g)  # 17 rows: tiles of 6, 6, 5 (AVX-512 8, 8, 1; AMX 16, 1)
    for lo, hi in [(0, 1), (3, 5), (1, 4), (2, 9), (6, 11), (4, 17), (11, 17), (0, 16)]:
        assert torch.equal(cpu_fp16.linear(x[lo:hi], w16, g), together[lo:hi])


@pytest.mark.skipif(not cpu_fp16._cpu_has("avx512f"), reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("rows", [1, 4, 6, 7, 8, 9, 12, 13, 16, 25, 32, 40, 128])
def test_the_avx512_kernel_gives_the_avx2_kernels_bits(rows, monkeypatch):
    w = nvfp4(80, 576, seed=rows)
    w16, g = cpu_fp16.blocked(w.unscaled(), "avx512"), float(w.weight_scale_2)
    x = torch.randn(rows, 576)
    monkeypatch.setenv("DFLASH_TRT_CPU_FP16", "avx512")
    monkeypatch.setattr(cpu_fp16, "_kernel", False)
    wide = cpu_fp16.linear(x, w16, g)
    assert cpu_fp16.load().__name__ == "fp16_linear_avx512"
    monkeypatch.setenv("DFLASH_TRT_CPU_FP16", "avx2")
    monkeypatch.setattr(cpu_fp16, "_kernel", False)
    narrow = cpu_fp16.linear(x, w16, g)
    assert cpu_fp16.load().__name__ == "fp16_linear"
    assert torch.equal(wide, narrow)


@pytest.mark.skipif(not cpu_fp16._cpu_has("avx512f"), reason="this CPU has no AVX-512F")
def test_each_kernel_takes_calls_up_to_its_own_row_count(monkeypatch):
    monkeypatch.setattr(cpu_fp16, "_kernel", False)
    assert cpu_fp16.isa() == "avx512" and cpu_fp16.max_rows() == cpu_fp16.MAX_ROWS["avx512"] == 128
    if "amx" in cpu_fp16.kernels():  # only when asked for
        monkeypatch.setenv("DFLASH_TRT_CPU_FP16", "amx")
        monkeypatch.setattr(cpu_fp16, "_kernel", False)
        assert cpu_fp16.isa() == "amx" and cpu_fp16.max_rows() == cpu_fp16.MAX_ROWS["amx"] == 512
    monkeypatch.setenv("DFLASH_TRT_CPU_FP16", "avx2")
    monkeypatch.setattr(cpu_fp16, "_kernel", False)
    assert cpu_fp16.max_rows() == cpu_fp16.MAX_ROWS["avx2"] == 32


def quant_layer(out: int, inp: int, seed: int) -> qf.QuantLinear:
    w = nvfp4(out, inp, seed)
    state = {"l.weight": w.packed, "l.weight_scale": w.weight_scale,
             "l.weight_scale_2": w.weight_scale_2}
    cfg = qf.QuantConfig(qf.W4A16_NVFP4, None, 16, ())
    return qf.build_quant_linears(state, cfg, torch.float32)["l"]


@pytest.mark.parametrize("case", ["none", "one", "most", "one too many"])
def test_packed_nvfp4_layer_uses_the_kernel_for_few_rows_only(case, monkeypatch):
    layer = quant_layer(48, 64, seed=4)
    assert layer.stored is not None
    packed = cpu_linear.PackedLinear(layer)
    assert packed.fp16 is not None and layer.stored is None  # read once, then dropped
    assert packed.fp16_rows == cpu_fp16.max_rows() in cpu_fp16.MAX_ROWS.values()
    rows = {"none": 0, "one": 1, "most": packed.fp16_rows,
            "one too many": packed.fp16_rows + 1}[case]
    calls, real = [], cpu_fp16.linear

    def counted(*args):
        calls.append(args[0].shape[0])
        return real(*args)

    monkeypatch.setattr(cpu_fp16, "linear", counted)
    x = torch.randn(1, rows, 64)
    assert torch.allclose(packed(x), layer(x), rtol=1e-5, atol=1e-5)
    assert calls == ([rows] if 0 < rows <= packed.fp16_rows else [])


def test_switched_off_the_layer_stays_on_onednn(monkeypatch):
    monkeypatch.setattr(cpu_fp16, "_kernel", None)
    packed = cpu_linear.PackedLinear(quant_layer(48, 64, seed=5))
    assert packed.fp16 is None and packed.fp16_rows == 0 and cpu_fp16.max_rows() == 0


def test_a_layer_whose_outputs_do_not_fill_panels_stays_on_onednn():
    layer = quant_layer(40, 64, seed=6)  # 40 outputs: not a multiple of the kernel's 16
    assert not cpu_fp16.fits(40, 64) and cpu_fp16.fits(48, 64)
    packed = cpu_linear.PackedLinear(layer)
    assert packed.fp16 is None
    x = torch.randn(3, 64)
    assert torch.allclose(packed(x), x @ layer.weight.T, rtol=1e-5, atol=1e-5)


def write_nvfp4_checkpoint(path):
    """The tiny target with its decoder layers' linear weights stored as W4A16_NVFP4."""
    from safetensors.torch import load_file, save_file

    write_tiny_checkpoint(path)
    state = load_file(str(path / "model.safetensors"))
    for name in [k[:-len(".weight")] for k in state if k.endswith("proj.weight")]:
        w = qf.nvfp4_quantize(state[f"{name}.weight"])
        state[f"{name}.weight"] = w.packed
        state[f"{name}.weight_scale"] = w.weight_scale
        state[f"{name}.weight_scale_2"] = w.weight_scale_2
    save_file(state, str(path / "model.safetensors"))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {
        "quant_algo": "W4A16_NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
        "exclude_modules": ["lm_head", "model.embed_tokens"]}}))
    return path


def test_engine_on_the_kernel_stays_lossless(tmp_path, kernel):
    from dflash_trt.engines.base import SamplingParams, collect
    from dflash_trt.engines.torch_engine import TorchEngine

    target = write_nvfp4_checkpoint(tmp_path / "target")
    drafter = write_tiny_drafter(target, tmp_path / "drafter")
    engine = TorchEngine.load(target, drafter, max_seq_len=256)
    kernels = [m for m in engine.model.modules() if getattr(m, "fp16", None) is not None]
    assert len(kernels) == 4 * 7  # every projection of the 4 decoder layers
    for prompt in ["hello", "The quick brown fox"]:
        ids = engine.tokenize(prompt, chat=True)
        plain = collect(engine.stream(ids, SamplingParams(max_new_tokens=32,
                                                          num_draft_tokens=0)))
        spec = collect(engine.stream(ids, SamplingParams(max_new_tokens=32)))
        assert spec.token_ids == plain.token_ids and spec.total_draft_tokens > 0
    engine.close()


def test_batched_streams_on_the_kernel_equal_each_requests_plain_greedy(tmp_path):
    """Four requests at once in the batching engine, float32 on the kernel: each equals its own
    plain greedy output from the batch-1 engine. The kernel's rows never depend on each other;
    the attention and the float32 LM head (oneDNN) may differ in the last bits between shapes,
    which could flip a token only at a float32 tie, and these seeded prompts have none."""
    from dflash_trt.engines.base import SamplingParams, collect
    from dflash_trt.engines.torch_engine import TorchEngine

    target = write_nvfp4_checkpoint(tmp_path / "target")
    drafter = write_tiny_drafter(target, tmp_path / "drafter")
    serial = TorchEngine.load(target, drafter, max_seq_len=256)
    prompts = ["hello", "The quick brown fox", "élan 中文", "0123456789 " * 3]
    ids = [serial.tokenize(p, chat=True) for p in prompts]
    refs = [collect(serial.stream(i, SamplingParams(max_new_tokens=24, num_draft_tokens=0)))
            for i in ids]
    serial.close()
    engine = TorchEngine.load(target, drafter, max_seq_len=256, max_batch_size=4)
    assert engine.dtype == "float32"
    assert sum(getattr(m, "fp16", None) is not None for m in engine.model.modules()) == 4 * 7
    results = [None] * len(ids)

    def one(i):
        results[i] = collect(engine.stream(ids[i], SamplingParams(max_new_tokens=24)))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    try:
        assert [r.token_ids for r in results] == [r.token_ids for r in refs]
        assert sum(r.total_draft_tokens for r in results) > 0
    finally:
        engine.close()
