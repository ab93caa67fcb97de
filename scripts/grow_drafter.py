"""A trained drafter with one more layer that drafts exactly as it did, to train further.

    .venv/bin/python scripts/grow_drafter.py DRAFTER OUTPUT

The new last layer copies the last one with its two output projections (attention's o_proj, the
MLP's down_proj) zeroed, so both residual branches add nothing and the drafter's outputs are
unchanged until training moves them (checked before writing). Continue it with
`dflash-trt train-drafter --drafter OUTPUT ...` (docs/training.md, 2 or 3 drafter layers).
"""

import argparse
import copy
import json
from pathlib import Path

import torch

from dflash_trt.dflash.drafter import DFlashDraftModel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("drafter", type=Path)
    parser.add_argument("output", type=Path)
    args = parser.parse_args()
    old = DFlashDraftModel.from_pretrained(args.drafter)
    config = copy.deepcopy(old.config)
    config.num_hidden_layers += 1
    config.layer_types = [*config.layer_types, config.layer_types[-1]]
    new = DFlashDraftModel(config)
    n = len(old.layers)
    state = old.state_dict()
    for key, value in list(state.items()):
        if key.startswith(f"layers.{n - 1}."):
            grown = value.clone()
            if key.endswith(("o_proj.weight", "down_proj.weight")):
                grown.zero_()
            state[key.replace(f"layers.{n - 1}.", f"layers.{n}.", 1)] = grown
    new.load_state_dict(state, strict=True)
    new.set_draft_vocab(old.draft_vocab)
    new.eval()
    generator = torch.Generator().manual_seed(0)
    noise = torch.randn(1, old.block_size, config.hidden_size, generator=generator)
    context = torch.randn(1, 12, len(old.target_layer_ids) * config.hidden_size,
                          generator=generator)
    with torch.no_grad():
        if not torch.equal(old(noise, context), new(noise, context)):
            raise SystemExit("the grown drafter drafts differently; nothing written")
    new.to(_stored_dtype(args.drafter)).save_pretrained(args.output)
    print(f"{args.output}: {n} -> {n + 1} layers, outputs unchanged")


def _stored_dtype(path: Path) -> torch.dtype:
    """The dtype the drafter's weights were written in (bfloat16 for train-drafter's default)."""
    name = json.loads((path / "config.json").read_text()).get("dtype", "float32")
    return getattr(torch, name)


if __name__ == "__main__":
    main()
