"""What a drafter pass costs beside a verify forward, for drafters of different shapes.

    .venv/bin/python scripts/drafter_pass_bench.py ENGINE_DIR DRAFTER [DRAFTER ...] [--rounds 15]

ENGINE_DIR's target (as the engine loads it) and each DRAFTER (reference format, float32, its
linears packed as the engine packs them) are timed by the build's own cost model runs
(engines.cost_model._batch_runs): a verify forward of 1 token per row after 128 cached tokens,
and the batched drafter pass of a decode step (the whole block over 2 new context positions per
row, then the LM head over the drafts, the draft vocabulary if there is one; drafters in one run
must share it). At 1, 4 and 8 rows; medians over interleaved rounds (timed_rounds), so drift hits
every shape alike.
"""

import argparse
from pathlib import Path
from types import SimpleNamespace

import torch

from dflash_trt.dflash.drafter import DFlashDraftModel
from dflash_trt.engines import load_engine
from dflash_trt.engines.cost_model import CONTEXT_TOKENS, _batch_runs, timed_rounds
from dflash_trt.engines.torch_engine import _pack_for_cpu


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
    block = first.block_size
    ids = torch.arange(CONTEXT_TOKENS + block)[None] * 7 % target.vocab_size
    runs, names = [], []
    with torch.inference_mode():
        for rows in (1, 4, 8):
            for i, (path, drafter) in enumerate(drafters.items()):
                engine = SimpleNamespace(target=target, drafter=drafter, block_size=block)
                mine = _batch_runs(engine, rows, ids, CONTEXT_TOKENS)  # verify 1..block, draft
                runs.append(mine[-1])
                names.append((rows, f"{path} ({len(drafter.layers)} layers)"))
                if i == 0:
                    runs.append(mine[0])
                    names.append((rows, "target verify, 1 token per row"))
        seconds = timed_rounds(runs, args.rounds)
    for (rows, name), s in zip(names, seconds, strict=True):
        print(f"{rows} rows  {1000 * s:6.1f} ms  {name}")


if __name__ == "__main__":
    main()
