"""What a drafter pass costs beside a verify forward, for drafters of different shapes.

    .venv/bin/python scripts/drafter_pass_bench.py ENGINE_DIR DRAFTER [DRAFTER ...] [--rounds 15]

ENGINE_DIR's target (as the engine loads it) runs one verify forward of 1 token per row after 128
in its cache; each DRAFTER (reference format, float32, its linears packed as the engine packs
them) runs the batched pass a decode step runs: its whole block over 2 new context positions per
row after 126 in its cache, then the LM head over its drafts (its draft vocabulary if it has one;
drafters in one run must share it). At 1, 4 and 8 rows; medians over interleaved rounds
(engines.cost_model.timed_rounds), so drift hits every shape alike.
"""

import argparse
from pathlib import Path

import torch

from dflash_trt.dflash.drafter import DFlashDraftModel
from dflash_trt.engines import load_engine
from dflash_trt.engines.cost_model import timed_rounds
from dflash_trt.engines.torch_engine import _pack_for_cpu

CONTEXT = 128


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("engine_dir", type=Path)
    parser.add_argument("drafters", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    target = load_engine(args.engine_dir).target
    drafters = {path: DFlashDraftModel.from_pretrained(path) for path in args.drafters}
    vocabs = {None if d.draft_vocab is None else tuple(d.draft_vocab.tolist())
              for d in drafters.values()}
    if len(vocabs) > 1:  # the target keeps one draft vocabulary's LM-head rows packed
        raise SystemExit("the drafters draft different vocabularies: time each in a run of its own")
    first = next(iter(drafters.values()))
    for drafter in drafters.values():
        drafter.draft_vocab = first.draft_vocab  # one tensor: the target's packed rows are reused
        _pack_for_cpu(drafter)
    ids = torch.arange(CONTEXT + 8)[None] * 7 % target.vocab_size
    runs, names = [], []
    with torch.inference_mode():
        for rows in (1, 4, 8):
            kv = target.new_slot_cache(rows, CONTEXT + 8)
            _, features = target.forward(ids[:, :CONTEXT].expand(rows, -1),
                                         kv.view(0, rows, CONTEXT), True)
            kv.lengths[:rows] = [CONTEXT] * rows  # the verify runs after the context
            for path, drafter in drafters.items():
                runs.append(_drafter_pass(target, drafter, features, rows))
                names.append((rows, f"{path} ({len(drafter.layers)} layers)"))

            def verify(rows=rows, kv=kv):  # the cache is not advanced: every round alike
                hidden, _ = target.forward(ids[:, CONTEXT:CONTEXT + 1].expand(rows, -1),
                                           kv.view(0, rows, 1), True)
                target.logits(hidden)
            runs.append(verify)
            names.append((rows, "target verify, 1 token per row"))
        seconds = timed_rounds(runs, args.rounds)
    for (rows, name), s in zip(names, seconds, strict=True):
        print(f"{rows} rows  {1000 * s:6.1f} ms  {name}")


def _drafter_pass(target, drafter, features, rows: int):
    start = CONTEXT - 2
    cache = drafter.new_slot_cache(rows, CONTEXT + 8)
    drafter.forward_rows(None, features[:, :start], [start] * rows, cache.view(0, rows, start))
    cache.lengths[:rows] = [start] * rows

    def run():
        block = torch.full((rows, drafter.block_size), drafter.mask_token_id, dtype=torch.long)
        hidden = drafter.forward_rows(target.embed(block), features[:, start:], [2] * rows,
                                      cache.view(0, rows, 2))  # the cache is not advanced
        drafts = hidden[:, 1:]
        vocab = drafter.draft_vocab
        return target.logits(drafts) if vocab is None else target.logits_rows(drafts, vocab)
    return run


if __name__ == "__main__":
    main()
