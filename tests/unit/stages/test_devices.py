"""The serving dtype: engine.dtype auto follows the CPU's bf16 instructions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dflash_trt.stages import devices

CPUINFO = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {extra}\nbogomips\t: 4000\n"


def test_cpu_bf16_flags_reads_the_flags_line():
    assert devices.cpu_bf16_flags(CPUINFO.format(extra="avx512f avx512_bf16")) == ["avx512_bf16"]
    assert devices.cpu_bf16_flags(CPUINFO.format(extra="amx_bf16 avx512_bf16")) == [
        "avx512_bf16", "amx_bf16"]
    assert devices.cpu_bf16_flags(CPUINFO.format(extra="avx512f")) == []
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"  # Graviton3, Grace
    assert devices.cpu_bf16_flags(arm) == ["bf16"]


def _recipe(dtype, hardware="cpu", device="cpu", max_batch_size=1):
    return SimpleNamespace(hardware=hardware, target=SimpleNamespace(dtype="bfloat16"),
                           engine=SimpleNamespace(dtype=dtype, device=device, backend="torch",
                                                  max_batch_size=max_batch_size))


@pytest.mark.parametrize(("flags", "want"), [(["avx512_bf16"], "bfloat16"), ([], "float32")])
def test_auto_on_cpu_is_bf16_only_with_bf16_instructions(monkeypatch, flags, want):
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda: flags)
    assert devices.engine_dtype(_recipe("auto")) == want


def test_auto_is_float32_when_the_torch_engine_batches(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda: ["avx512_bf16"])
    assert devices.engine_dtype(_recipe("auto", max_batch_size=8)) == "float32"


def test_auto_on_a_gpu_and_unset_mean_the_target_dtype_and_explicit_wins(monkeypatch):
    monkeypatch.setattr(devices, "cpu_bf16_flags", lambda: [])
    assert devices.engine_dtype(_recipe("auto", hardware="b200", device="auto")) == "bfloat16"
    assert devices.engine_dtype(_recipe(None)) == "bfloat16"
    assert devices.engine_dtype(_recipe("float16")) == "float16"


def test_loaded_bytes_counts_parameters_from_the_headers(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5, dtype=torch.float16)},
              tmp_path / "model.safetensors")
    assert devices.loaded_bytes(tmp_path, torch.bfloat16) == 17 * 2
    assert devices.loaded_bytes(tmp_path, torch.float32) == 17 * 4


def test_a_target_too_big_for_one_gpu_is_refused_with_the_numbers():
    from dflash_trt.errors import DflashTrtError

    gib = 2**30
    devices.check_fits_one_gpu(100 * gib, "cpu", "quantize")  # the CPU is not checked
    devices.check_fits_one_gpu(60 * gib, "cuda", "quantize", gpu_bytes=80 * gib)
    with pytest.raises(DflashTrtError, match=r"^quantize: the target's weights \(240.0 GiB as "
                       r"loaded\) do not fit one GPU \(139.0 GiB"):
        devices.check_fits_one_gpu(240 * gib, "cuda", "quantize", gpu_bytes=139 * gib)
