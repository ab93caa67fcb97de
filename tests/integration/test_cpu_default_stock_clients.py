"""The shipped CPU default, built by the pipeline and served by a real tritonserver, answers
TensorRT-LLM's stock ensemble client protocol (stock_protocol.py) with the text `dflash-trt
generate` gives for the same engine: streaming and not, with and without end_id / pad_id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

pytestmark = pytest.mark.integration
pytest.importorskip("pytriton", reason="needs the tritonserver bundled in nvidia-pytriton")
pytest.importorskip("modelopt.torch.quantization")
pytest.importorskip("gguf")

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "Write a Python function that returns the larger of two numbers."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def build(tmp_path_factory):
    from dflash_trt.recipe import validate_recipe
    from dflash_trt.stages.pipeline import run_pipeline

    data = yaml.safe_load((ROOT / "recipes" / "smollm2-135m-cpu.yaml").read_text())
    data["output_dir"] = str(tmp_path_factory.mktemp("cpu-default"))
    data["drafter"]["source"] = str(ROOT / "recipes" / data["drafter"]["source"])
    data["verify"].update(num_prompts=2, max_new_tokens=16)  # the rest exactly as shipped
    recipe = validate_recipe(data)
    run_pipeline(recipe)
    return recipe.build_dir


@pytest.fixture(scope="module")
def server(build):
    from dflash_trt.serving.server import TritonServer

    with TritonServer(build / "triton_repo") as srv:
        yield srv


@pytest.fixture(scope="module")
def generated(build):
    """`dflash-trt generate --json` on the built engine's checkpoints, as the engine serves."""
    from dflash_trt.cli import cli

    engine = yaml.safe_load((build / "engine" / "engine.yaml").read_text())
    result = CliRunner().invoke(cli, [
        "generate", "--target", str(build / "engine" / "target"),
        "--drafter", str(build / "engine" / "drafter"), "--prompt", PROMPT, "--chat",
        "--prompt-lookup", "--dtype", engine["dtype"], "--max-seq-len",
        str(engine["max_seq_len"]), "--max-new-tokens", str(MAX_TOKENS), "--temperature", "0",
        "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.output.strip().splitlines()[-1])


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("with_ids", [False, True])
def test_stock_client_gets_the_generate_text(server, generated, build, stream, with_ids):
    from stock_protocol import stock_generate
    from transformers import AutoTokenizer

    ids = {}
    if with_ids:  # as clients do: the tokenizer's end and pad ids
        tokenizer = AutoTokenizer.from_pretrained(build / "engine" / "target")
        ids = {"end_id": tokenizer.eos_token_id,
               "pad_id": tokenizer.pad_token_id or tokenizer.eos_token_id}
    text, errors = stock_generate(server.grpc_url, PROMPT, MAX_TOKENS, stream=stream,
                                  temperature=0.0, exclude_input_in_output=True, **ids)
    assert errors == []
    assert text == generated["text"] and len(generated["token_ids"]) == MAX_TOKENS
