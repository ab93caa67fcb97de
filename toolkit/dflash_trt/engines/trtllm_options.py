"""The TensorRT-LLM LLM API options for a DFlash engine (`engine/llm_api_options.yaml`).

The same mapping is read by `tensorrt_llm.LLM(**options)` in the engine adapter and by
`trtllm-serve TARGET --config llm_api_options.yaml`. Every option name is checked against
`engines/trtllm_llm_api_options.yaml`, a list taken from a named TensorRT-LLM version, so a misspelt or
unsupported option fails here, on the build machine, rather than at model load on a GPU node.

Paths: `speculative_model` is written relative to the engine directory when `engine_dir` is given.
TensorRT-LLM itself resolves relative paths against the process's working directory, so
`resolve_option_paths` makes them absolute again at load (the adapter does this), and a user running
`trtllm-serve` by hand runs it from the engine directory.

Pure Python: nothing here imports tensorrt_llm, so the unit tests run anywhere.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from dflash_trt.engines.spec import inside_engine_tree
from dflash_trt.errors import DflashTrtError

if TYPE_CHECKING:
    from dflash_trt.recipe import Recipe

LLM_API_OPTIONS_FILE = "llm_api_options.yaml"

# DFlash's TRTLLM context attention uses Blackwell-only generated FMHA kernels (SM100/SM103, per
# DFlashDecodingConfig.attention_backend); every other GPU gets the FlashAttention path.
_TRTLLM_ATTENTION_HARDWARE = frozenset({"sm100", "sm103"})
_NVFP4_SERVE_HARDWARE = frozenset({"sm100", "sm103"})
_NVFP4_FORMATS = frozenset({"nvfp4", "w4a16_nvfp4"})
# Recipe kv_cache -> KvCacheConfig.dtype; "none" keeps TensorRT-LLM's "auto" (the checkpoint's own).
_KV_CACHE_DTYPE = {"fp8": "fp8", "nvfp4": "nvfp4"}
_MODEL_DTYPES = frozenset({"float16", "bfloat16", "float32"})


@dataclass(frozen=True)
class OptionNames:
    """The option names and values one TensorRT-LLM version accepts (from the data file)."""

    source: str
    tensorrt_llm_version: str
    container: str
    top_level: frozenset[str]
    speculative_config: frozenset[str]
    kv_cache_config: frozenset[str]
    cuda_graph_config: frozenset[str]
    decoding_types: frozenset[str]
    attention_backends: frozenset[str]
    kv_cache_dtypes: frozenset[str]


@cache
def load_option_names() -> OptionNames:
    """Read `engines/trtllm_llm_api_options.yaml` shipped with the package."""
    text = (Path(__file__).parent / "trtllm_llm_api_options.yaml").read_text(encoding="utf-8")
    raw = yaml.safe_load(text)
    return OptionNames(
        source=" ".join(str(raw["source"]).split()),
        tensorrt_llm_version=str(raw["tensorrt_llm_version"]),
        container=str(raw["container"]),
        top_level=frozenset(raw["top_level"]),
        speculative_config=frozenset(raw["speculative_config"]),
        kv_cache_config=frozenset(raw["kv_cache_config"]),
        cuda_graph_config=frozenset(raw["cuda_graph_config"]),
        decoding_types=frozenset(raw["decoding_type"]),
        attention_backends=frozenset(raw["attention_backend"]),
        kv_cache_dtypes=frozenset(raw["kv_cache_dtype"]),
    )


@dataclass(frozen=True)
class DrafterConfig:
    """The DFlash fields of a drafter checkpoint's config.json."""

    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    block_size: int | None  # absent in some exported checkpoints


def read_drafter_config(drafter_dir: Path) -> DrafterConfig:
    """Read `dflash_config.{mask_token_id, target_layer_ids}` and `block_size` from config.json."""
    config = _read_json(drafter_dir / "config.json", what="drafter")
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise DflashTrtError(
            f"{drafter_dir / 'config.json'}: no `dflash_config` section; this is not a DFlash "
            "drafter checkpoint (expected dflash_config.mask_token_id and target_layer_ids)"
        )
    mask = dflash.get("mask_token_id")
    layers = dflash.get("target_layer_ids")
    if not isinstance(mask, int) or isinstance(mask, bool):
        raise DflashTrtError(
            f"{drafter_dir / 'config.json'}: dflash_config.mask_token_id must be an integer, "
            f"got {mask!r}"
        )
    if not isinstance(layers, list) or not layers or not all(_is_int(i) for i in layers):
        raise DflashTrtError(
            f"{drafter_dir / 'config.json'}: dflash_config.target_layer_ids must be a non-empty "
            f"list of integers, got {layers!r}"
        )
    block_size = config.get("block_size")
    return DrafterConfig(
        mask_token_id=mask,
        target_layer_ids=tuple(layers),
        block_size=block_size if _is_int(block_size) else None,
    )


def llm_api_options(
    recipe: Recipe, target_dir: Path, drafter_dir: Path, *, engine_dir: Path | None = None,
    position_rates: list[float] | None = None,
) -> dict[str, Any]:
    """Build the LLM API options for serving `target_dir` with the DFlash drafter `drafter_dir`.

    `target_dir` and `drafter_dir` must be readable now (their config.json files are checked).
    With `engine_dir`, `speculative_model` is written relative to it; otherwise as given.
    `position_rates`: the drafter's P(draft i accepted | reached) from the verify stage, from
    which the draft_len_schedule is computed (recipe engine.draft_len_schedule wins; neither:
    a fixed draft length). Raises DflashTrtError for a recipe this path cannot serve.
    """
    engine = recipe.engine
    _check_servable(recipe)
    drafter = read_drafter_config(drafter_dir)
    _check_drafter_matches(recipe, drafter, drafter_dir)
    _check_target_layers(drafter, target_dir)

    speculative = {
        "decoding_type": "DFlash",
        "max_draft_len": recipe.drafter.block_size - 1,
        "speculative_model": _path_for(drafter_dir, engine_dir),
        "mask_token_id": drafter.mask_token_id,
        "target_layer_ids": list(drafter.target_layer_ids),
        "attention_backend": (
            "TRTLLM" if recipe.hardware in _TRTLLM_ATTENTION_HARDWARE else "VANILLA"
        ),
    }
    if recipe.engine.rejection_sampling:
        speculative["use_rejection_sampling"] = True
    schedule = engine.draft_len_schedule or (
        default_draft_len_schedule(recipe, target_dir, drafter_dir, position_rates)
        if position_rates is not None else None)
    if schedule:
        speculative["draft_len_schedule"] = {int(b): int(k) for b, k in sorted(schedule.items())}
    kv_cache: dict[str, Any] = {
        "free_gpu_memory_fraction": engine.kv_cache_free_gpu_memory_fraction,
        # Upstream's DFlash builds the drafter's context from the hidden states of the prefill
        # tokens it computes (dflash.py _store_prefill_context): a prefix-cache hit skips them,
        # leaving the drafter without that context and its positions short. Off until it is fixed.
        "enable_block_reuse": False,
    }
    kv_dtype = _KV_CACHE_DTYPE.get(recipe.quantize.target.kv_cache)
    if kv_dtype is not None:
        kv_cache["dtype"] = kv_dtype

    options: dict[str, Any] = {
        "speculative_config": speculative, "kv_cache_config": kv_cache,
        # Without padding upstream captures graphs for batch sizes 1-31, 32, 64 and 128 only.
        "cuda_graph_config": {"enable_padding": True, "max_batch_size": engine.max_batch_size},
        "disable_overlap_scheduler": not engine.overlap_scheduler,
        "enable_chunked_prefill": engine.chunked_prefill,
    }
    for name in ("max_batch_size", "max_num_tokens", "max_seq_len", "tensor_parallel_size"):
        value = getattr(engine, name)
        if value is not None:
            options[name] = value
    if getattr(engine, "dtype", None) in _MODEL_DTYPES:
        options["dtype"] = engine.dtype
    if recipe.target.trust_remote_code:
        options["trust_remote_code"] = True
    check_option_names(options)
    return options


def default_draft_len_schedule(recipe: Recipe, target_dir: Path, drafter_dir: Path,
                               position_rates: list[float]) -> dict[int, int]:
    """{batch size: drafts} maximising expected tokens per second under a roofline step cost:
    a forward over n tokens costs max(n, S) / S of a weight-bound forward (S =
    VERIFY_SATURATION_TOKENS of the hardware), the drafter's pass over the whole block its layer
    share of that. Batch sizes: powers of two up to max_batch_size, and max_batch_size."""
    from dflash_trt.dflash.draft_length import draft_len_schedule
    from dflash_trt.recipe.schema import VERIFY_SATURATION_TOKENS

    saturation = VERIFY_SATURATION_TOKENS[recipe.hardware]
    block = recipe.drafter.block_size
    share = (_num_layers(_read_json(drafter_dir / "config.json", what="drafter"))
             / _num_layers(_read_json(target_dir / "config.json", what="target")))

    def forward(tokens: int) -> float:
        return max(tokens, saturation) / saturation

    def step_s(batch: int, drafts: int) -> float:
        drafting = share * forward(batch * block) if drafts else 0.0
        return forward(batch * (drafts + 1)) + drafting

    top = recipe.engine.max_batch_size
    sizes = [b for b in (2 ** i for i in range(top.bit_length())) if b <= top] + [top]
    return draft_len_schedule(position_rates, step_s, block - 1, sizes)


def _num_layers(config: Mapping[str, Any]) -> int:
    layers = config.get("num_hidden_layers")
    if not _is_int(layers) and isinstance(config.get("text_config"), dict):
        layers = config["text_config"].get("num_hidden_layers")
    if not _is_int(layers) or layers < 1:
        raise DflashTrtError("a config.json without num_hidden_layers; cannot size the step cost")
    return layers


def check_option_names(options: Mapping[str, Any], names: OptionNames | None = None) -> None:
    """Raise DflashTrtError naming every option or value the pinned TensorRT-LLM does not know."""
    names = names or load_option_names()
    problems = [f"`{key}`" for key in options if key not in names.top_level]
    sections = {
        "speculative_config": names.speculative_config,
        "kv_cache_config": names.kv_cache_config,
        "cuda_graph_config": names.cuda_graph_config,
    }
    for section, allowed in sections.items():
        value = options.get(section)
        if value is None:
            continue
        if not isinstance(value, Mapping):
            problems.append(f"`{section}` (must be a mapping)")
            continue
        problems += [f"`{section}.{key}`" for key in value if key not in allowed]
    spec = options.get("speculative_config") or {}
    problems += _bad_value(spec, "decoding_type", names.decoding_types, "speculative_config")
    problems += _bad_value(spec, "attention_backend", names.attention_backends, "speculative_config")
    problems += _bad_value(
        options.get("kv_cache_config") or {}, "dtype", names.kv_cache_dtypes, "kv_cache_config"
    )
    if problems:
        raise DflashTrtError(
            f"unknown TensorRT-LLM LLM API option(s) {', '.join(problems)} for TensorRT-LLM "
            f"{names.tensorrt_llm_version}; the accepted names are listed in "
            "dflash_trt/engines/trtllm_llm_api_options.yaml"
        )


def resolve_option_paths(options: Mapping[str, Any], engine_dir: Path) -> dict[str, Any]:
    """Return a copy of `options` with `speculative_model` made absolute.

    Paths in llm_api_options.yaml are relative to the engine directory that holds it (TensorRT-LLM
    would resolve them against the working directory instead) and may not leave its parent.
    """
    resolved = copy.deepcopy(dict(options))
    spec = resolved.get("speculative_config")
    if isinstance(spec, dict) and spec.get("speculative_model") is not None:
        spec["speculative_model"] = str(inside_engine_tree(
            engine_dir, str(spec["speculative_model"]),
            f"{LLM_API_OPTIONS_FILE}: speculative_config.speculative_model"))
    return resolved


def write_llm_api_options(options: Mapping[str, Any], engine_dir: Path) -> Path:
    """Check and write `engine_dir/llm_api_options.yaml`; return its path."""
    check_option_names(options)
    names = load_option_names()
    header = (
        f"# TensorRT-LLM LLM API options (checked against TensorRT-LLM "
        f"{names.tensorrt_llm_version}).\n"
        "# Paths are relative to this directory. By hand: cd here, then\n"
        "#   trtllm-serve <target checkpoint> --config llm_api_options.yaml\n"
    )
    path = engine_dir / LLM_API_OPTIONS_FILE
    path.write_text(header + yaml.safe_dump(dict(options), sort_keys=False))
    return path


def read_llm_api_options(engine_dir: Path) -> dict[str, Any]:
    """Read and check `engine_dir/llm_api_options.yaml`."""
    path = engine_dir / LLM_API_OPTIONS_FILE
    if not path.is_file():
        raise DflashTrtError(
            f"{path} is missing; rebuild the engine with `dflash-trt build RECIPE --force compile`"
        )
    options = yaml.safe_load(path.read_text())
    if not isinstance(options, dict):
        raise DflashTrtError(f"{path}: expected a mapping of LLM API options")
    check_option_names(options)
    return options


def _check_servable(recipe: Recipe) -> None:
    """Refuse recipes that TensorRT-LLM's DFlash path cannot serve, with the fix in the message."""
    if recipe.engine.build_path == "trtllm_build":
        raise DflashTrtError(
            "engine.build_path: trtllm_build is not available: TensorRT-LLM removed its TensorRT "
            "engine-build path and its C++ runtime never had a DFlash mode; use "
            "engine.build_path: llm_api (the PyTorch backend)"
        )
    if recipe.hardware == "cpu":
        raise DflashTrtError(
            "engine.backend: tensorrt_llm needs an NVIDIA GPU; set hardware to sm90/sm100/sm103/"
            "sm120, or use engine.backend: torch on cpu"
        )
    if recipe.quantize.target.format in _NVFP4_FORMATS and recipe.hardware not in (
        _NVFP4_SERVE_HARDWARE
    ):
        raise DflashTrtError(
            f"quantize.target.format: {recipe.quantize.target.format} needs Blackwell (sm100/"
            f"sm103) to serve with tensorrt_llm, but hardware is {recipe.hardware}; use "
            "quantize.target.format: fp8 on this GPU"
        )
    if recipe.drafter.block_size < 2:
        raise DflashTrtError(
            f"drafter.block_size: {recipe.drafter.block_size} leaves no draft tokens "
            "(max_draft_len = block_size - 1); use 2 or more"
        )


def _check_drafter_matches(recipe: Recipe, drafter: DrafterConfig, drafter_dir: Path) -> None:
    if drafter.block_size is not None and drafter.block_size != recipe.drafter.block_size:
        raise DflashTrtError(
            f"drafter.block_size: {recipe.drafter.block_size} in the recipe, but the drafter in "
            f"{drafter_dir} was trained with block_size {drafter.block_size}; set "
            f"drafter.block_size: {drafter.block_size}"
        )


def _check_target_layers(drafter: DrafterConfig, target_dir: Path) -> None:
    config = _read_json(target_dir / "config.json", what="target")
    layers = config.get("num_hidden_layers")
    if not _is_int(layers):
        text = config.get("text_config")
        layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
    if not _is_int(layers):
        return  # an unusual config layout: TensorRT-LLM checks the ids again at load
    bad = [i for i in drafter.target_layer_ids if not 0 <= i < layers]
    if bad:
        raise DflashTrtError(
            f"drafter dflash_config.target_layer_ids {bad} are outside the target's "
            f"{layers} layers ({target_dir}); the drafter was built for a different target"
        )


def _path_for(path: Path, engine_dir: Path | None) -> str:
    if engine_dir is None:
        return str(path)
    return os.path.relpath(Path(path).resolve(), Path(engine_dir).resolve())


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise DflashTrtError(
            f"{path} not found: the {what} checkpoint is missing; run the earlier stages first"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise DflashTrtError(f"{path}: cannot read the {what} config ({exc})") from None
    if not isinstance(data, dict):
        raise DflashTrtError(f"{path}: expected a JSON object")
    return data


def _bad_value(section: Mapping[str, Any], key: str, allowed: frozenset[str], where: str) -> list:
    if key in section and section[key] not in allowed:
        return [f"`{where}.{key}: {section[key]}` (one of {', '.join(sorted(allowed))})"]
    return []


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
