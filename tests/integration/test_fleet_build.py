"""The Blackwell fleet recipe builds its TensorRT-LLM options and Triton repository here.

Qwen3-8B and its z-lab drafter are replaced by tiny stand-ins with the same config shapes that
matter to the build (36 Qwen3 layers, the full 151,936-token vocabulary, a 5-layer block-16 drafter
reading layers [1, 9, 17, 25, 33] with mask token 151669). Everything else is the shipped recipe.
"""

import json
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from quant_fixtures import char_tokenizer  # noqa: E402
from safetensors.torch import load_file

from dflash_trt.cli import cli

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.integration


def _qwen3_stand_in(path: Path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_trt.dflash.drafter_init import drafter_config_for_target, init_drafter

    config = Qwen3Config(vocab_size=151936, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=36, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, max_position_embeddings=512, tie_word_embeddings=True,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    torch.manual_seed(0)
    target = Qwen3ForCausalLM(config).eval()
    target.config.architectures = ["Qwen3ForCausalLM"]
    target.save_pretrained(path / "Qwen3-8B")
    char_tokenizer().save_pretrained(path / "Qwen3-8B")
    drafter_config = drafter_config_for_target(target.config, num_layers=5, block_size=16,
                                               target_layer_ids=None, mask_token_id=151669)
    init_drafter(drafter_config, seed=0).save_pretrained(path / "Qwen3-8B-DFlash-b16")


def test_b200_recipe_builds_trtllm_options_and_triton_repo(tmp_path):
    _qwen3_stand_in(tmp_path / "models")
    data = yaml.safe_load((ROOT / "recipes" / "qwen3-8b-nvfp4-b200.yaml").read_text())
    data["target"]["source"] = str(tmp_path / "models" / "Qwen3-8B")
    data["drafter"]["source"] = str(tmp_path / "models" / "Qwen3-8B-DFlash-b16")
    data["output_dir"] = str(tmp_path / "build")
    data["quantize"]["calibration"].update(calib_size=4, seq_len=32, batch_size=2)
    data["verify"].update(num_prompts=2, max_new_tokens=12, min_acceptance_length=1.0)
    data["target"]["chat_template"] = False  # the stand-in tokenizer has none
    recipe = tmp_path / "qwen3-8b-nvfp4-b200.yaml"
    recipe.write_text(yaml.safe_dump(data))
    runner = CliRunner()

    # resolve + quantize (NVFP4 through ModelOpt on CPU), then exactly what the issue asks for.
    first = runner.invoke(cli, ["build", str(recipe), "--only", "resolve", "quantize", "verify",
                                "--quiet"])
    assert first.exit_code == 0, first.output
    second = runner.invoke(cli, ["build", str(recipe), "--only", "compile", "emit", "--quiet"])
    assert second.exit_code == 0, second.output

    build = tmp_path / "build" / "qwen3-8b-nvfp4-b200"
    options = yaml.safe_load((build / "engine" / "llm_api_options.yaml").read_text())
    spec = options["speculative_config"]
    assert spec["decoding_type"] == "DFlash"
    assert spec["max_draft_len"] == 16 - 1
    assert spec["mask_token_id"] == 151669
    assert spec["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert spec["attention_backend"] == "TRTLLM"  # sm100
    assert options["kv_cache_config"]["dtype"] == "fp8"
    assert options["kv_cache_config"]["enable_block_reuse"] is False
    assert options["cuda_graph_config"] == {"enable_padding": True, "max_batch_size": 32}
    # A valid schedule from the verify stage's acceptance profile (TensorRT-LLM's rules: the
    # smallest key drafts max_draft_len, none more; ours: non-increasing, a key for batch 32).
    schedule = spec["draft_len_schedule"]
    keys = sorted(schedule)
    assert keys[0] == 1 and schedule[1] == 15 and keys[-1] == 32
    assert [schedule[k] for k in keys] == sorted(schedule.values(), reverse=True)
    profile = json.loads((build / "reports" / "verify.json").read_text())["acceptance_profile"]
    assert profile["drafter_steps"] > 0
    # The fp32 init-drafter ships in bf16, as upstream's DFlash attention needs.
    drafter = build / "engine" / "drafter"
    assert json.loads((drafter / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = load_file(next(drafter.glob("*.safetensors")))
    assert {t.dtype for t in tensors.values() if t.is_floating_point()} == {torch.bfloat16}
    source = load_file(next((build / "quantized" / "drafter").glob("*.safetensors")))
    assert torch.float32 in {t.dtype for t in source.values()}
    repo_engine = build / "triton_repo" / "dflash" / "1" / "engine"
    assert yaml.safe_load((repo_engine / "engine.yaml").read_text())["backend"] == "tensorrt_llm"
    assert (repo_engine / "llm_api_options.yaml").is_file()
    config = (build / "triton_repo" / "dflash" / "config.pbtxt").read_text()
    assert "decoupled: true" in config
    # The quantized target really is NVFP4 on disk.
    quant = yaml.safe_load((build / "quantized" / "target" / "hf_quant_config.json").read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4"
