"""The compile stage: turn the quantized checkpoints into a self-contained `engine/` directory.

engine/
  engine.yaml            backend, checkpoint paths (relative), dtype, device, sizes, defaults
  target/, drafter/      the quantized checkpoints (hard links when possible, else copies)
  llm_api_options.yaml   tensorrt_llm only: TensorRT-LLM LLM API / `trtllm-serve --config` options

The torch backend is loaded and runs a few tokens here, so a broken artifact fails the build rather
than the server. The tensorrt_llm backend is not loaded: TensorRT-LLM runs on the serving GPU.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dflash_trt.engines.cost_model import CALIBRATION_FILE
from dflash_trt.engines.spec import EngineSpec, SamplingDefaults
from dflash_trt.errors import DflashTrtError
from dflash_trt.formats.cast import cast_checkpoint
from dflash_trt.stages.devices import build_device, engine_dtype, resolve_device
from dflash_trt.stages.files import link_or_copy_tree
from dflash_trt.stages.verify import REPORT_JSON as VERIFY_JSON

SMOKE_PROMPT = "Hello"
SMOKE_TOKENS = 4
TRTLLM_BUILD_REMOVED = (
    "engine.build_path: trtllm_build is not available: TensorRT-LLM removed its trtllm-build "
    "engine path in 2026 and its C++ runtime never had a DFlash speculative mode; use "
    "engine.build_path: llm_api (TensorRT-LLM's PyTorch backend with DFlashDecodingConfig)")


def run_compile_stage(ctx) -> dict:
    """Write ctx.out/engine.yaml and the checkpoints it names; smoke-test the torch engine."""
    recipe = ctx.recipe
    engine = recipe.engine
    if engine.build_path == "trtllm_build":
        raise DflashTrtError(TRTLLM_BUILD_REMOVED)
    if recipe.triton.max_tokens >= engine.max_seq_len:
        raise DflashTrtError(f"triton.max_tokens ({recipe.triton.max_tokens}) must be below "
                             f"engine.max_seq_len ({engine.max_seq_len}); lower it")
    quantized = ctx.stage_dir("quantize")
    if not (quantized / "target").is_dir():
        raise DflashTrtError(f"{quantized / 'target'} is missing; run the quantize stage first "
                             "(`dflash-trt build RECIPE`)")

    info: dict = {}
    with ctx.progress("compile: linking checkpoints", total=2) as task:
        info["target"] = link_or_copy_tree(quantized / "target", ctx.out / "target")
        task.advance()
        has_drafter = (quantized / "drafter").is_dir()
        if has_drafter and engine.backend == "tensorrt_llm":
            # Upstream's DFlash attention takes bf16/fp16 only: ship the drafter in that dtype.
            info["drafter"] = cast_checkpoint(quantized / "drafter", ctx.out / "drafter",
                                              engine_dtype(recipe))
        elif has_drafter:
            info["drafter"] = link_or_copy_tree(quantized / "drafter", ctx.out / "drafter")
        task.advance()

    spec = EngineSpec(
        backend=engine.backend,
        target="target",
        drafter="drafter" if has_drafter else None,
        dtype=engine_dtype(recipe),
        device=resolve_device(engine.device, recipe.hardware),
        block_size=recipe.drafter.block_size if has_drafter else 1,
        max_batch_size=engine.max_batch_size,
        max_seq_len=engine.max_seq_len,
        chat_template=recipe.target.chat_template,
        defaults=SamplingDefaults(max_tokens=recipe.triton.max_tokens),
        prompt_lookup=engine.prompt_lookup,
        parse_special_tokens=recipe.target.parse_special_tokens,
        draft_length=engine.draft_length if engine.backend == "torch" else "fixed",
        max_queue=engine.max_queue,
        queue_timeout_s=engine.queue_timeout_s,
        prefix_cache_tokens=engine.prefix_cache_tokens,
    )
    spec.write(ctx.out)
    info.update(backend=spec.backend, device=spec.device, dtype=spec.dtype,
                block_size=spec.block_size)

    if spec.backend == "tensorrt_llm":
        if not has_drafter:
            raise DflashTrtError("engine.backend: tensorrt_llm needs a DFlash drafter; set "
                                 "drafter.source or drafter.init")
        rates = _position_rates(ctx.stage_dir("verify"))
        info["llm_api_options"] = str(_write_trtllm_options(recipe, ctx.out, rates))
        info["draft_len_schedule_from"] = (
            "recipe" if engine.draft_len_schedule else "verify acceptance profile + roofline"
            if rates is not None else "none (no acceptance profile: fixed draft length)")
    else:
        if spec.draft_length == "adaptive" and has_drafter:
            info["acceptance_calibration"] = _write_calibration(ctx.stage_dir("verify"), ctx.out)
        with ctx.progress("compile: smoke generation", total=None):
            info["smoke"] = smoke_test(ctx.out, spec)
    return info


def _write_calibration(reports: Path, engine_dir: Path) -> int:
    """engine/acceptance_calibration.json from the verify stage's acceptance profile (the
    drafter's confidence -> measured acceptance, for the adaptive draft length); the number of
    calibration points written (0: none, the raw confidences are used)."""
    from dflash_trt.dflash.acceptance import calibration_points

    path = reports / VERIFY_JSON
    profile = json.loads(path.read_text()).get("acceptance_profile") if path.is_file() else None
    points = calibration_points(profile) if profile else []
    if points:
        (engine_dir / CALIBRATION_FILE).write_text(json.dumps(
            {"points": points, "source": f"verify stage ({VERIFY_JSON})",
             "drafter_steps": profile["drafter_steps"]}, indent=2) + "\n")
    return len(points)


def _position_rates(reports: Path) -> list[float] | None:
    """P(draft i accepted | reached) from the verify report, None when there is none: drafting
    the full vocabulary where verify measured it, as TensorRT-LLM drafts (it ignores
    draft_vocab.json)."""
    path = reports / VERIFY_JSON
    if not path.is_file():
        return None
    report = json.loads(path.read_text())
    profile = report.get("full_vocab_acceptance_profile") or report.get("acceptance_profile") or {}
    rates = [p["rate"] for p in profile.get("position_acceptance", [])]
    return rates if profile.get("drafter_steps") else None


def _write_trtllm_options(recipe, engine_dir: Path, rates: list[float] | None) -> Path:
    try:
        from dflash_trt.engines.trtllm_options import llm_api_options, write_llm_api_options
    except ImportError as exc:
        raise DflashTrtError(f"the TensorRT-LLM option mapping is unavailable ({exc}); "
                             "reinstall dflash-trt") from exc
    options = llm_api_options(recipe, engine_dir / "target", engine_dir / "drafter",
                              engine_dir=engine_dir, position_rates=rates)
    return write_llm_api_options(options, engine_dir).relative_to(engine_dir)


def smoke_test(engine_dir: Path, spec: EngineSpec) -> dict:
    """Load the torch engine from engine_dir and generate a few greedy tokens."""
    from dflash_trt.engines import load_engine
    from dflash_trt.engines.base import SamplingParams, collect

    device = build_device(spec.device, "cpu")
    start = time.perf_counter()
    engine = load_engine(engine_dir, device=device, measure_here=True)
    if engine.cost_model is not None:  # measured on the build device by load_engine
        engine.cost_model.write(engine_dir)
    ids = engine.tokenize(SMOKE_PROMPT, chat=False)
    result = collect(engine.stream(ids, SamplingParams(max_new_tokens=SMOKE_TOKENS)))
    if not result.token_ids:
        raise DflashTrtError(f"the engine in {engine_dir} produced no tokens for a smoke prompt; "
                             "check the verify report")
    return {"device": device, "tokens": len(result.token_ids),
            "acceptance_length": round(result.acceptance_length, 3),
            "seconds": round(time.perf_counter() - start, 2)}
