"""A trained drafter with one more layer that drafts exactly as it did, to train further.

    .venv/bin/python scripts/grow_drafter.py DRAFTER OUTPUT

dflash.drafter_init.grow_drafter: the new last layer copies the last one with its output
projections zeroed, so the drafts stay the same until training moves it (checked here before
writing, in float32). Written in the dtype DRAFTER was stored in. Continue it with
`dflash-trt train-drafter --drafter OUTPUT ...` (docs/training.md, a third drafter layer).
"""

import argparse
import json
from pathlib import Path

import torch

from dflash_trt.dflash.drafter import DFlashDraftModel
from dflash_trt.dflash.drafter_init import grow_drafter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("drafter", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    drafter = DFlashDraftModel.from_pretrained(args.drafter)
    grown = grow_drafter(drafter)
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(1, drafter.block_size, drafter.config.hidden_size, generator=generator)
    context = torch.randn(1, 12, drafter.fc.in_features, generator=generator)
    with torch.inference_mode():
        if not torch.equal(drafter(noise, context), grown(noise, context)):
            raise SystemExit("the grown drafter drafts differently; nothing written")
    stored = json.loads((args.drafter / "config.json").read_text())
    dtype = getattr(torch, stored.get("dtype") or stored.get("torch_dtype") or "float32")
    grown.to(dtype).save_pretrained(args.output)
    print(f"{args.output}: {len(drafter.layers)} -> {len(grown.layers)} layers, drafts unchanged")


if __name__ == "__main__":
    main()
