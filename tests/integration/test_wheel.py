"""The built wheel, not the checkout: it ships the plugin and the templates, emits and loads.

The checkout is copied, a wheel is built from the copy (setuptools, no network) and unpacked; a
Python started with `-S` (no site: the editable install's import hook never loads) imports
dflash_trt from the unpacked wheel only, with the venv's site-packages after it for torch and
tritonclient.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What a wheel is built from: pyproject.toml, README.md, toolkit/, plugins/, triton_repo/.
SOURCES = ("pyproject.toml", "README.md", "toolkit", "plugins", "triton_repo")

CHECK = """
import sys
from pathlib import Path

import torch

import dflash_trt
from dflash_trt.stages.emit import emit_repository
from dflash_trt.engines.spec import EngineSpec
from dflash_trt.plugins import dflash_plugin_dir, load_dflash_ops
from dflash_trt.recipe import TritonSection

wheel = Path(sys.argv[1]).resolve()
assert Path(dflash_trt.__file__).resolve().is_relative_to(wheel), dflash_trt.__file__
ops = load_dflash_ops()
assert dflash_plugin_dir().is_relative_to(wheel), dflash_plugin_dir()
assert ops.load_tolerances()["accept"]
drafts = torch.tensor([[3, 1, 2]])
logits = torch.zeros(1, 4, 5)
logits[0, 0, 3] = logits[0, 1, 1] = logits[0, 2, 4] = 1.0
num_accepted, next_token = torch.ops.dflash.accept(drafts, logits)
assert (int(num_accepted), int(next_token)) == (2, 4)

engine = Path("engine")
(engine / "target").mkdir(parents=True)
EngineSpec(backend="torch", target="target", drafter=None, dtype="float32", device="cpu",
           block_size=1, max_batch_size=1, max_seq_len=64, chat_template=False).write(engine)
model_dir = emit_repository(engine, Path("repo"), TritonSection(), "cpu")
print(sorted(str(p.relative_to(model_dir)) for p in model_dir.rglob("*") if p.is_file()))
"""


@pytest.fixture(scope="module")
def unpacked_wheel(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(root / "dist"), str(src)], check=True, timeout=300)
    (wheel,) = (root / "dist").glob("dflash_trt-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(root / "site")
    assert "dflash_trt/plugins/dflash/kernels.py" in names
    assert "dflash_trt/plugins/dflash/tolerances.yaml" in names
    assert "dflash_trt/stages/triton_repo/dflash/config.pbtxt" in names
    assert "dflash_trt/engines/trtllm_llm_api_options.yaml" in names
    return root / "site"


def test_the_wheel_emits_a_repository_and_loads_the_plugin(unpacked_wheel, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("tritonclient.grpc")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(unpacked_wheel), sysconfig.get_paths()["purelib"],
                                         sysconfig.get_paths()["platlib"]])
    done = subprocess.run([sys.executable, "-S", "-c", CHECK, str(unpacked_wheel)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == str(["1/engine/engine.yaml", "1/model.py",
                                               "config.pbtxt"])
