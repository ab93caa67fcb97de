"""The `quantize` stage: ModelOpt post-training quantization of target and drafter, then export.

The only module that imports modelopt. Steps:
1. Calibration data from the recipe (text/.jsonl files, builtin:python-stdlib, builtin:chat),
   tokenized into `calib_size` sequences of `seq_len` tokens; its sha256 is recorded.
2. Target: `mtq.quantize` with the format's ModelOpt config (plus a KV-cache config), max
   calibration over the data, then `export_hf_checkpoint` (unified HF checkpoint with
   hf_quant_config.json) and the tokenizer files.
3. Drafter: `mtq.quantize` calibrated on real drafting: the (quantized) target's own layer features
   over the calibration sequences feed block drafts at random anchors. Exported in the reference
   drafter format plus hf_quant_config.json and the ModelOpt scales (see `qformats`).
4. The checkpoint linter runs on the outputs; any finding fails the stage.

On CPU, ModelOpt's NVFP4 fake quantization needs CUDA kernels, so a pure-torch backend
(`qformats.nvfp4_fake_quantize`, the same code the torch engine serves with) is registered and used
for every dynamic-block NVFP4 quantizer. On CUDA, ModelOpt's own kernels run unchanged.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_trt.errors import DflashTrtError, UsageError
from dflash_trt.stages.devices import check_fits_one_gpu, loaded_bytes, torch_device
from dflash_trt.stages.files import copy_tree, dir_bytes

FORMAT_CONFIGS = {  # recipe format -> ModelOpt preset
    "nvfp4": "NVFP4_DEFAULT_CFG",
    "fp8": "FP8_DEFAULT_CFG",
    "int4_awq": "INT4_AWQ_CFG",
    "w4a16_nvfp4": "W4A16_NVFP4_CFG",
}
KV_CONFIGS = {"fp8": "FP8_KV_CFG", "nvfp4": "NVFP4_KV_CFG"}
DRAFTER_ALGOS = {"nvfp4": "NVFP4", "w4a16_nvfp4": "W4A16_NVFP4", "fp8": "FP8"}
CPU_NVFP4_BACKEND = "dflash_trt_nvfp4_torch"
# Files of a resolved target that are not weights or model config: copied next to the export.
_MODEL_FILES = {"config.json", "generation_config.json", "hf_quant_config.json",
                "model.safetensors.index.json"}
DRAFTER_ANCHORS_PER_SEQ = 4


# --- calibration data -----------------------------------------------------------------------


@dataclass(frozen=True)
class CalibrationData:
    """Token sequences for calibration, and what they were made of."""

    input_ids: object  # torch.LongTensor (N, seq_len)
    sha256: str  # of the token ids: same data, same hash
    sources: tuple[str, ...]

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])


def _texts(spec: str, tokenizer, chat_template: bool) -> Iterator[str]:
    """Calibration texts of one data spec (the training corpus's specs): documents as they are,
    prompts chat-templated when asked (followed by their response when the data has one)."""
    from dflash_trt.training import corpus

    if spec not in corpus.BUILTINS and not Path(spec).expanduser().is_file():
        raise UsageError(f"quantize.calibration.data: {spec} does not exist")
    for sample in corpus.iter_samples(spec):
        if sample.text is not None:
            yield sample.text
            continue
        prompt = sample.prompt
        if chat_template and tokenizer.chat_template:
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                   tokenize=False, add_generation_prompt=True)
        yield prompt + (sample.response or "")


def build_calibration(tokenizer, data: list[str], calib_size: int, seq_len: int,
                      chat_template: bool = False) -> CalibrationData:
    """Tokenize the data sources into `calib_size` sequences of `seq_len` tokens.

    Each source contributes an equal share of tokens; documents are joined with EOS. Fewer
    sequences come back when the data is too small for `calib_size` (never zero).
    """
    import torch

    need = calib_size * seq_len
    share = -(-need // len(data))  # ceil: every source gets an equal share
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for spec in data:
        taken: list[int] = []
        for text in _texts(spec, tokenizer, chat_template):
            taken += tokenizer(text, add_special_tokens=False)["input_ids"] + sep
            if len(taken) >= share:
                break
        stream += taken[:share]
    n = min(calib_size, len(stream) // seq_len)
    if n == 0:
        raise UsageError(f"quantize.calibration.data gives {len(stream)} tokens, fewer than one "
                         f"sequence of seq_len={seq_len}; add data or lower seq_len")
    ids = torch.tensor(stream[: n * seq_len], dtype=torch.long).view(n, seq_len)  # (N, L)
    digest = hashlib.sha256(ids.numpy().tobytes()).hexdigest()
    return CalibrationData(ids, digest, tuple(data))


def batches(calib: CalibrationData, batch_size: int, device) -> Iterator:
    """(B, L) slices of the calibration ids on `device`."""
    for i in range(0, calib.num_sequences, batch_size):
        yield calib.input_ids[i : i + batch_size].to(device)


# --- ModelOpt configs and the CPU backend ---------------------------------------------------


def mtq_config(fmt: str, kv_cache: str = "none") -> dict:
    """The ModelOpt quantization config for a recipe format and KV-cache format."""
    import modelopt.torch.quantization as mtq

    if fmt not in FORMAT_CONFIGS:
        raise UsageError(f"unknown quantization format {fmt!r}; choose one of "
                         f"{', '.join(FORMAT_CONFIGS)} or none")
    cfg = copy.deepcopy(getattr(mtq, FORMAT_CONFIGS[fmt]))
    if kv_cache != "none":
        kv = copy.deepcopy(getattr(mtq, KV_CONFIGS[kv_cache])["quant_cfg"])
        if isinstance(cfg["quant_cfg"], dict):  # older ModelOpt: a pattern -> attributes dict
            cfg["quant_cfg"].update(kv)
        else:
            cfg["quant_cfg"] = [*cfg["quant_cfg"], *kv]
    return cfg


def _nvfp4_backend(x, quantizer):
    """ModelOpt backend entry point: NVFP4 fake quantization in pure torch (any device)."""
    from dflash_trt.formats.qformats import nvfp4_fake_quantize, nvfp4_global_scale

    amax = quantizer.amax if quantizer.amax is not None else x.detach().abs().amax()
    return nvfp4_fake_quantize(x, nvfp4_global_scale(amax.float()))


def use_torch_nvfp4_backend(model) -> int:
    """Route every enabled dynamic-block NVFP4 quantizer through the torch backend; returns count."""
    from modelopt.torch.quantization.nn import TensorQuantizer
    from modelopt.torch.quantization.nn.modules.tensor_quantizer import (
        is_registered_quant_backend,
        register_quant_backend,
    )

    if not is_registered_quant_backend(CPU_NVFP4_BACKEND):
        register_quant_backend(CPU_NVFP4_BACKEND, _nvfp4_backend)
    count = 0
    for module in model.modules():
        if isinstance(module, TensorQuantizer) and module.is_enabled:
            blocks = module.block_sizes or {}
            if blocks.get("type") == "dynamic" and tuple(module.num_bits) == (2, 1):
                module.backend = CPU_NVFP4_BACKEND
                count += 1
    return count


def quantize_model(model, cfg: dict, forward_loop, device) -> None:
    """`mtq.quantize` in place; on CPU, switch NVFP4 quantizers to the torch backend after."""
    import modelopt.torch.quantization as mtq

    mtq.quantize(model, cfg, forward_loop)
    if device.type == "cpu":
        use_torch_nvfp4_backend(model)


# --- target ---------------------------------------------------------------------------------


def quantize_target(model, fmt: str, kv_cache: str, calib: CalibrationData, batch_size: int,
                    device, progress=None) -> None:
    """Calibrate and fake-quantize a HF causal LM in place."""
    import torch

    def forward_loop(m):
        with torch.no_grad():
            for ids in batches(calib, batch_size, device):
                m(input_ids=ids, use_cache=False)
                if progress is not None:
                    progress.advance()

    quantize_model(model, mtq_config(fmt, kv_cache), forward_loop, device)


def export_target(model, src_dir: Path, out: Path, dtype) -> list[str]:
    """ModelOpt unified HF export, plus the tokenizer and chat-template files of the source."""
    from modelopt.torch.export import export_hf_checkpoint

    if not getattr(model.config, "architectures", None):
        model.config.architectures = [type(model).__name__]  # export needs it (multimodal check)
    export_hf_checkpoint(model, dtype=dtype, export_dir=str(out))
    copied = []
    for item in sorted(src_dir.iterdir()):
        if item.is_file() and item.suffix != ".safetensors" and item.name not in _MODEL_FILES:
            shutil.copyfile(item, out / item.name)
            copied.append(item.name)
    return copied


# --- drafter --------------------------------------------------------------------------------


def drafter_forward_loop(drafter, target, calib: CalibrationData, batch_size: int, device,
                         seed: int = 0, progress=None):
    """A ModelOpt forward loop that drafts blocks from the target's real features.

    For each calibration sequence and a few random anchors a, the drafter sees the target's
    features of positions < a as context and drafts the block [token_a, MASK...] at a.
    """
    import torch

    embed = target.get_input_embeddings()
    ids_per_layer = [i + 1 for i in drafter.target_layer_ids]  # hidden_states[0] is the embedding
    bs = drafter.block_size

    def loop(model):
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for ids in batches(calib, batch_size, device):  # (B, L)
                out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
                feats = torch.cat([out.hidden_states[i] for i in ids_per_layer], dim=-1)  # (B, L, k*H)
                seq_len = ids.shape[1]
                anchors = torch.randint(1, max(2, seq_len - bs), (DRAFTER_ANCHORS_PER_SEQ,), generator=gen)
                for a in anchors.tolist():
                    block = torch.full((ids.shape[0], bs), drafter.mask_token_id, device=device)
                    block[:, 0] = ids[:, a]  # (B, bs): [token_a, MASK...]
                    model(embed(block), feats[:, :a])
                if progress is not None:
                    progress.advance()

    return loop


def _group_key(name: str) -> str:
    """Linears that a fused runtime runs as one GEMM share scales: q/k/v, and gate/up."""
    for members, fused in ((("q_proj", "k_proj", "v_proj"), "qkv"), (("gate_proj", "up_proj"), "gate_up")):
        parent, _, leaf = name.rpartition(".")
        if leaf in members:
            return f"{parent}.{fused}"
    return name


def quantized_drafter_state(drafter, fmt: str, plain_state: dict) -> dict:
    """The drafter's tensors in the exported format, from ModelOpt's calibrated amax values."""
    import torch

    from dflash_trt.formats import qformats as qf

    algo = DRAFTER_ALGOS[fmt]
    layers = {name: m for name, m in drafter.named_modules()
              if isinstance(m, torch.nn.Linear) and getattr(m, "weight_quantizer", None) is not None
              and m.weight_quantizer.is_enabled}
    w_amax: dict[str, torch.Tensor] = {}
    x_amax: dict[str, torch.Tensor] = {}
    for name, m in layers.items():  # unify scales over each fused group (max)
        key = _group_key(name)
        wa = m.weight_quantizer.amax.float().max()
        w_amax[key] = torch.maximum(w_amax.get(key, wa), wa)
        if m.input_quantizer.is_enabled and m.input_quantizer.amax is not None:
            xa = m.input_quantizer.amax.float().max()
            x_amax[key] = torch.maximum(x_amax.get(key, xa), xa)
    state = {k: v for k, v in plain_state.items()
             if k.removesuffix(".weight") not in layers or not k.endswith(".weight")}
    for name, m in layers.items():
        weight, key = m.weight.detach().float().cpu(), _group_key(name)
        if algo in ("NVFP4", "W4A16_NVFP4"):
            q = qf.nvfp4_quantize(weight, w_amax[key].cpu())
            state[f"{name}.weight"] = q.packed
            state[f"{name}.weight_scale"] = q.weight_scale
            state[f"{name}.weight_scale_2"] = q.weight_scale_2
            if algo == "NVFP4":
                state[f"{name}.input_scale"] = qf.nvfp4_global_scale(x_amax[key].cpu())
        else:  # FP8
            q8, scale = qf.fp8_quantize(weight, qf.fp8_scale(w_amax[key].cpu()))
            state[f"{name}.weight"] = q8
            state[f"{name}.weight_scale"] = scale
            state[f"{name}.input_scale"] = qf.fp8_scale(x_amax[key].cpu())
    return {k: v.contiguous() for k, v in state.items()}


def hf_quant_config(algo: str, exclude: list[str], kv_algo: str | None = None) -> dict:
    """hf_quant_config.json content in ModelOpt's schema."""
    from dflash_trt import __version__

    quant = {"quant_algo": algo, "kv_cache_quant_algo": kv_algo}
    if "NVFP4" in algo:
        quant["group_size"] = 16
    quant["exclude_modules"] = exclude
    return {"producer": {"name": "dflash-trt", "version": __version__}, "quantization": quant}


def export_drafter(drafter, fmt: str, src_dir: Path, out: Path) -> None:
    """Write a calibrated drafter in the reference format plus its quantization config."""
    from safetensors.torch import load_file, save_file

    from dflash_trt.dflash.drafter import DRAFT_VOCAB_FILE

    plain = {}
    for f in sorted(src_dir.glob("*.safetensors")):
        plain.update(load_file(str(f)))
    state = quantized_drafter_state(drafter, fmt, plain)
    out.mkdir(parents=True, exist_ok=True)
    qcfg = hf_quant_config(DRAFTER_ALGOS[fmt], exclude=[])
    config = json.loads((src_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "modelopt", **qcfg["quantization"]}
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "hf_quant_config.json").write_text(json.dumps(qcfg, indent=4) + "\n")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if (src_dir / DRAFT_VOCAB_FILE).is_file():  # the tokens it drafts: unchanged by quantization
        shutil.copyfile(src_dir / DRAFT_VOCAB_FILE, out / DRAFT_VOCAB_FILE)


# --- the stage ------------------------------------------------------------------------------


def _check_supported(q) -> None:
    if q.drafter.kv_cache != "none":
        raise UsageError("quantize.drafter.kv_cache: the drafter's KV cache holds injected "
                         "target features and stays in the model dtype; set kv_cache: none")
    if q.drafter.format not in ("none", *DRAFTER_ALGOS):
        raise UsageError(f"quantize.drafter.format: {q.drafter.format} is not supported for "
                         f"drafters; use {', '.join(DRAFTER_ALGOS)} or none")


def run_quantize_stage(ctx) -> dict:
    """Pipeline stage `quantize`: resolved/{target,drafter} -> quantized/{target,drafter}, linted."""
    from dflash_trt.formats.lint import lint_pair

    q = ctx.recipe.quantize
    _check_supported(q)
    src = ctx.stage_dir("resolve")
    src_target, src_drafter = src / "target", src / "drafter"
    out_target, out_drafter = ctx.out / "target", ctx.out / "drafter"
    info: dict = {"target": {"format": q.target.format, "kv_cache": q.target.kv_cache},
                  "drafter": {"format": q.drafter.format}}
    timings: dict[str, float] = {}
    if q.target.format == "none" and q.drafter.format == "none":
        copy_tree(src_target, out_target)
        copy_tree(src_drafter, out_drafter)
    else:
        info["calibration"] = _quantize_and_export(ctx, src_target, src_drafter, timings)
    findings = lint_pair(out_target, out_drafter)
    if findings:
        shown = "\n".join(str(f) for f in findings[:20])
        raise DflashTrtError(f"the quantized checkpoints failed the linter ({len(findings)} "
                             f"findings); this is a bug in the export, please report it:\n{shown}")
    info["target"]["bytes"] = dir_bytes(out_target)
    info["drafter"]["bytes"] = dir_bytes(out_drafter)
    info["seconds"] = timings
    return info


def _quantize_and_export(ctx, src_target: Path, src_drafter: Path, timings: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_trt.dflash.drafter import DFlashDraftModel

    recipe, q = ctx.recipe, ctx.recipe.quantize
    cal = q.calibration
    device = torch_device(recipe)
    store_dtype = getattr(torch, recipe.target.dtype)
    # CPU calibrates in float32 (bf16 matmuls are slow and less exact there); CUDA in the recipe dtype.
    work_dtype = torch.float32 if device.type == "cpu" else store_dtype

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(src_target)
    calib = build_calibration(tokenizer, list(cal.data), cal.calib_size, cal.seq_len,
                              chat_template=recipe.target.chat_template)
    check_fits_one_gpu(loaded_bytes(src_target, work_dtype), device, "quantize")
    target = AutoModelForCausalLM.from_pretrained(src_target, dtype=work_dtype).to(device).eval()
    timings["load"] = time.monotonic() - t0

    n_batches = -(-calib.num_sequences // cal.batch_size)
    if q.target.format != "none":
        t0 = time.monotonic()
        with ctx.progress(f"calibrate target ({q.target.format})", total=n_batches) as task:
            quantize_target(target, q.target.format, q.target.kv_cache, calib, cal.batch_size,
                            device, task)
        timings["calibrate_target"] = time.monotonic() - t0

    if q.drafter.format != "none":
        t0 = time.monotonic()
        drafter = DFlashDraftModel.from_pretrained(src_drafter, dtype=work_dtype, device=str(device))
        with ctx.progress(f"calibrate drafter ({q.drafter.format})", total=n_batches) as task:
            loop = drafter_forward_loop(drafter, target, calib, cal.batch_size, device, progress=task)
            quantize_model(drafter, mtq_config(q.drafter.format), loop, device)
        export_drafter(drafter, q.drafter.format, src_drafter, ctx.out / "drafter")
        timings["calibrate_export_drafter"] = time.monotonic() - t0
    else:
        copy_tree(src_drafter, ctx.out / "drafter")

    t0 = time.monotonic()
    if q.target.format != "none":
        with ctx.progress("export target", total=None):
            export_target(target, src_target, ctx.out / "target", store_dtype)
    else:
        copy_tree(src_target, ctx.out / "target")
    timings["export_target"] = time.monotonic() - t0
    return {"sources": list(calib.sources), "num_sequences": calib.num_sequences,
            "seq_len": cal.seq_len, "batch_size": cal.batch_size, "sha256": calib.sha256,
            "device": device.type}
