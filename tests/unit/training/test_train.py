"""Drafter training: the batched training forward, learning, checkpoints and exact resume."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from train_fixtures import greedy_sequences, setup

from dflash_trt.errors import DflashTrtError
from dflash_trt.training.estimate import estimate_acceptance
from dflash_trt.training.features import OnTheFlyFeatures, build_store
from dflash_trt.training.train import (
    CheckpointSaved,
    StepStats,
    TrainConfig,
    Trainer,
    block_loss,
    draft_hidden,
    lr_factor,
    sample_anchors,
    soft_cross_entropy,
)

CONFIG = TrainConfig(steps=40, batch_size=4, lr=3e-3, warmup_steps=4, block_size=4,
                     anchors_per_seq=8, gamma=4.0, seed=0, checkpoint_every=0, eval_every=0)


def _trainer(tmp_path, config=CONFIG, data=None, **kwargs):
    torch.manual_seed(0)
    model, target, drafter = setup(block_size=config.block_size)
    data = data or OnTheFlyFeatures(target, greedy_sequences(model, 16))
    return Trainer(drafter, model.get_input_embeddings().weight, model.get_output_embeddings().weight,
                   data, config, tmp_path, **kwargs), model, target


def test_training_forward_equals_drafter_forward_per_block():
    model, target, drafter = setup(block_size=4, num_layers=2)
    seqs = greedy_sequences(model, 2, new_tokens=12)
    batch = OnTheFlyFeatures(target, seqs).batch([0, 1])
    anchors = torch.tensor([[4, 9, 1], [6, 5, 12]])  # (B, N)
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        hidden = draft_hidden(drafter, embed, batch.features, batch.tokens, anchors, 4)
        for b in range(2):
            for n in range(3):
                a = int(anchors[b, n])
                block = torch.full((1, 4), drafter.mask_token_id)
                block[0, 0] = batch.tokens[b, a]
                ref = drafter(embed[block], batch.features[b:b + 1, :a])  # (1, 4, H)
                torch.testing.assert_close(hidden[b, n], ref[0], rtol=1e-5, atol=1e-5)


def test_anchors_stay_in_the_trainable_range():
    lengths, starts = torch.tensor([10, 6, 20]), torch.tensor([5, 0, 3])
    anchors, ok = sample_anchors(lengths, starts, 8, [11, 12, 13])
    for b in range(3):
        real = anchors[b][ok[b]]
        assert len(set(real.tolist())) == len(real)  # distinct
        assert bool(((real >= max(int(starts[b]), 1)) & (real < lengths[b])).all())
    assert int(ok[0].sum()) == 5 and int(ok[1].sum()) == 5 and int(ok[2].sum()) == 8
    # A row's anchors depend on its seed alone, not on the batch around it.
    alone, _ = sample_anchors(lengths[2:], starts[2:], 8, [13])
    assert torch.equal(alone[0], anchors[2])


def test_schedule_warms_up_then_decays_to_the_floor():
    config = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, config) == pytest.approx(0.1)
    assert lr_factor(9, config) == pytest.approx(1.0)
    assert lr_factor(55, config) == pytest.approx(0.55)
    assert lr_factor(100, config) == pytest.approx(0.1)


def test_short_run_lowers_loss_and_raises_acceptance(tmp_path):
    events = []
    trainer, model, target = _trainer(tmp_path, callback=events.append)
    held = build_store(target, greedy_sequences(model, 6, seed=99), tmp_path / "held")
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    before = estimate_acceptance(trainer.drafter, embed, head, held, max_new_tokens=24)
    history = trainer.run()
    after = estimate_acceptance(trainer.drafter, embed, head, held, max_new_tokens=24)
    losses = [s.loss for s in history.steps]
    assert len(losses) == CONFIG.steps
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    assert after.mean_acceptance_length > before.mean_acceptance_length + 0.5
    assert isinstance(events[0], StepStats) and isinstance(events[-1], CheckpointSaved)


def test_resume_equals_uninterrupted_training(tmp_path):
    full, _, _ = _trainer(tmp_path / "full", dataclasses.replace(CONFIG, steps=12))
    full.run()
    part, _, _ = _trainer(tmp_path / "part", dataclasses.replace(CONFIG, steps=12, checkpoint_every=5))

    class Stop(Exception):
        pass

    def stop_after_checkpoint(event):
        if isinstance(event, CheckpointSaved):
            raise Stop

    part.callback = stop_after_checkpoint
    with pytest.raises(Stop):
        part.run()
    resumed, _, _ = _trainer(tmp_path / "part", dataclasses.replace(CONFIG, steps=12))
    assert resumed.load_checkpoint() == 5
    resumed.run()
    for (name, a), (_, b) in zip(full.drafter.state_dict().items(),
                                 resumed.drafter.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert [s.loss for s in full.history.steps] == [s.loss for s in resumed.history.steps]


def test_interrupt_saves_a_checkpoint(tmp_path):
    trainer, _, _ = _trainer(tmp_path)
    seen = []

    def interrupt(event):
        seen.append(event)
        if isinstance(event, StepStats) and event.step == 3:
            raise KeyboardInterrupt

    trainer.callback = interrupt
    with pytest.raises(KeyboardInterrupt):
        trainer.run()
    assert isinstance(seen[-1], CheckpointSaved) and seen[-1].step == 3
    assert (tmp_path / "checkpoint.pt").is_file()
    assert (tmp_path / "checkpoints" / "step-000003" / "model.safetensors").is_file()


def test_resume_refuses_changed_settings(tmp_path):
    trainer, _, _ = _trainer(tmp_path, dataclasses.replace(CONFIG, steps=2))
    trainer.run()
    other, _, _ = _trainer(tmp_path, dataclasses.replace(CONFIG, lr=1e-4))
    with pytest.raises(DflashTrtError, match="lr"):
        other.load_checkpoint()


def test_vocab_limit_trains_on_frequent_labels(tmp_path):
    config = dataclasses.replace(CONFIG, steps=3, vocab_limit=20)
    trainer, _, _ = _trainer(tmp_path, config)
    assert trainer.head.shape[0] == 20 and int((trainer.label_map >= 0).sum()) == 20
    history = trainer.run()
    assert all(torch.isfinite(torch.tensor(s.loss)) for s in history.steps)
    kept = torch.nonzero(trainer.label_map >= 0).flatten().tolist()
    saved = json.loads((tmp_path / "checkpoints" / "step-000003" / "draft_vocab.json").read_text())
    assert trainer.drafter.draft_vocab.tolist() == kept == saved["token_ids"]  # drafts what it learned


def test_store_matches_on_the_fly_features(tmp_path):
    model, target, _ = setup()
    seqs = greedy_sequences(model, 5)
    store = build_store(target, seqs, tmp_path / "store", batch_size=2)
    live = OnTheFlyFeatures(target, seqs)
    assert len(store) == 5 and store.num_tokens == sum(len(s.ids) for s in seqs)
    a, b = store.batch([3, 0]), live.batch([3, 0])
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    torch.testing.assert_close(a.features, b.features, rtol=2e-3, atol=2e-3)  # stored as fp16
    assert (store.label_counts(128) == live.label_counts(128)).all()


def test_soft_labels_of_one_token_are_the_hard_labels():
    logits = torch.randn(3, 5, 10, dtype=torch.float64)
    ids = torch.randint(0, 10, (3, 5, 1))
    soft = soft_cross_entropy(logits, ids, torch.zeros(3, 5, 1), None)
    hard = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten(),
                                             reduction="none").view(3, 5)
    torch.testing.assert_close(soft, hard)


def test_soft_labels_renormalise_over_the_kept_tokens():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float64)  # the head's 3 kept tokens
    label_map = torch.tensor([-1, 0, 1, -1, 2])  # token ids 1, 2, 4 are kept
    ids = torch.tensor([[0, 2, 4]])  # token 0 (not kept), 2 -> row 1, 4 -> row 2
    logp = torch.log(torch.tensor([[0.5, 0.3, 0.1]]))
    got = soft_cross_entropy(logits, ids, logp, label_map)
    logq = torch.log_softmax(logits, -1)[0]
    want = -(0.75 * logq[1] + 0.25 * logq[2])  # 0.3 and 0.1, renormalised
    torch.testing.assert_close(got, want.view(1))
    none_kept = soft_cross_entropy(logits, torch.tensor([[0, 3, 3]]), logp, label_map)
    assert none_kept.item() == 0.0  # no kept token: nothing to learn there


def test_store_keeps_the_targets_top_k(tmp_path):
    model, target, _ = setup()
    seqs = greedy_sequences(model, 4)
    seqs[0] = dataclasses.replace(seqs[0], ids=seqs[0].ids[:20])  # batch [2, 0] pads row 1
    store = build_store(target, seqs, tmp_path / "store", batch_size=2, topk=5)
    live = OnTheFlyFeatures(target, seqs, topk=5)
    a, b = store.batch([2, 0]), live.batch([2, 0])
    assert a.topk_ids.shape == (2, a.tokens.shape[1], 5)
    n = int(a.lengths[0])
    assert torch.equal(a.topk_ids[0, :n, 0], a.labels[0, :n])  # the top-1 is the argmax label
    with torch.no_grad():
        logp = torch.log_softmax(model(a.tokens[:1, :n]).logits[0].float(), -1)
    torch.testing.assert_close(a.topk_logp[0, :n], logp.gather(-1, a.topk_ids[0, :n]),
                               rtol=0, atol=2e-2)  # stored as fp16
    assert torch.equal(a.topk_ids, b.topk_ids)
    torch.testing.assert_close(a.topk_logp, b.topk_logp, rtol=0, atol=2e-2)
    pad = a.topk_logp[1, int(a.lengths[1]):]
    assert pad.numel() and torch.isinf(pad).all()  # padding has no soft label
    assert torch.isinf(b.topk_logp[1, int(b.lengths[1]):]).all()


def test_block_loss_with_top_1_soft_labels_equals_hard_labels(tmp_path):
    model, target, drafter = setup(block_size=CONFIG.block_size)
    seqs = greedy_sequences(model, 3)
    seqs[1] = dataclasses.replace(seqs[1], ids=seqs[1].ids[:18])  # padding: -inf soft labels
    batch = build_store(target, seqs, tmp_path / "s", topk=3).batch([0, 1, 2])
    anchors, ok = sample_anchors(batch.lengths, batch.train_start, 6, [1, 2, 3])
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    hard = block_loss(drafter, embed, head, None, batch, anchors, ok, CONFIG.block_size, 4.0)
    soft = block_loss(drafter, embed, head, None, batch, anchors, ok, CONFIG.block_size, 4.0, topk=1)
    torch.testing.assert_close(soft.weighted_ce, hard.weighted_ce)
    wider = block_loss(drafter, embed, head, None, batch, anchors, ok, CONFIG.block_size, 4.0, topk=3)
    assert wider.weight == hard.weight and not torch.isclose(wider.weighted_ce, hard.weighted_ce)
    wider.weighted_ce.backward()
    assert torch.isfinite(wider.weighted_ce)
    assert all(torch.isfinite(q.grad).all() for q in drafter.parameters() if q.grad is not None)


def test_top_k_distillation_learns_and_needs_stored_top_k(tmp_path):
    model, target, _ = setup(block_size=CONFIG.block_size)
    config = dataclasses.replace(CONFIG, distill_topk=4)
    with pytest.raises(DflashTrtError, match="top 0 only"):
        _trainer(tmp_path / "a", config, data=OnTheFlyFeatures(target, greedy_sequences(model, 16)))
    trainer, model, target = _trainer(tmp_path / "b", config, data=OnTheFlyFeatures(
        target, greedy_sequences(model, 16), topk=4))
    held = build_store(target, greedy_sequences(model, 6, seed=99), tmp_path / "held")
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    before = estimate_acceptance(trainer.drafter, embed, head, held, max_new_tokens=24)
    trainer.run()
    after = estimate_acceptance(trainer.drafter, embed, head, held, max_new_tokens=24)
    assert after.mean_acceptance_length > before.mean_acceptance_length + 0.5


def test_the_best_drafter_outlives_its_process_for_resume(tmp_path):
    from dflash_trt.commands.train import _load_best, _save_best

    _, _, drafter = setup(block_size=4)
    path = tmp_path / "best"
    _save_best(path, drafter, {"step": 20, "tau": 1.5})
    got = _load_best(path, step=30)
    assert (got["step"], got["tau"]) == (20, 1.5)
    want = drafter.state_dict()
    assert got["state"].keys() == want.keys()
    assert all(torch.equal(got["state"][k], want[k]) for k in want)
    assert _load_best(path, step=10) == {}  # evaluated after the checkpoint: it will come again
    assert _load_best(tmp_path / "none", step=30) == {}
    _save_best(path, drafter, {"step": 25, "tau": 1.6})  # a better one replaces it whole
    assert _load_best(path, step=30)["step"] == 25 and not (tmp_path / "best.partial").exists()
