"""The emit stage: a self-contained Triton model repository from the `triton_repo/` templates.

<out>/<ensemble_name>/    a Triton ensemble routing to <model_name> (TensorRT-LLM's client name)
<out>/<model_name>/
  config.pbtxt          from the template, every placeholder filled (substitute, never
                        safe_substitute), parsed back with Triton's own protobuf schema
  1/model.py            the Python-backend model (a verbatim copy)
  1/engine/             the compiled engine directory (copied, or hard-linked)

The templates are the checkout's top-level triton_repo/; the package reaches them through the link
dflash_trt/stages/triton_repo, and a wheel ships a copy there (package data), so an installed
dflash-trt emits from any directory.
"""

from __future__ import annotations

import shutil
from importlib import resources
from pathlib import Path
from string import Template

from dflash_trt.engines.spec import EngineSpec
from dflash_trt.errors import DflashTrtError
from dflash_trt.stages.files import link_or_copy_tree

TEMPLATE_MODEL = "dflash"  # the template's directory name under triton_repo/
VERSION = "1"


def templates_dir() -> Path:
    """The packaged triton_repo/ templates."""
    path = Path(str(resources.files("dflash_trt.stages") / "triton_repo"))
    if not (path / TEMPLATE_MODEL / "config.pbtxt").is_file():
        raise DflashTrtError(f"the Triton templates are missing from {path}; reinstall dflash-trt")
    return path


def instance_kind(hardware: str, spec: EngineSpec) -> str:
    """KIND_CPU on CPU; KIND_GPU for the torch engine on a GPU; KIND_MODEL for TensorRT-LLM."""
    if hardware == "cpu" or spec.device == "cpu":
        return "KIND_CPU"
    if spec.backend == "tensorrt_llm":
        # TensorRT-LLM places itself on its GPUs (tensor parallelism spans several); one Triton
        # instance per GPU would load one full copy per GPU.
        return "KIND_MODEL"
    return "KIND_GPU"


def render_config(template: str, values: dict[str, str]):
    """Fill the config template and parse it with Triton's schema; return (text, ModelConfig)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        text = Template(template).substitute(values)
    except (KeyError, ValueError) as exc:
        raise DflashTrtError(f"config.pbtxt template: placeholder {exc} has no value; fix "
                             "triton_repo/dflash/config.pbtxt or the emit stage") from None
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(text, config)
    except text_format.ParseError as exc:
        raise DflashTrtError(f"the emitted config.pbtxt does not parse as a Triton ModelConfig: "
                             f"{exc}") from None
    return text, config


def emit_repository(engine_dir: Path, out_dir: Path, triton, hardware: str, *,
                    link: bool = False) -> Path:
    """Write `out_dir/<triton.model_name>/` for the engine in engine_dir; return that directory.

    `triton` is the recipe's TritonSection; `link` hard-links the engine files instead of
    copying them (same filesystem only; falls back to copies).
    """
    engine_dir, out_dir = Path(engine_dir), Path(out_dir)
    spec = EngineSpec.read(engine_dir)
    model_dir = out_dir / triton.model_name
    if model_dir.exists():
        raise DflashTrtError(f"{model_dir} already exists; emit into an empty directory")
    template_dir = templates_dir() / TEMPLATE_MODEL
    values = {
        "model_name": triton.model_name,
        "max_batch_size": str(spec.max_batch_size),
        "decoupled": "true" if triton.decoupled else "false",
        "instance_count": str(triton.instance_count),
        "instance_kind": instance_kind(hardware, spec),
    }
    text, config = render_config((template_dir / "config.pbtxt").read_text(), values)
    if config.name != triton.model_name or config.backend != "python":
        raise DflashTrtError(f"the emitted config.pbtxt names model {config.name!r} with backend "
                             f"{config.backend!r}; expected {triton.model_name!r} / python")

    version_dir = model_dir / VERSION
    version_dir.mkdir(parents=True)
    (model_dir / "config.pbtxt").write_text(text)
    shutil.copy2(template_dir / VERSION / "model.py", version_dir / "model.py")
    if link:
        link_or_copy_tree(engine_dir, version_dir / "engine")
    else:
        shutil.copytree(engine_dir, version_dir / "engine")
    return model_dir


def emit_ensemble(model_dir: Path, name: str) -> Path:
    """Write `<repo>/<name>/`: a Triton ensemble that routes every input and output of the model
    in `model_dir` to it unchanged, so clients written for TensorRT-LLM's `ensemble` model (its
    end_to_end_grpc_client.py, genai-perf's tensorrtllm format) reach it under that name."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    model_dir = Path(model_dir)
    model = model_config_pb2.ModelConfig()
    text_format.Parse((model_dir / "config.pbtxt").read_text(), model)
    ensemble_dir = model_dir.parent / name
    if ensemble_dir.exists():
        raise DflashTrtError(f"{ensemble_dir} already exists; emit into an empty directory")
    ensemble = model_config_pb2.ModelConfig(name=name, platform="ensemble",
                                            max_batch_size=model.max_batch_size)
    ensemble.input.extend(model.input)
    ensemble.output.extend(model.output)
    step = ensemble.ensemble_scheduling.step.add(model_name=model.name, model_version=-1)
    step.input_map.update({i.name: i.name for i in model.input})
    step.output_map.update({o.name: o.name for o in model.output})
    (ensemble_dir / VERSION).mkdir(parents=True)  # Triton wants a version, even an empty one
    header = (f"# Routes TensorRT-LLM ensemble clients to `{model.name}` unchanged (dflash-trt "
              "emit stage).\n")
    (ensemble_dir / "config.pbtxt").write_text(header + text_format.MessageToString(ensemble))
    return ensemble_dir


def run_emit_stage(ctx) -> dict:
    """Emit build/<name>/triton_repo/<model_name>/ from the compiled engine."""
    recipe = ctx.recipe
    with ctx.progress("emit: Triton model repository", total=None):
        # Hard links: the repository is still self-contained (links are files), without a
        # second copy of the weights on disk. Copy the directory to move it elsewhere.
        model_dir = emit_repository(ctx.stage_dir("compile"), ctx.out, recipe.triton,
                                    recipe.hardware, link=True)
        if recipe.triton.ensemble_name:
            emit_ensemble(model_dir, recipe.triton.ensemble_name)
    return {"model_name": recipe.triton.model_name,
            "ensemble_name": recipe.triton.ensemble_name,
            "model_dir": str(model_dir.relative_to(ctx.out)),
            "decoupled": recipe.triton.decoupled,
            "instance_count": recipe.triton.instance_count}
