"""The offline acceptance estimate replays generate() exactly on the target's greedy text."""

from __future__ import annotations

import pytest
from train_fixtures import greedy_sequences, setup

from dflash_trt.dflash.generate import generate
from dflash_trt.training.corpus import TokenSequence
from dflash_trt.training.estimate import estimate_acceptance, replay
from dflash_trt.training.features import OnTheFlyFeatures, build_store
from dflash_trt.training.train import TrainConfig, Trainer


def test_replay_counts_like_generate():
    greedy = [5, 6, 7, 8, 9, 10, 11, 12]
    right = lambda m, k: greedy[m + 1:m + 1 + k]  # noqa: E731 - always right
    assert replay(right, greedy, 4, 8, set()) == [4, 3]  # 3 drafts + bonus, then the cap at 8
    wrong = lambda m, k: [0] * k  # noqa: E731
    assert replay(wrong, greedy, 4, 5, set()) == [1, 1, 1, 1]
    assert replay(right, greedy, 4, 8, {7}) == [2]  # stops at the stop token


@pytest.mark.parametrize("vocab_limit", [0, 40])
def test_estimate_equals_real_generation(tmp_path, vocab_limit):
    """Also for a drafter with a draft vocabulary (--vocab-limit): both draft only from it."""
    model, target, drafter = setup(block_size=4)
    # Train a little so that acceptance lengths are spread over 1..block_size.
    config = TrainConfig(steps=25, batch_size=4, lr=3e-3, warmup_steps=3, block_size=4,
                         anchors_per_seq=8, checkpoint_every=0, eval_every=0,
                         vocab_limit=vocab_limit)
    data = OnTheFlyFeatures(target, greedy_sequences(model, 16))
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    Trainer(drafter, embed, head, data, config, tmp_path / "run").run()
    drafter.eval()
    assert (drafter.draft_vocab is None) == (vocab_limit == 0)
    prompts = [list(s.ids[:4]) for s in greedy_sequences(model, 6, seed=7, new_tokens=1)]
    real_lengths, held = [], []
    for prompt in prompts:
        tokens, stats = generate(target, drafter, prompt, max_new_tokens=20, block_size=4)
        real_lengths.extend(stats.acceptance_lengths)
        held.append(TokenSequence(tuple(prompt + tokens), len(prompt), "held"))
    store = build_store(target, held, tmp_path / "held", dtype="float32")
    est = estimate_acceptance(drafter, embed, head, store, max_new_tokens=20)
    assert est.num_steps == len(real_lengths)
    assert est.mean_acceptance_length == sum(real_lengths) / len(real_lengths)
    assert est.histogram == [real_lengths.count(i) for i in range(1, 5)]
    assert max(real_lengths) > 1  # the check is not vacuous
