"""Data-parallel drafter training: 2 CPU processes (gloo) step exactly as one with the same batch."""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.multiprocessing as mp
from train_fixtures import greedy_sequences, setup

from dflash_trt.training.features import OnTheFlyFeatures
from dflash_trt.training.train import TrainConfig, Trainer

CONFIG = TrainConfig(steps=6, batch_size=4, lr=3e-3, warmup_steps=2, block_size=4,
                     anchors_per_seq=8, gamma=4.0, seed=0, checkpoint_every=3, eval_every=0)


def _run(out, config=CONFIG):
    """Train the fixture drafter; return (trainer, losses)."""
    torch.manual_seed(0)
    model, target, drafter = setup(block_size=config.block_size)
    data = OnTheFlyFeatures(target, greedy_sequences(model, 10, new_tokens=16))
    trainer = Trainer(drafter, model.get_input_embeddings().weight,
                      model.get_output_embeddings().weight, data, config, out)
    history = trainer.run()
    return trainer, [s.loss for s in history.steps]


def _worker(rank: int, world: int, rendezvous: str, out: str, results) -> None:
    import torch.distributed as dist

    # Each process is one torchrun worker: 1 thread, gloo (on the loopback), a file rendezvous.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world)
    try:
        trainer, losses = _run(out)
        assert type(trainer.loss_module).__name__ == "DistributedDataParallel"
        results[rank] = ({k: v.clone() for k, v in trainer.drafter.state_dict().items()}, losses)
    finally:
        dist.destroy_process_group()


def test_two_processes_equal_one_with_the_same_global_batch(tmp_path):
    torch.set_num_threads(1)
    single, single_losses = _run(tmp_path / "one")
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path / "two"), results),
             nprocs=2, join=True)
    (state0, losses0), (state1, losses1) = results[0], results[1]
    for name, want in single.drafter.state_dict().items():
        torch.testing.assert_close(state0[name], want, rtol=1e-4, atol=1e-5, msg=name)
        assert torch.equal(state0[name], state1[name]), name  # the processes agree exactly
    assert losses0 == losses1
    torch.testing.assert_close(torch.tensor(losses0), torch.tensor(single_losses), rtol=1e-5,
                               atol=1e-6)
    # One writer: rank 0's checkpoints only, one directory as a single process writes.
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == \
        sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir())


def test_a_different_global_batch_gives_different_weights(tmp_path):
    """The comparison above can fail: the weights do depend on the global batch."""
    a, _ = _run(tmp_path / "a")
    b, _ = _run(tmp_path / "b", dataclasses.replace(CONFIG, batch_size=2))
    assert any(not torch.allclose(x, y) for x, y in zip(a.drafter.state_dict().values(),
                                                        b.drafter.state_dict().values(), strict=True))
